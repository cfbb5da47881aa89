"""The tools an agent request offers, as a chat template renders them, and the model's calls
read back in the form the client knows.

Chat templates render chat completions' function tools (``{"type": "function", "function":
{name, description, parameters}}``), and mlx-lm's parsers read calls by name. What agent
clients send is wider:

- **client tools**: Anthropic's (no ``type``, or ``"custom"``) and Responses' ``"function"``
  tools, offered as they are;
- Responses' **namespace** tools (functions grouped under a name: Codex's sub-agent and MCP
  tools): each function is offered as ``NAMESPACE__name``, the flat name Codex itself uses
  where a boundary cannot keep the split (codex-rs ``ToolName::canonical_flat_name``), and a
  call to it goes back as a ``function_call`` carrying ``name`` and ``namespace``, which is
  how Codex routes it (codex-rs ``ToolRouter::build_tool_call``: ``ToolName::new(namespace,
  name)``);
- Responses' **custom** tools (free-form text input): offered as a function of one string,
  ``input``; a call goes back as a ``custom_tool_call`` with that string;
- **deferred** tools (``defer_loading: true``: Claude Code's tool search, Responses' too):
  callable, but rendered only where the conversation loads them (a ``tool_reference`` or a
  ``tool_addition`` renders its definition in place), so the prompt's start never moves;
- **hosted** tools the server cannot run (web search, code interpreter, Anthropic's server
  tools): left out of the prompt, with one log line per kind, so that a client's default
  tool set is served, not refused.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field

from . import fields as f

log = logging.getLogger("mlx_radix.agents")

# codex-rs protocol/src/tool_name.rs: NAMESPACED_TOOL_NAME_DELIMITER, and the namespace of
# top-level tools (a call in it needs no namespace to be routed).
NAMESPACE_DELIMITER = "__"
DEFAULT_NAMESPACE = "functions"
# A custom tool's one argument.
CUSTOM_INPUT = "input"
CUSTOM_SCHEMA = {
    "type": "object",
    "properties": {CUSTOM_INPUT: {"type": "string"}},
    "required": [CUSTOM_INPUT],
}

_left_out: set[str] = set()
_left_out_lock = threading.Lock()


def leave_out(kind: str) -> None:
    """A hosted tool's kind, said once per server."""
    with _left_out_lock:
        if kind in _left_out:
            return
        _left_out.add(kind)
    log.info(
        "tools of type %r are left out of the prompt: this server runs no hosted tools, only "
        "the client's own",
        kind,
    )


def flat_name(namespace: str, name: str) -> str:
    """A namespaced tool's name as the model sees it (Codex's canonical flat name)."""
    if namespace == DEFAULT_NAMESPACE:
        return name
    namespace, name = namespace.rstrip("_"), name.lstrip("_")
    return f"{namespace}{NAMESPACE_DELIMITER}{name}"


@dataclass(frozen=True)
class Tool:
    """One tool the model may call: ``name`` is what the model calls it, ``client_name``
    and ``namespace`` what the client knows it by."""

    name: str
    function: dict  # chat completions' form, as templates render it
    client_name: str
    namespace: str | None = None
    custom: bool = False  # free-form input: called with one string

    def render(self) -> str:
        """Its definition as text, where a conversation loads it (templates render tools
        as JSON, ``tool | tojson``)."""
        return json.dumps(self.function, ensure_ascii=False)


@dataclass
class Toolset:
    """A request's tools: ``offered`` is what the template renders, ``callable`` every tool
    a call may name (deferred ones too)."""

    offered: list[Tool] = field(default_factory=list)
    callable: dict[str, Tool] = field(default_factory=dict)

    def add(self, tool: Tool, at: str, deferred: bool = False) -> None:
        if tool.name in self.callable:
            raise f.bad(f"{at}.name", f"{tool.name!r} names another tool of this request")
        self.callable[tool.name] = tool
        if not deferred:
            self.offered.append(tool)

    def define(self, tool: Tool) -> None:
        """A tool a conversation adds in place (its definition rendered there): callable
        from then on, the template's tools unchanged."""
        self.callable[tool.name] = tool

    @property
    def rendered(self) -> list[dict] | None:
        """The template's ``tools`` (None: no tools)."""
        return [t.function for t in self.offered] or None

    @property
    def for_parser(self) -> list[dict] | None:
        """What a tool parser reads (some type arguments by the schema): every callable
        tool, loaded or not."""
        return [t.function for t in self.callable.values()] or None

    def names(self) -> list[str]:
        """The offered tools' names, the client's first (a namespaced one's child name)."""
        return list(
            dict.fromkeys([t.client_name for t in self.offered] + [t.name for t in self.offered])
        )


def function(name: str, schema: object, description: object, at: str, schema_key: str) -> dict:
    if not isinstance(schema, dict):
        raise f.bad(f"{at}.{schema_key}", f"must be a JSON schema object, got {schema!r}")
    body = {"name": name, "parameters": schema}
    if isinstance(description, str):
        body["description"] = description
    return {"type": "function", "function": body}


def _deferred(tool: dict, at: str) -> bool:
    value = tool.get("defer_loading", False)
    if not isinstance(value, bool):
        raise f.bad(f"{at}.defer_loading", f"must be true or false, got {value!r}")
    return value


def _items(value: object, at: str) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise f.bad(at, f"must be a list of tools, got {value!r}")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise f.bad(f"{at}.{i}", f"must be an object, got {tool!r}")
        kind = tool.get("type")
        if kind is not None and not isinstance(kind, str):
            raise f.bad(f"{at}.{i}.type", f"must be a string, got {kind!r}")
    return value


def anthropic_tool(tool: dict, at: str) -> Tool:
    """A Messages API client tool: name, description, input_schema."""
    name = f.nonempty(tool.get("name"), f"{at}.name")
    body = function(name, tool.get("input_schema"), tool.get("description"), at, "input_schema")
    return Tool(name, body, name)


def anthropic_tools(value: object) -> Toolset:
    """A Messages request's ``tools``: client tools (no ``type``, or ``"custom"``); the rest
    are Anthropic's server tools (web search, code execution, tool search) or tools its
    models know by type alone (bash, text editor, computer use): left out."""
    tools = Toolset()
    for i, tool in enumerate(_items(value, "tools")):
        at = f"tools.{i}"
        kind = tool.get("type")
        if kind not in (None, "custom"):
            leave_out(kind)
            continue
        tools.add(anthropic_tool(tool, at), at, _deferred(tool, at))
    return tools


def _responses_member(tool: dict, at: str, namespace: str | None) -> Tool | None:
    kind = tool.get("type")
    client_name = f.nonempty(tool.get("name"), f"{at}.name")
    name = client_name if namespace is None else flat_name(namespace, client_name)
    if kind == "function":
        schema = tool.get("parameters", {"type": "object"})
        body = function(name, schema, tool.get("description"), at, "parameters")
        return Tool(name, body, client_name, namespace)
    if kind == "custom":
        description = tool.get("description")
        body = function(name, CUSTOM_SCHEMA, description, at, "parameters")
        return Tool(name, body, client_name, namespace, custom=True)
    return None


def responses_tools(value: object) -> Toolset:
    """A Responses request's ``tools``: functions, custom tools, namespaces of them; hosted
    tools (web_search, file_search, code_interpreter, image_generation, mcp, ...) left out."""
    tools = Toolset()
    for i, tool in enumerate(_items(value, "tools")):
        at = f"tools.{i}"
        kind = tool.get("type")
        if kind == "namespace":
            namespace = f.nonempty(tool.get("name"), f"{at}.name")
            for j, member in enumerate(_items(tool.get("tools"), f"{at}.tools")):
                where = f"{at}.tools.{j}"
                read = _responses_member(member, where, namespace)
                if read is None:
                    leave_out(member.get("type") or "untyped")
                    continue
                tools.add(read, where, _deferred(member, where))
            continue
        read = _responses_member(tool, at, None) if kind in ("function", "custom") else None
        if read is None:
            leave_out(kind or "untyped")
            continue
        tools.add(read, at, _deferred(tool, at))
    return tools


def named_tool(name: object, tools: Toolset, param: str) -> None:
    """A ``tool_choice`` that names a tool must name one the prompt offers."""
    if name not in tools.names():
        raise f.bad(param, f"must name one of the tools {tools.names()}, got {name!r}")
