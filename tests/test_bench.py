"""The benchmark harness end to end and its random models (function, not speed: no timing
asserted)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm import load

from mlx_radix_plugin.cli import cli
from mlx_radix_plugin.models.random_model import EOS, FIRST_WORD, SHAPES, TINY, build, words
from mlx_radix_plugin.tools.bench.report import RATIO_KEYS
from mlx_radix_plugin.tools.bench.workloads import PRESETS, WORKLOADS, single_token_words

# layers x (K, V) x KV heads x head dim x float32 bytes
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * (64 // 4) * 4

SUMMARY_KEYS = {
    "wall_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "prompt_tokens",
    "cached_tokens",
    "prompt_tokens_computed",
    "stats_prompt_tokens_computed",
    "completion_tokens",
    "tokens_per_s",
    "cpu_s_per_token",
    "peak_rss_bytes",
}


def test_random_model_tokenizer_is_byte_level_bpe_one_word_per_token(tmp_path):
    """The random models' tokenizer is of the kind real models ship (mlx-lm streams it
    with its BPE detokenizer), each id from FIRST_WORD one word after a space."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    path = build("smollm2-135m", tmp_path / "m", **TINY)
    model, tok = load(str(path))
    ids = list(range(FIRST_WORD, FIRST_WORD + 40)) + [400, 401, 599]
    assert tok.encode(words(ids)) == ids
    assert words([FIRST_WORD, FIRST_WORD + 25, FIRST_WORD + 26]) == " a z aa"
    assert tok.decode([FIRST_WORD + 27, FIRST_WORD + 28]) == " ab ac"
    assert isinstance(tok.detokenizer, BPEStreamingDetokenizer)
    assert tok.eos_token_ids == {0}
    assert len(model.layers) == 2
    # EOS's output row is zero (tied embeddings: the embedding's row), so greedy decoding
    # never ends early and requests need no logit bias.
    assert mx.abs(model.model.embed_tokens.weight[EOS]).max().item() == 0
    assert mx.abs(model.model.embed_tokens.weight[EOS + 2]).max().item() > 0


def test_random_shapes_carry_their_real_models_context(tmp_path):
    assert SHAPES["llama-3.2-1b"]["max_position_embeddings"] == 131072
    assert SHAPES["llama-3-8b"]["max_position_embeddings"] == 8192
    assert SHAPES["llama-3.1-8b"]["max_position_embeddings"] == 131072
    with pytest.raises(ValueError, match=f"vocab_size 200: it must be above {FIRST_WORD}"):
        build("smollm2-135m", tmp_path, **{**TINY, "vocab_size": 200})


def test_a_hybrid_random_model_takes_one_token_a_word_through_its_own_tokenizer(tmp_path):
    """Qwen3.5's tokenizer class in transformers splits text its own byte-level way: the
    random model's words stay one token each after a space, for the server and the bench."""
    small = dict(head_dim=16, linear_key_head_dim=32, linear_value_head_dim=16)
    path = build("qwen3.5-0.8b", tmp_path / "m", **{**TINY, **small, "vocab_size": 8192})
    _, tok = load(str(path))
    found = single_token_words(path)
    text = " " + " ".join(found[1000:1040])
    assert len(tok.encode(text)) == 40 and tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == {0}


def test_unknown_shape_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'gpt-9'; known: " + ", ".join(SHAPES)):
        build("gpt-9", tmp_path)


def test_bad_model_choices_are_named(tmp_path):
    r = CliRunner().invoke(cli, ["bench", "--model", str(tmp_path)])
    assert r.exit_code == 2
    assert f"'{tmp_path}' is not an mlx-lm model directory (no config.json)" in r.output
    r = CliRunner().invoke(cli, ["bench", "--model", str(tmp_path), "--random", "smollm2-135m"])
    assert r.exit_code == 2 and "pass --model or --random, not both" in r.output
    r = CliRunner().invoke(cli, ["bench", "--preset", "huge"])
    assert r.exit_code == 2 and "'huge' is not one of 'smoke', 'small', 'medium'" in r.output


def test_module_entry_point_is_the_same_command():
    cmd = [sys.executable, "-m", "mlx_radix_plugin.tools.bench", "--help"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0
    assert "Usage: python -m mlx_radix_plugin.tools.bench [OPTIONS]" in r.stdout
    assert "--preset [smoke|small|medium]" in r.stdout


@pytest.mark.slow
def test_smoke_preset_runs_both_servers_and_reports_every_field(tmp_path):
    model = build("smollm2-135m", tmp_path / "m", **TINY)
    out = tmp_path / "results" / "smoke.json"
    argv = ["bench", "--preset", "smoke", "--model", str(model), "--ban-eos", "--json", str(out)]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())

    assert report["preset"] == "smoke" and report["eos_banned"] is True
    assert report["greedy_outputs_match"] is True
    assert set(report["workloads"]) == set(WORKLOADS)
    for name, w in report["workloads"].items():
        for server in ("stock", "radix"):
            assert SUMMARY_KEYS <= set(w[server]), (name, server)
            # A Python process with MLX loaded holds more than 50 MiB: a smaller reading
            # would be some other process's, or none.
            assert w[server]["peak_rss_bytes"] > 50 << 20, (name, server)
            # tokens/s is completion over wall time, which the report rounds to 1 ms.
            completion, wall = w[server]["completion_tokens"], w[server]["wall_s"]
            low, high = completion / (wall + 5e-4), completion / max(wall - 5e-4, 1e-6)
            assert low - 0.01 <= w[server]["tokens_per_s"] <= high + 0.01, (name, server)
        assert w["stock"]["stats_prompt_tokens_computed"] is None  # stock has no stats
        assert w["radix"]["stats_prompt_tokens_computed"] is not None
        assert set(w["ratios"]) == set(RATIO_KEYS)
        assert w["greedy_outputs_match"] is True, name
    for s in ("stock", "radix"):
        peaks = [w[s]["peak_rss_bytes"] for w in report["workloads"].values()]
        assert report["peak_rss_bytes"][s] >= max(peaks)

    sizes = {w.name: w for w in PRESETS["smoke"].workloads}
    a = report["acceptance"]
    agent = report["workloads"]["agent"]
    assert [t["turn"] for t in agent["by_turn"]] == list(range(1, sizes["agent"].turns + 1))
    # Each turn's prompt holds the last one's prompt and reply: the pool serves all of it
    # but the new tool result and the template's marks around it (16 + a few of ~300).
    assert a["agent_cached_share_min_after_turn_1"]["radix"] >= 0.9
    assert len(a["decode_ratios_by_round"]) == sizes["decode"].rounds
    d, b = report["workloads"]["decode"], report["workloads"]["burst"]
    assert a["decode_tokens_per_s_ratio"] == round(median(a["decode_ratios_by_round"]), 3)
    assert a["decode_cpu_s_per_token_ratio"] == round(
        d["stock"]["cpu_s_per_token"] / d["radix"]["cpu_s_per_token"], 3
    )
    assert a["burst_ttft_mean_speedup"] == round(
        b["stock"]["ttft_mean_s"] / b["radix"]["ttft_mean_s"], 3
    )
    burst = sizes["burst"]
    computed = a["burst_prompt_tokens_computed"]
    # The plugin computes the new prefix once (at most a page more per request when a
    # question starts mid-page); stock, up to once per request.
    once = burst.prefix_tokens + burst.requests * burst.question_tokens
    assert once <= computed["radix"] <= once + burst.requests * 16
    assert computed["stock"] <= burst.requests * (burst.prefix_tokens + burst.question_tokens)

    # Conversations: each later turn finds its session's history cached; the pace of a
    # streamed reply and the cached share are each server's.
    conv, cs = report["workloads"]["conversations"], sizes["conversations"]
    assert [t["turn"] for t in conv["by_turn"]] == list(range(1, cs.turns + 1))
    for server in ("stock", "radix"):
        assert conv[server]["decode_s_per_token"] > 0, server
        assert 0 <= conv[server]["cached_share"] < 1, server
    assert conv["cached_share_min_after_turn_1"]["radix"] >= 0.5
    assert f"conversations, {cs.sessions} sessions x {cs.turns} turns" in result.output

    # More prefixes than stock's 10 cache entries: the pool keeps every one.
    rep, w = sizes["prefix_repetition"], report["workloads"]["prefix_repetition"]
    hits = (rep.requests - rep.prefixes) * (rep.prefix_tokens // 16 * 16)
    assert w["radix"]["stats_cached_tokens"] >= hits > w["stock"]["cached_tokens"]

    memory = report["workloads"]["memory"]
    assert memory["kv_bytes_per_token"] == TINY_KV_BYTES_PER_TOKEN
    assert memory["kv_bytes_unshared"] > 0 and memory["kv_bytes_held_peak"] is not None
    one_copy = sizes["memory"].one_copy_tokens * TINY_KV_BYTES_PER_TOKEN
    assert memory["kv_bytes_one_copy"] == one_copy
    assert a["memory_kv_held_over_one_copy"] == memory["kv_held_over_one_copy"] is not None

    # decode_shared: the warm-up is neither reported nor computed again in the rounds; both
    # servers had the prefix cached for every timed request.
    ds, w = sizes["decode_shared"], report["workloads"]["decode_shared"]
    assert w["radix"]["requests"] == w["stock"]["requests"] == ds.rounds * ds.requests
    for server in ("stock", "radix"):
        assert w[server]["cached_tokens"] >= ds.rounds * ds.requests * ds.prefix_tokens, server
    assert w["radix"]["stats_prompt_tokens_computed"] <= ds.rounds * ds.requests * (
        ds.question_tokens + 16
    )
    assert len(a["decode_shared_ratios_by_round"]) == ds.rounds
    assert a["decode_shared_tokens_per_s_ratio"] == round(
        median(a["decode_shared_ratios_by_round"]), 3
    )
    for s in ("stock", "radix"):
        rates = [r[f"{s}_decode_tokens_per_s"] for r in w["by_round"]]
        assert a["decode_shared_tokens_per_s"][s] == round(median(rates), 2)
    assert w["kv_bytes_one_copy"] == ds.one_copy_tokens * TINY_KV_BYTES_PER_TOKEN
    assert w["kv_held_over_one_copy"] is not None
    assert set(a["decode_shared_paths"]) <= {"shared", "exact"}
    assert "decode_shared, 4 concurrent on one cached 64-token prefix" in result.output

    for name in WORKLOADS:
        assert f"\n{name} " in result.output
    assert "greedy outputs identical: yes" in result.output
    assert f"report: {out}" in result.output
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "results" / "smoke-workloads.png").exists()
    else:
        assert "charts: skipped, matplotlib is not installed" in result.output


@pytest.mark.slow
def test_restart_workload_reads_the_prefix_back_from_disk_after_a_clean_stop(tmp_path):
    model = build("smollm2-135m", tmp_path / "m", **TINY)
    out = tmp_path / "restart.json"
    argv = ["bench", "--preset", "smoke", "--model", str(model), "--ban-eos"]
    # A tiny model computes a page about as fast as a file is read: ``auto`` may not read.
    argv += ["--workload", "restart", "--disk-restore", "on", "--json", str(out)]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["workloads"]) == {"restart"}
    assert report["machine"]["cpus"] >= 1  # no shared servers: read from a restarted one
    sizes = next(w for w in PRESETS["smoke"].workloads if w.name == "restart")
    w = report["workloads"]["restart"]
    assert w["greedy_outputs_match"] is True and w["mismatched_requests"] == 0
    assert len(w["by_round"]) == sizes.rounds
    whole_pages = sizes.prefix_tokens // 16 * 16  # the prefix's pages, page size 16
    for rd in w["by_round"]:
        stock, radix = rd["stock"], rd["radix"]
        # The plugin stopped cleanly and its new process found the prefix's pages on disk...
        assert radix["exit_code"] == 0
        assert radix["disk_pages_at_start"] >= sizes.prefix_tokens // 16
        assert radix["disk_pages_at_start"] >= radix["disk_pages_written_before_stop"]
        # ...read them back for the request after the restart, which found them cached.
        assert radix["disk_hits"] >= 1
        assert radix["disk_pages_read"] >= sizes.prefix_tokens // 16
        assert radix["disk_tokens_read"] == radix["disk_pages_read"] * 16
        assert whole_pages <= radix["cached_tokens_after"] <= radix["prompt_tokens_after"]
        assert radix["restore_s_per_1k_tokens"] is not None
        # Stock started with nothing cached of the prefix and computed it again.
        assert stock["cached_tokens_after"] < 16 and stock["disk_hits"] is None
        assert stock["ttft_s_per_1k_prompt_tokens"] is not None
        assert stock["prompt_tokens_after"] == radix["prompt_tokens_after"]
        for side in (stock, radix):
            assert side["ttft_after_s"] is not None and side["ttft_before_s"] is not None
        assert rd["ttft_after_restart_speedup"] is not None
        assert rd["restore_speedup_per_1k_tokens"] is not None
    assert w["cached_tokens_after_restart"]["radix"] >= whole_pages
    assert w["radix"]["cached_tokens"] >= whole_pages * sizes.rounds
    assert w["radix"]["stats_prompt_tokens_computed"] < sizes.prefix_tokens
    a = report["acceptance"]
    assert a["restart_ttft_after_speedup"] == w["ttft_after_restart_speedup"] is not None
    assert a["restart_restore_speedup_per_1k_tokens"] == w["restore_speedup_per_1k_tokens"]
    assert "TTFT after restart, s" in result.output
    assert "s per 1,000 tokens: prefill / disk restore" in result.output
    assert "greedy outputs identical: yes" in result.output
