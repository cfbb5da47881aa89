"""The in-process decode calibration at a tiny shape (function, not speed: no timing asserted)."""

import json

import pytest

from mlx_radix_plugin.models.random_model import TINY, build
from mlx_radix_plugin.tools import decode_calibration


def test_a_tiny_grid_times_every_path(tmp_path):
    model = build("smollm2-135m", tmp_path / "m", **TINY)
    out = tmp_path / "rows.json"
    argv = ["--model", str(model), "--grid", "3x32", "--steps", "3", "--page-size", "4"]
    argv += ["--modes", "stock,off,on,masked"]
    assert decode_calibration.main([*argv, "--question", "5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["rows"], row["prefix"], row["auto"]) == (3, 32, "exact")
    paths = [row[f"{m}_path"] for m in ("stock", "off", "on", "masked")]
    assert paths == ["stock", "exact", "shared", "shared"]
    assert min(row["stock_ms"], row["off_ms"], row["on_ms"], row["masked_ms"]) > 0
    assert row["on_speedup"] == round(row["stock_ms"] / row["on_ms"], 3)


def test_modes_start_with_stock_and_are_named(capsys):
    with pytest.raises(SystemExit):
        decode_calibration.main(["--modes", "on,stock"])
    assert "'on,stock': expected stock, then any of off, on, split, masked" in (
        capsys.readouterr().err
    )


def test_a_bad_grid_is_named(capsys):
    with pytest.raises(SystemExit):
        decode_calibration.main(["--grid", "8by2048"])
    assert "'8by2048': expected ROWSxPREFIX" in capsys.readouterr().err


def test_the_server_s_pool_and_logit_bias_can_be_asked_for(tmp_path, monkeypatch):
    """``--pool-tokens`` sizes the engine's pool (the server's, not one just large enough)
    and ``--logit-bias`` gives every request a processor, as the benchmarks' requests have."""
    import mlx_lm.sample_utils

    from mlx_radix_plugin import KVPool

    pools, biases = [], []
    for_model, make = KVPool.for_model.__func__, mlx_lm.sample_utils.make_logits_processors

    def sized(cls, model, **kwargs):
        pools.append(kwargs["pool_tokens"])
        return for_model(cls, model, **kwargs)

    def processors(**kwargs):
        biases.append(kwargs["logit_bias"])
        return make(**kwargs)

    monkeypatch.setattr(KVPool, "for_model", classmethod(sized))
    monkeypatch.setattr(mlx_lm.sample_utils, "make_logits_processors", processors)
    model = build("smollm2-135m", tmp_path / "m", **TINY)
    out = tmp_path / "rows.json"
    argv = ["--model", str(model), "--grid", "3x32", "--steps", "3", "--page-size", "4"]
    argv += ["--modes", "stock,on", "--pool-tokens", "8192", "--logit-bias"]
    assert decode_calibration.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["stock_path"], row["on_path"]) == ("stock", "shared")
    assert pools == [8192]
    assert biases == [{0: -100.0}, {0: -100.0}]
