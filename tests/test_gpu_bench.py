"""The GPU benchmark at a tiny shape on the CPU (function, not speed: no timing asserted)."""

import json

import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from mlx_radix_plugin.models.random_model import TINY, build
from mlx_radix_plugin.tools import gpu_bench
from mlx_radix_plugin.tools.bench.servers import Launched


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_bytes_counts_every_weight_read_and_the_kv(tmp_path, tied):
    path = build("smollm2-135m", tmp_path / "m", tie_word_embeddings=tied, **TINY)
    model, _ = load(str(path))
    params = dict(tree_flatten(model.parameters()))
    total = sum(p.nbytes for p in params.values())
    embedding = params["model.embed_tokens.weight"].nbytes
    step = gpu_bench.decode_step_bytes(path, context=100)
    # An untied embedding is looked up one row per step, not read whole.
    assert step["weights"] == (total if tied else total - embedding)
    # K and V, 2 layers x 2 KV heads x head dim 16, float32, 100 tokens.
    assert step["kv"] == 2 * 2 * 2 * 16 * 4 * 100


def test_a_rank_reads_its_share_of_the_projections_and_kv_and_all_the_rest(tmp_path):
    path = build("smollm2-135m", tmp_path / "m", **TINY)
    whole = gpu_bench.decode_step_bytes(path, context=100)
    rank = gpu_bench.decode_step_bytes(path, context=100, ranks=2)
    # Per layer, float32: q and o 64 x 64, k and v 32 x 64, gate, up and down 128 x 64; two
    # layers. Each rank reads half of them; embedding and norms whole.
    projections = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) * 4
    assert rank["weights"] == whole["weights"] - projections // 2
    # One of the two KV heads on each rank.
    assert rank["kv"] == whole["kv"] // 2 == 2 * 2 * 1 * 16 * 4 * 100


def test_kv_heads_that_ranks_cannot_split_are_named(capsys):
    assert gpu_bench.parse_args(["--shape", "tiny", "--ranks", "2"]).ranks == 2
    with pytest.raises(SystemExit) as e:
        gpu_bench.parse_args(["--shape", "tiny", "--shape", "smollm2-135m", "--ranks", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--ranks 2: shape smollm2-135m has 3 KV heads" in err


def test_launch_command_gives_every_rank_the_server_environment_and_own_ports():
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/c", "PYTHONPATH": "/a:/b", "HOME": "/h"}
    env.update(MLX_RADIX_POOL_TOKENS="0", NCCL_NVLS_ENABLE="0")
    server = ["python", "-m", "mlx_lm", "server", "--model", "/m", "--port", "9000"]
    cmd = gpu_bench.mlx_launch(server, env, ranks=2, backend="nccl", port=9001)
    assert cmd[0].endswith("mlx.launch") and cmd[-len(server) :] == server
    options = " ".join(cmd[1 : -len(server)])
    assert "--hosts 127.0.0.1 -n 2 --backend nccl" in options
    # Two servers side by side must not meet on mlx.launch's fixed default NCCL port.
    assert "--starting-port 9001 --nccl-port 9001" in options
    carried = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--env"]
    assert carried == [
        "HF_HUB_OFFLINE=1",
        "HF_HUB_CACHE=/c",
        "PYTHONPATH=/a:/b",
        "MLX_RADIX_POOL_TOKENS=0",
        "NCCL_NVLS_ENABLE=0",
    ]


def test_bad_decode_shared_grid_is_named(capsys):
    assert gpu_bench.parse_args(["--decode-shared", ""]).decode_shared == []
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--decode-shared", "32x"])
    assert "'32x': expected ROWSxPREFIX" in capsys.readouterr().err


def test_bad_concurrency_is_named(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_bench.parse_args(["--concurrency", "1,0"])
    assert e.value.code == 2
    assert "'1,0': expected positive integers separated by commas" in capsys.readouterr().err


def test_copy_bandwidth_counts_bytes_read_and_written_over_the_timed_copies(monkeypatch):
    clock = iter([10.0, 10.5])  # the loop's start and end
    monkeypatch.setattr(gpu_bench.time, "perf_counter", lambda: next(clock))
    # 1 MiB read and 1 MiB written, twice, in half a second.
    assert gpu_bench.copy_bandwidth(1 << 20, iters=2) == 2 * (1 << 20) * 2 / 0.5


@pytest.mark.slow
def test_tiny_run_reports_every_workload(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "gpu.json"
    argv = [
        "--shape", "tiny", "--dtype", "float32", "--concurrency", "1,2",
        "--max-tokens", "6", "--rounds", "1", "--cached-prefix", "64", "--cached-requests", "2",
        "--question", "16", "--burst", "3", "--burst-prefix", "48", "--burst-rounds", "2",
        "--bandwidth-mib", "8", "--pool-tokens", "4096", "--json", str(out),
        "--decode-shared", "3x64", "--shared-max-tokens", "6", "--shared-prefix", "on",
        "--agent-clients", "2", "--agent-rounds", "3", "--agent-requests", "2",
        "--agent-prefix", "64", "--agent-turn", "16", "--agent-max-tokens", "4", "--front", "on",
        "--long-prompts", "256,512", "--conversations", "3", "--conversation-turns", "3",
        "--conversation-system", "8", "--conversation-opening", "48", "--conversation-turn", "8",
        "--conversation-max-tokens", "4", "--conversation-arrival", "0.05",
        "--conversation-think", "0",
    ]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    report = json.loads(out.read_text())
    (shape,) = report["shapes"]
    assert shape["shape"] == "tiny" and "error" not in shape
    assert report["radix_settings"] == {
        "decode.shared_prefix": "on",
        "prefill.shared_prefix": "auto",
        "model.fuse_projections": "auto",
        "decode.compile": "auto",
        "server.front": "on",  # every workload through the HTTP front, as on a GPU
        "radix.hold_to_plan": True,
    }

    # The figures are what the rounds measured: medians, and ratios of those medians.
    assert set(shape["decode"]) == {"1", "2"}
    for b, d in shape["decode"].items():
        assert d["requests"] == int(b)
        for name in ("stock", "radix"):
            rounds = d[name]["tokens_per_s_by_round"]
            assert len(rounds) == 1 and d[name]["tokens_per_s"] == pytest.approx(rounds[0], 0.01)
        assert d["ratio"] == round(d["radix"]["tokens_per_s"] / d["stock"]["tokens_per_s"], 3)
    # One request alone decodes the same tokens on both servers.
    assert shape["decode"]["1"]["greedy_match"] == 1

    shared = shape["decode_shared"]["3x64"]
    assert shared["requests"] == 3 and shared["greedy_match"] == 3
    for name in ("stock", "radix"):
        (rate,) = shared[name]["by_round"]
        assert shared[name]["decode_tokens_per_s"] == rate
    ratio = shared["radix"]["decode_tokens_per_s"] / shared["stock"]["decode_tokens_per_s"]
    assert shared["ratio"] == pytest.approx(ratio, rel=0.01)
    assert shared["radix"]["shared_steps"] >= 5  # 6 tokens: the first comes from the prefill
    # What the 50 ms poll saw of a round this short depends on timing: only what it may say.
    assert set(shared["radix"]["decode_paths"]) <= {"shared"}
    assert shared["radix"]["decode_groups_max"] in (0, 1)

    cached = shape["cached_prefix"]
    assert cached["radix"]["cached_tokens_mean"] >= 64

    burst = shape["burst"]
    assert burst["stock"]["prompt_tokens"] == burst["radix"]["prompt_tokens"] == 3 * (48 + 16)
    # The plugin computes the new prefix once; the questions each time.
    assert 48 + 3 * 16 <= burst["radix"]["prompt_tokens_computed"] < 3 * (48 + 16)
    # The followers' passes read the pool (on the CPU, each row its own: auto groups on a GPU).
    passes = burst["radix"]["prefill_passes"]
    assert passes["per_row"] > 0 and passes["grouped"] >= 0
    for name in ("stock", "radix"):
        first, later = burst[name]["ttft_mean_s_by_round"]  # each round on a new prefix
        assert burst[name]["first_ttft_mean_s"] == first and burst[name]["ttft_mean_s"] == later

    # The agent sessions: every request's history holds the replies and tool results before
    # it, so the plugin reads them from the cache, and both servers reply alike.
    agent = shape["agent"]
    assert (agent["clients"], agent["rounds"], agent["requests_per_turn"]) == (2, 3, 2)
    assert agent["greedy_match"] == 2 * 3 * 2
    for name in ("stock", "radix"):
        assert agent[name]["prompt_tokens"] > 2 * 3 * 2 * 64
    assert agent["radix"]["prompt_tokens_computed"] < agent["radix"]["prompt_tokens"] / 2
    for name in ("stock", "radix"):  # each alone, every request served
        assert agent[name]["requests_served"] == 12 and "server_failed" not in agent[name]
    assert [t["turn"] for t in agent["by_turn"]] == [1, 2, 3]
    for name in ("stock", "radix"):  # each server's own, there where the other fails
        by_turn = agent[name]["ttft_p50_by_turn_s"]
        assert by_turn == pytest.approx([t[f"{name}_ttft_s"] for t in agent["by_turn"]], abs=1e-3)
        assert min(by_turn[1:]) <= agent[name]["ttft_p50_later_turns_s"] <= max(by_turn[1:])
    assert agent["radix"]["mlx_idle_bytes"] > 0
    assert agent["cached_share_min_after_turn_1"]["radix"] > 0.5
    assert agent["radix"]["buffer_bytes_peak"] >= 0 and agent["radix"]["mlx_peak_bytes"] > 0
    # Working memory against the plan, measured by the server (memory/working_set.py).
    radix = agent["radix"]
    assert 0 < radix["working_peak_prefill_bytes"] <= radix["memory_plan"]["working_bytes"]
    assert radix["mlx_memory_limit_bytes"] >= radix["memory_plan"]["working_bytes"]
    assert sum(radix["prefill_passes"].values()) > 0
    # The generation thread's time in the steps that decoded, by part, prompt passes in batch.
    steps = radix["step_ms"]
    assert steps["steps"] > 0 and steps["batch"] > 0
    assert steps["step"] == pytest.approx(sum(steps[k] for k in gpu_bench.STEP_PARTS))
    plan = agent["radix"]["memory_plan"]
    assert plan["model_bytes"] > 0 and agent["radix"]["pool_bytes_total"] <= plan["pool_max_bytes"]
    assert agent["wall_speedup"] == round(agent["stock"]["wall_s"] / agent["radix"]["wall_s"], 3)

    # Conversations, each server alone: every later turn's history comes from the cache, and
    # each server's streamed replies have a pace.
    chats = shape["conversations"]
    assert chats["params"]["sessions"] == 3 and chats["greedy_match"] == 9
    for name in ("stock", "radix"):
        assert chats[name]["requests_served"] == 9 and chats[name]["decode_s_per_token"] > 0
    assert [t["turn"] for t in chats["by_turn"]] == [1, 2, 3]
    assert chats["cached_share_min_after_turn_1"]["radix"] > 0.5
    paces = [chats[n]["decode_s_per_token"] for n in ("stock", "radix")]
    assert chats["decode_pace_speedup"] == round(paces[0] / paces[1], 3)

    # Long prompts, each server alone.
    long = shape["long"]
    assert set(long["prompts"]) == {"256", "512"} and long["matmul_tflop_s"] >= 0
    for tokens, point in long["prompts"].items():
        assert point["flop_time_s"] > 0
        for name in ("stock", "radix"):
            assert point[name]["prompt_tokens"] == int(tokens) and point[name]["ttft_s"] > 0
        assert 0 < point["radix"]["working_peak_prefill_bytes"]
        assert point["radix"]["working_peak_prefill_bytes"] <= radix["memory_plan"]["working_bytes"]

    # The floor: the step's bytes over the measured copy bandwidth.
    floor = shape["floor"]
    bandwidth = report["copy_bandwidth_gb_s"] * 1e9
    floor_ms = 1000 * (floor["weight_bytes"] + floor["kv_bytes"]) / bandwidth
    assert floor["floor_ms_per_token"] == pytest.approx(floor_ms, rel=0.02)
    for name in ("stock", "radix"):
        over = shape["decode"]["1"][name]["ms_per_token"] / floor_ms
        assert floor[f"{name}_over_floor"] == pytest.approx(over, rel=0.03)

    table = capsys.readouterr().out
    assert "| tiny | decode, 2 concurrent: tokens/s (ms/token) |" in table
    assert "| tiny | burst of 3 on a new 48-token prefix: prompt tokens computed |" in table
    assert "| tiny | decode, 3 requests on a cached 64-token prefix, 6 out: tokens/s |" in table
    agents = "| tiny | agents, 2 x 3 turns of 2 requests (+16 a tool result) on a 64-token prompt"
    assert f"{agents}: wall |" in table and f"{agents}: least cached share" in table
    assert "on a 64-token prompt: memory against the plan |  | MLX peak " in table
    chats = "| tiny | 3 chats x 3 turns (48-token openings, +8 a turn, 0.05 s apart)"
    assert f"{chats}: time a token while a reply streams |" in table
    assert "| tiny | burst of 3 on a new 48-token prefix: the plugin's prompt passes |  | " in table


def test_a_prompts_flops_are_its_linear_work_and_causal_attention():
    config = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128,
    )  # fmt: skip
    flops = gpu_bench.prefill_flops(config, 10)
    # q and o 64 x 64, k and v 64 x 32, the MLP 3 x 64 x 128: a layer's weights, 2 per token.
    assert flops["linear"] == 2 * 10 * 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    # Scores and their product with the values: 55 query-key pairs, 4 heads of 16.
    assert flops["attention"] == 2 * 2 * 2 * 4 * 16 * 55


def test_a_failed_request_is_a_result_not_a_crash():
    """A request with no token (a server that ran out of memory) is reported with its
    error; only ``strict`` raises."""

    class Refusing:
        def stream(self, path, body, on_first=None):
            if body["prompt"] == "bad":
                return [{"error": "out of memory"}]
            on_first()
            return [{"choices": [{"text": "x"}]}, {"usage": {"prompt_tokens": 1}}]

    _, results = gpu_bench.stream_all(Refusing(), ["good", "bad"], 2, strict=False)
    assert "usage" in results[0] and results[1]["error"] == "out of memory"
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_bench.stream_all(Refusing(), ["good", "bad"], 2)


@pytest.mark.slow
def test_decode_shared_alone_runs_only_that_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "gpu.json"
    argv = [
        "--shape", "tiny", "--dtype", "float32", "--workload", "decode-shared",
        "--rounds", "2", "--question", "8", "--bandwidth-mib", "8", "--pool-tokens", "4096",
        "--decode-shared", "2x48", "--shared-max-tokens", "4", "--json", str(out),
    ]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    (shape,) = json.loads(out.read_text())["shapes"]
    assert set(shape) >= {"decode_shared"} and not {"decode", "burst", "floor"} & set(shape)
    point = shape["decode_shared"]["2x48"]
    assert point["requests"] == 4 and point["greedy_match"] == 4
    assert len(point["stock"]["by_round"]) == len(point["radix"]["by_round"]) == 2


def test_servers_leaves_stock_out_of_the_workloads_that_start_each_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "gpu.json"
    argv = [
        "--shape", "tiny", "--dtype", "float32", "--workload", "agent", "--servers", "radix",
        "--bandwidth-mib", "8", "--pool-tokens", "4096", "--agent-clients", "2",
        "--agent-rounds", "2", "--agent-requests", "1", "--agent-prefix", "64",
        "--agent-turn", "16", "--agent-max-tokens", "4", "--json", str(out),
    ]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    report = json.loads(out.read_text())
    (shape,) = report["shapes"]
    assert set(shape["agent"]) >= {"radix"} and "stock" not in shape["agent"]
    assert shape["agent"]["radix"]["requests_served"] == 4
    table = gpu_bench.markdown(report)
    assert "on a 64-token prompt: requests | not run | 4 served |" in table


def test_servers_must_name_stock_or_radix(capsys):
    assert gpu_bench.parse_args(["--servers", "radix,stock"]).servers == ("stock", "radix")
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--servers", "radix,vllm"])
    assert "'radix,vllm': a comma-separated subset of stock,radix" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_under_mlx_launch_serve_both_and_the_plugin_hits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logs: dict[str, list[str]] = {}

    class Recorded(Launched):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            logs.setdefault(self.log.stem, []).append(self.output())

    monkeypatch.setattr(gpu_bench, "Launched", Recorded)
    out = tmp_path / "gpu.json"
    argv = [
        "--shape", "tiny", "--dtype", "float32", "--ranks", "2", "--backend", "ring",
        "--concurrency", "1,2", "--max-tokens", "6", "--rounds", "1", "--cached-prefix", "64",
        "--cached-requests", "2", "--question", "16", "--burst", "3", "--burst-prefix", "48",
        "--burst-rounds", "1", "--bandwidth-mib", "8", "--pool-tokens", "4096",
        "--json", str(out), "--decode-shared", "2x48", "--shared-max-tokens", "4",
        "--workload", "decode", "--workload", "decode-shared", "--workload", "cached-prefix",
        "--workload", "burst",
    ]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["backend"] == "ring"
    (shape,) = report["shapes"]
    assert "error" not in shape

    # Each server ran under mlx.launch (side by side, then alone for the burst and for
    # decode-shared), and each rank of the plugin's built its own pool.
    assert len(logs["stock"]) == len(logs["radix"]) == 3
    assert all(log.count("radix KV pool: up to") == 2 for log in logs["radix"])

    for b, d in shape["decode"].items():
        assert d["requests"] == int(b)
        assert d["stock"]["tokens_per_s"] > 0 and d["radix"]["tokens_per_s"] > 0
    # Both tensor-parallel servers decode one request alike.
    assert shape["decode"]["1"]["greedy_match"] == 1
    shared = shape["decode_shared"]["2x48"]
    assert shared["stock"]["decode_tokens_per_s"] > 0 and shared["radix"]["decode_tokens_per_s"] > 0

    # Where requests share a prefix, the plugin's pool served it.
    assert shape["cached_prefix"]["radix"]["cached_tokens_mean"] >= 64
    burst = shape["burst"]
    assert burst["radix"]["prompt_tokens"] == 3 * (48 + 16)
    assert burst["radix"]["prompt_tokens_computed"] < 3 * (48 + 16)
    assert shape["radix_stats"]["hits"] > 0 and shape["radix_stats"]["fallback"] is None

    # The floor is a rank's: half the projections and K/V, so below the whole model's.
    floor = shape["floor"]
    assert floor["ranks"] == 2 and "in_process_over_floor" not in floor
    assert (
        floor["weight_bytes"]
        < gpu_bench.decode_step_bytes(gpu_bench.build("smollm2-135m", tmp_path / "m", **TINY), 38)[
            "weights"
        ]
    )

    table = capsys.readouterr().out
    assert "Tensor parallel: 2 ranks under mlx.launch, ring backend." in table
    assert "| tiny | decode, 1 request: ms/token over a rank's floor of" in table
