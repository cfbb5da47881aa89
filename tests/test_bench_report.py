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
    percentile,
    summarize,
    table,
    write_charts,
    write_json,
)
from mlx_radix_plugin.tools.bench.workloads import Burst, Decode, Memory, Reply, Run

META = {
    "schema": 1,
    "model": "tiny",
    "preset": "smoke",
    "seed": 0,
    "machine": {"cpus": 2, "blas": "OpenBLAS"},
    "duration_s": 12.5,
    "peak_rss_method": "VmHWM",
}


def reply(text="t5 t6", prompt=10, cached=0, completion=4, ttft=0.1):
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return Reply(text, usage, ttft)


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
    a = acceptance({"decode": w})
    assert a["decode_tokens_per_s_ratio"] == 1.0
    assert a["decode_ratios_by_round"] == [1.0, 2.0, 0.5]
    assert a["decode_tokens_per_s"] == {"stock": 20.0, "radix": 20.0}
    assert a["decode_cpu_s_per_token_ratio"] == 1.0 and a["decode_batch"] == 2


def test_burst_acceptance_prefers_the_plugins_counters():
    a = acceptance({"burst": compare(Burst(2, 100, 0, 4), burst_runs())})
    assert a["burst_prompt_tokens_computed"] == {"stock": 200, "radix": 120, "shared_prefix": 100}
    assert a["burst_ttft_mean_speedup"] == 3.0  # stock mean 1.5 s, radix 0.5 s
    assert (a["burst_requests"], a["burst_prefix_tokens"]) == (2, 100)


def test_memory_workload_reports_kv_bytes_held_and_unshared():
    runs = burst_runs()
    runs["radix"][0].kv_bytes_held_peak = 3000
    runs["radix"][0].pool_bytes_per_token = 10.0
    w = compare(Memory(2, 100, 0, 4), runs)
    assert w["kv_bytes_held_peak"] == 3000
    assert w["kv_bytes_unshared"] == 10 * (200 + 8)
    assert w["kv_bytes_per_token"] == 10.0


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
