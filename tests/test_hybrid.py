"""Hybrid models (recurrent layers between attention layers) served from the pool: the
recurrent state resumes from snapshots, the answers are stock mlx-lm's.

Stock's reference is a request generated on its own (``generate_step``). mlx-lm 0.32.2's
``nemotron_h`` gives other answers in a batch whose prompts are right-padded (its Mamba-2
mixer does not pass ``cache.lengths`` to its SSM update, so padding enters the state);
its batches here have prompts, or remaining prompts, of one length.
"""

import os
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_generation import KEY, no_eos
from tiny_models import HYBRID_ARCHS

from mlx_radix_plugin import KVPool, RadixPromptCache
from mlx_radix_plugin.cache.paged_batch import PagedBatchKVCache
from mlx_radix_plugin.cache.tiering import Tiering, disk_identity
from mlx_radix_plugin.engine.attention import FIDELITY_TOLERANCE
from mlx_radix_plugin.engine.generator import RadixBatchGenerator
from mlx_radix_plugin.engine.prefill_path import PoolPromptBatch
from mlx_radix_plugin.memory.cache_list import flat
from mlx_radix_plugin.memory.disk_tier import DiskTier, state_key

PS = 4
MAX_TOKENS = 8


def stock(model, tokenizer, prompt):
    """Greedy tokens and the first token's log-probabilities of a request on its own."""
    out, first = [], None
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=MAX_TOKENS,
        prompt_cache=make_prompt_cache(model),
        logits_processors=[no_eos(tokenizer.eos_token_ids)],
    )
    for token, logprobs in steps:
        out.append(int(token))
        first = logprobs if first is None else first
    return out, first


class Server:
    """What mlx_lm.server does with the plugin's engine: fetch, cut the prompt's segments
    by what was cached, insert; commit at segment ends and at the finish."""

    def __init__(
        self,
        model,
        tokenizer,
        snapshot_mib=None,
        every=64,
        pool_tokens=4096,
        disk=None,
        defer=False,
    ):
        pool = KVPool.for_model(
            model,
            page_size=PS,
            pool_tokens=pool_tokens,
            snapshot_bytes=None if snapshot_mib is None else int(snapshot_mib * 2**20),
        )
        self.rpc = RadixPromptCache(pool)
        self.rpc.defer_finished = defer  # as the server's
        if disk is not None:  # the disk tier at ``disk``, written through
            tier = DiskTier(disk, disk_identity(model, pool), 1 << 30)
            self.rpc.tiering = Tiering(pool, tier, KEY)
        self.gen = RadixBatchGenerator(
            model,
            self.rpc,
            snapshot_every=every,
            completion_batch_size=8,
            prefill_batch_size=4,
            prefill_step_size=2048,
        )
        self.eos = tokenizer.eos_token_ids

    def run(self, requests, later=()):
        """``requests``: prompts, or lists of segments; all arrive together, and ``later``
        ones once the first are decoding. Returns per request (tokens, cached tokens, first
        token's log-probabilities)."""
        uids, info = [], {}

        def add(request):
            segments = [list(s) for s in request] if isinstance(request[0], list) else [request]
            prompt = [t for s in segments for t in s]
            cache, rest = self.rpc.fetch_nearest_cache(KEY, prompt)
            n = len(prompt) - len(rest)
            cached = n
            while n > 0:
                if n >= len(segments[0]):
                    n -= len(segments.pop(0))
                else:
                    segments[0] = segments[0][n:]
                    break
            (uid,) = self.gen.insert_segments(
                [segments],
                max_tokens=[MAX_TOKENS],
                caches=[cache],
                all_tokens=[prompt[:cached]],
                logits_processors=[[no_eos(self.eos)]],
            )
            uids.append(uid)
            info[uid] = ([], cached, None)

        for request in requests:
            add(request)
        done, waiting = 0, list(later)
        while done < len(uids):
            prompt_responses, responses = self.gen.next()
            ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt]
            for cache, tokens in self.gen.extract_cache(ends).values():
                self.rpc.insert_cache(KEY, tokens[:], cache)
            for r in responses:
                out, cached, first = info[r.uid]
                out.append(r.token)
                if first is None:
                    info[r.uid] = (out, cached, mx.array(r.logprobs))
                if r.finish_reason is not None:
                    done += 1
                    self.rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
            if responses and waiting:
                for request in waiting:
                    add(request)
                waiting = []
        return [info[u] for u in uids]

    def stats(self):
        return self.rpc.stats()

    def stop(self):
        """What a server's clean shutdown does with the disk tier."""
        tiering = self.rpc.tiering
        tiering.save_tree(self.rpc.tree, time.monotonic() + 30, self.rpc.snapshots)
        assert tiering.disk.close(30)


def check(model, tokenizer, served, prompts):
    """Each request's tokens are stock's, and its first logits within the tolerance."""
    for (out, _, first), prompt in zip(served, prompts):
        if isinstance(prompt[0], list):
            prompt = [t for s in prompt for t in s]
        expected, logprobs = stock(model, tokenizer, prompt)
        assert out == expected
        diff = mx.abs(first.astype(mx.float32) - logprobs).max().item()
        assert diff <= FIDELITY_TOLERANCE * mx.abs(logprobs).max().item()


def words(tokenizer, text):
    return tokenizer.encode(text)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_requests_one_after_another_equal_stock_and_resume_from_snapshots(loaded, arch):
    model, tok = loaded(arch)
    server = Server(model, tok)
    system = words(tok, "You are a helpful assistant. Answer the question briefly. " * 2 + "Hi.")
    question = words(tok, " Where is Paris, then?")
    cold = [system, question]

    ((out, cached, _),) = server.run([cold])
    check(model, tok, [(out, cached, _)], [cold])
    assert cached == 0

    # The same prompt again: all but its last token, from the snapshot where the prompt's
    # segment ended (inside a page), as from stock's cache.
    prompt = system + question
    assert (len(prompt) - 1) % PS  # an end inside a page, which this test is about
    served = server.run([prompt])
    check(model, tok, served, [prompt])
    assert served[0][1] == len(prompt) - 1

    # Turn 2: turn 1, its answer and a new message. The finished request left its state
    # where it ended, inside its tail page: turn 2 resumes exactly there, as from stock's
    # cache, not at the page boundary before it.
    turn2 = prompt + out + words(tok, " And Berlin?")
    assert (len(prompt) + len(out)) % PS  # an end inside a page, which this test is about
    served = server.run([turn2])
    check(model, tok, served, [turn2])
    assert served[0][1] == len(prompt) + len(out)
    out2 = served[0][0]

    # Turn 3, whose history renders turn 2's answer otherwise than it was generated (as a
    # template that drops a reasoning block does): stock resumes from its cache at the end
    # of turn 2's prompt but its last token (a segment end); this resumes there or later.
    turn3 = turn2 + out2[:2] + words(tok, " And Rome?")
    served = server.run([turn3])
    check(model, tok, served, [turn3])
    assert len(turn2) - 1 <= served[0][1] <= len(turn2) + 2

    # The same system prompt, another question: it resumes exactly where the system
    # prompt's segment ended.
    other = [system, words(tok, " Count: 1 2 3 4 5 6 7 8 9 10.")]
    assert len(system) % PS
    served = server.run([other])
    check(model, tok, served, [other])
    assert served[0][1] == len(system)
    stats = server.stats()
    assert stats["snapshots"] > 0 and stats["snapshot_hits"] == 4
    assert stats["snapshot_bytes"] <= stats["snapshot_bytes_max"]
    assert stats["pages_locked"] == 0 and stats["requests_holding_pages"] == 0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_chats_finishing_together_are_committed_after_both_are_answered(loaded, arch):
    """The server's finished commits wait for the next fetch or step: two chats that finish
    in one step hold their pages until then, and their next turns resume exactly where
    each ended, with stock's answers."""
    model, tok = loaded(arch)
    server = Server(model, tok, defer=True)
    system = words(tok, "You are a helpful assistant. Answer the question briefly. " * 2)
    # Questions of one length (see the module's note on nemotron_h).
    firsts = [system + words(tok, q) for q in (" Where is city 1?", " Where is city 2?")]
    served = server.run(firsts)
    held = server.stats()
    assert held["requests_holding_pages"] == 2  # answered, not committed yet
    turns = [p + out + words(tok, " And city 3?") for p, (out, _, _) in zip(firsts, served)]
    served = server.run(turns)
    check(model, tok, served, turns)
    assert [c for _, c, _ in served] == [len(p) + MAX_TOKENS for p in firsts]
    server.rpc.commit_finished()
    stats = server.stats()
    assert stats["requests_holding_pages"] == 0 and stats["pages_locked"] == 0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_kv_match_deeper_than_any_snapshot_leaves_one_for_the_next(loaded, arch):
    model, tok = loaded(arch)
    server = Server(model, tok)
    shared = words(tok, "Radix trees share prefixes; pages hold keys and values. " * 2)
    a = shared + words(tok, " Paris is the capital of France.")
    b = shared + words(tok, " Berlin is the capital of Germany.")
    c = shared + words(tok, " once upon a time 1 2 3")
    served = server.run([a])
    # b's K/V match runs through the shared part, but a left no snapshot there: b computes
    # from the start and leaves one where its match ended, for c.
    served += server.run([b])
    assert served[-1][1] == 0
    served += server.run([c])
    check(model, tok, served, [a, b, c])
    assert served[-1][1] == len(shared) // PS * PS


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_concurrent_batch_computes_its_shared_prefix_once(loaded, arch):
    model, tok = loaded(arch)
    server = Server(model, tok)
    system = words(tok, "You are a helpful assistant. Answer the question briefly. " * 2)
    # Questions of one length (see the module's note on nemotron_h).
    questions = [" Where is city 1?", " Where is city 2?", " Where is city 3?"]
    prompts = [system + words(tok, q) for q in questions]
    assert len({len(p) for p in prompts}) == 1
    served = server.run(prompts)
    check(model, tok, served, prompts)
    # The later two take the first one's pages and recurrent state for the shared part.
    shared = len(os.path.commonprefix(prompts)) // PS * PS
    assert shared >= len(system) // PS * PS
    assert [c for _, c, _ in served] == [0, shared, shared]
    assert server.stats()["pages_locked"] == 0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_request_joining_a_decoding_batch_answers_as_stock(loaded, arch, monkeypatch):
    """A request whose prefill (over the pool) ends while another decodes joins its batch,
    both on mlx-lm's buffers (a hybrid decodes on the exact path): a falcon_h1 layer's
    CacheList part by part."""
    left = []
    split = PoolPromptBatch.split

    def recorded(self, indices):
        batch = split(self, indices)
        left.append(any(isinstance(c, PagedBatchKVCache) for c in flat(batch.prompt_cache)))
        return batch

    monkeypatch.setattr(PoolPromptBatch, "split", recorded)
    model, tok = loaded(arch)
    server = Server(model, tok)
    system = words(tok, "You are a helpful assistant. Answer the question briefly. " * 2)
    server.run([system + words(tok, " Warm up.")])
    first, second = (system + words(tok, q) for q in (" Where is Paris?", " And Rome?"))
    served = server.run([first], later=[second])
    check(model, tok, served, [first, second])
    assert served[1][1] >= len(system) // PS * PS
    assert left and not any(left)
    assert server.stats()["pages_locked"] == 0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_evicted_snapshots_are_recomputed_with_the_same_answers(loaded, arch):
    model, tok = loaded(arch)
    probe = Server(model, tok)
    probe.run([words(tok, "Paris is the capital of France.")])
    one = probe.stats()["snapshot_bytes"] // probe.stats()["snapshots"]
    # Room for two snapshots: every prompt's snapshots push out the ones before.
    server = Server(model, tok, snapshot_mib=2.5 * one / 2**20)
    prompts = [
        words(tok, f"Question {i}: what is the capital of country number {i}? Answer briefly.")
        for i in range(4)
    ]
    served = [r for p in prompts for r in server.run([p])]
    again = [r for p in prompts for r in server.run([p])]
    check(model, tok, served + again, prompts + prompts)
    stats = server.stats()
    assert stats["snapshot_evictions"] > 0 and stats["snapshots"] <= 2
    assert stats["snapshot_bytes"] <= stats["snapshot_bytes_max"]
    # The first prompts' snapshots were evicted: they were computed again.
    assert again[0][1] == 0 and stats["pages_locked"] == 0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_warm_resume_equals_a_cold_request_split_at_the_same_position(loaded, arch):
    model, tok = loaded(arch)
    prompt = words(tok, "Once upon a time there was a small model that learned to count.")
    cut = len(prompt) // 2 // PS * PS
    # Cold, its prefill split at ``cut``; then warm, resumed from the snapshot taken there.
    server = Server(model, tok)
    (cold,) = server.run([[prompt[:cut], prompt[cut:]]])
    server = Server(model, tok)
    server.run([prompt[: cut + 1]])  # leaves a snapshot at ``cut`` (its last page boundary)
    (warm,) = server.run([prompt])
    assert warm[1] == cut
    assert warm[0] == cold[0]
    diff = mx.abs(warm[2] - cold[2]).max().item()
    assert diff <= FIDELITY_TOLERANCE * mx.abs(cold[2]).max().item()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_restart_resumes_a_chat_from_the_disk_tier(loaded, arch, tmp_path):
    model, tok = loaded(arch)
    server = Server(model, tok, every=2, disk=tmp_path)
    prompt = words(tok, "You are a helpful assistant. Answer the question briefly. Paris?")
    ((out, _, _),) = server.run([prompt])
    assert server.stats()["disk_states"] > 0
    server.stop()

    # A new process: an empty pool and no snapshot in memory, the same disk. Turn 2 resumes
    # from the deepest page boundary that has a state on disk (its pages read back), as
    # stock resumes nothing: every token before it is not computed again.
    server = Server(model, tok, every=2, disk=tmp_path)
    turn2 = prompt + out + words(tok, " And Berlin?")
    served = server.run([turn2])
    check(model, tok, served, [turn2])
    deepest = (len(prompt) + len(out)) // PS * PS
    assert deepest - 2 * PS < served[0][1] <= deepest
    stats = server.stats()
    assert stats["disk_hits"] == 1 and stats["snapshot_hits"] == 1
    assert stats["pages_locked"] == 0
    server.stop()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_with_the_disk_tier_a_segment_end_leaves_a_state_at_its_page_boundary(
    loaded, arch, tmp_path
):
    """Snapshots at segment ends lie inside pages, which the disk does not keep: with the
    disk tier on, the page boundary before each end gets one too, so a restart resumes near
    it (no periodic snapshots here)."""
    model, tok = loaded(arch)
    system = words(tok, "You are a helpful assistant. Answer the question briefly. Hi.")
    assert len(system) % PS
    server = Server(model, tok, every=0, disk=tmp_path)
    server.run([[system, words(tok, " Where is Paris?")]])
    server.stop()
    server = Server(model, tok, every=0, disk=tmp_path)
    other = [system, words(tok, " And Rome?")]
    served = server.run([other])
    check(model, tok, served, [other])
    assert served[0][1] == len(system) // PS * PS
    server.stop()


def test_a_corrupt_state_on_disk_is_a_miss_and_answers_stay_stock(loaded, tmp_path):
    model, tok = loaded("qwen3_5")
    server = Server(model, tok, every=2, disk=tmp_path)
    prompt = words(tok, "Radix trees share prefixes; pages hold keys and values. Why?")
    server.run([prompt])
    server.stop()
    tier = DiskTier(tmp_path, server.rpc.tiering.disk.identity, 1 << 30)
    states = [k for k, e in tier._entries.items() if e.state]
    assert states and all(k == state_key(tier._entries[k].parent) for k in states)
    for key in states:  # every state's data, not its header: the checksum fails
        path = tier.path_of(key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    tier.close(10)

    server = Server(model, tok, every=2, disk=tmp_path)
    again = prompt + words(tok, " Because.")
    served = server.run([again])
    check(model, tok, served, [again])
    # No state read back: its pages alone give a hybrid nothing to resume from.
    stats = server.stats()
    assert served[0][1] == 0 and stats["disk_corrupt"] >= 1
    server.stop()
