"""The benchmark's report: per-workload totals of each server, radix/stock ratios, the
terminal table, the JSON file and PNG charts.

Everything after ``compare`` works on the JSON-shaped report alone, so a saved report
renders the same table and charts again.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .workloads import Reply, Restart, Run, Workload

SERVERS = ("stock", "radix")
# Ratios are radix / stock: below 1 is better for times, tokens computed and memory,
# above 1 for cached tokens and tokens/s.
RATIO_KEYS = (
    "wall_s",
    "ttft_p50_s",
    "ttft_mean_s",
    "ttft_p95_s",
    "decode_s_per_token",
    "prompt_tokens_computed",
    "cached_tokens",
    "tokens_per_s",
    "cpu_s_per_token",
    "peak_rss_bytes",
)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded, or None when either is missing or ``b`` is 0."""
    if a is None or not b:
        return None
    return round(a / b, 3)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _sum_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def _median(values: list[float | None], digits: int = 3) -> float | None:
    """Median of the values that are there; None when none is."""
    present = [v for v in values if v is not None]
    return _round(statistics.median(present), digits) if present else None


def decode_tokens_per_s(run: Run) -> float | None:
    """Tokens/s while ``run``'s requests decode: every token after each reply's first, over
    the time from the earliest first token to the latest end, so prefill and admission
    before the first tokens do not count. Replies with no text are left out; None when no
    reply has the times (made-up runs) or they span no time."""
    timed = [
        r for r in run.replies.values() if r.first_token_at is not None and r.done_at is not None
    ]
    if not timed:
        return None
    span = max(r.done_at for r in timed) - min(r.first_token_at for r in timed)
    tokens = sum(max(0, r.usage["completion_tokens"] - 1) for r in timed)
    return round(tokens / span, 2) if span > 0 else None


def decode_s_per_token(replies: list[Reply]) -> float | None:
    """Mean seconds a token after each reply's first: the pace a reader sees while a reply
    streams. Replies of one token, or with no times, are left out."""
    paces = [
        (r.done_at - r.first_token_at) / (r.usage["completion_tokens"] - 1)
        for r in replies
        if r.first_token_at is not None
        and r.done_at is not None
        and r.usage["completion_tokens"] > 1
    ]
    return round(statistics.fmean(paces), 5) if paces else None


def summarize(runs: list[Run]) -> dict:
    """One server's totals over its runs of one workload."""
    replies = [r for run in runs for r in run.replies.values()]
    prompt = sum(r.usage["prompt_tokens"] for r in replies)
    cached = sum(_cached(r.usage) for r in replies)
    completion = sum(r.usage["completion_tokens"] for r in replies)
    wall = sum(run.wall_s for run in runs)
    ttft = sorted(r.ttft_s for r in replies if r.ttft_s is not None)
    cpu = _sum_or_none([run.cpu_s for run in runs])
    stats_prompt = _sum_or_none([run.stats_prompt_tokens for run in runs])
    stats_cached = _sum_or_none([run.stats_cached_tokens for run in runs])
    peaks = [run.peak_rss_bytes for run in runs if run.peak_rss_bytes is not None]
    return {
        "runs": len(runs),
        "requests": len(replies),
        "wall_s": round(wall, 3),
        "ttft_p50_s": _round(percentile(ttft, 0.5)),
        "ttft_p95_s": _round(percentile(ttft, 0.95)),
        "ttft_mean_s": _round(statistics.fmean(ttft) if ttft else None),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "prompt_tokens_computed": prompt - cached,
        "stats_prompt_tokens_computed": (
            None if stats_prompt is None else stats_prompt - stats_cached
        ),
        "stats_cached_tokens": stats_cached,
        "completion_tokens": completion,
        "tokens_per_s": round(completion / wall, 2) if wall else None,
        "decode_s_per_token": decode_s_per_token(replies),
        "cpu_s": _round(cpu),
        "cpu_s_per_token": _round(cpu / completion if cpu is not None and completion else None, 5),
        "peak_rss_bytes": max(peaks) if peaks else None,
    }


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# What each server's side of a restart round reports from its run's ``restarted``.
RESTART_KEYS = (
    "exit_code",
    "stop_s",
    "start_s",
    "disk_pages_written_before_stop",
    "disk_pages_at_start",
    "disk_hits",
    "disk_pages_read",
    "disk_restore_seconds",
    "page_size",
)


def _per_1k(seconds: float | None, tokens: int | None) -> float | None:
    """Seconds per 1,000 tokens, or None without either."""
    if seconds is None or not tokens:
        return None
    return round(seconds / tokens * 1000, 4)


def restart_side(run: Run) -> dict:
    """One server's round of the restart workload: its measured request after the restart
    (TTFT, tokens cached, TTFT per 1,000 prompt tokens, which for a server that recomputes
    the whole prompt is its prefill's rate), the restart, and the disk tier's reads (the
    plugin's stats: None from stock). ``restore_s_per_1k_tokens`` is the time the restore
    took over the tokens it read back (``disk_pages_read`` x ``page_size``)."""
    after = run.replies[Restart.AFTER]
    info = run.restarted or {}
    prompt = after.usage["prompt_tokens"]
    side = {
        "ttft_before_s": _round(run.before.ttft_s) if run.before else None,
        "ttft_after_s": _round(after.ttft_s),
        "prompt_tokens_after": prompt,
        "cached_tokens_after": _cached(after.usage),
        "ttft_s_per_1k_prompt_tokens": _per_1k(after.ttft_s, prompt),
        **{k: info.get(k) for k in RESTART_KEYS},
    }
    pages, page_size = side["disk_pages_read"], side["page_size"]
    read = None if pages is None or page_size is None else pages * page_size
    side["disk_tokens_read"] = read
    side["restore_s_per_1k_tokens"] = _per_1k(side["disk_restore_seconds"], read)
    return side


def compare_restart(runs: dict[str, list[Run]]) -> dict:
    """The restart workload's rounds, and their medians: TTFT after the restart (stock over
    radix: above 1, the plugin's first token came sooner), the tokens the request found
    cached, and a restore's seconds per 1,000 tokens read back against stock's prefill
    seconds per 1,000 prompt tokens (stock / radix again)."""
    rounds = []
    for s, r in zip(runs["stock"], runs["radix"]):
        rd = {"stock": restart_side(s), "radix": restart_side(r)}
        rd["ttft_after_restart_speedup"] = ratio(
            rd["stock"]["ttft_after_s"], rd["radix"]["ttft_after_s"]
        )
        rd["restore_speedup_per_1k_tokens"] = ratio(
            rd["stock"]["ttft_s_per_1k_prompt_tokens"], rd["radix"]["restore_s_per_1k_tokens"]
        )
        rounds.append(rd)

    def median(server: str, key: str, digits: int = 3):
        return _median([rd[server][key] for rd in rounds], digits)

    return {
        "by_round": rounds,
        "ttft_after_restart_s": {s: median(s, "ttft_after_s") for s in SERVERS},
        "ttft_after_restart_speedup": _median([rd["ttft_after_restart_speedup"] for rd in rounds]),
        "cached_tokens_after_restart": {s: median(s, "cached_tokens_after", 1) for s in SERVERS},
        "recompute_s_per_1k_tokens": median("stock", "ttft_s_per_1k_prompt_tokens", 4),
        "restore_s_per_1k_tokens": median("radix", "restore_s_per_1k_tokens", 4),
        "restore_speedup_per_1k_tokens": _median(
            [rd["restore_speedup_per_1k_tokens"] for rd in rounds]
        ),
        "disk_hits_after_restart": [rd["radix"]["disk_hits"] for rd in rounds],
        "exit_codes": {s: [rd[s]["exit_code"] for rd in rounds] for s in SERVERS},
    }


def compare_turns(runs: dict[str, list[Run]]) -> dict:
    """Per turn of a workload whose replies are keyed (client, turn): each server's share
    of prompt tokens served from its cache and median TTFT, and the least share of any turn
    after the first (the acceptance figure of an agent session)."""
    turns = sorted({key[1] for run in runs["radix"] for key in run.replies})
    by_turn = []
    for t in turns:
        row: dict = {"turn": t + 1}
        for server in SERVERS:
            replies = [r for run in runs[server] for k, r in run.replies.items() if k[1] == t]
            prompt = sum(r.usage["prompt_tokens"] for r in replies)
            row[f"{server}_prompt_tokens"] = prompt
            row[f"{server}_cached_share"] = _round(
                sum(_cached(r.usage) for r in replies) / prompt if prompt else None, 4
            )
            row[f"{server}_ttft_s"] = _median([r.ttft_s for r in replies])
        row["ttft_speedup"] = ratio(row["stock_ttft_s"], row["radix_ttft_s"])
        by_turn.append(row)
    later = by_turn[1:]
    return {
        "by_turn": by_turn,
        "cached_share_min_after_turn_1": {
            s: min((row[f"{s}_cached_share"] or 0 for row in later), default=None) for s in SERVERS
        },
        "ttft_speedup_median_by_turn": _median([row["ttft_speedup"] for row in by_turn]),
    }


def compare(workload: Workload, runs: dict[str, list[Run]]) -> dict:
    """Both servers' totals on ``workload``, their ratios, and whether outputs matched.

    ``runs[server][i]`` is the i-th repeat; repeats of the same index got the same requests.
    """
    out: dict = {"params": workload.params()}
    for server in SERVERS:
        out[server] = summarize(runs[server])
    out["ratios"] = {k: ratio(out["radix"][k], out["stock"][k]) for k in RATIO_KEYS}
    mismatched = sum(
        s.replies[key].text != r.replies[key].text
        for s, r in zip(runs["stock"], runs["radix"])
        for key in s.replies
    )
    if workload.restarts:
        # The request before the restart is compared too.
        mismatched += sum(
            s.before.text != r.before.text
            for s, r in zip(runs["stock"], runs["radix"])
            if s.before is not None and r.before is not None
        )
        out.update(compare_restart(runs))
    out["greedy_outputs_match"] = mismatched == 0
    out["mismatched_requests"] = mismatched
    if (workload.repeats > 1 or workload.decode_rate) and not workload.restarts:
        rounds = []
        for s, r in zip(runs["stock"], runs["radix"]):
            one = {"stock": summarize([s]), "radix": summarize([r])}
            rd = {f"{k}_tokens_per_s": one[k]["tokens_per_s"] for k in SERVERS}
            rd["tokens_per_s_ratio"] = ratio(rd["radix_tokens_per_s"], rd["stock_tokens_per_s"])
            rd.update({f"{k}_ttft_mean_s": one[k]["ttft_mean_s"] for k in SERVERS})
            rd["ttft_mean_speedup"] = ratio(rd["stock_ttft_mean_s"], rd["radix_ttft_mean_s"])
            if workload.decode_rate:
                rd["stock_decode_tokens_per_s"] = decode_tokens_per_s(s)
                rd["radix_decode_tokens_per_s"] = decode_tokens_per_s(r)
                rd["decode_tokens_per_s_ratio"] = ratio(
                    rd["radix_decode_tokens_per_s"], rd["stock_decode_tokens_per_s"]
                )
            rounds.append(rd)
        out["by_round"] = rounds
        out["tokens_per_s_ratio_median"] = _median([rd["tokens_per_s_ratio"] for rd in rounds])
        if workload.decode_rate:
            out["decode_tokens_per_s_ratio_median"] = _median(
                [rd["decode_tokens_per_s_ratio"] for rd in rounds]
            )
    if workload.per_turn:
        out.update(compare_turns(runs))
    if workload.poll_pool:
        radix_runs = runs["radix"]
        per_token = radix_runs[-1].pool_bytes_per_token
        held = [r.kv_bytes_held_peak for r in radix_runs if r.kv_bytes_held_peak is not None]
        tokens = workload.one_copy_tokens
        one_copy = None if per_token is None or tokens is None else round(per_token * tokens)
        # One run's tokens stored once per request, as stock's per-request caches hold them.
        last = summarize(radix_runs[-1:])
        unshared = last["prompt_tokens"] + last["completion_tokens"]
        out["kv_bytes_per_token"] = per_token
        out["kv_bytes_held_peak"] = max(held) if held else None
        out["kv_bytes_one_copy"] = one_copy
        out["kv_held_over_one_copy"] = ratio(out["kv_bytes_held_peak"], one_copy)
        # While all live requests decode (no prompt batch holding copies for its prefill).
        decoding = [
            r.kv_bytes_held_decode_peak
            for r in radix_runs
            if r.kv_bytes_held_decode_peak is not None
        ]
        out["kv_bytes_held_decode_peak"] = max(decoding) if decoding else None
        out["kv_held_decode_over_one_copy"] = ratio(out["kv_bytes_held_decode_peak"], one_copy)
        out["kv_bytes_unshared"] = None if per_token is None else round(per_token * unshared)
        out["decode_paths"] = list(
            dict.fromkeys(p for r in radix_runs for p in r.decode_paths or [])
        )
    return out


def acceptance(workloads: dict[str, dict]) -> dict:
    """Issue 4's numbers: decode tokens/s ratio (median over alternating rounds), server CPU
    seconds per token (stock / radix: above 1, the plugin spends less), burst TTFT speedup
    (stock / radix mean) and prompt tokens each server computed for the burst. Shared-prefix
    decode's: its decode tokens/s ratio (median over rounds) and the K/V the plugin held
    over one copy of what the live requests need, there and in the memory workload."""
    out: dict = {}
    if "decode" in workloads:
        d = workloads["decode"]
        rounds = d.get("by_round") or [
            {
                "stock_tokens_per_s": d["stock"]["tokens_per_s"],
                "radix_tokens_per_s": d["radix"]["tokens_per_s"],
                "tokens_per_s_ratio": d["ratios"]["tokens_per_s"],
            }
        ]
        out.update(
            decode_batch=d["params"]["batch"],
            decode_tokens_per_s_ratio=_round(
                statistics.median(r["tokens_per_s_ratio"] for r in rounds)
            ),
            decode_ratios_by_round=[r["tokens_per_s_ratio"] for r in rounds],
            decode_tokens_per_s={
                s: _round(statistics.median(r[f"{s}_tokens_per_s"] for r in rounds), 2)
                for s in SERVERS
            },
            decode_cpu_s_per_token_ratio=ratio(
                d["stock"]["cpu_s_per_token"], d["radix"]["cpu_s_per_token"]
            ),
        )
    if "decode_shared" in workloads:
        d = workloads["decode_shared"]
        rounds = d["by_round"]
        out.update(
            decode_shared_requests=d["params"]["requests"],
            decode_shared_prefix_tokens=d["params"]["prefix_tokens"],
            decode_shared_tokens_per_s_ratio=d["decode_tokens_per_s_ratio_median"],
            decode_shared_ratios_by_round=[r["decode_tokens_per_s_ratio"] for r in rounds],
            decode_shared_tokens_per_s={
                s: _median([r[f"{s}_decode_tokens_per_s"] for r in rounds], 2) for s in SERVERS
            },
            decode_shared_kv_held_over_one_copy=d["kv_held_over_one_copy"],
            decode_shared_kv_held_decode_over_one_copy=d["kv_held_decode_over_one_copy"],
            decode_shared_paths=d["decode_paths"],
        )
    if "restart" in workloads:
        r = workloads["restart"]
        out.update(
            restart_prefix_tokens=r["params"]["prefix_tokens"],
            restart_ttft_after_s=r["ttft_after_restart_s"],
            restart_ttft_after_speedup=r["ttft_after_restart_speedup"],
            restart_cached_tokens_after=r["cached_tokens_after_restart"],
            restart_recompute_s_per_1k_tokens=r["recompute_s_per_1k_tokens"],
            restart_restore_s_per_1k_tokens=r["restore_s_per_1k_tokens"],
            restart_restore_speedup_per_1k_tokens=r["restore_speedup_per_1k_tokens"],
        )
    if "agent" in workloads:
        a = workloads["agent"]
        out.update(
            agent_turns=a["params"]["turns"],
            agent_cached_share_min_after_turn_1=a["cached_share_min_after_turn_1"],
            agent_ttft_speedup_median_by_turn=a["ttft_speedup_median_by_turn"],
        )
    if "memory" in workloads:
        m = workloads["memory"]
        out["memory_kv_held_over_one_copy"] = m["kv_held_over_one_copy"]
        out["memory_kv_held_decode_over_one_copy"] = m["kv_held_decode_over_one_copy"]
    if "burst" in workloads:
        b = workloads["burst"]
        computed = {}
        for s in SERVERS:
            # The plugin's own counters where the server has them, else usage.
            stats = b[s]["stats_prompt_tokens_computed"]
            total = stats if stats is not None else b[s]["prompt_tokens_computed"]
            computed[s] = round(total / max(1, b[s]["runs"]))  # a burst's, rounds alike
        speedup = ratio(b["stock"]["ttft_mean_s"], b["radix"]["ttft_mean_s"])
        rounds = b.get("by_round") or []
        if len(rounds) > 1:
            # The first burst of a run also pays first-use costs: reported apart, the
            # speedup is the median of the later rounds'.
            out["burst_first_ttft_mean_speedup"] = rounds[0]["ttft_mean_speedup"]
            out["burst_ttft_mean_speedups_by_round"] = [r["ttft_mean_speedup"] for r in rounds]
            speedup = _median([r["ttft_mean_speedup"] for r in rounds[1:]])
        out.update(
            burst_requests=b["params"]["requests"],
            burst_prefix_tokens=b["params"]["prefix_tokens"],
            burst_ttft_mean_speedup=speedup,
            burst_prompt_tokens_computed={
                **computed,
                "shared_prefix": b["params"]["prefix_tokens"],
            },
        )
    return out


def build_report(meta: dict, workloads: dict[str, dict], startup_rss: dict[str, int | None]):
    """The whole report: ``meta`` (model, preset, machine ...), each workload's comparison,
    issue 4's numbers, each server's peak memory over the run, and overall output match."""
    peaks = {}
    for s in SERVERS:
        values = [startup_rss.get(s)] + [w[s]["peak_rss_bytes"] for w in workloads.values()]
        values = [v for v in values if v is not None]
        peaks[s] = max(values) if values else None
    return {
        **meta,
        "workloads": workloads,
        "acceptance": acceptance(workloads),
        "peak_rss_bytes": peaks,
        "greedy_outputs_match": all(w["greedy_outputs_match"] for w in workloads.values()),
    }


# -- terminal -----------------------------------------------------------------------

COLUMNS = (
    # header, summary key, format
    ("wall s", "wall_s", "{:.2f}"),
    ("TTFT p50", "ttft_p50_s", "{:.3f}"),
    ("TTFT p95", "ttft_p95_s", "{:.3f}"),
    ("computed", "prompt_tokens_computed", "{:d}"),
    ("cached", "cached_tokens", "{:d}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("peak MiB", "peak_rss_bytes", "mib"),
)


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "mib":
        return f"{value / 2**20:.0f}"
    return fmt.format(value)


def table(report: dict) -> str:
    """Per workload: a row for each server and one of radix/stock ratios; then issue 4's
    numbers and the memory workload's KV bytes."""
    m = report["machine"]
    title = (
        f"mlx-radix bench, preset {report['preset']}, seed {report['seed']}: {report['model']}"
        f" ({m['cpus']} CPUs, {m['blas'] or 'BLAS unknown'}, {report['duration_s']} s)"
    )
    head = ["workload", "server"] + [c[0] for c in COLUMNS] + ["outputs"]
    rows = [head]
    for name, w in report["workloads"].items():
        for s in SERVERS:
            cells = [_cell(w[s][key], fmt) for _, key, fmt in COLUMNS]
            rows.append([name if s == "stock" else "", s, *cells, ""])
        ratios = [
            "-" if w["ratios"][k] is None else f"{w['ratios'][k]:.2f}x" for _, k, _ in COLUMNS
        ]
        match = "same" if w["greedy_outputs_match"] else f"{w['mismatched_requests']} differ"
        rows.append(["", "radix/stock", *ratios, match])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [title, ""]
    for i, r in enumerate(rows):
        cells = [c.ljust(widths[j]) if j < 2 else c.rjust(widths[j]) for j, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    lines += _notes(report)
    return "\n".join(lines)


def _notes(report: dict) -> list[str]:
    out = [""]
    a = report["acceptance"]
    if "decode_tokens_per_s_ratio" in a:
        rounds = " ".join(f"{r:.2f}" for r in a["decode_ratios_by_round"])
        cpu = a["decode_cpu_s_per_token_ratio"]
        out.append(
            f"decode, {a['decode_batch']} concurrent: tokens/s radix/stock median "
            f"{a['decode_tokens_per_s_ratio']:.2f}x (rounds: {rounds}); "
            f"CPU s/token stock/radix {'-' if cpu is None else f'{cpu:.3f}'}"
        )
    d = report["workloads"].get("decode_shared")
    if d:
        p = d["params"]
        out.append(
            f"decode_shared, {p['requests']} concurrent on one cached {p['prefix_tokens']}-token "
            f"prefix: decode tokens/s radix/stock median "
            f"{_times(d['decode_tokens_per_s_ratio_median'])} (rounds: "
            + " ".join(_times(r["decode_tokens_per_s_ratio"]) for r in d["by_round"])
            + f"); {_held(d)}; decode path: {', '.join(d['decode_paths']) or '-'}"
        )
    if "burst_ttft_mean_speedup" in a:
        c = a["burst_prompt_tokens_computed"]
        speedup = a["burst_ttft_mean_speedup"]
        rounds = a.get("burst_ttft_mean_speedups_by_round")
        later = (
            f" (median of rounds after the first; rounds: {' '.join(map(_times, rounds))})"
            if rounds
            else ""
        )
        out.append(
            f"burst, {a['burst_requests']} on a new {a['burst_prefix_tokens']}-token prefix: "
            f"TTFT mean speedup {'-' if speedup is None else f'{speedup:.2f}x'}{later}; "
            f"prompt tokens computed stock {c['stock']}, radix {c['radix']}"
        )
    m = report["workloads"].get("memory")
    if m and m["kv_bytes_held_peak"] is not None:
        p = m["params"]
        out.append(
            f"memory, {p['requests']} live on a {p['prefix_tokens']}-token prefix: {_held(m)}; "
            f"the same tokens stored per request: {m['kv_bytes_unshared'] / 2**20:.2f} MiB"
        )
    c = report["workloads"].get("conversations")
    if c:
        p, st, rx = c["params"], c["stock"], c["radix"]

        def both(key: str, fmt: str) -> str:
            return " / ".join("-" if x[key] is None else format(x[key], fmt) for x in (st, rx))

        out.append(
            f"conversations, {p['sessions']} sessions x {p['turns']} turns, stock / radix: "
            f"wall {both('wall_s', '.1f')} s, TTFT mean {both('ttft_mean_s', '.3f')} s, "
            f"p50 {both('ttft_p50_s', '.3f')} s, p95 {both('ttft_p95_s', '.3f')} s, decode "
            f"{both('decode_s_per_token', '.4f')} s a token, cached {both('cached_share', '.1%')}"
        )
    r = report["workloads"].get("restart")
    if r:
        out += _restart_notes(r)
    peaks = report["peak_rss_bytes"]
    if all(peaks[s] is not None for s in SERVERS):
        out.append(
            f"peak memory ({report['peak_rss_method']}): stock {peaks['stock'] / 2**20:.0f} MiB, "
            f"radix {peaks['radix'] / 2**20:.0f} MiB"
        )
    out.append(f"greedy outputs identical: {'yes' if report['greedy_outputs_match'] else 'NO'}")
    return out


def _restart_notes(w: dict) -> list[str]:
    """The restart workload's rows: medians over its rounds, each server and stock/radix."""
    p, rounds = w["params"], w["by_round"]

    def cell(value, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    codes = w["exit_codes"]
    rows = [
        ("", "stock", "radix", "stock/radix"),
        (
            "TTFT after restart, s",
            cell(w["ttft_after_restart_s"]["stock"], "{:.3f}"),
            cell(w["ttft_after_restart_s"]["radix"], "{:.3f}"),
            _times(w["ttft_after_restart_speedup"]),
        ),
        (
            "s per 1,000 tokens: prefill / disk restore",
            cell(w["recompute_s_per_1k_tokens"], "{:.4f}"),
            cell(w["restore_s_per_1k_tokens"], "{:.4f}"),
            _times(w["restore_speedup_per_1k_tokens"]),
        ),
        (
            "cached tokens after restart",
            cell(w["cached_tokens_after_restart"]["stock"], "{:g}"),
            cell(w["cached_tokens_after_restart"]["radix"], "{:g}"),
            "",
        ),
        (
            "exit status on SIGTERM",
            " ".join(cell(c, "{}") for c in codes["stock"]),
            " ".join(cell(c, "{}") for c in codes["radix"]),
            "",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"restart, a new {p['prefix_tokens']}-token prefix, the server stopped (SIGTERM) and "
        f"started again, the plugin's disk tier on; medians of {len(rounds)} "
        f"round{'s' if len(rounds) != 1 else ''} (TTFT after restart, stock/radix by round: "
        + " ".join(_times(rd["ttft_after_restart_speedup"]) for rd in rounds)
        + "):"
    ]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(widths[i + 1]) for i, c in enumerate(r[1:])]
        lines.append(("  " + "  ".join(cells)).rstrip())
    return lines


def _times(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _held(w: dict) -> str:
    """The K/V the radix server held at peak (pool pages and batch buffers), and that over
    one copy of what the live requests need."""
    if w["kv_bytes_held_peak"] is None:
        return "K/V held: -"
    # Reports saved before kv_held_over_one_copy existed render without it.
    over = w.get("kv_held_over_one_copy")
    copies = "" if over is None else f", {over:.2f}x one copy"
    decoding = w.get("kv_held_decode_over_one_copy")
    during = "" if decoding is None else f" ({decoding:.2f}x while only decoding)"
    return f"radix held {w['kv_bytes_held_peak'] / 2**20:.2f} MiB of K/V at peak{copies}{during}"


# -- files --------------------------------------------------------------------------


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_charts(report: dict, stem: Path) -> list[Path]:
    """``STEM-workloads.png`` (each server's wall time, TTFT p50, prompt tokens computed and
    peak memory per workload) and ``STEM-ratios.png`` (radix/stock per workload).
    Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    names = list(report["workloads"])
    x = range(len(names))
    panels = [
        ("wall time (s)", "wall_s", 1),
        ("TTFT p50 (s)", "ttft_p50_s", 1),
        ("prompt tokens computed", "prompt_tokens_computed", 1),
        ("peak memory (MiB)", "peak_rss_bytes", 2**20),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, key, scale) in zip(axes.flat, panels):
        for i, s in enumerate(SERVERS):
            values = [(report["workloads"][n][s][key] or 0) / scale for n in names]
            ax.bar([j + (i - 0.5) * 0.4 for j in x], values, width=0.4, label=s)
        ax.set_title(title)
        ax.set_xticks(list(x), names, rotation=20)
        ax.legend()
    fig.suptitle(f"mlx-radix bench: {report['model']} ({report['preset']})")
    fig.tight_layout()
    workloads_png = stem.with_name(stem.name + "-workloads.png")
    fig.savefig(workloads_png, dpi=100)
    plt.close(fig)

    series = [
        ("wall time", "wall_s"),
        ("TTFT p50", "ttft_p50_s"),
        ("prompt tokens computed", "prompt_tokens_computed"),
        ("tokens/s", "tokens_per_s"),
    ]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        # A missing ratio (nothing to divide by) leaves a gap: log scale has no 0.
        values = [report["workloads"][n]["ratios"][key] or math.nan for n in names]
        ax.bar([j + (i - len(series) / 2 + 0.5) * width for j in x], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_title("radix / stock (below 1x: less time or compute; above 1x: more tokens/s)")
    ax.legend()
    fig.tight_layout()
    ratios_png = stem.with_name(stem.name + "-ratios.png")
    fig.savefig(ratios_png, dpi=100)
    plt.close(fig)
    return [workloads_png, ratios_png]
