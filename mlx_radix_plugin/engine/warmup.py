"""The engine's paths run once at model load, so that the first requests do not build kernels.

MLX builds a kernel the first time it is launched with a new type or layout (on CUDA it
compiles it, and sets up cuBLAS and cuDNN plans); a server's first requests pay for every
kernel the engine's paths launch. Measured on the H200 (Llama-3-8B's shape, bf16,
2026-12-01): the first burst of 32 requests on a new 2,048-token prefix answered in 3.06 s,
the next two in 0.71 and 0.87 s. Here, before the first request, a few requests of random
tokens go through the engine on a pool of their own: a prompt alone (prefill, page writes,
decode), then requests on its cached prefix together (the prefix read from the pool into a
batch, suffixes prefilled together reading it once unless ``prefill.shared_prefix`` is
``off``, a batch decoding) and, unless ``decode.shared_prefix``
is ``off``, the same batch on the shared-prefix path. Where cuDNN serves prompt attention
(CUDA), the attention of a fresh prompt's passes up to the model's context is built too. The
tree and pool that serve requests are left as they were.
"""

from __future__ import annotations

import random
import time

import mlx.core as mx
from mlx_lm_hooks.validation import vocab_size

from ..cache.prompt_cache import RadixPromptCache
from ..memory.pool import KVPool
from . import attention, prompt_attention
from .decode_path import backend
from .generator import RadixBatchGenerator

MODES = ("auto", "on", "off")
KEY = ("warm-up", None, None)
ROWS = 4  # requests decoding together on the prefix
OWN = 8  # tokens of each of them after the prefix
CROSSING_PAGES = 2  # pages a chunk of the second scratch pool holds


def enabled(mode: str) -> bool:
    """``decode.warmup``: ``auto`` warms up on a GPU (Metal, CUDA), where kernels are built at
    first use; a CPU's are ready-made."""
    if mode not in MODES:
        raise ValueError(f"decode.warmup must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and mx.default_device() != mx.cpu)


def warm_up(
    model,
    page_size: int,
    shared_prefix: str,
    prefill_shared: str = "off",
    prefill_step: int = 2048,
    context: int | None = None,
) -> float:
    """Run the engine's paths on a scratch pool; seconds taken. ``prefill_shared``: the
    server's ``prefill.shared_prefix`` (unless ``off``, the requests on the cached prefix
    prefill their suffixes together reading it once). ``prefill_step``: the server's
    ``--prefill-step-size``; ``context``: the most tokens a prompt may have, whose passes'
    attention graphs are built here where cuDNN serves them (``prompt_attention.prebuild``)."""
    start = time.perf_counter()
    vocab = vocab_size(model) or 256  # ids the warm-up's random prompts take
    rng = random.Random(0)  # the same tokens on every rank of mlx.launch
    prefix = [rng.randrange(vocab) for _ in range(3 * page_size + 5)]
    own = [[rng.randrange(vocab) for _ in range(OWN)] for _ in range(ROWS + 1)]
    tokens = (ROWS + 2) * (len(prefix) + OWN + 8 * page_size)
    pool = KVPool.for_model(model, page_size=page_size, pool_tokens=tokens)
    _run_paths(model, pool, prefix, own, shared_prefix, prefill_shared)
    # Again on a pool of CROSSING_PAGES-page chunks, so that every read spans chunks (parts
    # gathered a chunk at a time and joined; the paged kernel once a chunk): a long
    # prompt's passes cross into a second chunk too, and on the H100 the first crossing
    # built kernels for 3.2 s inside one pass of a 65,536-token prompt (docs/benchmarking.md,
    # "Warm-up at model load").
    pool = KVPool.for_model(
        model,
        page_size=page_size,
        pool_tokens=tokens,
        chunk_bytes=CROSSING_PAGES * pool.bytes_per_page,
    )
    _run_paths(model, pool, prefix, own, shared_prefix, prefill_shared)
    if context and backend() == "cuda":
        # A fresh prompt over the pool, alone: where cuDNN serves prompt attention, its call
        # shows ``prebuild`` the model's geometry.
        rpc = RadixPromptCache(KVPool.for_model(model, page_size=page_size, pool_tokens=tokens))
        _serve(RadixBatchGenerator(model, rpc, prefill_from_pool="on"), rpc, [own[0] * 4])
        prompt_attention.prebuild(prefill_step, context)
    del pool
    mx.clear_cache()
    return time.perf_counter() - start


def _run_paths(
    model,
    pool: KVPool,
    prefix: list[int],
    own: list[list[int]],
    shared_prefix: str,
    prefill_shared: str,
) -> None:
    """A prompt alone, then rows on its cached prefix on each path, on ``pool``."""
    rpc = RadixPromptCache(pool)
    _serve(RadixBatchGenerator(model, rpc, shared_prefix="off"), rpc, [prefix + own[0]])
    # The shared path computes attention one of several ways (engine/attention.py): each
    # this device has (on CUDA the paged kernel, whose check runs here, at load).
    variants = ["masked", "split"] + (["paged"] if backend() == "cuda" else [])
    paths = [("off", None)] + ([] if shared_prefix == "off" else [("on", v) for v in variants])
    try:
        for mode, attention.VARIANT in paths:
            # Their prefill reads the pool, which ``prefill.from_pool = auto`` takes for rows
            # that decode on the shared path or pass the working set; a buffer's fill from the
            # pool gathers as the decode batch's does after it.
            gen = RadixBatchGenerator(
                model,
                rpc,
                shared_prefix=mode,
                prefill_from_pool="on",
                prefill_shared="off" if prefill_shared == "off" else "on",
                prefill_batch_size=ROWS,
            )
            _serve(gen, rpc, [prefix + o for o in own[1:]])
    finally:
        attention.VARIANT = None


def _serve(gen: RadixBatchGenerator, rpc: RadixPromptCache, prompts: list[list[int]]) -> None:
    """``prompts`` fetched and run to their end together, as mlx_lm.server runs requests."""
    fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
    uids = gen.insert_segments(
        [[rest] for _, rest in fetched],
        max_tokens=[4] * len(prompts),
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(r)] for p, (_, r) in zip(prompts, fetched)],
    )
    del fetched
    done = set()
    while len(done) < len(uids):
        for r in gen.next()[1]:
            if r.finish_reason is not None:
                done.add(r.uid)
                rpc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    gen.close()
