"""Where a decode step's time goes, in process: stock mlx-lm's BatchGenerator and the engine.

Modes: ``stock``, the engine's exact path (``off``) and its shared path (``on``: on CUDA the
paged kernel, engine/paged_attention.py; ``paged``: that kernel wherever it serves, its MLX-ops
form on the CPU); the engine's modes with its projections fused (``--fuse on``, as the plugin
serves by default), unfused (``off``) or both; ``--compile pass`` runs a paged pass as one
compiled call (engine/compiled_pass.py).

For each batch size, ROWS requests with short prompts of their own decode together; once
every row decodes, each step's wall time is split into the host's parts:

- ``model_ms``: Python building the model's graph (the forward call);
- ``launch_ms``: ``mx.async_eval`` of the next step, which on a GPU encodes and launches its
  kernels (on MLX's CUDA backend: adding them to a CUDA graph, updating and launching it);
- ``wait_ms``: ``mx.eval`` of the step before, that is waiting for the device;
- ``other_ms``: the rest (sampling's and logits processors' graphs, per-row Python, and
  each row's sampled log-probability read to the host, as mlx_lm.server's generation thread
  reads it);
- ``host_ms``: ``model_ms`` and ``other_ms`` together, the host's own work around the
  device's (each a median of steps, so they need not add up);
- ``engine_ms`` (the engine's modes): its own clock's parts of a step (engine/step_clock.py),
  means over the same steps: where ``other_ms`` goes (``read``: the rows' responses;
  ``batch``: mlx-lm's ``BatchGenerator`` around the step; ``engine``: the engine's call around
  it; ``outside``: between calls, here this tool's loop).

Where ``nvidia-smi`` answers, ``device_busy`` is the GPU's utilization over the same steps
(the share of time a kernel ran) and ``device_ms`` that share of a step: what the device
itself needs against what the step takes.

    python -m mlx_radix_plugin.tools.step_profile --shape llama-3-8b --dtype bfloat16
    python -m mlx_radix_plugin.tools.step_profile --rows 32 --temperature 0.7   # tiny: host costs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from .decode_calibration import make_generator

MODES = ("stock", "off", "on", "paged")
PARTS = ("model_ms", "launch_ms", "wait_ms")


class _Clock:
    """Seconds spent inside the calls it wraps, by part, since the last ``take``."""

    def __init__(self):
        self.spent = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, dict.fromkeys(PARTS, 0.0)
        return spent


class _TimedModel:
    """The model, its forward calls timed (mlx-lm's batches call ``generator.model``)."""

    def __init__(self, model, clock: _Clock):
        self._model = model
        self._call = clock.wrap("model_ms", model.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def graph_ops(arrays) -> Counter:
    """The operations (primitives) of the unevaluated graph behind ``arrays``, by name."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


@contextlib.contextmanager
def timed_evals(clock: _Clock):
    """``mx.eval`` and ``mx.async_eval`` timed for the block, wherever they are called."""
    import mlx.core as mx

    saved = mx.eval, mx.async_eval
    mx.eval, mx.async_eval = clock.wrap("wait_ms", mx.eval), clock.wrap("launch_ms", mx.async_eval)
    try:
        yield
    finally:
        mx.eval, mx.async_eval = saved


ONE_CHUNK_MIB = 1 << 20  # larger than any pool here: one chunk


def profile(model, rows: int, mode: str, steps: int, args, gpu, fuse: bool = True) -> dict:
    """Median parts of a step of ``rows`` requests decoding together, in ms."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors, make_sampler
    from mlx_lm_hooks.sampling import LogitBias

    rng = random.Random(f"{rows}-{mode}")
    prompts = [[rng.randrange(2, args.vocab) for _ in range(args.prompt)] for _ in range(rows)]
    # What each server gives its requests: stock a sampler and processors of their own for
    # each; the hooks' server one sampler for equal settings and a readable logit bias
    # (mlx_lm_hooks/sampling.py).
    if mode == "stock":
        samplers = [make_sampler(args.temperature) for _ in range(rows)]
        bias = lambda: make_logits_processors(logit_bias={0: -100.0})  # noqa: E731
    else:
        samplers = [make_sampler(args.temperature)] * rows
        bias = lambda: [LogitBias({0: -100.0})]  # noqa: E731
    processors = [bias() if args.logit_bias else [] for _ in range(rows)]
    clock = _Clock()
    # As mlx_lm.server runs it: its generation thread's default stream (else mlx-lm's own).
    stream = mx.default_stream(mx.default_device()) if args.thread else None
    # The pool in one chunk, as a server's holds these rows (its chunks are an eighth of its
    # ceiling: 12.9 GB for Llama-3-8B on an H200). Sized to the rows, it came in chunks of 256
    # MiB, which 32 rows' pages spanned, and CUDA's paged kernel gave way to the masked variant
    # there: 15.3 ms a step against 8.2 in one chunk (docs/benchmarking.md, "The paged decode
    # kernel on CUDA").
    gen = make_generator(
        model, prompts, mode, steps + 64, processors=processors, samplers=samplers,
        pool_tokens=args.pool_tokens or None, stream=stream, fuse=fuse, chunk_mib=ONE_CHUNK_MIB,
        compiled=args.compile,
    )  # fmt: skip
    # mlx-lm's batches call the model their generator was made with.
    gen.model = gen._generation_batch.model = _TimedModel(model, clock)
    walls, parts, ops = [], [], Counter()
    launch = mx.async_eval

    def counted(*arrays):
        # What the first measured step launches (the next step's graph, the pool's writes).
        if len(walls) == 8:
            ops.update(graph_ops(_leaves(arrays)))
        return launch(*arrays)

    mx.async_eval = counted
    try:
        engine = _run(gen, rows, steps, clock, walls, parts, args.nvtx)
    finally:
        mx.async_eval = launch
    gen.close()
    mx.clear_cache()
    out = _summary(walls[8:], parts[8:], ops, gpu)
    if engine is not None:
        out["engine_ms"] = engine
    return out


def _profiled(model, rows: int, mode: str, args, gpu, fuse: bool) -> dict:
    """``profile`` here, or with ``--thread`` on a thread of its own."""
    if not args.thread:
        return profile(model, rows, mode, args.steps, args, gpu, fuse)
    out: list = []
    worker = threading.Thread(
        target=lambda: out.append(profile(model, rows, mode, args.steps, args, gpu, fuse))
    )
    worker.start()
    worker.join()
    if not out:
        raise RuntimeError("the profiling thread failed (its traceback is above)")
    return out[0]


def _read_as_the_server(responses: list) -> None:
    """What mlx_lm.server's generation thread does with each row's response of every step,
    besides detokenizing: read its token's log-probability to the host
    (``r.logprobs[r.token].item()``). Stock's rows are arrays, whose ``item()`` evaluates a
    slice; the engine's answer it from the host (decode_step.py, ``TokenLogprobs``)."""
    for r in responses:
        r.logprobs[r.token].item()


def _leaves(tree) -> list:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten(list(tree)) if isinstance(a, mx.array)]


def _run(
    gen, rows: int, steps: int, clock: _Clock, walls: list, parts: list, nvtx
) -> dict[str, float] | None:
    """Step until ``steps`` are measured after 8 more; the engine's clock's parts of a
    measured step (means, ms), where ``gen`` is the engine."""
    engine = getattr(gen, "clock", None)
    start_parts = None
    with timed_evals(clock):
        while len(walls) < steps + 8:
            if engine is not None and start_parts is None and len(walls) == 8:
                start_parts = dict(engine.seconds), engine.steps
            clock.take()
            if nvtx and len(walls) >= 8:
                nvtx.range_push("step")
            start = time.perf_counter()
            responses = gen.next()[1]
            _read_as_the_server(responses)
            wall = time.perf_counter() - start
            if nvtx and len(walls) >= 8:
                nvtx.range_pop()
            spent = clock.take()
            if len(responses) == rows:  # every row decoded: no prefill in this call
                walls.append((start, wall))
                parts.append(spent)
    if start_parts is None:
        return None
    seconds, first = start_parts
    n = max(1, engine.steps - first)
    return {k: round(1000 * (v - seconds[k]) / n, 3) for k, v in engine.seconds.items()}


def _summary(measured: list, parts: list, ops: Counter, gpu) -> dict:
    """Medians of the measured steps (the first ones, which build kernels and buffers, are
    left out), the device's share of them, and the operations one step launches."""
    out = {"step_ms": round(1000 * statistics.median(w for _, w in measured), 3)}
    for part in PARTS:
        out[part] = round(1000 * statistics.median(p[part] for p in parts), 3)
    # Of each step, then the median: a difference of medians moved with the launch's spread
    # (on 2 CPU cores, where a launch computes the step, by 0.1-0.2 ms from run to run).
    rest = [w - sum(p[part] for part in PARTS) for (_, w), p in zip(measured, parts)]
    own = [w - p["launch_ms"] - p["wait_ms"] for (_, w), p in zip(measured, parts)]
    out["other_ms"] = round(1000 * statistics.median(rest), 3)
    out["host_ms"] = round(1000 * statistics.median(own), 3)
    busy = gpu.mean(measured[0][0], measured[-1][0] + measured[-1][1])
    if busy is not None:
        out["device_busy"] = round(busy, 3)
        out["device_ms"] = round(busy * out["step_ms"], 3)
    out["ops"] = sum(ops.values())
    out["ops_by_kind"] = dict(ops.most_common(12))
    return out


def main(argv: list[str] | None = None) -> int:
    from mlx_lm_hooks import blas

    blas.preload()  # before MLX is imported: this is a command's entry point
    import mlx.core as mx
    from mlx_lm import load

    from ..models.random_model import SHAPES, build
    from .gpu_bench import GpuUtilization, _positive_ints, shape_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (else --shape builds random weights)")
    p.add_argument("--shape", choices=[*sorted(SHAPES), "tiny"], default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rows", type=_positive_ints, default=[1, 8, 32], help="e.g. 1,8,32")
    p.add_argument("--modes", default="stock,off", help=f"of {', '.join(MODES)}, comma-separated")
    p.add_argument(
        "--fuse", default="on", help="the engine's projections fused: on, off, or on,off"
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "layers", "pass", "off"],
        help="the engine's decode.compile: its Llama and Qwen layers through compiled calls "
        "(auto, layers), and a paged shared pass as one (pass)",
    )
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens a row")
    p.add_argument("--steps", type=int, default=48, help="decode steps timed a point")
    p.add_argument("--temperature", type=float, default=0.0, help="every row samples at this")
    p.add_argument("--logit-bias", action="store_true", help="every row bans EOS by a logit bias")
    p.add_argument(
        "--nvtx",
        action="store_true",
        help="mark each measured step as an NVTX range 'step' (for ncu --nvtx-include step/; "
        "through PyTorch's NVTX binding)",
    )
    p.add_argument(
        "--pool-tokens", type=int, default=0, help="the engine's pool (0: what the rows need)"
    )
    p.add_argument(
        "--thread",
        action="store_true",
        help="step on a thread of its own and its default stream, as mlx_lm.server does",
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.nvtx:
        from torch.cuda import nvtx

        args.nvtx = nvtx
    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(MODES):
        p.error(f"--modes {args.modes!r}: expected some of {', '.join(MODES)}")
    fuses = args.fuse.split(",")
    if not fuses or not set(fuses) <= {"on", "off"}:
        p.error(f"--fuse {args.fuse!r}: expected on, off, or on,off")
    gpu = GpuUtilization()
    gpu.start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            base, overrides = shape_config(args.shape)
            model_dir = build(base, Path(tmp), args.dtype, **overrides)
        args.vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 30000)
        model, _ = load(str(model_dir))
        for n in args.rows:
            for mode in modes:
                for fuse in ["off"] if mode == "stock" else fuses:
                    part = _profiled(model, n, mode, args, gpu, fuse == "on")
                    row = {"rows": n, "mode": mode, "fuse": fuse, **part}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    gpu.stop()
    report = {
        "device": str(mx.default_device()),
        "model": args.model or f"{args.shape} ({args.dtype})",
        "temperature": args.temperature,
        "logit_bias": args.logit_bias,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
