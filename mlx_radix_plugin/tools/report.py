"""README's measured numbers, rendered from the reports in ``results/``.

Each block of README between ``<!-- report: NAME -->`` and ``<!-- /report -->`` is the
rendering of ``BLOCKS[NAME]``: a caption and a table whose every row names the report and
the run it comes from. ``mlx-radix report`` rewrites those blocks, ``--check`` exits 1 where
README differs (``tests/test_report.py`` runs it), so a number in README is one a report
holds: a new measurement goes into ``results/``, then this table names it.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click

BEGIN = re.compile(r"^<!-- report: ([\w-]+) -->$", re.M)
END = "<!-- /report -->"


@dataclass(frozen=True)
class Source:
    """One run of one report: ``file`` in results/; ``run`` a key of the report's ``runs``
    (or of the report itself); None where the report is one run."""

    file: str
    run: str | None = None

    def load(self, results: Path) -> dict:
        report = _read(results / self.file)
        if self.run is None:
            return report
        return (report.get("runs") or report)[self.run]

    def cite(self) -> str:
        name = f"`{self.run}`" if self.run else "report"
        return f"[{name}](results/{self.file})"


@dataclass(frozen=True)
class Row:
    # The first cell: text, or made from the run (a workload's sizes are the report's).
    title: str | Callable[[dict], str]
    source: Source
    cells: Callable[[dict], Sequence[str]]  # the rest, from the run


@dataclass(frozen=True)
class Block:
    caption: Callable[[Path], str]
    header: Sequence[str]
    rows: Sequence[Row]

    def render(self, results: Path) -> str:
        lines = [self.caption(results), ""]
        lines.append("| " + " | ".join([*self.header, "run"]) + " |")
        lines.append("|" + "---|" * (len(self.header) + 1))
        for row in self.rows:
            run = row.source.load(results)
            title = row.title if isinstance(row.title, str) else row.title(run)
            lines.append("| " + " | ".join([title, *row.cells(run), row.source.cite()]) + " |")
        return "\n".join(lines)


@cache
def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# -- formats --------------------------------------------------------------------------


def n(x: float | None, digits: int = 0) -> str:
    """A number with thousands separators; "-" for a missing one."""
    return "-" if x is None else f"{x:,.{digits}f}"


def x(ratio: float | None, digits: int = 2) -> str:
    return "-" if ratio is None else f"{ratio:.{digits}f}x"


def gb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.1f} GB"


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f} MiB"


def both(a: str, b: str) -> str:
    return f"{a} / {b}"


# -- the CPU: mlx-radix bench ---------------------------------------------------------

# The whole preset, seed 1, on a quiet machine, after a prompt arriving as another request's
# first token is due came to start a call later (the report says why seed_0 is not shown).
CPU = Source("bench-medium-cpu-2026-12-06.json", "seed_1_2026_12_07")
# Decode alone, after a decode step's host work was cut (issue 57).
DECODE = Source("bench-medium-cpu-2026-12-06.json", "host_ops_seed_1_2026_12_07")


def _cpu_caption(results: Path) -> str:
    r = CPU.load(results)
    m = r["machine"]
    # The command as run, less where it wrote the report.
    cmd = re.sub(r" --json \S+", "", r.get("command", f"mlx-radix bench --preset {r['preset']}"))
    blas = "OpenBLAS" if "openblas" in m["blas"].lower() else Path(m["blas"]).name
    left = "".join(
        f"; `{w}` left out: the model reads too few tokens" for w in r.get("left_out", {})
    )
    return (
        f"**CPU**: {m['cpus']} x86-64 cores, {blas}, MLX {m['mlx']}, {r['model']}, "
        f"{r['started'][:10]}: `{cmd}` ({n(r['duration_s'] / 60)} minutes, seed {r['seed']}"
        f"{left}); a row of another run names it. Greedy outputs "
        f"{'identical' if r['greedy_outputs_match'] else 'differed'}."
    )


def _cpu_row(workload: str, title: Callable[[dict], str], source: Source = CPU) -> Row:
    def cells(run: dict) -> list[str]:
        w = run["workloads"][workload]
        s, r = w["stock"], w["radix"]
        return [
            both(n(s["prompt_tokens_computed"]), n(r["prompt_tokens_computed"])),
            both(n(s["wall_s"], 1), n(r["wall_s"], 1)),
            both(n(s["ttft_p50_s"], 2), n(r["ttft_p50_s"], 2)),
            both(n(s["ttft_mean_s"], 2), n(r["ttft_mean_s"], 2)),
        ]

    return Row(lambda run: title(run["workloads"][workload]["params"]), source, cells)


CPU_BLOCK = Block(
    _cpu_caption,
    (
        "workload",
        "prompt tokens computed, stock / radix",
        "wall s, stock / radix",
        "TTFT p50 s, stock / radix",
        "TTFT mean s, stock / radix",
    ),
    (
        _cpu_row(
            "burst",
            lambda p: (
                f"burst: {p['requests']} at once on one new {p['prefix_tokens']}-token "
                f"prefix, {p.get('rounds', 1)} rounds"
            ),
        ),
        _cpu_row(
            "memory",
            lambda p: (
                f"memory: {p['requests']} live requests on one {n(p['prefix_tokens'])}-token prefix"
            ),
        ),
        _cpu_row(
            "prefix_repetition",
            lambda p: (
                f"prefix repetition: {p['prefixes']} prefixes of {p['prefix_tokens']} "
                f"tokens, {p['requests']} requests"
            ),
        ),
        _cpu_row(
            "shared_prefix",
            lambda p: (
                f"shared prefix: {p['groups']} system prompts of {p['system_tokens']} "
                f"tokens x {p['questions']} questions"
            ),
        ),
        _cpu_row(
            "multi_turn",
            lambda p: f"multi-turn chat: {p['clients']} clients x {p['rounds']} rounds",
        ),
        _cpu_row(
            "conversations",
            lambda p: (
                f"conversations: {p['sessions']} chats x {p['turns']} turns, "
                f"{p['opening_tokens']}-token openings, {p['arrival_s']:g} s apart"
            ),
        ),
        _cpu_row(
            "decode",
            lambda p: (
                f"decode: {p['batch']} concurrent x {p['output_tokens']} tokens, "
                f"{p['rounds']} rounds"
            ),
        ),
        _cpu_row(
            "decode_shared",
            lambda p: (
                f"decode on a shared prefix: {p.get('batch', p.get('requests'))} x "
                f"{p['output_tokens']} tokens on one cached {n(p['prefix_tokens'])}-token prefix"
            ),
        ),
    ),
)


def _rates_caption(results: Path) -> str:
    return (
        "The same run: decode tokens/s (each server's median round; the ratio is the median of "
        "the rounds' ratios), peak memory, K/V held, and the first token after a restart "
        "(medians of rounds; radix on its disk tier, stock computing the prompt again):"
    )


def _median_of(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def _decode_rate(workload: str) -> Callable[[dict], list[str]]:
    def cells(run: dict) -> list[str]:
        w = run["workloads"][workload]
        rounds = w["by_round"]
        # The decode rate where the run has it (tokens after each first one, while all
        # decode); the whole round's tokens/s in older reports.
        key = "decode_tokens_per_s" if "radix_decode_tokens_per_s" in rounds[0] else "tokens_per_s"
        ratio = w.get(f"{key}_ratio_median")
        return [
            n(_median_of(rounds, f"stock_{key}"), 1),
            n(_median_of(rounds, f"radix_{key}"), 1),
            x(ratio),
        ]

    return cells


def _pace(run: dict) -> list[str]:
    w = run["workloads"]["conversations"]
    s, r = w["stock"]["decode_s_per_token"], w["radix"]["decode_s_per_token"]
    return [f"{n(s * 1000)} ms", f"{n(r * 1000)} ms", x(r / s)]


def _memory(run: dict) -> list[str]:
    # The process's peak over the whole run (VmHWM): what earlier workloads left counts too.
    s, r = run["peak_rss_bytes"]["stock"], run["peak_rss_bytes"]["radix"]
    return [mib(s), mib(r), x(r / s)]


def _kv_held(run: dict) -> list[str]:
    # Stock's side is computed: the same tokens' K/V held once per request, as its batch does.
    w = run["workloads"]["memory"]
    held, copies = w["kv_bytes_held_peak"], w["kv_bytes_unshared"]
    return [f"{mib(copies)} (a copy a request)", mib(held), x(held / copies)]


def _restart(run: dict) -> list[str]:
    w = run["workloads"]["restart"]
    t = w["ttft_after_restart_s"]
    return [f"{n(t['stock'], 2)} s", f"{n(t['radix'], 2)} s", x(w["ttft_after_restart_speedup"])]


def _rates_title(workload: str, what: str) -> Callable[[dict], str]:
    def title(run: dict) -> str:
        p = run["workloads"][workload]["params"]
        rows = p.get("batch", p.get("requests"))
        prefix = (
            f" on one cached {n(p['prefix_tokens'])}-token prefix" if workload != "decode" else ""
        )
        if workload == "restart":
            return f"warm restart: {what} on a {n(p['prefix_tokens'])}-token prompt"
        if workload == "memory":
            return f"memory: {what}, {rows} requests on one {n(p['prefix_tokens'])}-token prefix"
        return f"{workload.replace('_', ' ')}: {what}, {rows} requests{prefix}"

    return title


RATES_BLOCK = Block(
    _rates_caption,
    ("workload", "stock", "radix", "radix / stock"),
    (
        Row(_rates_title("decode", "tokens/s"), DECODE, _decode_rate("decode")),
        Row(_rates_title("decode_shared", "tokens/s"), DECODE, _decode_rate("decode_shared")),
        Row("conversations: time a token while a reply streams (mean)", CPU, _pace),
        Row("peak resident memory of each server over the run", CPU, _memory),
        Row(_rates_title("memory", "K/V held at peak"), CPU, _kv_held),
        Row(_rates_title("restart", "first token after a restart"), CPU, _restart),
    ),
)


# -- the GPU: tools/gpu_bench ---------------------------------------------------------

GPU = "gpu-h200-2026-12-04-serving.json"
HEADLINE = Source(GPU, "headline_h100_2026_12_07_b")
AGENT = Source(GPU, "plan_after_prepare_agent_h100")
LONG = Source(GPU, "long_h100_2026_12_07_c")
CLIENTS = Source(GPU, "clients_agent_h100")
CHATS = Source(GPU, "conversations_h100")
ONE_B = Source(GPU, "decode_attention_1b_h100")


def _shape(run: dict) -> dict:
    return run["shapes"][0]


def _gpu_caption(results: Path) -> str:
    run = HEADLINE.load(results)
    shape = _shape(run)
    return (
        f"**{run['device_name']}**: MLX {run['mlx']}'s CUDA backend, random weights of the "
        f"{shape['shape']} shape in {shape['dtype']}, each server alone, medians of rounds "
        f"(`python -m mlx_radix_plugin.tools.gpu_bench`, each run's command in its report). "
        "Greedy outputs in bf16 differ from stock's on some requests (the column *same "
        "text*): batched bf16 sums in another order; float32 logits within the fidelity "
        "tolerance are shown by the tests."
    )


def _decode(concurrency: str) -> Callable[[dict], list[str]]:
    def cells(run: dict) -> list[str]:
        shape = _shape(run)
        d = shape["decode"][concurrency]
        floor = shape.get("floor") or {}
        s, r = n(d["stock"]["tokens_per_s"]), n(d["radix"]["tokens_per_s"])
        if concurrency == "1" and floor:
            s += f" ({x(floor['stock_over_floor'])})"
            r += f" ({x(floor['radix_over_floor'])})"
        return [s, r, x(d["ratio"]), f"{d['greedy_match']} of {d['requests']}"]

    return cells


def _decode_shared(run: dict) -> list[str]:
    (d,) = _shape(run)["decode_shared"].values()
    return [
        n(d["stock"]["decode_tokens_per_s"]),
        n(d["radix"]["decode_tokens_per_s"]),
        x(d["ratio"]),
        f"{d['greedy_match']} of {d['requests']}",
    ]


def _decode_shared_title(run: dict) -> str:
    (d,) = _shape(run)["decode_shared"].values()
    return f"decode tokens/s, {d['rows']} requests on a cached {n(d['prefix'])}-token prefix"


def _burst(run: dict) -> list[str]:
    b = _shape(run)["burst"]

    def side(s: dict) -> str:
        return f"{n(s['ttft_mean_s'] * 1000)} ms ({n(s['prompt_tokens_computed'])})"

    return [side(b["stock"]), side(b["radix"]), x(b["speedup"]), ""]


def _burst_title(run: dict) -> str:
    b = _shape(run)["burst"]
    return (
        f"burst of {b['requests']} on a new {n(b['shared_prefix'])}-token prefix: TTFT mean "
        "(prompt tokens computed)"
    )


def _sessions(block: dict, total: int, ttft: Callable[[dict], str]) -> list[str]:
    """A workload of sessions, each server alone: wall and TTFT, or how many of ``total``
    it served where it fell short; its device peak either way."""

    def side(s: dict) -> str:
        peak = gb(s["device_memory_peak_bytes"])
        if s.get("requests_served", total) < total:
            return f"{s['requests_served']} of {total} served (out of memory); {peak}"
        return f"{n(s['wall_s'], 1)} s / {ttft(s)}; {peak}"

    return [side(block["stock"]), side(block["radix"]), x(block.get("wall_speedup")), ""]


def _agent(run: dict) -> list[str]:
    a = _shape(run)["agent"]
    total = a["clients"] * a["rounds"] * a["requests_per_turn"]

    def ttft(s: dict) -> str:
        later = s.get("ttft_p50_later_turns_s")
        later = f" (turns 2-{a['rounds']}: {n(later, 2)} s)" if later is not None else ""
        return f"{n(s['ttft_p50_s'], 2)} s{later}"

    return _sessions(a, total, ttft)


def _agent_title(run: dict) -> str:
    a = _shape(run)["agent"]
    return (
        f"{a['clients']} agents x {a['rounds']} turns of +{n(a['turn'])} tokens on a "
        f"{n(a['shared_prefix'])}-token prompt: wall / TTFT p50; device peak"
    )


def _chats(run: dict) -> list[str]:
    c = _shape(run)["conversations"]
    total = c["params"]["sessions"] * c["params"]["turns"]
    return _sessions(c, total, lambda s: f"{n(s['ttft_mean_s'] * 1000)} ms")


def _chats_title(run: dict) -> str:
    p = _shape(run)["conversations"]["params"]
    return (
        f"{p['sessions']} chats x {p['turns']} turns, each its own {n(p['opening_tokens'])}-token "
        f"opening, {p['arrival_s']:g} s apart: wall / TTFT mean; device peak"
    )


def _clients(run: dict) -> list[str]:
    a = _shape(run)["agent"]
    later = a["by_turn"][1:]

    def side(name: str) -> str:
        shares = [t[f"{name}_cached_share"] for t in later]
        s = a[name]
        return (
            f"{min(shares):.1%}-{max(shares):.1%} cached; {n(s['wall_s'], 1)} s; "
            f"{gb(s['device_memory_peak_bytes'])}"
        )

    speedups = [t["ttft_speedup"] for t in later]
    return [
        side("stock"),
        side("radix"),
        f"wall {x(a['wall_speedup'])}; TTFT {x(min(speedups))}-{x(max(speedups))}",
        f"{a['greedy_match']} of {a['clients'] * a['rounds'] * a['requests_per_turn']}",
    ]


def _clients_title(run: dict) -> str:
    a = _shape(run)["agent"]
    return (
        f"an agent session in Claude Code's and Codex's shape ({a['requests_per_turn']} "
        f"requests a turn on a {n(a['shared_prefix'])}-token prompt), turns 2-{a['rounds']}: "
        "share cached; wall; device peak"
    )


def _long(tokens: str) -> Callable[[dict], list[str]]:
    def cells(run: dict) -> list[str]:
        p = _shape(run)["long"]["prompts"][tokens]

        def side(s: dict) -> str:
            if "ttft_s" not in s:
                return f"no first token; {gb(s['device_memory_peak_bytes'])}"
            return (
                f"{n(s['ttft_s'], 1)} s ({x(s['over_flop_time'], 1)}); "
                f"{gb(s['device_memory_peak_bytes'])}"
            )

        speedup = (
            p["stock"]["ttft_s"] / p["radix"]["ttft_s"]
            if "ttft_s" in p["stock"] and "ttft_s" in p["radix"]
            else None
        )
        return [side(p["stock"]), side(p["radix"]), x(speedup), ""]

    return cells


def _long_title(tokens: str) -> Callable[[dict], str]:
    return lambda run: (
        f"one prompt of {n(int(tokens))} tokens: first token (its FLOP time's multiple); "
        "device peak"
    )


GPU_BLOCK = Block(
    _gpu_caption,
    ("", "stock", "radix", "radix / stock", "same text"),
    (
        Row(
            "decode tokens/s at 1 request (time a token over the bandwidth floor's)",
            HEADLINE,
            _decode("1"),
        ),
        Row("decode tokens/s at 32 requests", HEADLINE, _decode("32")),
        Row(_decode_shared_title, HEADLINE, _decode_shared),
        Row(_burst_title, HEADLINE, _burst),
        Row(_agent_title, AGENT, _agent),
        Row(_clients_title, CLIENTS, _clients),
        Row(_chats_title, CHATS, _chats),
        *(Row(_long_title(t), LONG, _long(t)) for t in ("32768", "65536", "131056")),
        Row(
            "Llama-3.2-1B shape: decode tokens/s at 1 request (over the floor)",
            ONE_B,
            _decode("1"),
        ),
        Row("Llama-3.2-1B shape: decode tokens/s at 32 requests", ONE_B, _decode("32")),
    ),
)

BLOCKS: dict[str, Block] = {"cpu": CPU_BLOCK, "cpu-rates": RATES_BLOCK, "gpu": GPU_BLOCK}


# -- README ---------------------------------------------------------------------------


def render(text: str, results: Path) -> str:
    """``text`` with each report block rendered anew from ``results``."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"<!-- report: {m.group(1)} --> has no {END}")
        if m.group(1) not in BLOCKS:
            raise ValueError(f"no report block named {m.group(1)!r}; known: {', '.join(BLOCKS)}")
        out += [text[pos : m.end()], "\n", BLOCKS[m.group(1)].render(results), "\n"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


@click.command(
    "report",
    help="Render README's measured tables from the reports in results/ (each row names its "
    "report and run). --check: exit 1 where README differs.",
)
@click.option(
    "--readme",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("README.md"),
    show_default=True,
)
@click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results"),
    show_default=True,
)
@click.option("--check", is_flag=True, help="Change nothing; exit 1 if README is not current.")
def command(readme: Path, results: Path, check: bool) -> None:
    text = readme.read_text()
    new = render(text, results)
    if check:
        if new != text:
            click.echo(f"{readme} differs from the reports: run `mlx-radix report`", err=True)
            sys.exit(1)
        click.echo(f"{readme}: current")
        return
    readme.write_text(new)
    click.echo(f"{readme}: {len(BEGIN.findall(new))} blocks rendered")
