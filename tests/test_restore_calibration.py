"""The in-process restore calibration at a tiny shape (function, not speed: no timing asserted)."""

import json

import pytest

from mlx_radix_plugin.models.random_model import TINY, build
from mlx_radix_plugin.tools import restore_calibration


def test_a_tiny_model_restores_every_page_and_answers_alike(tmp_path):
    model = build("smollm2-135m", tmp_path / "m", **TINY)
    out = tmp_path / "restore.json"
    argv = ["--model", str(model), "--lengths", "64,100", "--page-size", "4", "--rounds", "1"]
    assert restore_calibration.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["cached"] for r in report["rows"]] == [64, 100]  # every whole page came back
    for row in report["rows"]:
        assert row["all_written"] and row["max_rel_logit_diff"] < 1e-4
        assert min(row["cold_ttft_s"], row["restored_ttft_s"], row["restore_s_per_1k"]) > 0
    assert report["read_s_per_page"] > 0 and report["probe_prefill_s_per_1k"] > 0
    assert isinstance(report["auto_reads"], bool)


def test_bad_lengths_are_named(capsys):
    with pytest.raises(SystemExit):
        restore_calibration.main(["--shape", "llama-3-8b", "--lengths", "2k"])
    assert "'2k': expected token counts" in capsys.readouterr().err
