"""The benchmark's requests and measurements without servers: exact-length prompts,
what each workload sends, keyed replies, error propagation, peak memory."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tiny_models import build_model

from mlx_radix_plugin.models.random_model import TINY, build
from mlx_radix_plugin.tools.bench import servers as bench_server
from mlx_radix_plugin.tools.bench import workloads as bench_workloads
from mlx_radix_plugin.tools.bench.servers import PeakRSS
from mlx_radix_plugin.tools.bench.workloads import (
    PRESETS,
    AgentSession,
    Burst,
    Conversations,
    Decode,
    DecodeShared,
    Memory,
    MultiTurn,
    PrefixRepetition,
    PromptError,
    Prompts,
    Restart,
    Sampling,
    SharedPrefix,
    eos_logit_bias,
    fits,
    run_workload,
    single_token_words,
    stock_form,
    too_long,
)

WORDS = [f"t{i}" for i in range(2, 200)]


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    return build("smollm2-135m", tmp_path_factory.mktemp("m"), **TINY)


@pytest.mark.parametrize("kind", ["word-level", "byte-level BPE"])
def test_prompts_of_n_words_are_n_tokens(kind, word_model, tmp_path):
    from tokenizers import Tokenizer

    model = word_model if kind == "word-level" else build_model("llama", tmp_path / "bpe")
    words = single_token_words(model)
    assert len(words) >= 64
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    p = Prompts("seed", words)
    prefix, suffix = p.text(40), p.text(7)
    ids = tok.encode(prefix + suffix, add_special_tokens=False).ids
    assert len(ids) == 47
    # A shared prefix is a token-exact shared prefix.
    assert ids[:40] == tok.encode(prefix, add_special_tokens=False).ids


def test_a_tokenizer_without_single_token_words_is_refused(tmp_path):
    with pytest.raises(PromptError, match="tokenizer.json not found"):
        single_token_words(tmp_path)


def test_eos_ban_reads_config(tmp_path, word_model):
    assert eos_logit_bias(word_model) == {"0": -100.0}
    (tmp_path / "config.json").write_text('{"eos_token_id": [2, 7]}')
    assert eos_logit_bias(tmp_path) == {"2": -100.0, "7": -100.0}
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PromptError, match="no eos_token_id"):
        eos_logit_bias(tmp_path)


def plan(workload, seed="s", reply=lambda key, body: "t9 t9"):
    """``workload``'s warm-up requests, and what its clients send (one client after another,
    keyed), drawn in run_workload's order."""
    p, s = Prompts(seed, WORDS), Sampling({"0": -100.0})
    warmup = workload.warmup(p, s)
    sent = {}

    def send(key, path, body):
        sent[key] = (path, body)
        return reply(key, body)

    for client in workload.build(p, s):
        client(send)
    return warmup, sent


def collect(workload, seed="s", reply=lambda key, body: "t9 t9"):
    return plan(workload, seed, reply)[1]


def words_of(body):
    return body["prompt"].split()


def test_same_seed_same_requests_other_seed_other_requests():
    w = SharedPrefix(2, 3, 10, 4, 2, concurrency=2)
    assert collect(w) == collect(w)
    assert collect(w) != collect(w, seed="other")


def test_shared_prefix_groups_share_their_system_prompt_and_are_shuffled():
    w = SharedPrefix(3, 4, 10, 5, 2, concurrency=2)
    sent = collect(w)
    assert len(sent) == 12
    for (g, _), (path, body) in sent.items():
        assert path == "/v1/completions" and len(words_of(body)) == 15
        assert words_of(body)[:10] == words_of(sent[(g, 0)][1])[:10]
        assert body["max_tokens"] == 2 and body["temperature"] == 0.0
        assert body["logit_bias"] == {"0": -100.0}
    assert len({tuple(words_of(b)[:10]) for _, b in sent.values()}) == 3
    assert list(sent) != sorted(sent)  # shuffled, not group by group


def test_burst_and_memory_share_one_prefix():
    for w in (Burst(5, 12, 3, 2), Memory(5, 12, 3, 2)):
        prompts = [words_of(b) for _, b in collect(w).values()]
        assert len(prompts) == 5 and {len(p) for p in prompts} == {15}
        assert len({tuple(p[:12]) for p in prompts}) == 1
        assert len({tuple(p[12:]) for p in prompts}) == 5


def test_prefix_repetition_cycles_more_prefixes_than_stock_keeps():
    w = PrefixRepetition(12, 30, 8, 2, 1)
    sent = collect(w)
    prefixes = [tuple(words_of(sent[i][1])[:8]) for i in range(30)]
    assert len(set(prefixes)) == 12
    assert all(prefixes[i] == prefixes[i % 12] for i in range(30))
    assert all(
        w.prefixes > 10
        for p in PRESETS.values()
        for w in p.workloads
        if w.name == "prefix_repetition"
    )


def test_multi_turn_sends_history_with_the_servers_replies():
    w = MultiTurn(2, 3, 6, 4, 2)
    sent = collect(w, reply=lambda key, body: f"reply{key[0]}{key[1]}")
    assert len(sent) == 6
    path, body = sent[(1, 2)]
    assert path == "/v1/chat/completions"
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in body["messages"][2::2]] == ["reply10", "reply11"]
    assert body["messages"][0] == sent[(0, 0)][1]["messages"][0]  # one system prompt


def test_conversations_grow_their_own_histories_and_start_apart(monkeypatch):
    """Sessions share only the short system prompt; each turn sends its session's whole
    history with the server's replies; session i starts i arrivals late, turns think apart."""
    slept = []
    monkeypatch.setattr(bench_workloads.time, "sleep", slept.append)
    w = Conversations(3, 3, 4, 20, 5, 2, arrival_s=0.5, think_s=0.25)
    sent = collect(w, reply=lambda key, body: f"reply{key[0]}{key[1]}")
    assert len(sent) == w.total_requests == 9
    path, body = sent[(2, 2)]
    assert path == "/v1/chat/completions"
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in body["messages"][2::2]] == ["reply20", "reply21"]
    assert [len(m["content"].split()) for m in body["messages"][1::2]] == [20, 5, 5]
    assert body["max_tokens"] == 2
    openings = {sent[(c, 0)][1]["messages"][1]["content"] for c in range(3)}
    systems = {sent[(c, 0)][1]["messages"][0]["content"] for c in range(3)}
    assert len(openings) == 3 and len(systems) == 1
    # Clients ran one after another here: each slept its arrival, then between its turns.
    assert slept == [0.0, 0.25, 0.25, 0.5, 0.25, 0.25, 1.0, 0.25, 0.25]
    assert w.longest_prompt == 4 + 20 + 2 * 5 + 2 * 2


def test_an_agent_session_sends_messages_with_tool_calls_and_stock_the_same_as_chat():
    w = AgentSession(2, 2, 6, 4, 2, requests_per_turn=2)
    sent = collect(w, reply=lambda key, body: "reply" + "".join(map(str, key)))
    assert len(sent) == w.total_requests == 8
    path, body = sent[(1, 1, 1)]
    assert path == "/v1/messages" and body["system"] == sent[(0, 0, 0)][1]["system"]
    # Turn 1: a task, a reply calling a tool, its result, the answer; turn 2 the same so far.
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    call = body["messages"][1]["content"]
    assert call[0]["text"] == "reply100" and call[1]["type"] == "tool_use"
    assert body["messages"][2]["content"][0]["tool_use_id"] == call[1]["id"]
    assert body["messages"][3]["content"] == [{"type": "text", "text": "reply101"}]
    assert len(body["messages"][4]["content"].split()) == 4  # the next task
    path, chat = stock_form(path, body)
    assert path == "/v1/chat/completions"
    assert [m["role"] for m in chat["messages"]] == ["system", "user"] + [
        "assistant",
        "tool",
        "assistant",
        "user",
    ] + ["assistant", "tool"]
    assert chat["messages"][4]["content"] == "reply101"
    assert chat["max_tokens"] == body["max_tokens"] and chat["stream_options"]
    assert w.longest_prompt == 6 + 2 * (4 * 2 + 2 * 2)


def test_an_agent_session_past_the_models_context_is_refused_naming_a_longer_one(tmp_path):
    """The medium preset's sessions are as long as the clients' (24k-token system prompts):
    the default model's 8,192 tokens cannot hold them, tiny-long's 131,072 can."""
    [agent] = [w for w in PRESETS["medium"].workloads if w.name == "agent"]
    assert agent.longest_prompt > 24000
    short = build("smollm2-135m", tmp_path / "short", **TINY)
    with pytest.raises(PromptError, match="agent workload.*tiny-long"):
        fits([agent], short)
    fits([agent], build("tiny-long", tmp_path / "long"))
    # The preset as a whole (no --workload) runs the rest on the short model, the agent
    # workload left out with why, as the report says.
    left_out = too_long(list(PRESETS["medium"].workloads), short)
    assert list(left_out) == ["agent"] and "tiny-long" in left_out["agent"]


def test_decode_prompts_are_short_and_distinct():
    warmup, sent = plan(Decode(4, 6, 50, rounds=3))
    assert warmup == []
    assert {len(words_of(b)) for _, b in sent.values()} == {6}
    assert len({tuple(words_of(b)) for _, b in sent.values()}) == 4
    assert Decode(4, 6, 50, rounds=3).repeats == 3 and Burst(1, 1, 1, 1).repeats == 1


def test_decode_shared_warms_up_the_prefix_its_requests_share():
    w = DecodeShared(4, 12, 3, 20, rounds=2)
    warmup, sent = plan(w)
    assert len(warmup) == 1
    path, warm = warmup[0]
    assert path == "/v1/completions" and len(words_of(warm)) == 15
    assert warm["max_tokens"] == 2 and warm["logit_bias"] == {"0": -100.0}
    assert set(sent) == {0, 1, 2, 3}
    prompts = [words_of(body) for _, body in sent.values()]
    assert {len(p) for p in prompts} == {15}
    assert {body["max_tokens"] for _, body in sent.values()} == {20}
    # The warm-up caches exactly the prefix the timed requests share...
    assert {tuple(p[:12]) for p in prompts} == {tuple(words_of(warm)[:12])}
    # ...with a question of its own, as each timed request has.
    assert len({tuple(p[12:]) for p in [*prompts, words_of(warm)]}) == 5
    assert plan(w) == plan(w) and plan(w) != plan(w, seed="other")
    assert (w.repeats, w.total_requests) == (2, 4)
    assert w.one_copy_tokens == 12 + 4 * (3 + 20) and w.warmup_tokens == 12 + 3 + 2
    assert Memory(4, 12, 3, 20).one_copy_tokens == w.one_copy_tokens
    assert Decode(4, 6, 50, rounds=3).one_copy_tokens is None


def test_restart_sends_one_prefix_before_and_after_with_another_question():
    w = Restart(12, 3, 5, rounds=2)
    p, s = Prompts("s", WORDS), Sampling({"0": -100.0})
    path, before = w.before(p, s)
    warmup, sent = plan(w)
    assert warmup == [] and set(sent) == {"after"}
    assert path == sent["after"][0] == "/v1/completions"
    after = sent["after"][1]
    assert len(words_of(before)) == len(words_of(after)) == 15
    assert words_of(before)[:12] == words_of(after)[:12]  # one prefix...
    assert words_of(before)[12:] != words_of(after)[12:]  # ...another question
    assert before["max_tokens"] == after["max_tokens"] == 5
    # The same requests whichever is drawn first; another seed, others.
    p2 = Prompts("s", WORDS)
    clients = w.build(p2, s)
    assert w.before(p2, s)[1] == before
    got = {}

    def send(key, path, body):
        got[key] = body
        return ""

    clients[0](send)
    assert got == {"after": after}
    assert w.before(Prompts("other", WORDS), s)[1] != before
    assert (w.repeats, w.total_requests, w.restarts) == (2, 2, True)
    assert not Burst(1, 1, 1, 1).restarts
    # Every preset restarts on a prefix of its own size, the default (small) on ~2,000 tokens.
    sizes = {k: next(w for w in p.workloads if w.restarts) for k, p in PRESETS.items()}
    assert sizes["smoke"].prefix_tokens < sizes["small"].prefix_tokens
    assert sizes["small"].prefix_tokens < sizes["medium"].prefix_tokens
    assert 1900 <= sizes["small"].prefix_tokens <= 2100


class FakeServer:
    """Streams each prompt's first word; /v1/cache/stats counters move by 10 per request.
    With ``hold_s``, each request takes that long, and while it runs holds 2 pool pages
    and, with ``buffers``, 1000 bytes of batch buffer."""

    def __init__(self, plugin=True, fail_on=None, hold_s=0.0, buffers=True):
        self.plugin, self.fail_on, self.requests = plugin, fail_on, 0
        self.hold_s, self.buffers, self.live, self.sent = hold_s, buffers, 0, []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        self.lock = threading.Lock()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()

    def stream(self, path, body, on_first=None):
        if self.fail_on and self.fail_on in body["prompt"]:
            raise RuntimeError("POST /v1/completions: 500 boom")
        if on_first:
            on_first()
        with self.lock:
            self.sent.append(body)
            self.live += 1
        threading.Event().wait(self.hold_s)
        with self.lock:
            self.live -= 1
            self.requests += 1
        n = len(body["prompt"].split())
        usage = {
            "prompt_tokens": n,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        return [
            {"choices": [{"text": body["prompt"].split()[0]}]},
            {"choices": [], "usage": usage},
        ]

    def cpu_seconds(self):
        return 1.0 + self.requests

    def stats(self):
        if not self.plugin:
            return None
        with self.lock:
            k, live = self.requests, self.live
        stats = {
            "prompt_tokens": 10 * k,
            "cached_tokens": 4 * k,
            "pages_total": 8,
            "page_size": 4,
            "pool_bytes_total": 3200,
            "pages_locked": 1 + 2 * live,  # one page locked by something else throughout
            "decode_path": "exact" if live else None,
        }
        if self.buffers:
            stats["buffer_bytes"] = 1000 * live
        return stats

    def peak_rss(self):
        return PeakRSS(self.proc.pid)


def test_run_workload_keys_replies_and_counts_the_servers_work():
    server = FakeServer()
    try:
        w = SharedPrefix(2, 3, 5, 2, 2, concurrency=3)
        ticks = []
        r = run_workload(
            server, "radix", w, Prompts("s", WORDS), Sampling(), lambda: ticks.append(1)
        )
    finally:
        server.close()
    sent = collect(w)
    assert set(r.replies) == set(sent) and len(ticks) == 6
    for key, rep in r.replies.items():
        assert rep.text == words_of(sent[key][1])[0]  # each reply under its own request
        assert rep.usage["prompt_tokens"] == 7 and rep.ttft_s >= 0
    assert (r.stats_prompt_tokens, r.stats_cached_tokens) == (60, 24)
    assert r.cpu_s == 6.0 and r.pool_bytes_per_token == 100.0
    assert r.peak_rss_bytes > 0


def test_decode_shared_warm_up_is_sent_first_and_left_out_of_the_results():
    server = FakeServer(hold_s=0.3)
    w = DecodeShared(4, 6, 2, 3, rounds=2)
    ticks = []
    try:
        r = run_workload(
            server, "radix", w, Prompts("s", WORDS), Sampling(), lambda: ticks.append(1)
        )
    finally:
        server.close()
    warmup, sent = plan(w)
    assert server.sent[0]["prompt"] == warmup[0][1]["prompt"] and len(server.sent) == 5
    assert set(r.replies) == set(sent) == {0, 1, 2, 3} and len(ticks) == 4
    # The stats deltas start after the warm-up: 4 requests of 10 prompt tokens.
    assert (r.stats_prompt_tokens, r.stats_cached_tokens) == (40, 16)
    for rep in r.replies.values():
        # The fake's first text comes at once, its end 0.3 s later.
        assert 0 <= rep.ttft_s < 0.3 <= rep.done_at - rep.first_token_at
    # 4 live requests at once: 8 pages of 400 bytes (the other page is not theirs) and
    # 4000 bytes of batch buffers.
    assert r.kv_bytes_held_peak == 8 * 400 + 4000
    assert r.decode_paths == ["exact"]


class DiskFakeServer(FakeServer):
    """A plugin's server with its disk tier on: a process's counters start at 0; each of its
    requests reads 3 pages back in 0.01 s; 7 pages written, 5 found on disk at start."""

    def stats(self):
        stats = super().stats()
        k = self.requests
        stats.update(
            disk_hits=k,
            disk_pages_read=3 * k,
            disk_restore_seconds=0.01 * k,
            disk_pages=5,
            disk_pages_written=7,
        )
        return stats


def run_restart(old, new, server_name="radix"):
    """Restart(6, 2, 3) from ``old`` to ``new``; the run, the servers the restart was asked
    for, and the ticks."""
    asked, ticks = [], []

    def restart(server):
        asked.append(server)
        return new, {"exit_code": 0, "stop_s": 0.5, "start_s": 2.0}

    try:
        r = run_workload(
            old,
            server_name,
            Restart(6, 2, 3),
            Prompts("s", WORDS),
            Sampling(),
            lambda: ticks.append(1),
            restart=restart,
        )
    finally:
        old.close()
        new.close()
    return r, asked, ticks


def test_restart_sends_its_first_request_then_measures_on_the_restarted_server():
    old, new = DiskFakeServer(), DiskFakeServer()
    r, asked, ticks = run_restart(old, new)
    p, s = Prompts("s", WORDS), Sampling()
    before = Restart(6, 2, 3).before(p, s)[1]["prompt"]
    after = collect(Restart(6, 2, 3))["after"][1]["prompt"]
    assert asked == [old] and len(ticks) == 2
    assert [b["prompt"] for b in old.sent] == [before]
    assert [b["prompt"] for b in new.sent] == [after]
    assert set(r.replies) == {"after"} and r.replies["after"].text == after.split()[0]
    assert r.before.text == before.split()[0] and r.before.ttft_s >= 0
    # The restart as the restarter told it, the old process's pages written through, and
    # the new one's disk reads over the measured request (its counters started at 0).
    assert r.restarted == {
        "exit_code": 0,
        "stop_s": 0.5,
        "start_s": 2.0,
        "disk_pages_written_before_stop": 7,
        "page_size": 4,
        "disk_pages_at_start": 5,
        "disk_hits": 1,
        "disk_pages_read": 3,
        "disk_restore_seconds": 0.01,
    }
    # The measured window's stats deltas are the new server's: one request.
    assert (r.stats_prompt_tokens, r.stats_cached_tokens) == (10, 4)


def test_restart_of_stock_has_no_disk_counters_and_needs_a_restarter():
    r, asked, _ = run_restart(FakeServer(plugin=False), FakeServer(plugin=False), "stock")
    assert len(asked) == 1 and set(r.replies) == {"after"}
    assert r.restarted == {"exit_code": 0, "stop_s": 0.5, "start_s": 2.0}
    assert r.stats_prompt_tokens is None
    server = FakeServer()
    try:
        with pytest.raises(ValueError, match="restart restarts its server"):
            run_workload(server, "radix", Restart(6, 2, 3), Prompts("s", WORDS), Sampling())
    finally:
        server.close()
    assert server.sent == []


def test_pool_poller_adds_locked_pages_and_batch_buffers_sampled_together():
    before = {"pool_bytes_total": 3200, "pages_total": 8, "pages_locked": 2}
    poller = bench_workloads._PoolPoller(None, before)
    poller.sample({"pages_locked": 5, "buffer_bytes": 100, "decode_path": "exact"})
    assert poller.peak == 3 * 400 + 100
    # More pages but no buffer (a server without buffer_bytes): counted as 0 buffer.
    poller.sample({"pages_locked": 6, "decode_path": None})
    assert poller.peak == 4 * 400
    # A large buffer while pages fell below the baseline: the buffer alone.
    poller.sample({"pages_locked": 1, "buffer_bytes": 1700, "decode_path": "shared"})
    assert poller.peak == 1700
    poller.sample({"pages_locked": 2, "buffer_bytes": 0, "decode_path": "exact"})
    assert poller.peak == 1700 and poller.paths == ["exact", "shared"]
    # None of those was a moment of decode alone; these are, unless a prefill holds copies.
    assert poller.decode_peak is None
    decoding = {"decode_rows": 4, "decode_buffer_bytes": 300, "decode_path": "exact"}
    poller.sample({**decoding, "pages_locked": 4, "prefill_buffer_bytes": 0})
    poller.sample({**decoding, "pages_locked": 9, "prefill_buffer_bytes": 50})
    assert poller.decode_peak == 2 * 400 + 300


def test_stock_has_no_stats_and_a_failing_request_stops_the_workload():
    server = FakeServer(plugin=False)
    try:
        r = run_workload(server, "stock", Burst(3, 4, 1, 1), Prompts("s", WORDS), Sampling())
        assert r.stats_prompt_tokens is None and r.kv_bytes_held_peak is None
        prompt = collect(Burst(3, 4, 1, 1))[2][1]["prompt"]
        server.fail_on = prompt
        with pytest.raises(RuntimeError, match="500 boom"):
            run_workload(server, "stock", Burst(3, 4, 1, 1), Prompts("s", WORDS), Sampling())
    finally:
        server.close()


HOLDER = """
import sys
block = b"x" * (64 << 20)
if sys.argv[1] == "free":
    del block
print("ready", flush=True)
sys.stdin.read()
"""


def holder(mode):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"ready\n"
    return proc


def release(proc):
    proc.stdin.close()
    proc.wait()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc")
def test_peak_rss_resets_the_high_water_mark():
    proc = holder("free")  # touched 64 MiB, then gave it back
    try:
        with PeakRSS(proc.pid, reset=False) as since_start:
            pass
        with PeakRSS(proc.pid) as window:
            pass
    finally:
        release(proc)
    assert since_start.method == "VmHWM since start" and since_start.bytes >= 64 << 20
    assert window.method == "VmHWM" and window.bytes < 64 << 20


def test_peak_rss_samples_ps_elsewhere(monkeypatch):
    monkeypatch.setattr(bench_server, "LINUX", False)
    proc = holder("keep")
    try:
        with PeakRSS(proc.pid) as peak:
            threading.Event().wait(0.2)
    finally:
        release(proc)
    assert peak.method == "ps rss sampled 50 ms" and peak.bytes >= 64 << 20


def test_presets_grow_and_name_every_workload():
    names = [[w.name for w in p.workloads] for p in PRESETS.values()]
    assert names[0] == list(bench_workloads.WORKLOADS) and all(n == names[0] for n in names)
    assert "decode_shared" in names[0] and len(set(names[0])) == len(names[0])
    total = {k: sum(w.total_requests for w in p.workloads) for k, p in PRESETS.items()}
    assert total["smoke"] < total["small"] < total["medium"]
