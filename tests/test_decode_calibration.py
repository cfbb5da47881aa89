"""The in-process decode calibration at a tiny shape (function, not speed: no timing asserted)."""

import json

import pytest

from mlx_radix_plugin.models.random_model import TINY, build
from mlx_radix_plugin.tools import decode_calibration


def test_a_tiny_grid_times_every_path(tmp_path):
    model = build("smollm2-135m", tmp_path / "m", **TINY)
    out = tmp_path / "rows.json"
    argv = ["--model", str(model), "--grid", "3x32", "--steps", "3", "--page-size", "4"]
    assert decode_calibration.main([*argv, "--question", "5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["rows"], row["prefix"], row["auto"]) == (3, 32, "exact")
    assert (row["stock_path"], row["off_path"], row["on_path"]) == ("stock", "exact", "shared")
    assert min(row["stock_ms"], row["off_ms"], row["on_ms"]) > 0
    assert row["shared_speedup"] == round(row["stock_ms"] / row["on_ms"], 3)


def test_a_bad_grid_is_named(capsys):
    with pytest.raises(SystemExit):
        decode_calibration.main(["--grid", "8by2048"])
    assert "'8by2048': expected ROWSxPREFIX" in capsys.readouterr().err
