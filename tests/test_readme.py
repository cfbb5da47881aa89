"""README.md as a user reads it: the first screen, the Python example, the links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FIRST_SCREEN = 25  # lines
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def fenced_block_after(text: str, heading: str, language: str) -> str:
    """The first ```language block in the section whose heading contains ``heading``."""
    sections = re.split(r"^#{1,6} ", text, flags=re.M)
    for section in sections[1:]:
        title = section.splitlines()[0]
        if heading.lower() in title.lower():
            match = re.search(rf"^```{language}\n(.*?)^```", section, flags=re.M | re.S)
            assert match, f"no ```{language} block under the heading {title!r}"
            return match.group(1)
    raise AssertionError(f"README has no heading containing {heading!r}")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_first_screen_installs_serves_asks_and_tests():
    """One sentence, the install for serving (no test extra), serve, one request and the
    stats showing cached tokens, then the test command."""
    first = README.read_text().splitlines()[:FIRST_SCREEN]
    commands = [line.split("#")[0].strip() for line in first]
    assert 'pip install ".[cpu]"' in commands, "the install for serving is not on top"
    assert "mlx-radix serve" in commands
    assert any("curl" in c and "/v1/chat/completions" in c for c in commands)
    assert any("curl" in c and "/v1/cache/stats" in c and "cached" in c for c in commands)
    assert 'pip install ".[cpu,test]" && python -m pytest' in commands


@pytest.mark.slow
def test_first_screen_s_requests_show_the_pool_serving_the_second(model_dirs, tmp_path):
    """README's curl lines as a user pastes them, against ``--plugin radix`` on a tiny model:
    the second answer's prompt came from the pool, all of it but the last token."""
    import json
    import subprocess

    from servers import Server, free_port, mlx_lm_server, server_env

    first = README.read_text().split("\n## ", 1)[0]
    (block,) = [
        b for b in re.findall(r"^```bash\n(.*?)^```", first, flags=re.M | re.S) if "curl" in b
    ]
    port = free_port()
    cmd = mlx_lm_server(
        "--plugin", "radix", "--model", str(model_dirs["llama"]), "--port", str(port)
    )
    with Server(cmd, server_env(tmp_path / "hf"), port, tmp_path / "server.log"):
        out = subprocess.run(
            [
                "bash",
                "-euo",
                "pipefail",
                "-c",
                block.replace("127.0.0.1:8080", f"127.0.0.1:{port}"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    answers = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 2
    first_usage, second_usage = (a["usage"] for a in answers)
    assert first_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert (
        second_usage["prompt_tokens_details"]["cached_tokens"] == second_usage["prompt_tokens"] - 1
    )
    # The stats lines the grep keeps: the prompt tokens of both requests, and those cached.
    stats = dict(re.findall(r'"(prompt_tokens|cached_tokens)": (\d+)', out.stdout.split("}\n")[-1]))
    assert int(stats["cached_tokens"]) == second_usage["prompt_tokens"] - 1


def test_python_example_runs_and_reuses_pages(model_dirs, monkeypatch):
    code = fenced_block_after(README.read_text(), "from Python", "python")
    assert code.count('"path/to/model"') == 1, "the example's model path moved"
    code = code.replace('"path/to/model"', repr(str(model_dirs["llama"])))

    # The example's pool grows to the memory plan's ceiling, from device memory. The same
    # sizing path runs here, on a reading of 2 GiB (a 64 MiB chunk once a request comes).
    import mlx_radix_plugin.memory.pool as pool_module
    from mlx_radix_plugin.memory.budget import DeviceMemory

    monkeypatch.setattr(
        pool_module,
        "device_memory",
        lambda: DeviceMemory(backend="cpu", usable_bytes=2 << 30, source="test"),
    )

    namespace: dict = {}
    exec(compile(code, "README.md (Python example)", "exec"), namespace)
    ask, prompt_cache, tokenizer = (namespace[k] for k in ("ask", "prompt_cache", "tokenizer"))
    assert prompt_cache.pool.plan.warning is None and prompt_cache.pool.nbytes == 0

    text = "You are a helpful assistant. Answer briefly. What is the capital of France?"
    prompt = tokenizer.encode(text)
    assert len(prompt) > 16, "the prompt should span more than one page"

    first = ask(text)
    assert isinstance(first, str)
    assert prompt_cache.counters.hits == 0
    assert prompt_cache.counters.cached_tokens == 0

    second = ask(text)
    assert isinstance(second, str)
    assert prompt_cache.counters.hits == 1
    # All of the prompt but its last token came from the pool: that one is always prefilled.
    assert prompt_cache.counters.cached_tokens == len(prompt) - 1
    assert second == first, "greedy output changed when served from cached pages"
    stats = prompt_cache.stats()
    assert stats["pages_cached"] > 0 and stats["requests_holding_pages"] == 0


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    if doc == README:
        assert any(t.startswith("docs/") for t in links), "README links no docs"
    for target in links:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.is_file(), f"{doc.name}: {target} does not exist"
        assert ROOT in resolved.parents, f"{doc.name}: {target} is outside the repository"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{doc.name}: no heading for #{anchor}"


def test_docs_exist():
    assert {p.name for p in DOCS} >= {
        "architecture.md",
        "operations.md",
        "benchmarking.md",
        "CHANGELOG.md",
        "configuration.md",
        "agents.md",
    }


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_are_a_reference_of_at_most_500_lines(doc):
    assert len(doc.read_text().splitlines()) <= 500, f"{doc.name} is over 500 lines"


def test_readme_stays_a_user_s_and_results_keep_current_reports_only():
    """README is for users, at most 250 lines; results/ holds the current report of each
    platform and workload family, at most 8 files (the rest is in git)."""
    assert len(README.read_text().splitlines()) <= 250
    assert len(list((ROOT / "results").iterdir())) <= 8
