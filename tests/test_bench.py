"""The benchmark harness and its random models (function, not speed: no timing asserted)."""

import json

import pytest
from mlx_lm import load

from mlx_radix_plugin import bench
from mlx_radix_plugin.random_model import SHAPES, build, words

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=600,
)


def test_random_model_tokenizer_is_one_word_per_token(tmp_path):
    path = build("smollm2-135m", tmp_path / "m", **SMALL)
    model, tok = load(str(path))
    ids = list(range(2, 40)) + [100, 101, 599]
    assert tok.encode(words(ids)) == ids
    assert tok.decode([10, 11]) == "t10 t11"
    assert tok.eos_token_ids == {0}
    assert len(model.layers) == 2


def test_unknown_shape_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'gpt-9'; known: " + ", ".join(SHAPES)):
        build("gpt-9", tmp_path)


@pytest.mark.slow
def test_bench_runs_both_servers_and_reports_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build("smollm2-135m", tmp_path / "m", **SMALL)
    out = tmp_path / "report.json"
    argv = [
        "--model",
        str(model),
        "--batch",
        "3",
        "--prefix",
        "48",
        "--max-tokens",
        "4",
        "--rounds",
        "1",
        "--pool-tokens",
        "2048",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["greedy_outputs_match"] is True
    computed = report["burst_prompt_tokens_computed"]
    # The plugin computes the shared prefix once (stock's count depends on whether a
    # request finished before the next arrived, with a model this small).
    assert 48 + 3 * 16 <= computed["radix"] <= 48 + 3 * 16 + 3 * 16
    assert computed["stock"] <= 3 * (48 + 16)
    assert {r["server"] for r in report["results"]} == {"stock", "radix"}
    assert report["decode_tokens_per_s_ratio"] > 0 and report["burst_ttft_mean_speedup"] > 0
