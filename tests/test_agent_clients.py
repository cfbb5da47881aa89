"""Claude Code and Codex CLI, pinned (tests/clients), run as a user runs them against
``mlx_lm.server --plugin radix``: the scripted tool model calls a tool of the client's own,
the client runs it, the model answers, and the next turn reads its history from the cache.

The model reads 131,072 tokens (tiny_models' long-context variant): each client sends
30-50k characters of system prompt and tools a request.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from agent_clients import Recorder, check_recording, clients
from servers import Server, free_port, mlx_lm_server, server_env
from test_readme import README, fenced_block_after
from tiny_models import TOOL_ANSWER, build_tool_model

# Both clients run as README's Agents section says, its address made the recorder's.
README_ADDRESS = "127.0.0.1:8080"

MARKER = "mlx-radix-notes-4711"
# The pool holds every turn of a session (the default test pool of 4,096 tokens would not).
POOL = {"MLX_RADIX_POOL_TOKENS": "131072", "MLX_RADIX_PAGE_SIZE": "16"}


pytestmark = pytest.mark.slow  # npm installs the clients (800 MB) on first use


@pytest.fixture(scope="module")
def binaries():
    return clients()


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


def workdir(tmp_path_factory, name: str) -> Path:
    work = tmp_path_factory.mktemp(name)
    (work / "notes.txt").write_text(MARKER + "\n")
    return work


def serve(model: Path, hf_cache: Path, log: Path):
    port = free_port()
    cmd = mlx_lm_server("--plugin", "radix", "--model", str(model), "--port", str(port))
    return Server(cmd, server_env(hf_cache, **POOL), port, log)


def run(cmd: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def cached_share(read: int, total: int) -> float:
    return read / total if total else 0.0


# --- Claude Code --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(binaries, hf_cache, tmp_path_factory):
    """The work directory, Claude Code's environment, and a recorder before the server."""
    work = workdir(tmp_path_factory, "claude-work")
    call = {"name": "Read", "arguments": {"file_path": str(work / "notes.txt")}}
    model = build_tool_model(
        tmp_path_factory.mktemp("models") / "claude", call=call, long_context=True
    )
    log = tmp_path_factory.mktemp("log") / "server.log"
    command = fenced_block_after(README.read_text(), "Agents", "bash").split()
    assert command[-1] == "claude", command
    with serve(model, hf_cache, log) as server, Recorder(server.port) as recorder:
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path_factory.mktemp("claude-home"))}
        for assignment in command[:-1]:
            name, value = assignment.split("=", 1)
            env[name] = value.replace(README_ADDRESS, f"127.0.0.1:{recorder.port}")
        yield work, env, recorder, server


def claude_turn(binaries, claude, *args: str) -> dict:
    """One ``claude -p`` turn: its events (stream-json), the last one the result."""
    work, env, _, _ = claude
    cmd = [binaries["claude"], "-p", "--output-format", "stream-json", "--verbose", *args]
    lines = run(cmd, work, env).stdout.splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def blocks(events: list[dict], kind: str) -> list[dict]:
    return [
        b
        for e in events
        if e.get("type") in ("assistant", "user")
        for b in e["message"]["content"]
        if isinstance(b, dict) and b.get("type") == kind
    ]


def billing_line(exchange) -> str:
    return exchange.body["system"][0]["text"]


def test_claude_code_runs_its_tool_and_the_next_turn_reads_the_cache(binaries, claude):
    work, env, recorder, server = claude
    first = claude_turn(binaries, claude, "What is in notes.txt?")
    [use] = blocks(first, "tool_use")
    assert (use["name"], use["input"]) == ("Read", {"file_path": str(work / "notes.txt")})
    [result] = blocks(first, "tool_result")
    assert MARKER in json.dumps(result["content"]) and not result.get("is_error")
    done = first[-1]
    assert (done["type"], done["subtype"], done["is_error"]) == ("result", "success", False)
    assert done["result"] == TOOL_ANSWER
    asked = len(recorder.posts("/v1/messages"))

    # Turn 2, with a billing line that changes per request (interactive sessions add a
    # per-request value to it): it is left out of the prompt, so the history is cached.
    values = iter(range(10_000, 99_999))

    def per_request_value(body: dict) -> dict:
        line = body["system"][0]
        body["system"][0] = dict(line, text=line["text"] + f" cch={next(values)};")
        return body

    recorder.rewrite = per_request_value
    try:
        second = claude_turn(binaries, claude, "--continue", "And the notes again?")
    finally:
        recorder.rewrite = None
    assert blocks(second, "tool_result") and second[-1]["result"] == TOOL_ANSWER
    usage = second[-1]["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert cached_share(usage["cache_read_input_tokens"], total) >= 0.95, usage
    turn_two = recorder.posts("/v1/messages")[asked:]
    assert len({billing_line(e) for e in turn_two}) == len(turn_two) >= 2

    # A new session: Claude Code's billing line differs (a hash of the first prompt), and
    # the system prompt and tools it shares with the first session come from the cache.
    before = len(recorder.posts("/v1/messages"))
    third = claude_turn(binaries, claude, "Tell me about notes.txt")
    assert third[-1]["result"] == TOOL_ANSWER
    opening = recorder.posts("/v1/messages")[before]
    assert billing_line(opening) != billing_line(recorder.posts("/v1/messages")[0])
    usage = opening.usage()
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert cached_share(usage["cache_read_input_tokens"], total) >= 0.7, usage

    assert all(e.status < 400 for e in recorder.exchanges), [
        (e.path, e.status, e.answer[:300]) for e in recorder.exchanges if e.status >= 400
    ]
    assert "Traceback" not in server.output()
    check_recording("claude", recorder.exchanges)


# --- Codex CLI ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex(binaries, hf_cache, tmp_path_factory):
    work = workdir(tmp_path_factory, "codex-work")
    call = {"name": "exec_command", "arguments": {"cmd": "cat notes.txt"}}
    model = build_tool_model(
        tmp_path_factory.mktemp("models") / "codex", call=call, long_context=True
    )
    log = tmp_path_factory.mktemp("log") / "server.log"
    with serve(model, hf_cache, log) as server, Recorder(server.port) as recorder:
        home = tmp_path_factory.mktemp("codex-home")
        config = fenced_block_after(README.read_text(), "Agents", "toml")
        assert README_ADDRESS in config
        address = f"127.0.0.1:{recorder.port}"
        (home / "config.toml").write_text(config.replace(README_ADDRESS, address))
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
        yield work, env, recorder, server


def codex_turn(binaries, codex, *args: str) -> list[dict]:
    work, env, _, _ = codex
    cmd = [binaries["codex"], "exec", "--json", "--skip-git-repo-check", *args]
    events = [json.loads(line) for line in run(cmd, work, env).stdout.splitlines() if line]
    errors = [
        e
        for e in events
        if e["type"] in ("error", "turn.failed")
        or (
            e.get("item", {}).get("type") == "error"
            # Codex knows no metadata of a local model's name, and says so.
            and not e["item"]["message"].startswith("Model metadata for")
        )
    ]
    assert not errors, errors
    return events


def items(events: list[dict], kind: str) -> list[dict]:
    return [
        e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind
    ]


def test_codex_runs_its_tool_and_the_resumed_session_reads_the_cache(binaries, codex):
    _, _, recorder, server = codex
    first = codex_turn(binaries, codex, "What is in notes.txt?")
    [command] = items(first, "command_execution")
    assert "cat notes.txt" in command["command"] and command["exit_code"] == 0
    assert MARKER in command["aggregated_output"]
    assert [m["text"] for m in items(first, "agent_message")] == [TOOL_ANSWER]

    second = codex_turn(binaries, codex, "resume", "--last", "And the notes again?")
    assert items(second, "command_execution") and items(second, "agent_message")
    # Codex counts a thread's usage from its start: turn 2's own is the difference.
    [one] = [e["usage"] for e in first if e["type"] == "turn.completed"]
    [both] = [e["usage"] for e in second if e["type"] == "turn.completed"]
    read = both["cached_input_tokens"] - one["cached_input_tokens"]
    assert cached_share(read, both["input_tokens"] - one["input_tokens"]) >= 0.95, (one, both)

    assert all(e.status < 400 for e in recorder.exchanges), [
        (e.path, e.status, e.answer[:300]) for e in recorder.exchanges if e.status >= 400
    ]
    assert "Traceback" not in server.output()
    check_recording("codex", recorder.exchanges)
