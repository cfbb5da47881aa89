"""mlx_lm.server under ``mlx.launch`` (two ranks over the ring backend on 127.0.0.1), tensor
and pipeline parallel, with the plugin on every rank, against stock: the same answers, hits,
every rank's pool idle and alike afterwards, also under memory pressure that differs by rank
with clients hanging up."""

import concurrent.futures
import json
import random
import re
import sys
import threading
import time

import pytest
from servers import (
    BIN,
    NO_EOS,
    Server,
    free_port,
    mlx_lm_server,
    run_to_exit,
    server_env,
)
from tiny_models import CORPUS

from mlx_radix_plugin.server.server_cache import RANK_STATS
from mlx_radix_plugin.tools.bench.servers import Launched, free_ports, mlx_launch
from mlx_radix_plugin.tools.soak import Spec, send

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer the question briefly and politely. " * 2
QUESTIONS = ["Where is Paris?", "Where is Berlin?", "Where is Rome?", "Where is Oslo?"]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "logit_bias": NO_EOS}
# A request of the pressure test takes seconds; one that takes this long waits on ranks stuck
# in a collective.
REQUEST_SECONDS = 90


@pytest.fixture
def launch(model_dirs, tmp_path):
    def launch(
        arch: str = "llama",
        plugin: bool = True,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        rank_env: dict[int, dict[str, str]] | None = None,
        serve: bool = False,
    ) -> Launched:
        """Two ranks serving ``arch`` (by ``mlx-radix serve`` if ``serve``); ``rank_env``:
        variables one rank alone gets."""
        port = free_ports(3)  # HTTP, then one a rank
        (tmp_path / "hf").mkdir(exist_ok=True)
        env = server_env(tmp_path / "hf", **(env or {}))
        if plugin:
            env["MLX_LM_PLUGINS"] = "radix"
        server = [str(BIN / "mlx-radix"), "serve"] if serve else [str(BIN / "mlx_lm.server")]
        if rank_env:  # mlx.launch's --env is every rank's; mlx.launch sets MLX_RANK
            script = tmp_path / f"rank-env-{port}.sh"
            lines = [
                f'[ "$MLX_RANK" = {r} ] && export {k}={v}'
                for r, kv in rank_env.items()
                for k, v in kv.items()
            ]
            lines.append(f'exec {" ".join(server)} "$@"')
            script.write_text("\n".join(["#!/bin/sh", *lines]) + "\n")
            script.chmod(0o755)
            server = [str(script)]
        cmd = [*server, "--model", str(model_dirs[arch]), "--port", str(port), *args]
        cmd = mlx_launch(cmd, env, ranks=2, backend="ring", port=port + 1)
        return Launched(cmd, env, port, tmp_path / f"launch-{port}.log")

    return launch


def single(model_dirs, tmp_path, arch: str = "llama") -> Server:
    """Stock mlx_lm.server in one process."""
    port = free_port()
    cmd = mlx_lm_server("--model", str(model_dirs[arch]), "--port", str(port))
    return Server(cmd, server_env(tmp_path / "hf1"), port, tmp_path / f"stock-{port}.log")


def answers(server: Server) -> list[tuple[str, int]]:
    """The questions two at a time on one system prompt: texts and cached tokens."""

    def ask(question: str) -> tuple[str, int]:
        r = server.post("/v1/completions", {"prompt": SYSTEM + question, **GREEDY})
        details = r["usage"].get("prompt_tokens_details") or {}
        return r["choices"][0]["text"], details.get("cached_tokens", 0)

    out = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for pair in (QUESTIONS[:2], QUESTIONS[2:], QUESTIONS[:2]):
            out += list(pool.map(ask, pair))
    return out


def idle_ranks(server: Launched) -> tuple[dict, list[dict]]:
    """Rank 0's stats and every rank's ``RANK_STATS``, once the ranks have reported (while
    idle) every request rank 0 has seen."""
    deadline = time.monotonic() + 60
    while True:
        stats = server.stats()
        reported = stats.get("ranks") or []
        if reported and all(r[k] == stats[k] for r in reported for k in ("hits", "misses")):
            if all(r["requests_holding_pages"] == 0 for r in reported):
                return stats, reported
        assert time.monotonic() < deadline, f"the ranks never reported idle: {reported}"
        time.sleep(0.2)


def assert_idle_and_alike(reported: list[dict]) -> None:
    """Each rank's pool is idle (nothing locked or held but pins), and every rank's is the
    same."""
    assert len(reported) == 2
    for r in reported:
        assert r["requests_holding_pages"] == 0, r
        assert r["pages_locked"] == r["pinned_pages"] and r["tree_locks"] == r["pins"], r
        assert r["page_refs"] == r["pages_cached"], r
    assert reported[0] == reported[1]
    assert set(reported[0]) == set(RANK_STATS)


AGREE = """
import gc, json, weakref
import mlx.core as mx
from mlx_radix_plugin.memory import ranks
r = mx.distributed.init().rank()
got = [
    ranks.size(), ranks.least([5 + r, 10 - r]), ranks.all_agree(r == 0), ranks.all_agree(True),
    ranks.same(b"x"), ranks.same(bytes([r])), ranks.gather([r, 7]),
]
# Garbage in a cycle goes at the same step on every rank: every COLLECT_EVERY steps.
ranks.own_garbage_collection()
class Cycle:
    pass
freed, counts = [], []
for step in range(2 * ranks.COLLECT_EVERY):
    c = Cycle()
    c.me = c
    weakref.finalize(c, freed.append, step)
    del c
    ranks.stepped()
    counts.append(len(freed))
n = ranks.COLLECT_EVERY
got += [gc.isenabled(), counts[n - 2], counts[n - 1], counts[2 * n - 2], counts[2 * n - 1]]
print(json.dumps(got), flush=True)
"""


# Two pools planned apart (rank 1: more pages, larger chunks, more K/V held outside the pool,
# a later clock) that must come out alike: their size, when a chunk comes, when one goes.
POOLS = """
import json
import mlx.core as mx
from mlx_radix_plugin.memory.allocator import OutOfPages
from mlx_radix_plugin.memory.budget import MemoryPlan
from mlx_radix_plugin.memory.pool import KVPool, LayerSpec
r = mx.distributed.init().rank()
pool = KVPool([LayerSpec(1, 8, 8)], 64 + 64 * r, 4, mx.float32, chunk_pages=8 + 8 * r)
pool.plan = MemoryPlan(0, "test", 0, 0, 0, 0, "test", buffer_reserve_bytes=0)
pool = pool.agreed()
class Outside:  # K/V a rank holds outside the pool: rank 1's leaves no room past 2 chunks
    buffer_nbytes = r * 6 * 8 * pool.bytes_per_page
outside = Outside()
pool.hold_outside(outside)
got = [pool.max_pages, pool.allocator.chunk_pages, len(pool.alloc_pages(8))]
pages = pool.alloc_pages(8)
try:
    pool.alloc_pages(8)
except OutOfPages:
    got.append("full")
got.append(len(pool.allocator.online_chunks))
pool.release_pages(pages)
got.append(pool.trim(idle_seconds=10, now=0.0))  # chunk 1 empty from here
got.append(pool.trim(idle_seconds=10, now=5.0 + 10 * r))  # due on rank 1 only
got.append(pool.trim(idle_seconds=10, now=10.0 + 10 * r))  # due on both
got.append(pool.allocator.online_chunks)
print(json.dumps(got), flush=True)
"""


def run_ranks(tmp_path, code: str) -> list:
    """``code`` on two ranks; what each printed last, by rank."""
    script = tmp_path / "ranks.py"
    script.write_text(code)
    env = server_env(tmp_path)
    cmd = mlx_launch(
        [sys.executable, str(script)], env, ranks=2, backend="ring", port=free_ports(2)
    )
    out = run_to_exit(cmd, env, 120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]


def test_ranks_agree(tmp_path):
    expected = [2, [5, 9], False, True, True, False, [[0, 7], [1, 7]], False, 0, 64, 64, 128]
    assert run_ranks(tmp_path, AGREE) == [expected, expected]


def test_pools_planned_apart_grow_and_trim_alike(tmp_path):
    # 64 pages in chunks of 8 (the least), a third chunk refused (rank 1 had no room), chunk 1
    # given back once both ranks' clocks say so.
    expected = [64, 8, 8, "full", 2, 0, 0, 1, [0]]
    assert run_ranks(tmp_path, POOLS) == [expected, expected]


def test_tensor_parallel_ranks_answer_as_stock_and_hit(launch, model_dirs, tmp_path):
    with single(model_dirs, tmp_path) as stock:
        alone = [text for text, _ in answers(stock)]
    with launch(plugin=False) as stock:
        distributed = [text for text, _ in answers(stock)]
    with launch() as radix:
        got = answers(radix)
        stats, reported = idle_ranks(radix)
        with pytest.raises(RuntimeError, match="501 .*under mlx.launch .*radix.pin"):
            radix.post("/v1/cache/pin", {"prompt": SYSTEM})  # only rank 0 would hear it
        log = radix.output()
    assert [text for text, _ in got] == distributed == alone
    assert sum(cached for _, cached in got[2:]) > 0  # the system prompt, from the pool
    assert log.count("radix KV pool: up to") == 2  # each rank built its own pool
    assert stats["hits"] > 0 and stats["fallback"] is None
    assert_idle_and_alike(reported)
    assert reported[0]["hits"] == stats["hits"] > 0


def test_pipeline_ranks_answer_as_stock_and_hit(launch, model_dirs, tmp_path):
    # qwen2 is one of the model types mlx-lm pipelines (PipelineMixin): a layer per rank.
    with single(model_dirs, tmp_path, "qwen2") as stock:
        alone = [text for text, _ in answers(stock)]
    with launch("qwen2", plugin=False, args=("--pipeline",)) as stock:
        distributed = [text for text, _ in answers(stock)]
    # A pin file prefills at load on every rank (its send tied to the last layer's cache),
    # and --prompt-cache-bytes trims by each rank's bytes, agreed.
    pin = tmp_path / "system.txt"
    pin.write_text(SYSTEM)
    args = ("--pipeline", "--prompt-cache-bytes", str(1 << 30))
    with launch("qwen2", args=args, env={"MLX_RADIX_PIN": str(pin)}) as radix:
        got = answers(radix)
        stats, reported = idle_ranks(radix)
        log = radix.output()
    assert [text for text, _ in got] == distributed == alone
    assert all(cached > 0 for _, cached in got)  # the pinned system prompt
    assert stats["fallback"] is None and "radix cache off" not in log
    assert log.count(f"radix.pin: {pin} pinned") == 2 and stats["pins"] == 1
    assert_idle_and_alike(reported)


@pytest.mark.parametrize(
    "arch, args",
    [("qwen3_5", ()), ("llama", ("--decode-shared-prefix", "on"))],
    ids=["hybrid", "shared"],
)
def test_features_under_tensor_parallel(launch, model_dirs, tmp_path, arch, args):
    """A hybrid model's recurrent-state snapshots, and decode reading shared prefixes once;
    served by ``mlx-radix serve``."""
    with single(model_dirs, tmp_path, arch) as stock:
        alone = [text for text, _ in answers(stock)]
    with launch(arch, args=args, serve=True) as radix:
        got = answers(radix)
        stats, reported = idle_ranks(radix)
    assert [text for text, _ in got] == alone
    assert sum(cached for _, cached in got[2:]) > 0
    assert_idle_and_alike(reported)
    if arch == "qwen3_5":
        assert stats["snapshot_hits"] > 0 and reported[0]["snapshots"] > 0
    else:
        assert stats["decode_steps_shared"] > 0


def test_settings_that_differ_fall_back_on_every_rank(launch, model_dirs, tmp_path):
    with single(model_dirs, tmp_path) as stock:
        alone = [text for text, _ in answers(stock)]
    with launch(rank_env={1: {"MLX_RADIX_PAGE_SIZE": "8"}}) as radix:
        got = answers(radix)
        stats = radix.stats()
        log = radix.output()
    assert [text for text, _ in got] == alone
    assert "settings differ" in stats["fallback"]
    assert log.count("radix cache off") == 2 and "radix KV pool: up to" not in log


def pressure_specs(seed: int = 0) -> list[Spec]:
    """Prompts on 8 system prompts of about 1,500 tokens, 4 questions each, twice over (about
    100,000 prompt tokens, 50 times a 2,048-token pool); one streamed request in four hangs
    up after its first token."""
    rng = random.Random(seed)
    words = sorted(set(re.findall(r"[a-z]+", " ".join(CORPUS).lower())))
    systems = [" ".join(rng.choice(words) for _ in range(1100)) for _ in range(8)]
    specs = []
    for _ in range(2):
        for system in systems:
            for q in QUESTIONS:
                stream = rng.random() < 0.5
                specs.append(Spec(False, system, q, 8, stream, stream and rng.random() < 0.5))
    return specs


def run_specs(server: Server, specs: list[Spec]) -> list:
    """``specs`` four at a time; after a request that fails (ranks out of step hang in a
    collective: it times out), the rest are not sent (None)."""
    failed = threading.Event()

    def one(spec: Spec):
        if failed.is_set():
            return None
        outcome = send(server.port, spec, NO_EOS, timeout=REQUEST_SECONDS)
        if not outcome.ok:
            failed.set()
        return outcome

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, specs))


def test_pressure_different_device_memory_and_hang_ups(launch, model_dirs, tmp_path):
    """Rank 1 sees almost no device memory, rank 0 plenty: both ranks still size the same
    pool (the least), fill and evict it alike while clients hang up, and answer as stock."""
    specs = pressure_specs()
    answered = [s for s in specs if not s.disconnect]
    with single(model_dirs, tmp_path) as stock:
        expected = [o.text for o in run_specs(stock, answered)]
    memory = {0: {"MLX_RADIX_DEVICE_MEMORY": str(8 << 30)}, 1: {"MLX_RADIX_DEVICE_MEMORY": "1"}}
    with launch(env={"MLX_RADIX_POOL_TOKENS": "0"}, rank_env=memory) as radix:
        outcomes = run_specs(radix, specs)
        stats, reported = idle_ranks(radix)
        log = radix.output()
    assert all(o is not None and o.ok for o in outcomes), [o and o.error for o in outcomes]
    got = {id(o.spec): o for o in outcomes}
    assert [got[id(s)].text for s in answered] == expected
    assert sum(o.disconnected for o in outcomes) > 0
    pools = re.findall(r"radix KV pool: up to (\d+) pages x (\d+) tokens", log)
    assert len(pools) == 2 and pools[0] == pools[1]  # rank 0 alone would take gigabytes
    assert int(pools[0][0]) * int(pools[0][1]) == 2048
    assert "leave no room for a KV pool" in log  # rank 1's plan
    assert_idle_and_alike(reported)
    assert reported[0]["evictions"] > 0 and reported[0]["pages_max"] == int(pools[0][0])
    assert stats["prompt_tokens"] > 40 * 2048
