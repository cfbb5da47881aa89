"""Side by side: stock ``mlx_lm.server`` and ``mlx_lm.server --plugin radix``, same model.

Each server runs alone (they would share the cores otherwise), on 127.0.0.1, and
both get the same requests. Speed is reported as ratios measured in the same run.

    python -m mlx_radix_plugin.bench --random smollm2-135m
    python -m mlx_radix_plugin.bench --model PATH --json results.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .random_model import EOS, SHAPES, build, words

# Random weights may emit EOS at once; banning it keeps every output full length.
NO_EOS = {str(EOS): -100}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """An mlx_lm.server subprocess on 127.0.0.1, up once /health answers."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log: Path, cwd=None):
        self.cmd, self.env, self.port, self.log, self.cwd = cmd, env, port, log, cwd
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=self.cwd, stdout=self._out, stderr=self._out
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.get("/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=1800)

    def get(self, path: str) -> tuple[int, str]:
        conn = self._conn()
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()

    def post(self, path: str, body: dict) -> dict:
        conn = self._conn()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: {r.status} {data}")
        return json.loads(data)

    def stream(self, path: str, body: dict, on_first=None) -> list[dict]:
        """The JSON events of a streamed response; ``on_first()`` at the first token."""
        conn = self._conn()
        conn.request("POST", path, json.dumps({**body, "stream": True}))
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: {r.status} {r.read().decode()}")
        events = []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if on_first and event.get("choices") and event["choices"][0].get("text"):
                on_first()
                on_first = None
            events.append(event)
        return events

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the server has used (Linux), steadier than wall time
        on a shared machine."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stats(self) -> dict | None:
        status, body = self.get("/v1/cache/stats")
        return json.loads(body) if status == 200 else None


@dataclass
class Result:
    server: str
    workload: str
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    texts: list[str] = field(default_factory=list)
    cpu_s: float | None = None

    @classmethod
    def from_usage(cls, server, workload, wall, usage, texts, ttft=()) -> Result:
        """Totals of the ``usage`` objects the server returned."""
        return cls(
            server,
            workload,
            wall,
            ttft_s=list(ttft),
            completion_tokens=sum(u["completion_tokens"] for u in usage),
            prompt_tokens=sum(u["prompt_tokens"] for u in usage),
            prompt_tokens_computed=sum(
                u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usage
            ),
            texts=texts,
        )

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "texts")}
        out["tokens_per_s"] = round(self.tokens_per_s, 2)
        if ttft:
            out["ttft_p50_s"] = round(statistics.median(ttft), 3)
            out["ttft_p95_s"] = round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 3)
            out["ttft_mean_s"] = round(statistics.fmean(ttft), 3)
        return out


class Requests(random.Random):
    """A seeded request stream, the same for both servers; word ids within the vocabulary."""

    def __init__(self, seed: int, vocab: int):
        super().__init__(seed)
        self.vocab = vocab


def _measured(server: ServerProcess, workload):
    """Run ``workload()``; its Result gets the server's CPU seconds spent on it."""
    before = server.cpu_seconds()
    result = workload()
    after = server.cpu_seconds()
    if before is not None and after is not None:
        result.cpu_s = round(after - before, 2)
    return result


def _concurrently(fns) -> float:
    threads = [threading.Thread(target=f) for f in fns]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def decode(server: ServerProcess, name: str, batch: int, prompt_len: int, max_tokens: int, rng):
    """``batch`` concurrent requests, short distinct prompts, long outputs."""
    prompts = [words(rng.randrange(2, rng.vocab) for _ in range(prompt_len)) for _ in range(batch)]
    texts = [""] * batch
    usage = [None] * batch

    def one(i):
        def run():
            r = server.post(
                "/v1/completions",
                {
                    "prompt": prompts[i],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "logit_bias": NO_EOS,
                },
            )
            texts[i], usage[i] = r["choices"][0]["text"], r["usage"]

        return run

    wall = _concurrently([one(i) for i in range(batch)])
    return Result.from_usage(name, "decode", wall, usage, texts)


def burst(
    server: ServerProcess,
    name: str,
    n: int,
    prefix_len: int,
    question_len: int,
    max_tokens: int,
    rng,
):
    """``n`` requests on one new ``prefix_len``-token prefix, sent at once."""
    prefix = [rng.randrange(2, rng.vocab) for _ in range(prefix_len)]
    prompts = [
        words(prefix + [rng.randrange(2, rng.vocab) for _ in range(question_len)]) for _ in range(n)
    ]
    ttft = [0.0] * n
    texts = [""] * n
    usage = [None] * n
    start = time.perf_counter()

    def one(i):
        def first():
            ttft[i] = time.perf_counter() - start

        def run():
            events = server.stream(
                "/v1/completions",
                {
                    "prompt": prompts[i],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "logit_bias": NO_EOS,
                    "stream_options": {"include_usage": True},
                },
                on_first=first,
            )
            texts[i] = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            usage[i] = next(e["usage"] for e in reversed(events) if e.get("usage"))

        return run

    wall = _concurrently([one(i) for i in range(n)])
    return Result.from_usage(name, "burst", wall, usage, texts, ttft)


def server_env(hf_cache: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RADIX_")}
    env.pop("MLX_LM_PLUGINS", None)
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=hf_cache, **extra)
    return env


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mlx-radix-bench-"))
    model = args.model or str(build(args.random, work / "model", dtype=args.dtype))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    (work / "hf").mkdir()

    def requests(seed: int) -> Requests:
        return Requests(seed, min(vocab, 30000))

    flags = {"stock": [], "radix": ["--plugin", "radix"]}
    extra = {"stock": {}, "radix": {"MLX_RADIX_POOL_TOKENS": str(args.pool_tokens)}}
    results: dict[str, list[Result]] = {"stock": [], "radix": []}
    burst_computed: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in flags:
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "mlx_lm",
                "server",
                *flags[name],
                "--model",
                model,
                "--port",
                str(port),
            ]
            env = server_env(str(work / "hf"), extra[name])
            servers[name] = stack.enter_context(ServerProcess(cmd, env, port, work / f"{name}.log"))
            servers[name].post("/v1/completions", {"prompt": words([5, 6, 7]), "max_tokens": 2})
        # Both are up; they take turns, so each has the cores to itself and a slow
        # spell of the machine hits both alike.
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
            for name in order:
                rng = requests(args.seed + round_)
                work = functools.partial(
                    decode, servers[name], name, args.batch, 32, args.max_tokens, rng
                )
                results[name].append(_measured(servers[name], work))
        for name, server in servers.items():
            rng = requests(args.seed + 1000)
            before = server.stats()
            results[name].append(burst(server, name, args.batch, args.prefix, 16, 8, rng))
            after = server.stats()
            if before and after:
                # What the plugin's own counters say it computed for the burst.
                burst_computed[name] = (after["prompt_tokens"] - after["cached_tokens"]) - (
                    before["prompt_tokens"] - before["cached_tokens"]
                )
            else:
                burst_computed[name] = results[name][-1].prompt_tokens_computed

    stock, radix = results["stock"], results["radix"]
    decode_ratios = [r.tokens_per_s / s.tokens_per_s for s, r in zip(stock[:-1], radix[:-1])]
    for name in results:
        print(f"{name}: " + "; ".join(json.dumps(r.summary()) for r in results[name]))
    return {
        "model": args.model or f"random {args.random} ({args.dtype})",
        "decode_tokens_per_s_ratio": round(statistics.median(decode_ratios), 3),
        "decode_ratios_by_round": [round(x, 3) for x in decode_ratios],
        "decode_cpu_s_per_token_ratio": _cpu_ratio(stock[:-1], radix[:-1]),
        "decode_tokens_per_s": {
            name: round(statistics.median(r.tokens_per_s for r in results[name][:-1]), 2)
            for name in results
        },
        "burst_ttft_mean_speedup": round(
            statistics.fmean(stock[-1].ttft_s) / statistics.fmean(radix[-1].ttft_s), 2
        ),
        "burst_prompt_tokens_computed": {**burst_computed, "shared_prefix": args.prefix},
        "greedy_outputs_match": all(a.texts == b.texts for a, b in zip(stock, radix)),
        "results": [r.summary() for r in stock + radix],
    }


def _cpu_ratio(stock: list[Result], radix: list[Result]) -> float | None:
    """Stock's CPU seconds per generated token over the plugin's (> 1: the plugin uses less)."""
    if any(r.cpu_s is None for r in stock + radix):
        return None
    per_token = [
        sum(r.cpu_s for r in rs) / sum(r.completion_tokens for r in rs) for rs in (stock, radix)
    ]
    return round(per_token[0] / per_token[1], 3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an mlx-lm model directory")
    src.add_argument("--random", choices=sorted(SHAPES), help="random weights of this shape")
    p.add_argument("--dtype", default="float32", help="dtype of a --random model")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests")
    p.add_argument("--prefix", type=int, default=500, help="burst: shared prefix tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="decode: tokens per request")
    p.add_argument("--pool-tokens", type=int, default=65536, help="the plugin's pool size")
    p.add_argument("--rounds", type=int, default=5, help="decode: rounds per server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here too")
    args = p.parse_args(argv)
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
