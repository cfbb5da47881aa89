"""docs/configuration.md is the settings table rendered (config.render_reference)."""

from pathlib import Path

from mlx_radix_plugin.config import SETTINGS, render_reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_configuration_md_is_rendered_from_the_settings_table():
    assert DOC.read_text() == render_reference(), (
        "docs/configuration.md differs from the settings table in mlx_radix_plugin/config.py: "
        "run `mlx-radix config docs > docs/configuration.md` (or `python -c 'from "
        'mlx_radix_plugin.config import render_reference as r; print(r(), end="")\' > '
        "docs/configuration.md`)"
    )


def test_the_reference_says_what_each_automatic_choice_does_on_each_backend():
    text = render_reference()
    assert len(text.splitlines()) <= 500
    for s in SETTINGS:
        assert f"### `{s.key}`" in text and f"`{s.env}`" in text and f"`{s.flag}`" in text
        if s.default == "auto":
            assert s.auto is not None, f"{s.key}: what auto does on each backend"
