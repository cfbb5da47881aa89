"""Anthropic's Messages API (``POST /v1/messages``), as Claude Code and the ``anthropic``
SDK speak it, over the server's own generation (generation.py).

A request becomes chat messages (``tool_use`` blocks become an assistant message's
``tool_calls``, ``tool_result`` blocks ``tool`` messages) and the answer's events become
content blocks; streamed, the event sequence of the API: ``message_start``, per block
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` with the stop reason
and usage, ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from . import fields as f
from . import generation as g
from . import tools as t

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "stop_sequence": "stop_sequence",
}
TOOL_CHOICES = ("auto", "any", "tool", "none")
ROLES = ("user", "assistant", "system")
BILLING_HEADER = "x-anthropic-billing-header:"
# Fields a local model has no use for: accepted, their kinds checked (fields.unused).
UNUSED = {
    "metadata": "an object",
    "context_management": "an object",
    "output_config": "an object",
    "service_tier": "a string",
}


def error_body(error: f.ApiError) -> dict:
    return {"type": "error", "error": {"type": error.kind, "message": str(error)}}


def conversation(
    body: object, counting: bool = False, billing_header: bool = False
) -> g.Conversation:
    """The request in chat-completions form; ``ApiError`` names the first bad field.
    ``counting``: a ``count_tokens`` body, which has no ``max_tokens``. ``billing_header``:
    keep Claude Code's billing line in the system prompt (the setting
    ``agents.billing_header``)."""
    model = f.model_of(body)
    sampling = g.Sampling(
        max_tokens=f.integer(body, "max_tokens", 1, required=not counting),
        temperature=f.number(body, "temperature", 0.0, 1.0),
        top_p=f.number(body, "top_p", 0.0, 1.0),
        top_k=f.integer(body, "top_k", 0),
        stop=f.strings(body, "stop_sequences"),
        logit_bias=f.logit_bias(body),
        names={"stop": "stop_sequences"},
    )
    f.flag(body, "stream", False)
    f.unused(body, UNUSED)
    _thinking(body.get("thinking"))
    tools = t.anthropic_tools(body.get("tools"))
    messages = []
    if body.get("system") is not None:
        system = _system(body["system"], billing_header)
        if system:
            messages.append({"role": "system", "content": system})
    messages.extend(_messages(body.get("messages"), tools))
    _tool_choice(body.get("tool_choice"), tools)
    return g.Conversation(messages, tools, sampling, model, f.salt_of(body))


def _thinking(value: object) -> None:
    """Accepted and left to the model's template (``enabled``, ``adaptive``, ``disabled``:
    the modes change, so any named one is taken)."""
    if value is None:
        return
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise f.bad("thinking", f"must be an object with a string 'type', got {value!r}")


def _system(value: object, billing_header: bool) -> str:
    """The system prompt's text. Claude Code's first block is a billing line,
    ``x-anthropic-billing-header: cc_version=2.1.332.dcb; cc_entrypoint=sdk-cli;``, whose
    version suffix is a hash of the session's first prompt (and against Anthropic's API,
    per-request values follow): at the very start of the prompt, a changed value would cost
    the whole cached prefix, so it is left out unless ``billing_header``."""
    if isinstance(value, list) and not billing_header:
        value = [
            b
            for b in value
            if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))
        ]
    return f.text_of(value, "system", ("text",))


def _messages(value: object, tools: t.Toolset) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise f.bad("messages", f"must be a non-empty list of messages, got {value!r}")
    out: list[dict] = []
    open_calls: set[str] = set()  # the previous assistant message's tool_use ids
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise f.bad(where, f"must be an object with 'role' and 'content', got {message!r}")
        role = message.get("role")
        if role not in ROLES:
            raise f.bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        elif isinstance(content, list) and content:
            blocks = content
        else:
            raise f.bad(
                f"{where}.content",
                f"must be a string or a non-empty list of blocks, got {content!r}",
            )
        if role == "assistant":
            out.append(_assistant(blocks, where))
            open_calls = {c["id"] for c in out[-1].get("tool_calls", [])}
        elif role == "system":
            # Mid-conversation instructions (per-turn control, tool changes): placed where
            # the template can render them (instructions.py).
            out.append({"role": "system", "content": _system_turn(blocks, where, tools)})
        else:
            out.extend(_user(blocks, where, open_calls, tools))
            open_calls = set()
    if not any(m.get("role") == "user" for m in value):
        raise f.bad("messages", "must hold a user message")
    if value[-1].get("role") == "assistant":
        raise f.bad(
            f"messages.{len(value) - 1}.role",
            "the last message must be the user's, or a system message after it (continuing "
            "an assistant message is not supported)",
        )
    return out


def _block_type(block: object, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise f.bad(where, f"must be a content block with a 'type', got {block!r}")
    return kind


def _assistant(blocks: list, where: str) -> dict:
    text, calls, reasoning = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            text.append(f.block_text(block, at))
        elif kind == "tool_use":
            call_id = f.nonempty(block.get("id"), f"{at}.id")
            name, arguments = f.nonempty(block.get("name"), f"{at}.name"), block.get("input")
            if not isinstance(arguments, dict):
                raise f.bad(f"{at}.input", f"must be an object, got {arguments!r}")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "thinking":
            reasoning.append(block.get("thinking") or "")
        elif kind == "redacted_thinking":
            continue
        else:
            raise f.bad(
                f"{at}.type",
                f"an assistant message holds text, tool_use and thinking blocks, got {kind!r}",
            )
    message = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        # Where templates read it (Qwen3's, DeepSeek's): an agent's turns after the last user
        # message keep their reasoning there, so the prompt repeats what the model wrote and
        # the cache serves it.
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _system_turn(blocks: list, where: str, tools: t.Toolset) -> str:
    """A system message's text: text blocks, and tool changes (beta mid-conversation tool
    changes: ``tool_addition`` of a definition, ``tool_removal`` by name) said in place."""
    out = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            out.append(f.block_text(block, at))
        elif kind == "tool_addition":
            definition = _field(block, "tool", at).get("definition")
            if not isinstance(definition, dict):
                raise f.bad(f"{at}.tool.definition", f"must be a tool object, got {definition!r}")
            tool = t.anthropic_tool(definition, f"{at}.tool.definition")
            tools.define(tool)
            out.append(f"Tool added: {tool.render()}\n")
        elif kind == "tool_removal":
            name = f.nonempty(_field(block, "tool", at).get("name"), f"{at}.tool.name")
            out.append(f"Tool removed: {name}\n")
        else:
            raise f.bad(
                f"{at}.type",
                f"a system message holds text, tool_addition and tool_removal blocks, got {kind!r}",
            )
    return "".join(out)


def _field(block: dict, name: str, at: str) -> dict:
    value = block.get(name)
    if not isinstance(value, dict):
        raise f.bad(f"{at}.{name}", f"must be an object, got {value!r}")
    return value


def _user(blocks: list, where: str, open_calls: set[str], tools: t.Toolset) -> list[dict]:
    results, text = [], []

    def reference(block: dict, at: str) -> str:
        # A tool search's answer: the deferred tool it loads, its definition in place.
        name = f.nonempty(block.get("tool_name"), f"{at}.tool_name")
        tool = tools.callable.get(name)
        return f"Tool loaded: {tool.render() if tool else name}\n"

    result_parts = {"image": f.image_placeholder, "tool_reference": reference}
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            text.append(f.block_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in open_calls:
                raise f.bad(
                    f"{at}.tool_use_id",
                    f"{call_id!r} answers no tool_use block of the previous assistant message"
                    + (f" (its ids: {', '.join(sorted(open_calls))})" if open_calls else ""),
                )
            content = block.get("content", "")
            output = f.text_of(content, f"{at}.content", ("text",), result_parts)
            if block.get("is_error") is True:
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise f.bad(
                f"{at}.type", f"a user message holds text and tool_result blocks, got {kind!r}"
            )
    out = results
    if text:
        out = out + [{"role": "user", "content": "".join(text)}]
    return out


def _tool_choice(value: object, tools: t.Toolset) -> None:
    """Checked, then left to the model: without constrained decoding, "any" and "tool" are
    no stronger than "auto" (README says so)."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in TOOL_CHOICES:
        raise f.bad("tool_choice.type", f"must be one of {', '.join(TOOL_CHOICES)}, got {value!r}")
    if kind == "tool":
        t.named_tool(value.get("name"), tools, "tool_choice.name")


def count_tokens(conversation: g.Conversation, generator) -> dict:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as this model's chat template
    renders it (Claude Code asks every turn, to manage its context window)."""
    return {"input_tokens": len(g.render(generator, conversation))}


# --- the answer -------------------------------------------------------------------------


def _usage(turn: g.Turn, output_tokens: int) -> dict:
    # Anthropic counts input tokens read from the cache apart from the rest.
    return {
        "input_tokens": turn.prompt_tokens - turn.cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": turn.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _message(model: str, content: list, turn: g.Turn) -> dict:
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(turn, 0),
    }


def _tool_use(call: g.ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": call.arguments,
    }


def answer(turn: g.Turn, conversation: g.Conversation) -> dict:
    """The whole answer, as one message."""
    message = _message(conversation.model, [], turn)
    content = message["content"]
    try:
        for event in turn.events():
            if isinstance(event, g.Finish):
                message["stop_reason"] = STOP_REASONS[event.reason]
                message["stop_sequence"] = event.stop_sequence
                message["usage"] = _usage(turn, event.output_tokens)
            elif isinstance(event, g.ToolCall):
                content.append(_tool_use(event))
            else:
                kind, key = (
                    ("text", "text") if isinstance(event, g.Text) else ("thinking", "thinking")
                )
                if not content or content[-1]["type"] != kind:
                    block = {"type": kind, key: ""}
                    if kind == "thinking":
                        block["signature"] = ""
                    content.append(block)
                content[-1][key] += event.text
    finally:
        turn.close()
    return message


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def error_event(error: f.ApiError) -> bytes:
    return _sse("error", error_body(error))


def stream(turn: g.Turn, conversation: g.Conversation, write: Callable[[bytes], None]) -> None:
    """The answer as the API's event stream."""
    index = -1
    open_kind = None  # the type of the block being streamed: "text", "thinking" or None

    def close_block() -> None:
        nonlocal open_kind
        if open_kind is not None:
            write(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
            open_kind = None

    def open_block(block: dict) -> None:
        nonlocal index, open_kind
        close_block()
        index += 1
        open_kind = block["type"]
        write(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )

    def delta(payload: dict) -> None:
        write(
            _sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": payload},
            )
        )

    try:
        message = _message(conversation.model, [], turn)
        write(_sse("message_start", {"type": "message_start", "message": message}))
        for event in turn.events():
            if isinstance(event, g.Text):
                if open_kind != "text":
                    open_block({"type": "text", "text": ""})
                delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, g.Reasoning):
                if open_kind != "thinking":
                    open_block({"type": "thinking", "thinking": "", "signature": ""})
                delta({"type": "thinking_delta", "thinking": event.text})
            elif isinstance(event, g.ToolCall):
                block = _tool_use(event)
                arguments = block["input"]
                open_block(dict(block, input={}))
                delta(
                    {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(arguments, ensure_ascii=False),
                    }
                )
                close_block()
            else:
                close_block()
                stop = {
                    "stop_reason": STOP_REASONS[event.reason],
                    "stop_sequence": event.stop_sequence,
                }
                usage = _usage(turn, event.output_tokens)
                write(
                    _sse("message_delta", {"type": "message_delta", "delta": stop, "usage": usage})
                )
                write(_sse("message_stop", {"type": "message_stop"}))
    finally:
        turn.close()
