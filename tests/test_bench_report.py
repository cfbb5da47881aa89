"""The benchmark's report from made-up runs: totals, ratios, issue 4's numbers, the table,
the JSON file and the charts. No servers."""

import json
import sys

import pytest

from mlx_radix_plugin.tools.bench.report import (
    RATIO_KEYS,
    acceptance,
    build_report,
    compare,
    decode_tokens_per_s,
    percentile,
    summarize,
    table,
    write_charts,
    write_json,
)
from mlx_radix_plugin.tools.bench.workloads import (
    Burst,
    Decode,
    DecodeShared,
    Memory,
    Reply,
    Restart,
    Run,
)

META = {
    "schema": 1,
    "model": "tiny",
    "preset": "smoke",
    "seed": 0,
    "machine": {"cpus": 2, "blas": "OpenBLAS"},
    "duration_s": 12.5,
    "peak_rss_method": "VmHWM",
}


def reply(text="t5 t6", prompt=10, cached=0, completion=4, ttft=0.1, first=None, done=None):
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return Reply(text, usage, ttft, first, done)


def run(server, workload, wall, replies, **kw):
    return Run(server, workload, wall, dict(enumerate(replies)), **kw)


def burst_runs(stock_texts=("a", "b"), radix_texts=("a", "b")):
    stock = run(
        "stock",
        "burst",
        2.0,
        [reply(t, prompt=100, ttft=1.0 + i) for i, t in enumerate(stock_texts)],
        cpu_s=4.0,
        peak_rss_bytes=200 * 2**20,
    )
    radix = run(
        "radix",
        "burst",
        1.0,
        [reply(t, prompt=100, cached=80 * i, ttft=0.5) for i, t in enumerate(radix_texts)],
        cpu_s=2.0,
        peak_rss_bytes=210 * 2**20,
        stats_prompt_tokens=200,
        stats_cached_tokens=80,
    )
    return {"stock": [stock], "radix": [radix]}


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 0.5) == 10.0
    assert percentile(values, 0.95) == 19.0
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([], 0.5) is None


def test_summary_totals_usage_and_measurements():
    runs = burst_runs()["radix"]
    s = summarize(runs)
    assert s["requests"] == 2 and s["runs"] == 1
    assert (s["prompt_tokens"], s["cached_tokens"], s["prompt_tokens_computed"]) == (200, 80, 120)
    assert s["stats_prompt_tokens_computed"] == 120 and s["stats_cached_tokens"] == 80
    assert s["completion_tokens"] == 8 and s["tokens_per_s"] == 8.0
    assert s["cpu_s_per_token"] == 0.25
    assert s["ttft_p50_s"] == 0.5 and s["ttft_p95_s"] == 0.5
    # Stock has no /v1/cache/stats: its stats fields are None, not 0.
    stock = summarize(burst_runs()["stock"])
    assert stock["stats_prompt_tokens_computed"] is None
    assert stock["ttft_p50_s"] == 1.0 and stock["ttft_p95_s"] == 2.0


def test_summary_without_cached_details_or_cpu_time():
    r = Reply("x", {"prompt_tokens": 7, "completion_tokens": 3}, None)
    s = summarize([Run("stock", "decode", 1.5, {0: r})])
    assert s["cached_tokens"] == 0 and s["prompt_tokens_computed"] == 7
    assert s["cpu_s"] is None and s["cpu_s_per_token"] is None
    assert s["ttft_p50_s"] is None and s["peak_rss_bytes"] is None


def test_compare_gives_radix_over_stock_ratios_and_matches_outputs_by_key():
    w = compare(Burst(2, 100, 0, 4), burst_runs())
    assert set(w["ratios"]) == set(RATIO_KEYS)
    assert w["ratios"]["wall_s"] == 0.5
    assert w["ratios"]["prompt_tokens_computed"] == 0.6
    assert w["ratios"]["cached_tokens"] is None  # stock cached nothing: no ratio
    assert w["greedy_outputs_match"] is True and w["mismatched_requests"] == 0
    assert w["params"] == {
        "requests": 2,
        "prefix_tokens": 100,
        "question_tokens": 0,
        "output_tokens": 4,
        "rounds": 1,
    }
    # The same texts finished in another order still match: replies are compared by key.
    runs = burst_runs()
    runs["radix"][0].replies = dict(reversed(list(runs["radix"][0].replies.items())))
    assert compare(Burst(2, 100, 0, 4), runs)["greedy_outputs_match"] is True
    w = compare(Burst(2, 100, 0, 4), burst_runs(radix_texts=("a", "c")))
    assert w["greedy_outputs_match"] is False and w["mismatched_requests"] == 1


def decode_runs(stock_walls, radix_walls):
    def runs(server, walls):
        return [
            run(server, "decode", wall, [reply(completion=10)] * 2, cpu_s=1.0) for wall in walls
        ]

    return {"stock": runs("stock", stock_walls), "radix": runs("radix", radix_walls)}


def test_repeated_workload_reports_each_round_and_the_median_ratio():
    w = compare(Decode(2, 8, 10, rounds=3), decode_runs([1.0, 2.0, 1.0], [1.0, 1.0, 2.0]))
    assert [r["tokens_per_s_ratio"] for r in w["by_round"]] == [1.0, 2.0, 0.5]
    assert w["tokens_per_s_ratio_median"] == 1.0
    assert "decode_tokens_per_s_ratio" not in w["by_round"][0]  # decode only: wall time
    a = acceptance({"decode": w})
    assert a["decode_tokens_per_s_ratio"] == 1.0
    assert a["decode_ratios_by_round"] == [1.0, 2.0, 0.5]
    assert a["decode_tokens_per_s"] == {"stock": 20.0, "radix": 20.0}
    assert a["decode_cpu_s_per_token_ratio"] == 1.0 and a["decode_batch"] == 2
    assert not any(k.startswith("decode_shared") for k in a)


def test_decode_rate_counts_tokens_after_the_first_between_first_and_last_token():
    replies = [
        reply(completion=11, first=10.0, done=12.0),
        reply(completion=21, first=10.5, done=14.0),
        reply(completion=0, first=None, done=11.0),  # no text: nothing decoded to count
    ]
    # (10 + 20) tokens from 10.0 s to 14.0 s; each reply's first token is the prefill's.
    assert decode_tokens_per_s(run("radix", "decode_shared", 9.0, replies)) == 7.5
    # Without reply times (made-up runs), or over no time: no rate.
    assert decode_tokens_per_s(run("radix", "decode", 1.0, [reply()])) is None
    same = [reply(completion=1, first=3.0, done=3.0)]
    assert decode_tokens_per_s(run("radix", "decode_shared", 1.0, same)) is None


def decode_shared_runs(stock_spans, radix_spans, held=(None, None)):
    """One run per span: 2 replies of 9 tokens from their first token at 1.0 s to 1.0 s +
    span; the wall time adds 2 s of prefill before, which the decode rate leaves out."""

    def runs(server, spans):
        return [
            run(
                server,
                "decode_shared",
                2.0 + span,
                [reply(completion=9, prompt=20, cached=16, first=1.0, done=1.0 + span)] * 2,
                cpu_s=1.0,
            )
            for span in spans
        ]

    out = {"stock": runs("stock", stock_spans), "radix": runs("radix", radix_spans)}
    for r, h, paths in zip(out["radix"], held, (["exact"], ["exact", "shared"])):
        r.kv_bytes_held_peak, r.pool_bytes_per_token, r.decode_paths = h, 10.0, paths
    return out


def test_decode_shared_reports_decode_rate_by_round_and_kv_held_over_one_copy():
    w = DecodeShared(2, 16, 4, 9, rounds=2)
    d = compare(w, decode_shared_runs([2.0, 2.0], [1.0, 4.0], held=(400, 900)))
    rounds = d["by_round"]
    assert [r["stock_decode_tokens_per_s"] for r in rounds] == [8.0, 8.0]
    assert [r["radix_decode_tokens_per_s"] for r in rounds] == [16.0, 4.0]
    assert [r["decode_tokens_per_s_ratio"] for r in rounds] == [2.0, 0.5]
    assert d["decode_tokens_per_s_ratio_median"] == 1.25
    # Wall-time tokens/s counts the prefill too: 18 tokens in 3 s against 4 s.
    assert rounds[0]["tokens_per_s_ratio"] == 1.333
    # One copy: the 16-token prefix once, each request's 4 + 9 tokens; 10 bytes a token.
    assert d["kv_bytes_one_copy"] == 10 * (16 + 2 * 13)
    assert d["kv_bytes_held_peak"] == 900  # the larger round's
    assert d["kv_held_over_one_copy"] == round(900 / 420, 3)
    assert d["kv_bytes_unshared"] == 10 * 2 * (20 + 9)  # one round's requests, not both
    assert d["decode_paths"] == ["exact", "shared"]
    a = acceptance({"decode_shared": d})
    assert (a["decode_shared_requests"], a["decode_shared_prefix_tokens"]) == (2, 16)
    assert a["decode_shared_tokens_per_s_ratio"] == 1.25
    assert a["decode_shared_ratios_by_round"] == [2.0, 0.5]
    assert a["decode_shared_tokens_per_s"] == {"stock": 8.0, "radix": 10.0}
    assert a["decode_shared_kv_held_over_one_copy"] == d["kv_held_over_one_copy"]
    assert a["decode_shared_paths"] == ["exact", "shared"]


def test_decode_shared_of_one_round_still_has_its_decode_rate():
    d = compare(DecodeShared(2, 16, 4, 9, rounds=1), decode_shared_runs([2.0], [1.0]))
    assert [r["decode_tokens_per_s_ratio"] for r in d["by_round"]] == [2.0]
    assert d["kv_bytes_held_peak"] is None and d["kv_held_over_one_copy"] is None


def test_a_burst_of_several_rounds_reports_its_first_apart():
    """A run's first burst also pays first-use costs: the speedup is the median of the
    later rounds', the first reported beside it; tokens computed are a burst's."""
    runs = {"stock": [], "radix": []}
    for radix_ttft in (1.5, 0.5, 0.25):  # stock's mean TTFT is 1.5 s in every round
        one = burst_runs()
        replies = [reply(t, prompt=100, cached=80 * i, ttft=radix_ttft) for i, t in enumerate("ab")]
        one["radix"][0] = run("radix", "burst", 1.0, replies, stats_prompt_tokens=200,
                              stats_cached_tokens=80)  # fmt: skip
        for k in runs:
            runs[k] += one[k]
    burst = compare(Burst(2, 100, 0, 4, rounds=3), runs)
    a = acceptance({"burst": burst})
    assert a["burst_ttft_mean_speedups_by_round"] == [1.0, 3.0, 6.0]
    assert a["burst_first_ttft_mean_speedup"] == 1.0
    assert a["burst_ttft_mean_speedup"] == 4.5
    assert a["burst_prompt_tokens_computed"] == {"stock": 200, "radix": 120, "shared_prefix": 100}
    text = table(full_report(burst=burst))
    assert "TTFT mean speedup 4.50x (median of rounds after the first; rounds: 1.00x" in text


def test_burst_acceptance_prefers_the_plugins_counters():
    a = acceptance({"burst": compare(Burst(2, 100, 0, 4), burst_runs())})
    assert a["burst_prompt_tokens_computed"] == {"stock": 200, "radix": 120, "shared_prefix": 100}
    assert a["burst_ttft_mean_speedup"] == 3.0  # stock mean 1.5 s, radix 0.5 s
    assert (a["burst_requests"], a["burst_prefix_tokens"]) == (2, 100)


def test_memory_workload_reports_kv_bytes_held_over_one_copy_and_unshared():
    runs = burst_runs()
    runs["radix"][0].kv_bytes_held_peak = 3000
    runs["radix"][0].pool_bytes_per_token = 10.0
    w = compare(Memory(2, 100, 0, 4), runs)
    assert w["kv_bytes_held_peak"] == 3000
    assert w["kv_bytes_one_copy"] == 10 * (100 + 2 * 4)
    assert w["kv_held_over_one_copy"] == 2.778
    assert w["kv_bytes_unshared"] == 10 * (200 + 8)
    assert w["kv_bytes_per_token"] == 10.0
    assert w["decode_paths"] == []  # the server reported none
    assert acceptance({"memory": w})["memory_kv_held_over_one_copy"] == 2.778


def restart_runs(stock_ttfts=(4.0, 6.0), radix_ttfts=(0.5, 1.0), radix_before=("b", "b")):
    """Rounds of a 2,000-token prompt after a restart: stock recomputes it, the plugin reads
    125 pages of 16 tokens back in 0.2 s, then 0.4 s."""
    out = {"stock": [], "radix": []}
    for i, (ts, tr) in enumerate(zip(stock_ttfts, radix_ttfts)):
        stock = run("stock", "restart", ts + 0.2, [reply("a", prompt=2000, ttft=ts)])
        stock.before = reply("b", prompt=2000, ttft=ts)
        stock.restarted = {"exit_code": -15, "stop_s": 0.01, "start_s": 2.0}
        radix = run("radix", "restart", tr + 0.2, [reply("a", prompt=2000, cached=2000, ttft=tr)])
        radix.before = reply(radix_before[i], prompt=2000, ttft=ts)
        radix.restarted = {
            "exit_code": 0,
            "stop_s": 0.3,
            "start_s": 2.5,
            "disk_pages_written_before_stop": 120,
            "disk_pages_at_start": 125 * (i + 1),
            "disk_hits": 1,
            "disk_pages_read": 125,
            "disk_restore_seconds": 0.2 * (i + 1),
            "page_size": 16,
        }
        for r in (stock, radix):
            r.replies = {Restart.AFTER: r.replies[0]}
        out["stock"].append(stock)
        out["radix"].append(radix)
    return out


def test_restart_reports_ttft_after_restart_and_restore_against_recompute():
    w = compare(Restart(2000, 16, 8, rounds=2), restart_runs())
    rounds = w["by_round"]
    assert [r["ttft_after_restart_speedup"] for r in rounds] == [8.0, 6.0]
    assert w["ttft_after_restart_speedup"] == 7.0
    assert w["ttft_after_restart_s"] == {"stock": 5.0, "radix": 0.75}
    # Stock's prefill: 4 s and 6 s over 2,000 tokens; the restore: 0.2 s and 0.4 s over
    # 125 x 16 = 2,000 tokens read back.
    assert [r["stock"]["ttft_s_per_1k_prompt_tokens"] for r in rounds] == [2.0, 3.0]
    assert [r["radix"]["restore_s_per_1k_tokens"] for r in rounds] == [0.1, 0.2]
    assert [r["radix"]["disk_tokens_read"] for r in rounds] == [2000, 2000]
    assert [r["restore_speedup_per_1k_tokens"] for r in rounds] == [20.0, 15.0]
    assert (w["recompute_s_per_1k_tokens"], w["restore_s_per_1k_tokens"]) == (2.5, 0.15)
    assert w["restore_speedup_per_1k_tokens"] == 17.5
    assert w["cached_tokens_after_restart"] == {"stock": 0, "radix": 2000}
    assert w["disk_hits_after_restart"] == [1, 1]
    assert w["exit_codes"] == {"stock": [-15, -15], "radix": [0, 0]}
    stock = rounds[0]["stock"]
    assert stock["restore_s_per_1k_tokens"] is None and stock["disk_hits"] is None
    assert stock["ttft_before_s"] == 4.0 and rounds[1]["radix"]["disk_pages_at_start"] == 250
    assert w["greedy_outputs_match"] is True and "tokens_per_s_ratio_median" not in w
    a = acceptance({"restart": w})
    assert a["restart_ttft_after_speedup"] == 7.0 and a["restart_prefix_tokens"] == 2000
    assert a["restart_restore_speedup_per_1k_tokens"] == 17.5
    assert a["restart_cached_tokens_after"] == {"stock": 0, "radix": 2000}
    # The request before the restart is compared too.
    w = compare(Restart(2000, 16, 8, rounds=2), restart_runs(radix_before=("b", "c")))
    assert w["greedy_outputs_match"] is False and w["mismatched_requests"] == 1


def test_table_notes_the_restart_rows():
    runs = restart_runs()
    text = table(full_report(restart=compare(Restart(2000, 16, 8, rounds=2), runs)))
    lines = text.splitlines()
    assert next(line for line in lines if line.startswith("restart")).split()[:2] == [
        "restart",
        "stock",
    ]
    assert "restart, a new 2000-token prefix, the server stopped (SIGTERM)" in text
    assert "(TTFT after restart, stock/radix by round: 8.00x 6.00x)" in text

    def row(title):
        line = next(line for line in lines if line.strip().startswith(title))
        return line.strip()[len(title) :].split()

    assert row("TTFT after restart, s") == ["5.000", "0.750", "7.00x"]
    assert row("s per 1,000 tokens: prefill / disk restore") == ["2.5000", "0.1500", "17.50x"]
    assert row("cached tokens after restart") == ["0", "2000"]
    assert row("exit status on SIGTERM") == ["-15", "-15", "0", "0"]


def full_report(**workloads):
    workloads = workloads or {
        "burst": compare(Burst(2, 100, 0, 4), burst_runs()),
        "decode": compare(Decode(2, 8, 10, rounds=2), decode_runs([1.0, 1.0], [0.5, 1.0])),
    }
    return build_report(META, workloads, {"stock": 300 * 2**20, "radix": 100 * 2**20})


def test_report_peaks_include_start_up_and_every_workload():
    report = full_report()
    assert report["peak_rss_bytes"] == {"stock": 300 * 2**20, "radix": 210 * 2**20}
    assert report["greedy_outputs_match"] is True
    assert report["acceptance"]["decode_ratios_by_round"] == [2.0, 1.0]


def test_table_has_a_row_per_server_and_a_ratio_row_per_workload():
    text = table(full_report(burst=compare(Burst(2, 100, 0, 4), burst_runs(radix_texts="ac"))))
    lines = text.splitlines()
    assert lines[0].startswith("mlx-radix bench, preset smoke, seed 0: tiny (2 CPUs, OpenBLAS")
    row = next(line.split() for line in lines if line.startswith("burst"))
    assert row == ["burst", "stock", "2.00", "1.000", "2.000", "200", "0", "4.0", "200"]
    ratios = next(line.split() for line in lines if "radix/stock" in line)
    assert ratios[:4] == ["radix/stock", "0.50x", "0.50x", "0.25x"]
    assert ratios[-3:] == ["1.05x", "1", "differ"]
    assert "burst, 2 on a new 100-token prefix: TTFT mean speedup 3.00x" in text
    assert "prompt tokens computed stock 200, radix 120" in text
    assert "peak memory (VmHWM): stock 300 MiB, radix 210 MiB" in text
    assert text.endswith("greedy outputs identical: NO")


def test_table_notes_decode_shared_and_the_kv_held():
    shared = decode_shared_runs([2.0, 2.0], [1.0, 4.0], held=(2**20, 3 * 2**20))
    for r in shared["radix"]:
        r.pool_bytes_per_token = 2.0**14
    memory = burst_runs()
    memory["radix"][0].kv_bytes_held_peak = 2**21
    memory["radix"][0].pool_bytes_per_token = 2.0**14
    text = table(
        full_report(
            decode_shared=compare(DecodeShared(2, 16, 4, 9, rounds=2), shared),
            memory=compare(Memory(2, 100, 0, 4), memory),
        )
    )
    assert (
        "decode_shared, 2 concurrent on one cached 16-token prefix: decode tokens/s "
        "radix/stock median 1.25x (rounds: 2.00x 0.50x); radix held 3.00 MiB of K/V at "
        "peak, 4.57x one copy; decode path: exact, shared"
    ) in text
    # 3 MiB against 16 + 2 x 13 tokens of 16 KiB; 2 MiB against 100 + 2 x 4.
    assert (
        "memory, 2 live on a 100-token prefix: radix held 2.00 MiB of K/V at peak, 1.19x one "
        "copy; the same tokens stored per request: 3.25 MiB"
    ) in text


def test_json_round_trip_renders_the_same_table(tmp_path):
    report = full_report()
    path = tmp_path / "out" / "report.json"
    write_json(report, path)
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(report))
    assert table(saved) == table(report)


def test_charts_need_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError):
        write_charts(full_report(), tmp_path / "r")


def test_charts_are_png_files(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_charts(full_report(), tmp_path / "r")
    assert [p.name for p in paths] == ["r-workloads.png", "r-ratios.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_token_decode_is_the_mean_pace_after_each_first_token_and_cached_share_a_share():
    replies = [
        reply(prompt=100, cached=75, completion=5, first=1.0, done=1.4),  # 0.1 s a token
        reply(prompt=100, cached=25, completion=3, first=2.0, done=2.6),  # 0.3 s a token
        reply(prompt=100, completion=1, first=3.0, done=3.0),  # one token: no pace
        reply(prompt=100, completion=4),  # no times: left out
    ]
    s = summarize([run("radix", "conversations", 5.0, replies)])
    assert s["decode_s_per_token"] == pytest.approx(0.2)
    assert s["cached_share"] == 0.25
    assert (
        summarize([run("stock", "conversations", 1.0, [reply(prompt=0)])])["cached_share"] is None
    )
