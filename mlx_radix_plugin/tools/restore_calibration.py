"""A restart's first prompt in process: read back from the disk tier against computed again.

For each prompt length, a cold prefill (what stock does after a restart) is timed, then the
prompt's pages go through a pool to the disk tier, and a fresh pool over the same disk (a
restart) fetches the prompt plus a few tokens: the restore and the first token after it are
timed, and the first token's logits compared with the cold run's. Beside them, what
``radix.disk.restore = auto`` decides on this machine: the prefill probe it runs at load and
the read rate it measures on the pages found. These runs are where ``cache/tiering.py``'s
numbers come from.

    python -m mlx_radix_plugin.tools.restore_calibration --shape llama-3-8b --dtype bfloat16
    python -m mlx_radix_plugin.tools.restore_calibration --model PATH --lengths 2048,8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

KEY = ("calibration", None, None)
QUESTION = [5, 6, 7]


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(v) for v in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token counts, e.g. 2048,8192")
    return lengths


def measure(model, lengths: list[int], page_size: int, rounds: int, disk_root: Path) -> dict:
    """The rows of the report (one a prompt length) and what ``auto`` decides."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from ..cache.prompt_cache import RadixPromptCache
    from ..cache.tiering import Tiering, disk_identity, prefill_seconds_per_token
    from ..memory.disk_tier import DiskTier
    from ..memory.pool import KVPool

    began = time.perf_counter()
    probe = prefill_seconds_per_token(model)
    probe_s = time.perf_counter() - began
    identity = disk_identity(model, KVPool.for_model(model, page_size=page_size, pool_tokens=64))
    vocab = model.args.vocab_size
    step = 2048

    def fresh(tokens: int) -> RadixPromptCache:
        pool = KVPool.for_model(model, page_size=page_size, pool_tokens=tokens + 64)
        rpc = RadixPromptCache(pool)
        rpc.tiering = Tiering(pool, DiskTier(disk_root, identity, 1 << 40), KEY)
        return rpc

    rows = []
    rng = np.random.default_rng(0)
    for n in lengths:
        prompt = rng.integers(2, vocab, n).tolist()
        full = prompt + QUESTION
        cold = []
        for _ in range(rounds):
            cache = make_prompt_cache(model)
            t = time.perf_counter()
            for i in range(0, len(full), step):
                out = model(mx.array(full[i : i + step])[None], cache=cache)
                mx.eval([c.state for c in cache])
            ref = out[0, -1].astype(mx.float32)
            mx.eval(ref)
            cold.append(time.perf_counter() - t)
        writer = fresh(n)
        caches, rest = writer.fetch_nearest_cache(KEY, prompt)
        for i in range(0, len(rest), step):
            model(mx.array(rest[i : i + step])[None], cache=caches)
            mx.eval(writer.pool.arrays)
        writer.insert_cache(KEY, prompt, caches)
        del caches
        writer.tiering.pump(everything=True)
        while writer.tiering.write_later(writer.tree):  # a long prompt outruns the write queue
            writer.tiering.disk.flush(600)
        written = writer.tiering.disk.flush(600)
        writer.tiering.disk.close()
        warm, restores, diffs, read_rate = [], [], [], None
        for _ in range(rounds):
            rpc = fresh(n)
            if read_rate is None:
                rpc.tiering.measure_reads()
                read_rate = rpc.tiering.read_rate
            t = time.perf_counter()
            caches, rest = rpc.fetch_nearest_cache(KEY, full)
            restores.append(time.perf_counter() - t)
            logits = model(mx.array(rest)[None], cache=caches)[0, -1].astype(mx.float32)
            mx.eval(logits)
            warm.append(time.perf_counter() - t)
            cached = len(full) - len(rest)
            diffs.append((mx.abs(logits - ref).max() / mx.abs(ref).max()).item())
            rpc.tiering.disk.close()
            del caches, rpc
        cold_s, warm_s = statistics.median(cold), statistics.median(warm)
        restore_s = statistics.median(restores)
        rows.append(
            {
                "tokens": n,
                "cached": cached,
                "all_written": written,
                "cold_ttft_s": round(cold_s, 4),
                "restored_ttft_s": round(warm_s, 4),
                "speedup": round(cold_s / warm_s, 2),
                "restore_s_per_1k": round(restore_s / max(1, cached) * 1000, 4),
                "prefill_s_per_1k": round(cold_s / len(full) * 1000, 4),
                "max_rel_logit_diff": max(diffs),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    auto_reads = read_rate is None or read_rate < page_size * probe
    return {
        "probe_prefill_s_per_1k": round(probe * 1000, 4),
        "probe_seconds": round(probe_s, 3),
        "read_s_per_page": read_rate,
        "auto_reads": auto_reads,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    from mlx_lm_hooks import blas

    blas.preload()  # before MLX: its CPU matmuls
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="An mlx-lm model directory.")
    where.add_argument("--shape", help="Random weights of this shape (models/random_model.py).")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--lengths", type=parse_lengths, default=[2048, 8192])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="Write the report here too.")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx.utils import tree_map

    with tempfile.TemporaryDirectory(prefix="mlx-radix-restore-") as tmp:
        if args.model:
            from mlx_lm import load

            model, _ = load(args.model)
        else:
            from mlx_lm.utils import _get_classes

            from ..models.random_model import SHAPES

            config = dict(
                SHAPES[args.shape], rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=max(args.lengths) + 64,
            )  # fmt: skip
            model_class, args_class = _get_classes(config)
            mx.random.seed(0)
            model = model_class(args_class.from_dict(config))
            dtype = getattr(mx, args.dtype)
            model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
            mx.eval(model.parameters())
        report = {
            "model": args.model or f"random {args.shape}",
            "dtype": args.dtype,
            "device": str(mx.default_device()),
            **measure(model, args.lengths, args.page_size, args.rounds, Path(tmp)),
        }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
