"""Decode step time in process: stock mlx-lm against the engine's exact and shared paths.

For each point ``ROWSxPREFIX`` of the grid, ``ROWS`` requests share one cached
``PREFIX``-token prefix and have their own question; once all decode together, the median
time of a decode step is taken for mlx-lm's ``BatchGenerator`` (stock), the engine with
``decode.shared_prefix = "off"`` (exact) and ``"on"`` (shared; ``split``, ``masked`` and
``paged`` force one of the ways ``engine/attention.py`` computes it). What ``auto`` would
choose there is printed beside: these runs are where ``engine/decode_path.py``'s rule comes
from.

    python -m mlx_radix_plugin.tools.decode_calibration --model PATH --grid 8x2048,4x512
    python -m mlx_radix_plugin.tools.decode_calibration --shape llama-3-8b --dtype bfloat16 \
        --modes stock,off,split,masked
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

KEY = ("calibration", None, None)
MODES = ("stock", "off", "on", "split", "masked", "paged")


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``ROWSxPREFIX,...`` as pairs; an empty text is no point."""
    if not text:
        return []
    try:
        points = [tuple(int(v) for v in p.split("x")) for p in text.split(",")]
    except ValueError:
        points = []
    if not points or any(len(p) != 2 or min(p) < 1 for p in points):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROWSxPREFIX,... e.g. 8x2048,4x512")
    return points


def parse_modes(text: str) -> tuple[str, ...]:
    """``stock,off,...``: stock first, each of ``MODES`` at most once."""
    modes = tuple(text.split(","))
    if modes[0] != "stock" or len(set(modes)) != len(modes) or not set(modes) <= set(MODES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected stock, then any of {', '.join(MODES[1:])}, comma-separated"
        )
    return modes


def make_generator(
    model,
    prompts,
    mode: str,
    max_tokens: int,
    page_size: int = 16,
    pool_tokens: int | None = None,
    processors: list | None = None,
    chunk_mib: int = 0,
    samplers: list | None = None,
    stream=None,
    fuse: bool = True,
    compiled: str = "auto",
):
    """``prompts`` inserted into mlx-lm's ``BatchGenerator`` (``mode`` stock) or the engine
    (``off``: the exact path; ``on``, ``split``, ``masked``, ``paged``: the shared one), each
    row with its ``processors`` and ``samplers`` (mlx-lm's per-request lists; None: none,
    greedy).
    The engine's pool holds ``pool_tokens`` (default: what the prompts need); ``stream``:
    the generator's (default: mlx-lm's own generation stream); ``fuse``: the engine's model
    with its projections fused (``model.fuse_projections``); ``compiled``: its
    ``decode.compile``."""
    from mlx_lm.generate import BatchGenerator

    from ..cache.prompt_cache import RadixPromptCache
    from ..engine import attention, compiled_layers, compiled_pass, fused_projections
    from ..engine.generator import RadixBatchGenerator
    from ..memory.pool import KVPool

    # As each server runs it: the plugin fuses projections and gives the rest their views.
    compiled_pass.uninstall(model)
    compiled_layers.uninstall(model)
    fused_projections.restore(model)
    if mode != "stock":
        fused_projections.prepare(model, fuse)
        if compiled_layers.enabled(compiled):
            compiled_layers.install(model)
        if compiled_pass.enabled(compiled):
            compiled_pass.install(model)
    n = len(prompts)
    sizes = dict(completion_batch_size=max(32, n), prefill_batch_size=min(n, 8), stream=stream)
    extra = dict(logits_processors=processors or [[]] * n, samplers=samplers)
    attention.VARIANT = mode if mode in ("split", "masked", "paged") else None
    if mode == "stock":
        gen = BatchGenerator(model, **sizes)
        gen.insert(prompts, max_tokens=[max_tokens] * n, **extra)
        return gen
    tokens = pool_tokens or sum(map(len, prompts)) + n * (max_tokens + 16) + 4 * page_size
    pool = KVPool.for_model(
        model, page_size=page_size, pool_tokens=tokens, chunk_bytes=chunk_mib << 20 or None
    )
    rpc = RadixPromptCache(pool)
    path = "off" if mode == "off" else "on"
    gen = RadixBatchGenerator(model, rpc, shared_prefix=path, **sizes)
    fetched = [rpc.fetch_nearest_cache(KEY, p) for p in prompts]
    gen.insert_segments(
        [[rest] for _, rest in fetched],
        max_tokens=[max_tokens] * n,
        caches=[c for c, _ in fetched],
        all_tokens=[p[: len(p) - len(r)] for p, (_, r) in zip(prompts, fetched)],
        **extra,
    )
    return gen


def step_times(
    model,
    prompts,
    mode: str,
    steps: int,
    page_size: int,
    pool_tokens: int | None = None,
    logit_bias: bool = False,
    chunk_mib: int = 0,
) -> tuple[float, str]:
    """Median ms of a decode step of ``prompts`` together, after warm-up steps; and the path
    the engine's batch took (``stock`` for mlx-lm's own generator).

    ``pool_tokens``: the engine's pool (default: what the prompts need); ``logit_bias``:
    each request carries a logit bias, as the benchmarks' requests (which ban EOS) do;
    ``chunk_mib``: the pool's chunks (0: the server's default for that ceiling).
    """
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors

    from ..engine import attention

    n = len(prompts)
    # Rows admitted in later prefill batches join a few steps after the first: enough
    # tokens that all decode together for ``steps`` steps and more.
    max_tokens = 3 * steps + 64
    processors = [make_logits_processors(logit_bias={0: -100.0}) if logit_bias else []] * n
    gen = make_generator(
        model, prompts, mode, max_tokens, page_size, pool_tokens, processors, chunk_mib
    )
    times, finished = [], 0
    while len(times) < steps + 4:
        if finished:
            raise RuntimeError(f"rows finished after {len(times)} steps of all {n} together")
        start = time.perf_counter()
        responses = gen.next()[1]
        elapsed = time.perf_counter() - start
        finished += sum(r.finish_reason is not None for r in responses)
        if len(responses) == n:  # every row decoded: no prefill in this call
            times.append(elapsed)
    path = "stock" if mode == "stock" else gen.decode_stats["decode_path"]
    gen.close()
    attention.VARIANT = None
    mx.clear_cache()
    return 1000 * statistics.median(times[4:]), path


def calibrate(
    model_dir: Path,
    grid,
    *,
    question: int,
    steps: int,
    page_size: int,
    modes=("stock", "off", "on"),
    pool_tokens: int | None = None,
    logit_bias: bool = False,
    chunk_mib: int = 0,
) -> list[dict]:
    import mlx.core as mx
    from mlx_lm import load

    from ..engine.decode_path import backend, rule_for
    from ..memory import in_place
    from ..memory.pool import inspect_model
    from ..memory.prefix_groups import PrefixGroup

    model, _ = load(str(model_dir))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rule = rule_for(backend(), in_place.available(inspect_model(model)[1]))
    rows = []
    for n, prefix_tokens in grid:
        rng = random.Random(f"{n}x{prefix_tokens}")
        prefix = [rng.randrange(2, vocab) for _ in range(prefix_tokens)]
        prompts = [prefix + [rng.randrange(2, vocab) for _ in range(question)] for _ in range(n)]
        # The group and the lengths auto sees in the middle of the measured steps.
        pages = prefix_tokens // page_size
        group = PrefixGroup(tuple(range(n)), tuple(range(pages)))
        lengths = [prefix_tokens + question + steps // 2] * n
        row = {
            "rows": n,
            "prefix": prefix_tokens,
            "auto": "shared" if rule.takes_shared([group], lengths, page_size) else "exact",
        }
        for mode in modes:
            try:
                ms, path = step_times(
                    model, prompts, mode, steps, page_size, pool_tokens, logit_bias, chunk_mib
                )
            except RuntimeError as e:  # out of device memory: the other modes still run
                row[f"{mode}_error"] = str(e)[:200]
                mx.clear_cache()
                continue
            row[f"{mode}_ms"] = round(ms, 2)
            row[f"{mode}_path"] = path
        for mode in modes[1:]:
            if "stock_ms" in row and f"{mode}_ms" in row:
                row[f"{mode}_speedup"] = round(row["stock_ms"] / row[f"{mode}_ms"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    from mlx_lm_hooks import blas

    blas.preload()  # before MLX is imported: this is a command's entry point
    import mlx.core as mx

    from ..models.random_model import SHAPES, build

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (else --shape builds random weights)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--grid", type=parse_grid, default=parse_grid("2x512,4x512,8x512,4x1024,8x2048"))
    p.add_argument("--question", type=int, default=32, help="own tokens of each request")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per point")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--modes",
        type=parse_modes,
        default=parse_modes("stock,off,on"),
        help=f"what to time, in order, stock first: {','.join(MODES)}",
    )
    p.add_argument("--pool-tokens", type=int, help="the engine's pool (default: what it needs)")
    p.add_argument("--chunk-mib", type=int, default=0, help="the pool's chunks (0: default)")
    p.add_argument(
        "--logit-bias", action="store_true", help="every request with a logit bias, as in the bench"
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="decode-calibration-") as tmp:
        model_dir = Path(args.model) if args.model else build(args.shape, Path(tmp), args.dtype)
        rows = calibrate(
            model_dir,
            args.grid,
            question=args.question,
            steps=args.steps,
            page_size=args.page_size,
            modes=args.modes,
            pool_tokens=args.pool_tokens,
            logit_bias=args.logit_bias,
            chunk_mib=args.chunk_mib,
        )
    report = {"device": str(mx.default_device()), "model": args.model or args.shape, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
