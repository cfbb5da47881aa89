"""README's measured numbers are the rendering of the reports in results/ (tools/report.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_radix_plugin.tools import report

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "results"


def test_readme_s_tables_are_what_the_reports_render():
    text = README.read_text()
    assert report.render(text, RESULTS) == text, "README differs: run `mlx-radix report`"


def test_every_block_is_in_readme_once_and_every_row_names_a_report_in_results():
    text = README.read_text()
    assert sorted(report.BEGIN.findall(text)) == sorted(report.BLOCKS)
    for block in report.BLOCKS.values():
        for row in block.rows:
            assert (RESULTS / row.source.file).is_file(), row.source.file
            row.source.load(RESULTS)  # the run is there
    body = report.render(text, RESULTS)
    cited = set(re.findall(r"\]\(results/([^)]+)\)", body))
    assert cited and all((RESULTS / name).is_file() for name in cited)


def test_numbers_in_what_you_get_come_only_from_report_blocks():
    """Outside the rendered blocks, the section's prose carries no measured number."""
    text = README.read_text()
    section = text[text.index("## What you get") :]
    section = section[: section.index("\n## ", 1)]
    prose = re.sub(r"<!-- report: [\w-]+ -->.*?<!-- /report -->", "", section, flags=re.S)
    assert not re.search(r"\d", prose), prose


def test_check_fails_on_a_stale_readme_and_a_run_fixes_it(tmp_path):
    readme = tmp_path / "README.md"
    stale = README.read_text().replace("| decode tokens/s at 32 requests |", "| typed by hand |")
    assert stale != README.read_text()
    readme.write_text(stale)
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    args = ["--readme", str(readme), "--results", str(results)]

    checked = CliRunner().invoke(report.command, [*args, "--check"])
    assert checked.exit_code == 1 and "mlx-radix report" in checked.output

    assert CliRunner().invoke(report.command, args).exit_code == 0
    assert readme.read_text() == README.read_text()
    assert CliRunner().invoke(report.command, [*args, "--check"]).exit_code == 0


def test_a_block_with_no_end_or_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="has no"):
        report.render("<!-- report: gpu -->\n", RESULTS)
    with pytest.raises(ValueError, match="no report block named 'nope'"):
        report.render("<!-- report: nope -->\n<!-- /report -->\n", RESULTS)
