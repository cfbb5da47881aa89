"""Stock ``mlx_lm.server`` and the radix plugin side by side on a GPU, real-shape models.

For each shape a random-weight model is built on the spot (bf16 by default, no
download; a byte-level BPE tokenizer and its real model's context, models/random_model.py)
and both servers are started on it. Measured, same requests to both: decode tokens/s at 1,
8 and 32 concurrent requests; time to first token on a cached 4,096-token shared prefix;
bursts of 32 requests on a new 2,048-token prefix each, the first apart; an agent loop of
clients whose turns grow one shared prefix; and, with each server alone on the device,
decode of many requests on one cached prefix.
Decode at one request is set against the memory-bandwidth floor: the bytes one step
reads (weights + K/V) over the copy bandwidth measured on the same device.

With ``--ranks N`` both servers run tensor parallel under ``mlx.launch``, N ranks on
127.0.0.1 (rank r on GPU r with NCCL; the ring backend on a CPU), rank 0 serving HTTP; the
floor is then a rank's: its share of the sharded weights and K/V.

    python -m mlx_radix_plugin.tools.gpu_bench --json gpu.json
    python -m mlx_radix_plugin.tools.gpu_bench --shape tiny --dtype float32   # CPU smoke run
    python -m mlx_radix_plugin.tools.gpu_bench --ranks 2 --backend nccl --shape llama-3-8b

``python -m mlx_radix_plugin.tools.gpu_bench serve-radix --model PATH ...`` is the plugin's
server as the benchmark starts it (see ``serve_radix``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..engine.step_clock import PARTS as STEP_PARTS
from ..models.random_model import FIRST_WORD, SHAPES, TINY, build, words
from .bench.command import NO_EOS, Requests, server_env
from .bench.report import compare_turns, decode_s_per_token
from .bench.servers import Launched, ServerProcess, free_port, free_ports, mlx_launch
from .bench.workloads import (
    AgentSession,
    Conversations,
    Prompts,
    Sampling,
    Workload,
    run_workload,
    single_token_words,
)
from .decode_calibration import parse_grid

DEFAULT_SHAPES = ("llama-3.2-1b", "llama-3-8b")
SERVERS = ("stock", "radix")
NOT_RUN = "not run"  # a server --servers left out of a workload that starts each alone
WORKLOADS = ("decode", "decode-shared", "cached-prefix", "burst", "agent", "conversations", "long")
# Workloads that start each server alone on the device, not the pair side by side.
ALONE = ("decode-shared", "agent", "conversations", "burst", "long")


def progress(message: str) -> None:
    """A timestamped line on stdout: a run on a leased machine is read from its log."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def serve_radix(argv: list[str]) -> None:
    """``mlx_lm.server`` with the radix plugin registered directly.

    The stock start-up shim finds plugins through installed entry points; on a machine
    that runs this package from a source tree on PYTHONPATH there are none.
    """
    from mlx_lm_hooks.plugins import get_plugin_manager
    from mlx_lm_hooks.server import serve

    from ..server.plugin import plugin

    pm = get_plugin_manager()
    pm.register(plugin, name="radix")
    serve(["radix"], argv, pm)


def copy_bandwidth(nbytes: int, iters: int = 10) -> float:
    """Bytes read plus bytes written per second by an elementwise copy of ``nbytes``."""
    # 2-D: one MLX dimension holds at most 2**31 - 1 elements.
    x = mx.zeros((max(1, nbytes // 8192), 4096), dtype=mx.bfloat16)
    mx.eval(x)
    mx.eval(x + 1)  # compile and allocate outside the timed loop
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(x + 1)
    mx.synchronize()
    rate = 2 * x.nbytes * iters / (time.perf_counter() - start)
    del x
    mx.clear_cache()
    return rate


def matmul_rate(dtype: str = "bfloat16") -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` product in ``dtype`` on the default device (n 8,192
    on a GPU, 1,024 on a CPU): the rate a prompt's linear and attention work is set against."""
    n, iters = (8192, 10) if mx.default_device() == mx.gpu else (1024, 2)
    a = mx.random.normal((n, n)).astype(getattr(mx, dtype))
    b = mx.random.normal((n, n)).astype(getattr(mx, dtype))
    mx.eval(a, b, a @ b)
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(a @ b)
    mx.synchronize()
    rate = 2 * n**3 * iters / (time.perf_counter() - start)
    del a, b
    mx.clear_cache()
    return rate


def prefill_flops(config: dict, tokens: int) -> dict[str, int]:
    """A prompt's multiply-adds, x2: its tokens through every layer's projections and MLP
    (``linear``), and causal attention, each query over the keys up to it (``attention``)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    per_layer += 3 * hidden * config["intermediate_size"]
    return {
        "linear": 2 * tokens * layers * per_layer,
        "attention": 2 * 2 * layers * heads * head_dim * tokens * (tokens + 1) // 2,
    }


def safetensors_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {
        name: meta["data_offsets"][1] - meta["data_offsets"][0]
        for name, meta in header.items()
        if name != "__metadata__"
    }


def decode_step_bytes(model_dir: Path, context: int, ranks: int = 1) -> dict[str, int]:
    """What one decode step of one request must read from memory at ``context`` tokens, on
    each of ``ranks`` tensor-parallel ranks.

    Every weight matrix is read once, except an untied input embedding, of which a step
    reads one row; K/V is read for every cached token of every layer. mlx-lm's
    tensor-parallel Llama splits every attention and MLP projection, and so the K/V heads,
    over the ranks; embeddings, norms and the output head are whole on each rank.
    """
    config = json.loads((model_dir / "config.json").read_text())
    tensors = safetensors_bytes(model_dir / "model.safetensors")
    weights = sum(
        size // ranks if ".self_attn." in name or ".mlp." in name else size
        for name, size in tensors.items()
    )
    if "lm_head.weight" in tensors:
        weights -= tensors["model.embed_tokens.weight"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = tensors["model.norm.weight"] // config["hidden_size"]
    kv_heads = config["num_key_value_heads"] // ranks
    kv = 2 * config["num_hidden_layers"] * kv_heads * head_dim * itemsize
    return {"weights": weights, "kv": kv * context}


def in_process_ms_per_token(model_dir: Path, prompt_len: int, max_tokens: int) -> float:
    """Stock mlx-lm decode of one request with no server around it, ms per token."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir))
    prompt = mx.array(list(range(2, 2 + prompt_len)))
    stamps = [time.perf_counter() for _ in generate_step(prompt, model, max_tokens=max_tokens)]
    del model
    gc.collect()
    mx.clear_cache()
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


# Random weights give EOS no chance (models/random_model.py): requests carry no logit bias,
# as real clients' do not; ``--logit-bias`` bans EOS by one anyway, as the benchmark did
# before (it adds a logits processor a row to every step of both servers).
LOGIT_BIAS: dict = {}


def stream_all(
    server: ServerProcess, prompts: list[str], max_tokens: int, strict: bool = True
) -> tuple[float, list[dict]]:
    """Send ``prompts`` at once, streamed; (wall seconds, per request: ttft, seconds, usage,
    text, or ``error``). ``seconds`` runs from the first token to the end of the stream. A
    failed request raises where ``strict``; else it is returned with its ``error``."""
    start = time.perf_counter()
    out: list[dict] = [{} for _ in prompts]

    def one(i: int) -> None:
        try:
            request(i)
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            out[i]["error"] = f"{type(e).__name__}: {e}"[:300]

    def request(i: int) -> None:
        def first() -> None:
            out[i]["ttft"] = time.perf_counter() - start

        body = {
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **({"logit_bias": LOGIT_BIAS} if LOGIT_BIAS else {}),
            "stream_options": {"include_usage": True},
        }
        out[i]["retries"] = 0
        while True:
            try:
                events = server.stream("/v1/completions", body, on_first=first)
                break
            except ConnectionResetError:
                # Stock mlx_lm.server listens with Python's default queue of 5 connections;
                # a kernel that resets on overflow (the GPU machine's does) turns away part
                # of a 32-request burst. A client would retry; the time lost stays in TTFT.
                if out[i]["retries"] == 5:
                    raise
                out[i]["retries"] += 1
                time.sleep(0.05)
        failed = next((e["error"] for e in events if e.get("error")), None)
        if failed is not None or "ttft" not in out[i]:
            out[i]["error"] = str(failed or "the stream ended with no token")[:300]
            return
        out[i]["seconds"] = time.perf_counter() - start - out[i]["ttft"]
        out[i]["text"] = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        out[i]["usage"] = next(e["usage"] for e in reversed(events) if e.get("usage"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if strict and any("usage" not in r for r in out):
        errors = sorted({r.get("error", "no usage") for r in out if "usage" not in r})
        raise RuntimeError(f"a request failed ({'; '.join(errors)}); see the server's log")
    return time.perf_counter() - start, out


def _ids(rng: Requests, n: int) -> list[int]:
    """``n`` random word ids (each one token of the random model's tokenizer)."""
    return [rng.randrange(FIRST_WORD, rng.vocab) for _ in range(n)]


def _prompt(rng: Requests, n: int, prefix: list[int] = ()) -> str:
    return words([*prefix, *_ids(rng, n)])


def _computed(usage: dict) -> int:
    return usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


def _ttft_summary(ttft: list[float]) -> dict:
    ttft = sorted(ttft)
    return {
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 4),
    }


@contextlib.contextmanager
def alone(servers: dict, name: str):
    """Server ``name`` alone on the machine for the block: the others, under mlx.launch,
    paused (``Launched.paused``); one in a process of its own waits without using the CPU."""
    with contextlib.ExitStack() as stack:
        for other, server in servers.items():
            if other != name and isinstance(server, Launched):
                stack.enter_context(server.paused())
        yield servers[name]


def step_parts(before: dict | None, after: dict | None) -> dict | None:
    """Mean ms a decode step by part between two of the plugin's stats, and the step's
    total (None from stock, or where no step was timed)."""
    if not before or not after or "decode_step_seconds" not in after:
        return None
    steps = after["decode_steps_timed"] - before["decode_steps_timed"]
    if steps <= 0:
        return None
    a, b = after["decode_step_seconds"], before["decode_step_seconds"]
    parts = {k: 1000 * (a[k] - b[k]) / steps for k in a}
    return {**parts, "step": sum(parts.values()), "steps": steps}


def measure_decode(servers: dict, args, batch: int, rng_seed: int) -> dict:
    """``args.rounds`` rounds of ``batch`` concurrent requests per server, turns alternating."""
    per: dict[str, list[dict]] = {name: [] for name in servers}
    texts: dict[str, list[str]] = {name: [] for name in servers}
    retries = dict.fromkeys(servers, 0)
    spy = batch == max(args.concurrency)
    for round_ in range(args.rounds):
        order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
        for name in order:
            rng = Requests(rng_seed + round_, args.vocab)
            prompts = [_prompt(rng, args.decode_prompt) for _ in range(batch)]
            record = _spy_path(args, f"{name}-{batch}") if spy and round_ == 0 else None
            with alone(servers, name) as server, py_spy(server, record):
                before = server.stats()
                start = time.perf_counter()
                wall, results = stream_all(server, prompts, args.max_tokens)
                parts = step_parts(before, server.stats())
            busy = args.utilization.mean(start, start + wall)
            tokens = sum(r["usage"]["completion_tokens"] for r in results)
            per_token = [
                r["seconds"] / (r["usage"]["completion_tokens"] - 1)
                for r in results
                if r["usage"]["completion_tokens"] > 1
            ]
            per[name].append(
                {
                    "tokens_per_s": tokens / wall,
                    "ms_per_token": 1000 * statistics.median(per_token),
                    "device_busy": busy,
                    "step_ms": parts,
                }
            )
            texts[name] += [r["text"] for r in results]
            retries[name] += sum(r["retries"] for r in results)
    out = {
        name: {
            key: round(statistics.median(r[key] for r in rounds), 3)
            for key in ("tokens_per_s", "ms_per_token")
        }
        for name, rounds in per.items()
    }
    for name, rounds in per.items():
        out[name]["tokens_per_s_by_round"] = [round(r["tokens_per_s"], 1) for r in rounds]
        busy = [r["device_busy"] for r in rounds if r["device_busy"] is not None]
        if busy:  # the GPU's share of the round spent running kernels
            out[name]["device_busy"] = round(statistics.median(busy), 3)
        parts = [r["step_ms"] for r in rounds if r["step_ms"]]
        if parts:  # the plugin's generation thread, by part (engine/step_clock.py)
            out[name]["step_ms"] = {
                k: round(statistics.median(p[k] for p in parts), 3) for k in parts[0]
            }
    out["ratio"] = round(out["radix"]["tokens_per_s"] / out["stock"]["tokens_per_s"], 3)
    out["greedy_match"] = sum(a == b for a, b in zip(texts["stock"], texts["radix"]))
    out["requests"] = len(texts["stock"])
    out["connection_retries"] = retries
    return out


class DeviceMemoryPeak(threading.Thread):
    """The most device memory in use (``nvidia-smi``, every 200 ms) while it runs: what a
    server holds on the GPU, MLX's live arrays and its cache of freed buffers alike, the
    same reading for stock and the plugin; summed over the first ``gpus`` GPUs, where
    mlx.launch puts the ranks. ``peak_bytes`` is None where ``nvidia-smi`` is not."""

    def __init__(self, gpus: int = 1):
        super().__init__(daemon=True)
        self.gpus = gpus
        self.peak_bytes: int | None = None
        self._stop_event = threading.Event()

    def used_now(self) -> int | None:
        """Device memory in use now (``nvidia-smi``), None where it does not answer."""
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.split()
            if len(out) < self.gpus:
                return None
            return sum(int(mib) for mib in out[: self.gpus]) << 20
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def run(self) -> None:
        while True:
            used = self.used_now()
            if used is not None:
                self.peak_bytes = max(self.peak_bytes or 0, used)
            if self._stop_event.wait(0.2):
                return

    def stop(self) -> int | None:
        self._stop_event.set()
        self.join()
        return self.peak_bytes


class GpuUtilization(threading.Thread):
    """``nvidia-smi``'s utilization of GPU 0 (the share of time a kernel ran) sampled every
    50 ms; ``mean(start, end)`` over a span of ``time.perf_counter``, None where there is
    no ``nvidia-smi``."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int]] = []
        self._process = None

    def run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        try:
            self._process = subprocess.Popen(
                [*cmd, "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return
        for line in self._process.stdout:
            try:
                value = int(line.split(",")[0])
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), value))

    def mean(self, start: float, end: float) -> float | None:
        inside = [v for t, v in self.samples if start <= t <= end]
        return statistics.fmean(inside) / 100 if inside else None

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()


@contextlib.contextmanager
def py_spy(server: ServerProcess, path: Path | None):
    """``py-spy record`` of ``server`` for the block: the thread holding the GIL, 100 times
    a second, as raw collapsed stacks in ``path``; nothing when ``path`` is None or py-spy
    is missing.

    Where a step's time goes in the server is who holds the GIL, so only its holder is
    sampled, without pausing the process (``--nonblocking``). Native frames need it paused:
    on the H200 at 200 samples a second that slowed a 32-row decode round of stock's server
    several times over, and at 50 a second one server stalled."""
    exe = shutil.which("py-spy")
    if path is None or exe is None or isinstance(server, Launched):
        yield
        return
    cmd = [exe, "record", "--gil", "--nonblocking", "--threads", "-r", "100", "-f", "raw"]
    spy = subprocess.Popen(
        [*cmd, "-o", str(path), "-p", str(server.proc.pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # it writes the file when interrupted
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()


def _spy_path(args, name: str) -> Path | None:
    """Where ``--py-spy`` keeps the recording ``name``; None without it."""
    return Path(args.py_spy) / f"{name}.txt" if args.py_spy else None


class _StatsPoller(threading.Thread):
    """Reads the plugin's /v1/cache/stats every 50 ms while a round runs: the largest K/V
    it held (pool pages live requests lock, plus batch buffers) and the decode paths seen
    (a round shorter than a sample may show none: the step counters are exact)."""

    def __init__(self, server: ServerProcess):
        super().__init__(daemon=True)
        self.server = server
        self.kv_bytes_peak = 0
        self.buffer_bytes_peak = 0  # K/V outside the pool: the batches' buffers
        self.cache_bytes_peak = 0  # MLX's cache of freed buffers
        self.paths: set[str] = set()
        self.groups = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.05):
            s = self.server.stats()
            if not s:
                return
            page = s["pool_bytes_total"] // max(1, s["pages_total"])
            held = s["pages_locked"] * page + s.get("buffer_bytes", 0)
            self.kv_bytes_peak = max(self.kv_bytes_peak, held)
            self.buffer_bytes_peak = max(self.buffer_bytes_peak, s.get("buffer_bytes", 0))
            self.cache_bytes_peak = max(self.cache_bytes_peak, s.get("mlx_cache_bytes", 0))
            if s.get("decode_path"):
                self.paths.add(s["decode_path"])
            self.groups = max(self.groups, s.get("decode_groups", 0))

    def stop(self) -> dict:
        self._stop_event.set()
        self.join()
        return {
            "kv_bytes_held_peak": self.kv_bytes_peak,
            "buffer_bytes_peak": self.buffer_bytes_peak,
            "mlx_cache_bytes_peak": self.cache_bytes_peak,
            "decode_paths": sorted(self.paths),
            "decode_groups_max": self.groups,
        }


def _shared_round(server: ServerProcess, name: str, args, rows: int, prefix: int, seed: int):
    """One round of decode-shared on ``server``: (decode tokens/s, texts, what stats saw)."""
    rng = Requests(seed, args.vocab)
    shared = _ids(rng, prefix)
    warm = _prompt(rng, args.question, shared)
    prompts = [_prompt(rng, args.question, shared) for _ in range(rows)]
    stream_all(server, [warm], 2)  # the prefix is cached before the round
    poller = _StatsPoller(server) if name == "radix" else None
    if poller:
        before = server.stats()
        poller.start()
    start = time.perf_counter()
    _, results = stream_all(server, prompts, args.shared_max_tokens)
    extra = {}
    if poller:
        extra = poller.stop()
        extra["shared_steps"] = (
            server.stats()["decode_steps_shared"] - before["decode_steps_shared"]
        )
    first = min(start + r["ttft"] for r in results)
    last = max(start + r["ttft"] + r["seconds"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] - 1 for r in results)
    return generated / (last - first), [r["text"] for r in results], extra


def measure_decode_shared(model_dir: Path, work: Path, args, rows: int, prefix: int, seed: int):
    """``rows`` concurrent requests on one cached ``prefix``-token prefix, each with its own
    question, ``args.shared_max_tokens`` out: decode tokens/s, from the first token of the
    round to its last (admission is not counted), ``args.rounds`` rounds. Each server is
    started alone on the device for this point, stock first: at 32 x 4,096 on Llama-3-8B the
    K/V copies of two servers side by side do not fit 141 GB. A server that fails is
    reported as failed; the other's numbers stand."""
    out: dict = {"rows": rows, "prefix": prefix, "max_tokens": args.shared_max_tokens}
    rates: dict[str, list[float]] = {}
    texts: dict[str, list[str]] = {}
    for name in args.servers:
        rates[name], texts[name], extra = [], [], {}
        device = DeviceMemoryPeak(args.ranks)
        device.start()
        try:
            with started(name, model_dir, work, args) as server:
                for _ in range(args.rounds):
                    rate, round_texts, extra = _shared_round(server, name, args, rows, prefix, seed)
                    rates[name].append(rate)
                    texts[name] += round_texts
                if name == "radix":
                    s = server.stats()
                    extra["mlx"] = {k: s[k] for k in s if k.startswith("mlx_")}
                    extra["memory_plan"] = s["memory_plan"]
                    extra["pool_bytes_total"] = s["pool_bytes_total"]
        except Exception as e:  # noqa: BLE001 - the server's failure is the result
            extra["failed"] = f"{type(e).__name__}: {e}"[:300]
        extra["device_memory_peak_bytes"] = device.stop()
        out[name] = {
            "decode_tokens_per_s": round(statistics.median(rates[name]), 1)
            if rates[name]
            else None,
            "by_round": [round(r, 1) for r in rates[name]],
            **extra,
        }
    if rates.get("stock") and rates.get("radix"):
        out["ratio"] = round(
            statistics.median(rates["radix"]) / statistics.median(rates["stock"]), 3
        )
        out["greedy_match"] = sum(a == b for a, b in zip(texts["stock"], texts["radix"]))
        out["requests"] = min(len(texts["stock"]), len(texts["radix"]))
    return out


def measure_cached_prefix(servers: dict, args, rng_seed: int) -> dict:
    """TTFT of requests, one after another, on a shared prefix an earlier request cached."""
    out = {}
    for name in servers:
        rng = Requests(rng_seed, args.vocab)
        prefix = _ids(rng, args.cached_prefix)
        ttft, cached = [], []
        with alone(servers, name) as server:
            stream_all(server, [_prompt(rng, args.question, prefix)], 2)  # caches the prefix
            for _ in range(args.cached_requests):
                _, (r,) = stream_all(server, [_prompt(rng, args.question, prefix)], 2)
                ttft.append(r["ttft"])
                cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        out[name] = {**_ttft_summary(ttft), "cached_tokens_mean": statistics.fmean(cached)}
    out["speedup"] = round(out["stock"]["ttft_mean_s"] / out["radix"]["ttft_mean_s"], 3)
    out["shared_prefix"] = args.cached_prefix
    return out


def measure_burst(model_dir: Path, work: Path, args, rng_seed: int) -> dict:
    """``args.burst`` requests on one new prefix, sent at once, ``args.burst_rounds`` times,
    each round on a prefix of its own. The first round is the first burst since the server
    started (its new shapes' first use included); the figures are the later rounds' medians.

    Each server is started alone on the device: on an H100 (80 GB, Llama-3.1-8B shape) stock's
    burst beside the plugin's server ran out of memory and, its process still holding the
    memory, the plugin's then did too."""
    out = {}
    for name in args.servers:
        rounds = []
        device = DeviceMemoryPeak(args.ranks)
        device.start()
        try:
            rounds = _burst_rounds(name, model_dir, work, args, rng_seed)
        except Exception as e:  # noqa: BLE001 - the server's failure is the result
            rounds = [{"failed": args.burst, "errors": [f"{type(e).__name__}: {e}"[:300]]}]
        peak = device.stop()
        passes = rounds.pop() if rounds and "prefill_passes" in rounds[-1] else {}
        served = [r for r in rounds if "ttft_mean_s" in r]
        failed = sum(r["failed"] for r in rounds)
        if not served:
            out[name] = {"failed": failed, "errors": rounds[-1]["errors"] if rounds else []}
            out[name]["device_memory_peak_bytes"] = peak
            continue
        later = served[1:] or served
        out[name] = {
            **{
                key: round(statistics.median(r[key] for r in later), 4)
                for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "wall_s")
            },
            "failed": failed,
            "first_ttft_mean_s": served[0]["ttft_mean_s"],
            "ttft_mean_s_by_round": [r["ttft_mean_s"] for r in served],
            "prompt_tokens": served[-1]["prompt_tokens"],
            "prompt_tokens_computed": served[-1]["prompt_tokens_computed"],
            "connection_retries": sum(r["connection_retries"] for r in served),
            "device_memory_peak_bytes": peak,
            **passes,
        }
    if all("ttft_mean_s" in out.get(name, {}) for name in SERVERS):
        out["speedup"] = round(out["stock"]["ttft_mean_s"] / out["radix"]["ttft_mean_s"], 3)
    out["requests"] = args.burst
    out["shared_prefix"] = args.burst_prefix
    out["rounds"] = args.burst_rounds
    return out


def _burst_rounds(name: str, model_dir: Path, work: Path, args, rng_seed: int) -> list[dict]:
    """The rounds of ``measure_burst`` on server ``name``, started for them; for the plugin,
    last, how its followers' prompt passes read the pool over all rounds."""
    rounds: list[dict] = []
    with started(name, model_dir, work, args) as server:
        before = _prefill_passes(server) if name == "radix" else None
        for round_ in range(args.burst_rounds):
            rng = Requests(rng_seed + round_, args.vocab)
            prefix = _ids(rng, args.burst_prefix)
            prompts = [_prompt(rng, args.question, prefix) for _ in range(args.burst)]
            spy = _spy_path(args, f"{name}-burst") if round_ == 1 else None
            with py_spy(server, spy):
                wall, results = stream_all(server, prompts, 8, strict=False)
            failed = [r["error"] for r in results if "usage" not in r]
            results = [r for r in results if "usage" in r]
            if not results:
                rounds.append({"failed": len(failed), "errors": sorted(set(failed))})
                break  # the server is down or refuses all: nothing more to time
            rounds.append(
                {
                    **_ttft_summary([r["ttft"] for r in results]),
                    "failed": len(failed),
                    "wall_s": round(wall, 3),
                    "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in results),
                    "prompt_tokens_computed": sum(_computed(r["usage"]) for r in results),
                    "connection_retries": sum(r["retries"] for r in results),
                }
            )
        # How the followers' prompt passes read the pool, over all rounds.
        if before is not None:
            rounds.append({"prefill_passes": _prefill_passes(server, before)})
    return rounds


def _prefill_passes(server: ServerProcess, since: dict | None = None) -> dict:
    """The plugin's prompt passes over the pool by how their rows read it (grouped: a
    shared prefix once; per row), counted since ``since`` (an earlier return)."""
    s = server.stats()
    now = {path: s[f"prefill_passes_{path}"] for path in ("grouped", "per_row")}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def measure_agent(model_dir: Path, work: Path, args, rng_seed: int) -> dict:
    """Agent sessions in their clients' shape (the CPU bench's ``AgentSession``, Claude Code's
    and Codex's sessions): ``args.agent_clients`` at once on one ``args.agent_prefix``-token
    system prompt of instructions and tools, each ``args.agent_rounds`` turns; a turn is a
    user message and ``args.agent_requests`` requests, a tool result of ``args.agent_turn``
    tokens after each but the last, replies of ``args.agent_max_tokens``. The plugin is sent
    the Messages API, stock the same conversation through its chat completions.

    Each server is started alone on the device, stock first (at 16 clients on 4,096 tokens
    stock's K/V copies alone reached 150 GB): requests served, the device's peak memory, per
    turn the share of the prompt read from the cache and TTFT, and for the plugin what its
    memory plan names (model, working memory, the pool's ceiling) and the pool it grew to."""
    workload = AgentSession(
        args.agent_clients,
        args.agent_rounds,
        args.agent_prefix,
        args.agent_turn,
        args.agent_max_tokens,
        requests_per_turn=args.agent_requests,
    )
    out = _measure_sessions(model_dir, work, args, f"{rng_seed}:agent", workload, "agent")
    out["clients"], out["rounds"], out["requests_per_turn"] = (
        args.agent_clients,
        args.agent_rounds,
        args.agent_requests,
    )
    out["shared_prefix"], out["turn"] = args.agent_prefix, args.agent_turn
    return out


def measure_conversations(model_dir: Path, work: Path, args, rng_seed: int) -> dict:
    """Chats side by side that share little (the CPU bench's ``Conversations``, issue 59):
    ``args.conversations`` sessions on a short system prompt, each its own opening message
    and turns, arriving apart; each server alone, as ``measure_agent``, with the pace of a
    streamed reply (seconds a token after its first) and the share each served from cache."""
    workload = Conversations(
        args.conversations,
        args.conversation_turns,
        args.conversation_system,
        args.conversation_opening,
        args.conversation_turn,
        args.conversation_max_tokens,
        arrival_s=args.conversation_arrival,
        think_s=args.conversation_think,
    )
    out = _measure_sessions(
        model_dir, work, args, f"{rng_seed}:conversations", workload, "conversations"
    )
    out["params"] = workload.params()
    return out


def _measure_sessions(
    model_dir: Path, work: Path, args, seed: str, workload: Workload, label: str
) -> dict:
    """``workload``'s sessions on each server alone (stock first): what ``measure_agent``
    and ``measure_conversations`` report."""
    words_ = single_token_words(model_dir)
    sampling = Sampling(NO_EOS if LOGIT_BIAS else {})
    out: dict = {}
    runs: dict[str, list] = {}
    for name in args.servers:
        extra: dict = {}
        device = DeviceMemoryPeak(args.ranks)
        device.start()
        run = None
        try:
            with started(name, model_dir, work, args) as server:
                poller = _StatsPoller(server) if name == "radix" else None
                # Held before the first request (the warm-up done): the CUDA context, the
                # libraries' handles and the model, which the plan's usable memory (read
                # after the context was made) partly leaves out.
                extra["device_memory_idle_bytes"] = device.used_now()
                if poller:
                    idle = server.stats()
                    extra["mlx_idle_bytes"] = idle["mlx_active_bytes"] + idle["mlx_cache_bytes"]
                    poller.start()
                with py_spy(server, _spy_path(args, f"{name}-{label}")):
                    run = run_workload(server, name, workload, Prompts(seed, words_), sampling)
                if poller:
                    # What the plugin held outside the model and the pool, at its peaks.
                    extra.update(poller.stop())
                    s = server.stats()
                    extra["memory_plan"] = s["memory_plan"]
                    extra["pool_bytes_total"] = s["pool_bytes_total"]
                    # Where the generation thread's time went in the steps that decoded
                    # (``batch`` holds the prompt passes run between them).
                    extra["step_ms"] = step_parts(idle, s)
                    for key in (
                        "mlx_peak_bytes",
                        "working_peak_prefill_bytes",
                        "working_peak_decode_bytes",
                        "mlx_memory_limit_bytes",
                        "working_peak_prefill_pass",
                    ):
                        extra[key] = s[key]
                    extra["prefill_passes"] = _prefill_passes(server)
        except Exception as e:  # noqa: BLE001 - the server's failure is the result
            extra["server_failed"] = f"{type(e).__name__}: {e}"[:300]
        extra["device_memory_peak_bytes"] = device.stop()
        replies = list(run.replies.values()) if run else []
        out[name] = {
            "wall_s": round(run.wall_s, 3) if run else None,
            **(_ttft_summary([r.ttft_s for r in replies]) if replies else {}),
            "requests_served": len(replies),
            "prompt_tokens": sum(r.usage["prompt_tokens"] for r in replies),
            "prompt_tokens_computed": sum(_computed(r.usage) for r in replies),
            "decode_s_per_token": decode_s_per_token(replies),
            **_later_turns(run),
            **extra,
        }
        if run:
            runs[name] = [run]
    if len(runs) == len(SERVERS):
        out["wall_speedup"] = round(out["stock"]["wall_s"] / out["radix"]["wall_s"], 3)
        out["ttft_p50_speedup"] = round(out["stock"]["ttft_p50_s"] / out["radix"]["ttft_p50_s"], 3)
        out["ttft_mean_speedup"] = round(
            out["stock"]["ttft_mean_s"] / out["radix"]["ttft_mean_s"], 3
        )
        paces = [out[n]["decode_s_per_token"] for n in SERVERS]
        if None not in paces:
            # Stock's pace over the plugin's: above 1, the plugin's replies stream faster.
            out["decode_pace_speedup"] = round(paces[0] / paces[1], 3)
        stock, radix = (runs[n][0].replies for n in SERVERS)
        out["greedy_match"] = sum(stock[k].text == radix[k].text for k in stock)
        out.update(compare_turns(runs))
    return out


def _later_turns(run) -> dict:
    """TTFT of the turns after each session's first, which its cache should serve (issue 55's
    measure for an agent loop: the first turn computes the shared prompt), and the median of
    each turn; empty where nothing was served."""
    if run is None or not run.replies:
        return {}
    timed = {k: r.ttft_s for k, r in run.replies.items() if r.ttft_s is not None}
    turns = sorted({key[1] for key in timed})
    later = [ttft for k, ttft in timed.items() if k[1] != turns[0]]
    by_turn = [
        round(statistics.median([ttft for k, ttft in timed.items() if k[1] == t]), 4) for t in turns
    ]
    out = {"ttft_p50_by_turn_s": by_turn}
    if later:
        out["ttft_p50_later_turns_s"] = round(statistics.median(later), 4)
    return out


def measure_long(model_dir: Path, work: Path, args, rng_seed: int) -> dict:
    """Single prompts of ``args.long_prompts`` tokens (each a new prompt, up to the model's
    context), one after another, each server alone on the device: served or the error,
    TTFT, the device's peak memory during each, and for the plugin its memory plan and the
    largest prompt pass's working memory. TTFT is set against the prompt's FLOP time at the
    device's measured matrix rate (``matmul_rate``). A server that fails a prompt is
    started again for the next."""
    config = json.loads((model_dir / "config.json").read_text())
    context = config.get("max_position_embeddings") or max(args.long_prompts)
    out: dict = {"matmul_tflop_s": round(args.matmul_rate / 1e12, 1), "prompts": {}}
    points = {}
    for n in args.long_prompts:
        tokens = min(n, context - 16)
        flops = prefill_flops(config, tokens)
        points[tokens] = {
            "tokens": tokens,
            **{f"{k}_pflop": round(v / 1e15, 3) for k, v in flops.items()},
            "flop_time_s": sum(flops.values()) / args.matmul_rate,
        }
    for name in args.servers:
        with contextlib.ExitStack() as stack:
            server = None
            for tokens, point in points.items():
                device = DeviceMemoryPeak(args.ranks)
                device.start()
                result: dict = {}
                try:
                    if server is None:
                        server = stack.enter_context(started(name, model_dir, work, args))
                    rng = Requests(rng_seed + tokens, args.vocab)
                    _, (r,) = stream_all(server, [_prompt(rng, tokens)], 4, strict=False)
                    if "usage" in r:
                        result = {
                            "ttft_s": round(r["ttft"], 3),
                            "prompt_tokens": r["usage"]["prompt_tokens"],
                            "over_flop_time": round(r["ttft"] / point["flop_time_s"], 2),
                        }
                    else:
                        result = {"error": r["error"]}
                    st = server.stats() if name == "radix" else None
                    if st:
                        keys = ("memory_plan", "pool_bytes_total", "mlx_peak_bytes")
                        keys += ("working_peak_prefill_bytes", "working_peak_prefill_pass")
                        result.update({k: st[k] for k in keys})
                except Exception as e:  # noqa: BLE001 - the server's failure is the result
                    result.setdefault("error", f"{type(e).__name__}: {e}"[:300])
                result["device_memory_peak_bytes"] = device.stop()
                if "error" in result and server is not None:
                    # Started again for the next prompt: a dead server answers nothing.
                    stack.close()
                    server = None
                point[name] = result
                progress(f"long prompt of {tokens}: {name} {json.dumps(result)[:400]}")
    for point in points.values():
        point["flop_time_s"] = round(point["flop_time_s"], 4)
    out["prompts"] = {str(t): p for t, p in points.items()}
    return out


@contextlib.contextmanager
def started(name: str, model_dir: Path, work: Path, args):
    """Server ``name`` (stock or radix) up on ``model_dir`` and warmed up; under mlx.launch
    with ``args.ranks`` > 1.

    Each rank runs the same command as a single server: ``serve-radix`` registers the
    plugin itself, so the ranks need no installed entry point or start-up .pth (which
    MLX_LM_PLUGINS relies on, and which a ``pip install --target`` of MLX does not give).
    """
    (work / "hf").mkdir(exist_ok=True)
    command = {
        "stock": [sys.executable, "-m", "mlx_lm", "server"],
        "radix": [sys.executable, "-m", "mlx_radix_plugin.tools.gpu_bench", "serve-radix"],
    }[name]
    extra_env = {
        "stock": {},
        "radix": {
            "MLX_RADIX_POOL_TOKENS": str(args.pool_tokens),  # 0: the plugin's own memory plan
            "MLX_RADIX_DECODE_SHARED_PREFIX": args.shared_prefix,
            "MLX_RADIX_PREFILL_SHARED_PREFIX": args.prefill_shared,
            "MLX_RADIX_MODEL_FUSE_PROJECTIONS": args.fuse_projections,
            "MLX_RADIX_DECODE_COMPILE": args.compile,
            "MLX_RADIX_SERVER_FRONT": args.front,
            "MLX_RADIX_HOLD_TO_PLAN": str(args.hold_to_plan == "on").lower(),
            # The disk tier writes every committed page through: what that costs the steps.
            **(
                {"MLX_RADIX_DISK_ENABLED": "1", "MLX_RADIX_DISK_DIR": str(work / "disk")}
                if args.disk
                else {}
            ),
        },
    }[name]
    env = server_env(work / "hf", extra_env)
    log = work / f"{name}.log"
    # Under mlx.launch, the HTTP port and then one a rank for the ranks' own connections.
    port = free_port() if args.ranks == 1 else free_ports(args.ranks + 1)
    cmd = [*command, "--model", str(model_dir), "--port", str(port)]
    if args.ranks == 1:
        process = ServerProcess(cmd, env, port, log)
    else:
        process = Launched(mlx_launch(cmd, env, args.ranks, args.backend, port + 1), env, port, log)
    with process as server:
        # Kernels are built at first use: a batched prefill and a batched decode.
        rng = Requests(-1, 500)
        stream_all(server, [_prompt(rng, 300) for _ in range(8)], 8)
        yield server


@contextlib.contextmanager
def side_by_side(model_dir: Path, work: Path, args):
    """Both servers up on ``model_dir``, each warmed up; yields {name: ServerProcess}."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(started(name, model_dir, work, args)) for name in SERVERS}


def shape_config(shape: str) -> tuple[str, dict]:
    """The random model's base shape and the config keys ``shape`` overrides."""
    return ("smollm2-135m", TINY) if shape == "tiny" else (shape, {})


def bench_shape(shape: str, args, work: Path) -> dict:
    base, overrides = shape_config(shape)
    started = time.perf_counter()
    if args.models and (Path(args.models) / shape / "config.json").exists():
        model_dir = Path(args.models) / shape
        progress(f"{shape}: random weights of an earlier run, {model_dir}")
    else:
        progress(f"{shape}: building random {args.dtype} weights")
        where = Path(args.models) if args.models else work
        model_dir = build(base, where / shape, dtype=args.dtype, **overrides)
    mx.clear_cache()
    config = json.loads((model_dir / "config.json").read_text())
    args.vocab = min(config["vocab_size"], 30000)
    report: dict = {
        "shape": shape,
        "dtype": args.dtype,
        "build_s": round(time.perf_counter() - started, 1),
    }
    report["in_process_ms_per_token"] = round(
        in_process_ms_per_token(model_dir, args.decode_prompt, args.max_tokens), 3
    )
    side = [w for w in args.workload if w not in ALONE]
    if side:
        progress(f"{shape}: built in {report['build_s']} s; starting both servers")
        with side_by_side(model_dir, work, args) as servers:
            try:
                _side_by_side_workloads(shape, servers, args, report)
            except Exception as e:  # what was measured before still goes into the report
                traceback.print_exc()
                for name, server in servers.items():
                    print(f"--- {name} server log (tail) ---\n{server.output()[-4000:]}")
                report["error"] = f"{type(e).__name__}: {e}"[:300]
    if "decode-shared" in args.workload:
        report["decode_shared"] = {}
        for rows, prefix in args.decode_shared:
            progress(f"{shape}: decode of {rows} requests on a cached {prefix}-token prefix")
            report["decode_shared"][f"{rows}x{prefix}"] = point = measure_decode_shared(
                model_dir, work, args, rows, prefix, args.seed + 13 + rows + prefix
            )
            progress(f"{shape}: {json.dumps(point)}")
    if "burst" in args.workload:
        progress(f"{shape}: burst, each server alone")
        report["burst"] = measure_burst(model_dir, work, args, args.seed + 11)
    if "long" in args.workload:
        progress(f"{shape}: long prompts, each server alone")
        report["long"] = measure_long(model_dir, work, args, args.seed + 19)
    if "agent" in args.workload:
        progress(f"{shape}: agent loop, each server alone")
        report["agent"] = measure_agent(model_dir, work, args, args.seed + 17)
        progress(f"{shape}: {json.dumps(report['agent'])}")
    if "conversations" in args.workload:
        progress(f"{shape}: conversations, each server alone")
        report["conversations"] = measure_conversations(model_dir, work, args, args.seed + 23)
        progress(f"{shape}: {json.dumps(report['conversations'])}")
    if "1" in report.get("decode", {}):
        # Mean context of the measured steps: the prompt plus half the output.
        context = args.decode_prompt + args.max_tokens // 2
        step = decode_step_bytes(model_dir, context, args.ranks)
        floor_ms = 1000 * (step["weights"] + step["kv"]) / args.bandwidth
        one = report["decode"]["1"]
        report["floor"] = {
            "ranks": args.ranks,
            "weight_bytes": step["weights"],
            "kv_bytes": step["kv"],
            "floor_ms_per_token": round(floor_ms, 3),
            **{
                f"{name}_over_floor": round(one[name]["ms_per_token"] / floor_ms, 2)
                for name in SERVERS
            },
        }
        if args.ranks == 1:  # in process runs on one device, not a rank's share of it
            report["floor"]["in_process_over_floor"] = round(
                report["in_process_ms_per_token"] / floor_ms, 2
            )
    return report


def _side_by_side_workloads(shape: str, servers: dict, args, report: dict) -> None:
    if "decode" in args.workload:
        report["decode"] = {}
        for b in args.concurrency:
            progress(f"{shape}: decode at {b} concurrent")
            report["decode"][str(b)] = measure_decode(servers, args, b, args.seed + 100 * b)
    if "cached-prefix" in args.workload:
        progress(f"{shape}: TTFT on a cached prefix")
        report["cached_prefix"] = measure_cached_prefix(servers, args, args.seed + 7)
    report["radix_stats"] = servers["radix"].stats()


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def markdown(report: dict) -> str:
    rows = [
        "| shape | workload | stock | radix | radix speedup |",
        "|---|---|---|---|---|",
    ]

    def row(name: str, workload: str, stock: str, radix: str, ratio: str = "") -> None:
        rows.append(f"| {name} | {workload} | {stock} | {radix} | {ratio} |")

    def cells(point: dict, fmt: Callable[[dict], str]) -> list[str]:
        """Each server's cell of ``point``: ``fmt`` of its entry, or NOT_RUN."""
        return [fmt(point[k]) if k in point else NOT_RUN for k in SERVERS]

    def sessions(name: str, b: dict, label: str, more: Callable[[], None] = lambda: None) -> None:
        """The rows of a workload of sessions, each server alone (agents, conversations)."""
        if "wall_speedup" in b:
            stock, radix = (f"{b[k]['wall_s']:.2f} s" for k in SERVERS)
            row(name, f"{label}: wall", stock, radix, f"{b['wall_speedup']:.2f}x")
            stock, radix = (_ms(b[k]["ttft_p50_s"]) for k in SERVERS)
            row(name, f"{label}: TTFT p50", stock, radix, f"{b['ttft_p50_speedup']:.2f}x")
            more()
            least = b["cached_share_min_after_turn_1"]
            stock, radix = (f"{least[k]:.1%}" for k in SERVERS)
            row(name, f"{label}: least cached share of a turn after the first", stock, radix)
        served = cells(
            b,
            lambda r: (
                f"{r['requests_served']} served"
                + (" (server failed)" if "server_failed" in r else "")
            ),
        )
        row(name, f"{label}: requests", *served)

    for s in report["shapes"]:
        name = s["shape"]
        for b, d in s.get("decode", {}).items():
            stock, radix = (
                f"{d[k]['tokens_per_s']:.0f} ({d[k]['ms_per_token']:.2f}"
                + (f"; GPU busy {d[k]['device_busy']:.0%})" if "device_busy" in d[k] else ")")
                for k in SERVERS
            )
            workload = f"decode, {b} concurrent: tokens/s (ms/token)"
            row(name, workload, stock, radix, f"{d['ratio']:.2f}x")
            parts = d["radix"].get("step_ms")
            if parts:
                split = " / ".join(f"{parts[k]:.2f}" for k in STEP_PARTS)
                row(name, f"decode, {b}: radix step ms ({' / '.join(STEP_PARTS)})", "", split)
        for d in s.get("decode_shared", {}).values():
            stock, radix = cells(
                d,
                lambda r: r["failed"][:40] if "failed" in r else f"{r['decode_tokens_per_s']:.0f}",
            )
            workload = (
                f"decode, {d['rows']} requests on a cached {d['prefix']}-token prefix, "
                f"{d['max_tokens']} out: tokens/s"
            )
            row(name, workload, stock, radix, f"{d['ratio']:.2f}x" if "ratio" in d else "")
        if "cached_prefix" in s:
            c = s["cached_prefix"]
            stock, radix = (
                f"{_ms(c[k]['ttft_mean_s'])} ({c[k]['cached_tokens_mean']:.0f})" for k in SERVERS
            )
            workload = f"TTFT on a cached {c['shared_prefix']}-token prefix: mean (tokens cached)"
            row(name, workload, stock, radix, f"{c['speedup']:.2f}x")
        if "burst" in s:
            b = s["burst"]
            burst = f"burst of {b['requests']} on a new {b['shared_prefix']}-token prefix"

            def timed(fmt, b=b) -> list[str]:  # a server whose every request failed says so
                def one(e: dict) -> str:
                    if "ttft_mean_s" not in e:
                        return f"{e['failed']} failed"
                    return fmt(e) + (f" ({e['failed']} failed)" if e.get("failed") else "")

                return cells(b, one)

            ratio = f"{b['speedup']:.2f}x" if "speedup" in b else ""
            mean_p95 = timed(lambda r: f"{_ms(r['ttft_mean_s'])} / {_ms(r['ttft_p95_s'])}")
            row(name, f"{burst}: TTFT mean / p95", *mean_p95, ratio)
            first = timed(lambda r: _ms(r["first_ttft_mean_s"]))
            row(name, f"{burst}: the first burst's TTFT mean", *first)
            computed = timed(lambda r: f"{r['prompt_tokens_computed']:,}")
            row(name, f"{burst}: prompt tokens computed", *computed)
            passes = b.get("radix", {}).get("prefill_passes")
            peaks = [b.get(k, {}).get("device_memory_peak_bytes") for k in SERVERS]
            if None not in peaks:
                row(name, f"{burst}: device memory peak", *(f"{p / 1e9:.1f} GB" for p in peaks))
            if passes:
                read = f"{passes['grouped']} grouped, {passes['per_row']} per row"
                row(name, f"{burst}: the plugin's prompt passes", "", read)
        for tokens, point in s.get("long", {}).get("prompts", {}).items():
            ttft = cells(
                point,
                lambda r: (
                    r["error"][:60]
                    if "error" in r
                    else f"{r['ttft_s']:.2f} s ({r['over_flop_time']:.2f}x FLOP time)"
                ),
            )
            row(name, f"a {int(tokens):,}-token prompt: TTFT", *ttft)
            peaks = [point.get(k, {}).get("device_memory_peak_bytes") for k in SERVERS]
            if None not in peaks:
                row(name, f"a {int(tokens):,}-token prompt: device memory peak",
                    *(f"{p / 1e9:.1f} GB" for p in peaks))  # fmt: skip
        if "conversations" in s:
            c, cp = s["conversations"], s["conversations"]["params"]
            chats = (
                f"{cp['sessions']} chats x {cp['turns']} turns ({cp['opening_tokens']}-token "
                f"openings, +{cp['turn_tokens']} a turn, {cp['arrival_s']:g} s apart)"
            )

            def pace(c=c, chats=chats, name=name) -> None:
                stock, radix = (_ms(c[k]["ttft_mean_s"]) for k in SERVERS)
                row(name, f"{chats}: TTFT mean", stock, radix, f"{c['ttft_mean_speedup']:.2f}x")
                stock, radix = (_ms(c[k]["ttft_p95_s"]) for k in SERVERS)
                row(name, f"{chats}: TTFT p95", stock, radix)
                if "decode_pace_speedup" in c:
                    stock, radix = (_ms(c[k]["decode_s_per_token"]) for k in SERVERS)
                    ratio = f"{c['decode_pace_speedup']:.2f}x"
                    row(name, f"{chats}: time a token while a reply streams", stock, radix, ratio)

            sessions(name, c, chats, pace)
        if "agent" in s:
            a = s["agent"]
            loop = (
                f"agents, {a['clients']} x {a['rounds']} turns of {a['requests_per_turn']} "
                f"requests (+{a['turn']} a tool result) on a {a['shared_prefix']}-token prompt"
            )
            sessions(name, a, loop)
            peaks = [a.get(k, {}).get("device_memory_peak_bytes") for k in SERVERS]
            if None not in peaks:
                stock, radix = (f"{p / 1e9:.1f} GB" for p in peaks)
                row(name, f"{loop}: device memory peak", stock, radix)
            r = a.get("radix", {})
            if "buffer_bytes_peak" in r:
                held = (
                    f"pool {r['pool_bytes_total'] / 1e9:.1f} GB; at peaks, buffers "
                    f"{r['buffer_bytes_peak'] / 1e9:.1f} GB, MLX's cache "
                    f"{r['mlx_cache_bytes_peak'] / 1e9:.1f} GB"
                )
                row(name, f"{loop}: the plugin's K/V and caches", "", held)
            if r.get("working_peak_prefill_bytes") is not None:
                plan = r["memory_plan"]
                named = (plan["model_bytes"] + r["pool_bytes_total"] + plan["working_bytes"]) / 1e9
                held = (
                    f"MLX peak {r['mlx_peak_bytes'] / 1e9:.1f} GB against model + pool + "
                    f"working {named:.1f} GB; working at peak: prefill "
                    f"{r['working_peak_prefill_bytes'] / 1e9:.1f}, decode "
                    f"{r['working_peak_decode_bytes'] / 1e9:.1f} of "
                    f"{plan['working_bytes'] / 1e9:.1f} GB named"
                )
                row(name, f"{loop}: memory against the plan", "", held)
            idle = tuple(r.get(k) for k in ("device_memory_idle_bytes", "mlx_idle_bytes"))
            if None not in idle and r.get("device_memory_peak_bytes"):
                # The device's own share: the CUDA context, the libraries' handles, and what
                # the allocator keeps that MLX no longer counts, held before any request.
                outside = r["device_memory_idle_bytes"] - r["mlx_idle_bytes"]
                plan = r["memory_plan"]
                named = plan["model_bytes"] + r["pool_bytes_total"] + plan["working_bytes"]
                named += plan["margin_bytes"]
                held = (
                    f"device peak {r['device_memory_peak_bytes'] / 1e9:.1f} GB = outside MLX "
                    f"at idle {outside / 1e9:.1f} GB + "
                    f"{(r['device_memory_peak_bytes'] - outside) / 1e9:.1f} GB, against model + "
                    f"pool + working + margin {named / 1e9:.1f} GB"
                )
                row(name, f"{loop}: device memory against the plan", "", held)
        if "floor" in s:
            f = s["floor"]
            if "in_process_over_floor" in f:
                floor = (
                    f"the floor of {f['floor_ms_per_token']:.2f} ms "
                    f"(in-process stock mlx-lm: {f['in_process_over_floor']:.2f}x)"
                )
            else:
                floor = f"a rank's floor of {f['floor_ms_per_token']:.2f} ms (of {f['ranks']})"
            workload = f"decode, 1 request: ms/token over {floor}"
            row(name, workload, f"{f['stock_over_floor']:.2f}x", f"{f['radix_over_floor']:.2f}x")
        if "error" in s:
            row(name, f"failed: {s['error']}", "", "")
    if report["ranks"] > 1:
        rows.insert(
            0,
            f"Tensor parallel: {report['ranks']} ranks under mlx.launch, "
            f"{report['backend']} backend.\n",
        )
    return "\n".join(rows)


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected positive integers separated by commas, e.g. 1,8,32"
        )
    return values


def _servers(text: str) -> tuple[str, ...]:
    names = tuple(n for n in SERVERS if n in text.split(","))
    if not names or set(text.split(",")) - set(SERVERS):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated subset of stock,radix")
    return names


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shape",
        action="append",
        choices=[*sorted(SHAPES), "tiny"],
        help=f"model shape, repeatable (default: {', '.join(DEFAULT_SHAPES)})",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS,
        help=f"repeatable (default: all of {', '.join(WORKLOADS)})",
    )
    p.add_argument("--concurrency", type=_positive_ints, default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128, help="decode: tokens per request")
    p.add_argument("--decode-prompt", type=int, default=32, help="decode: prompt tokens")
    p.add_argument("--rounds", type=int, default=2, help="decode: rounds per server")
    p.add_argument(
        "--decode-shared",
        type=parse_grid,
        default=parse_grid("32x2048,32x4096,8x1024"),
        help="decode on a cached shared prefix: ROWSxPREFIX,... (empty: none)",
    )
    p.add_argument("--shared-max-tokens", type=int, default=256, help="decode-shared: tokens out")
    p.add_argument(
        "--shared-prefix",
        default="auto",
        choices=["auto", "on", "off"],
        help="the plugin's decode.shared_prefix",
    )
    p.add_argument(
        "--prefill-shared",
        default="auto",
        choices=["auto", "on", "off"],
        help="the plugin's prefill.shared_prefix",
    )
    p.add_argument(
        "--fuse-projections",
        default="auto",
        choices=["auto", "on", "off"],
        help="the plugin's model.fuse_projections",
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "layers", "pass", "off"],
        help="the plugin's decode.compile",
    )
    p.add_argument(
        "--front",
        default="auto",
        choices=["auto", "on", "off"],
        help="the plugin's server.front (HTTP in a process of its own)",
    )
    p.add_argument(
        "--hold-to-plan",
        default="on",
        choices=["on", "off"],
        help="the plugin's radix.hold_to_plan (MLX's memory limit from its memory plan)",
    )
    p.add_argument("--cached-prefix", type=int, default=4096, help="TTFT: shared prefix tokens")
    p.add_argument("--cached-requests", type=int, default=8, help="TTFT: requests timed")
    p.add_argument("--question", type=int, default=32, help="tokens after a shared prefix")
    p.add_argument("--burst", type=int, default=32, help="burst: requests")
    p.add_argument("--burst-prefix", type=int, default=2048, help="burst: shared prefix tokens")
    p.add_argument("--burst-rounds", type=_positive_int, default=3, help="burst: rounds")
    # Claude Code's and Codex's sessions: ~24k tokens of instructions and tools, turns of a
    # few requests with tool results between them (docs/agents.md).
    p.add_argument("--agent-clients", type=_positive_int, default=8, help="agent: clients")
    p.add_argument("--agent-rounds", type=_positive_int, default=4, help="agent: turns a client")
    p.add_argument("--agent-requests", type=_positive_int, default=3, help="agent: requests a turn")
    p.add_argument("--agent-prefix", type=int, default=24576, help="agent: system prompt tokens")
    p.add_argument("--agent-turn", type=int, default=512, help="agent: tokens a tool result")
    p.add_argument("--agent-max-tokens", type=int, default=64, help="agent: tokens a reply")
    # Chats side by side (issue 59): each its own long opening, arriving apart.
    p.add_argument("--conversations", type=_positive_int, default=32, help="conversations: chats")
    p.add_argument("--conversation-turns", type=_positive_int, default=6, help="turns a chat")
    p.add_argument("--conversation-system", type=int, default=64, help="system prompt tokens")
    p.add_argument("--conversation-opening", type=int, default=2048, help="tokens an opening")
    p.add_argument("--conversation-turn", type=int, default=256, help="tokens a later turn")
    p.add_argument("--conversation-max-tokens", type=int, default=128, help="tokens a reply")
    p.add_argument(
        "--conversation-arrival", type=float, default=0.25, help="seconds between chats' starts"
    )
    p.add_argument(
        "--conversation-think", type=float, default=0.5, help="seconds between a reply and a turn"
    )
    p.add_argument(
        "--long-prompts",
        type=_positive_ints,
        default=[32768, 65536, 131072],
        help="long: prompt tokens, each a prompt of its own (at most the model's context)",
    )
    p.add_argument(
        "--logit-bias",
        action="store_true",
        help="every request bans EOS with a logit bias (a logits processor a row)",
    )
    p.add_argument(
        "--py-spy",
        metavar="DIR",
        help="record each server with py-spy (the GIL's holder) in its largest decode round, a "
        "burst and the agent loop",
    )
    p.add_argument(
        "--pool-tokens",
        type=int,
        default=0,
        help="the plugin's pool ceiling (default 0: its memory plan, as a user gets it)",
    )
    p.add_argument(
        "--disk",
        action="store_true",
        help="the plugin's disk tier on (a fresh one, under the run's work directory)",
    )
    p.add_argument("--bandwidth-mib", type=int, default=4096, help="copy size for bandwidth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ranks",
        type=_positive_int,
        default=1,
        help="tensor-parallel ranks of each server, under mlx.launch on 127.0.0.1 (default 1: "
        "no mlx.launch)",
    )
    p.add_argument(
        "--backend",
        choices=["ring", "nccl"],
        help="mlx.launch's backend with --ranks > 1 (default: nccl where MLX has CUDA, else ring)",
    )
    p.add_argument(
        "--models",
        metavar="DIR",
        help="keep the random models here and use those an earlier run left (same --dtype)",
    )
    p.add_argument(
        "--servers",
        type=_servers,
        default=SERVERS,
        help="the servers of the workloads that start each alone (burst, decode-shared, long, "
        "agent, conversations), comma-separated (default: stock,radix)",
    )
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    args.shape = args.shape or list(DEFAULT_SHAPES)
    args.workload = args.workload or list(WORKLOADS)
    args.backend = args.backend or ("nccl" if mx.cuda.is_available() else "ring")
    for shape in args.shape:
        base, overrides = shape_config(shape)
        kv_heads = {**SHAPES[base], **overrides}["num_key_value_heads"]
        if kv_heads % args.ranks:
            p.error(
                f"--ranks {args.ranks}: shape {shape} has {kv_heads} KV heads, which tensor "
                f"parallelism cannot split over {args.ranks} ranks"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-radix"]:
        serve_radix(argv[1:])
        return 0
    args = parse_args(argv)
    global LOGIT_BIAS
    LOGIT_BIAS = NO_EOS if args.logit_bias else {}
    args.bandwidth = copy_bandwidth(args.bandwidth_mib << 20)
    args.matmul_rate = matmul_rate(args.dtype) if "long" in args.workload else None
    args.utilization = GpuUtilization()  # sampled for the whole run where nvidia-smi answers
    args.utilization.start()
    if args.py_spy:
        Path(args.py_spy).mkdir(parents=True, exist_ok=True)
    report = {
        "device": str(mx.default_device()),
        "device_name": mx.device_info().get("device_name", ""),
        "mlx": mx.__version__,
        "copy_bandwidth_gb_s": round(args.bandwidth / 1e9, 1),
        "ranks": args.ranks,
        "backend": args.backend if args.ranks > 1 else None,
        "disk": args.disk,
        # The plugin's settings these numbers were measured with.
        "radix_settings": {
            "decode.shared_prefix": args.shared_prefix,
            "prefill.shared_prefix": args.prefill_shared,
            "model.fuse_projections": args.fuse_projections,
            "decode.compile": args.compile,
            "server.front": args.front,
            "radix.hold_to_plan": args.hold_to_plan == "on",
        },
        "shapes": [],
    }
    print(f"copy bandwidth: {report['copy_bandwidth_gb_s']} GB/s on {report['device']}")
    for shape in args.shape:
        with tempfile.TemporaryDirectory(prefix=f"gpu-bench-{shape}-") as work:
            try:
                result = bench_shape(shape, args, Path(work))
            except Exception as e:  # one shape failing still reports the others
                traceback.print_exc()
                result = {"shape": shape, "error": f"{type(e).__name__}: {e}"[:300]}
        report["shapes"].append(result)
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    args.utilization.stop()
    print(markdown(report))
    return 1 if any("error" in s for s in report["shapes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
