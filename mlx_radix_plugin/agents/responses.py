"""OpenAI's Responses API (``POST /v1/responses``), as Codex and the ``openai`` SDK speak it,
over the server's own generation (generation.py).

``input`` items become chat messages (``function_call`` items an assistant message's
``tool_calls``, ``function_call_output`` items ``tool`` messages); the answer's events become
output items (``reasoning``, ``message``, ``function_call``); streamed, the API's typed
events, numbered. ``previous_response_id`` continues a conversation this server answered:
responses are remembered in memory (``REMEMBERED``, the oldest forgotten first).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from . import fields as f
from . import generation as g
from . import tools as t

# Conversations kept for previous_response_id: each holds its messages (the previous one's
# messages, shared, plus this turn's), so memory grows with the conversations' text only; at
# most REMEMBERED of them and REMEMBERED_BYTES of their turns' text, the oldest forgotten
# first (by count alone, 1,024 responses with a 20 MB reasoning item each stayed resident).
REMEMBERED = 1024
REMEMBERED_BYTES = 256 << 20
TOOL_CHOICES = ("auto", "none", "required")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
# A tool's output may hold images; a model that reads text gets a placeholder.
OUTPUT_PARTS = {"input_image": f.image_placeholder}
# Fields a local model has no use for: accepted, their kinds checked (fields.unused).
# ``prompt_cache_key`` (Codex: its session id) needs no use here: the radix tree finds a
# session's cached prefix by its tokens, whatever key it came with.
UNUSED = {
    "include": "a list",
    "prompt_cache_key": "a string",
    "prompt_cache_retention": "a string",
    "client_metadata": "an object",
    "metadata": "an object",
    "reasoning": "an object",
    "text": "an object",
    "parallel_tool_calls": "true or false",
    "service_tier": "a string",
    "truncation": "a string",
    "user": "a string",
    "safety_identifier": "a string",
}


class _Remembered:
    """Each stored response's conversation: its input messages and its output's message, by
    the requests' cache salt and the response's id (a tenant continues its own only)."""

    def __init__(self, size: int, max_bytes: int):
        self._size, self._max_bytes = size, max_bytes
        self._items: OrderedDict[tuple, tuple[list[dict], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # handler threads answer concurrently

    def put(self, salt: str | None, response_id: str, messages: list[dict], nbytes: int) -> None:
        """``nbytes``: the text this response adds to the conversation it continues."""
        with self._lock:
            self._items[salt, response_id] = (messages, nbytes)
            self._bytes += nbytes
            while self._items and (len(self._items) > self._size or self._bytes > self._max_bytes):
                self._bytes -= self._items.popitem(last=False)[1][1]

    def get(self, salt: str | None, response_id: str) -> list[dict] | None:
        with self._lock:
            item = self._items.get((salt, response_id))
            return None if item is None else item[0]


remembered = _Remembered(REMEMBERED, REMEMBERED_BYTES)


class Conversation(g.Conversation):
    """A Responses request: also what to remember and echo back."""

    def __init__(self, body: dict, messages: list[dict], history: list[dict], **kwargs):
        super().__init__(messages=messages, **kwargs)
        self.body = body
        self.history = history  # the messages without instructions (those are not carried)


def error_body(error: f.ApiError) -> dict:
    return {
        "error": {"message": str(error), "type": error.kind, "param": error.param, "code": None}
    }


def conversation(body: object) -> Conversation:
    model = f.model_of(body)
    sampling = g.Sampling(
        max_tokens=f.integer(body, "max_output_tokens", 1),
        temperature=f.number(body, "temperature", 0.0, 2.0),
        top_p=f.number(body, "top_p", 0.0, 1.0),
        logit_bias=f.logit_bias(body),
    )
    f.flag(body, "stream", False)
    f.flag(body, "store", True)
    f.unused(body, UNUSED)
    tools = t.responses_tools(body.get("tools"))
    history: list[dict] = []
    previous = body.get("previous_response_id")
    salt = f.salt_of(body)
    if previous is not None:
        history = remembered.get(salt, previous) if isinstance(previous, str) else None
        if history is None:
            raise f.bad(
                "previous_response_id",
                f"no response {previous!r} is remembered by this server for this cache_salt "
                f"(it keeps the last {REMEMBERED}, at most {REMEMBERED_BYTES >> 20} MiB of "
                "their text, in memory, those sent with store: true)",
            )
    continued = len(history)
    history = history + _input(body.get("input"), _calls_in(history))
    messages = list(history)
    if body.get("instructions") is not None:
        instructions = f.text_of(body["instructions"], "instructions", TEXT_PARTS)
        messages.insert(0, {"role": "system", "content": instructions})
    _tool_choice(body.get("tool_choice"), tools)
    conversation = Conversation(
        body, messages, history, tools=tools, sampling=sampling, model=model, salt=salt
    )
    conversation.continued = continued  # messages of the conversation it continues
    return conversation


def _calls_in(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls", ())}


def _input(value: object, calls: set[str]) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise f.bad("input", "must not be empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise f.bad("input", f"must be a string or a non-empty list of items, got {value!r}")
    out: list[dict] = []
    reasoning: list[str] = []  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(value):
        at = f"input.{i}"
        if not isinstance(item, dict):
            raise f.bad(at, f"must be an object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise f.bad(f"{at}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            text = f.text_of(item.get("content"), f"{at}.content", TEXT_PARTS)
            out.append({"role": ROLES[role], "content": text})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
        elif kind in ("function_call", "custom_tool_call"):
            call_id = f.nonempty(item.get("call_id"), f"{at}.call_id")
            call = {"id": call_id, "type": "function", "function": _called(item, kind, at)}
            # Calls made in one turn are one assistant message, after its text if it had any.
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
            calls.add(call_id)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if call_id not in calls:
                raise f.bad(f"{at}.call_id", f"{call_id!r} answers no function_call before it")
            output = f.text_of(item.get("output"), f"{at}.output", TEXT_PARTS, OUTPUT_PARTS)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            # Kept for the assistant message that follows, as ``reasoning_content``: see
            # messages.py (templates that read it repeat what the model wrote).
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise f.bad(
                    f"{at}.content", f"must be a list of reasoning_text parts, got {parts!r}"
                )
            reasoning += [
                p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
        else:
            raise f.bad(
                f"{at}.type",
                "must be message, function_call, function_call_output, custom_tool_call, "
                f"custom_tool_call_output or reasoning, got {kind!r}",
            )
    return out


def _called(item: dict, kind: str, at: str) -> dict:
    """A call item as a chat tool call's ``function``, named as the model sees the tool (a
    namespaced one by its flat name; tools.py)."""
    name = f.nonempty(item.get("name"), f"{at}.name")
    namespace = item.get("namespace")
    if namespace is not None:
        name = t.flat_name(f.nonempty(namespace, f"{at}.namespace"), name)
    if kind == "custom_tool_call":
        text = item.get("input")
        if not isinstance(text, str):
            raise f.bad(f"{at}.input", f"must be a string, got {text!r}")
        return {"name": name, "arguments": {t.CUSTOM_INPUT: text}}
    arguments = item.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise f.bad(f"{at}.arguments", f"must be a JSON object in a string, got {arguments!r}")
    return {"name": name, "arguments": parsed}


def _tool_choice(value: object, tools: t.Toolset) -> None:
    """Checked, then left to the model: without constrained decoding, "required" and a named
    function are no stronger than "auto" (README says so)."""
    if value is None or value in TOOL_CHOICES:
        return
    if isinstance(value, dict) and value.get("type") in ("function", "custom"):
        t.named_tool(value.get("name"), tools, "tool_choice.name")
        return
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return  # a hosted tool's kind (web_search, ...), left out of the prompt
    raise f.bad(
        "tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or a function, got {value!r}"
    )


# --- the answer -------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class _Output:
    """The response object, built as events arrive."""

    def __init__(self, conversation: Conversation, turn: g.Turn):
        body = conversation.body
        self.conversation = conversation
        self.turn = turn
        self.response = {
            "id": _new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": conversation.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
        }

    @property
    def items(self) -> list[dict]:
        return self.response["output"]

    def finish(self, event: g.Finish) -> None:
        r = self.response
        for item in self.items:
            item["status"] = "completed"
        if event.reason == "length":
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            r["status"] = "completed"
        r["usage"] = {
            "input_tokens": event.prompt_tokens,
            "input_tokens_details": {"cached_tokens": event.cached_tokens},
            "output_tokens": event.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": event.prompt_tokens + event.output_tokens,
        }
        if r["store"] is not False:
            c = self.conversation
            messages = c.history + [self._as_message()]
            added = len(json.dumps(messages[c.continued :], default=str))
            remembered.put(c.salt, r["id"], messages, added)

    def _as_message(self) -> dict:
        """This response as the assistant message a next turn's template renders."""
        text = "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )
        message = {"role": "assistant", "content": text}
        thought = "".join(
            part["text"]
            for item in self.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        if thought:
            message["reasoning_content"] = thought
        calls = [
            {"id": item["call_id"], "type": "function", "function": _called(item, item["type"], "")}
            for item in self.items
            if item["type"] in ("function_call", "custom_tool_call")
        ]
        if calls:
            message["tool_calls"] = calls
        return message


def _message_item() -> dict:
    return {
        "type": "message",
        "id": _new_id("msg"),
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }


def _reasoning_item() -> dict:
    return {
        "type": "reasoning",
        "id": _new_id("rs"),
        "status": "in_progress",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": ""}],
    }


def _call_item(call: g.ToolCall, tools: t.Toolset) -> dict:
    """A call as the client knows the tool: a namespaced one by its name and namespace, a
    custom one as a ``custom_tool_call`` with its text (tools.py). A name the request never
    offered goes back as the model wrote it (the client says it has no such tool)."""
    tool = tools.callable.get(call.name)
    custom = tool is not None and tool.custom
    item = {
        "type": "custom_tool_call" if custom else "function_call",
        "id": _new_id("ctc" if custom else "fc"),
        "call_id": call.id or _new_id("call"),
        "name": tool.client_name if tool is not None else call.name,
    }
    if tool is not None and tool.namespace is not None:
        item["namespace"] = tool.namespace
    if custom:
        text = call.arguments.get(t.CUSTOM_INPUT)
        item["input"] = text if isinstance(text, str) else json.dumps(call.arguments)
    else:
        item["arguments"] = json.dumps(call.arguments, ensure_ascii=False)
    item["status"] = "in_progress"
    return item


def answer(turn: g.Turn, conversation: Conversation) -> dict:
    out = _Output(conversation, turn)
    try:
        for event in turn.events():
            if isinstance(event, g.Finish):
                out.finish(event)
            elif isinstance(event, g.ToolCall):
                out.items.append(_call_item(event, conversation.tools))
            elif isinstance(event, g.Reasoning):
                if not out.items or out.items[-1]["type"] != "reasoning":
                    out.items.append(_reasoning_item())
                out.items[-1]["content"][0]["text"] += event.text
            else:
                if not out.items or out.items[-1]["type"] != "message":
                    item = _message_item()
                    item["content"].append({"type": "output_text", "text": "", "annotations": []})
                    out.items.append(item)
                out.items[-1]["content"][0]["text"] += event.text
    finally:
        turn.close()
    return out.response


class _Events:
    """The API's event stream: typed events, numbered from 0."""

    def __init__(self, write: Callable[[bytes], None]):
        self._write = write
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> None:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        self._write(f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())


def error_event(error: f.ApiError) -> bytes:
    # Sent where a stream breaks off, its number unknown here: the SDK does not check it.
    data = {"type": "error", "code": error.kind, "message": str(error), "param": error.param}
    data["sequence_number"] = 0
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


def stream(turn: g.Turn, conversation: Conversation, write: Callable[[bytes], None]) -> None:
    out = _Output(conversation, turn)
    send = _Events(write)
    open_item: dict | None = None  # the message or reasoning item being streamed

    def snapshot(item: dict) -> dict:
        return json.loads(json.dumps(item))

    def close_item() -> None:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return
        index = out.items.index(item)
        item["status"] = "completed"
        part = item["content"][0]
        if item["type"] == "message":
            ids = dict(item_id=item["id"], output_index=index, content_index=0)
            send("response.output_text.done", **ids, text=part["text"], logprobs=[])
            send("response.content_part.done", **ids, part=snapshot(part))
        else:
            ids = dict(item_id=item["id"], output_index=index, content_index=0)
            send("response.reasoning_text.done", **ids, text=part["text"])
        send("response.output_item.done", output_index=index, item=snapshot(item))

    def open_(item: dict) -> int:
        nonlocal open_item
        close_item()
        out.items.append(item)
        index = len(out.items) - 1
        send("response.output_item.added", output_index=index, item=snapshot(item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            send(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=snapshot(part),
            )
        open_item = item if item["type"] in ("message", "reasoning") else None
        return index

    try:
        send("response.created", response=snapshot(out.response))
        send("response.in_progress", response=snapshot(out.response))
        for event in turn.events():
            if isinstance(event, (g.Text, g.Reasoning)):
                kind = "message" if isinstance(event, g.Text) else "reasoning"
                if open_item is None or open_item["type"] != kind:
                    open_(_message_item() if kind == "message" else _reasoning_item())
                open_item["content"][0]["text"] += event.text
                name = "output_text" if kind == "message" else "reasoning_text"
                extra = {"logprobs": []} if kind == "message" else {}
                send(
                    f"response.{name}.delta",
                    item_id=open_item["id"],
                    output_index=len(out.items) - 1,
                    content_index=0,
                    delta=event.text,
                    **extra,
                )
            elif isinstance(event, g.ToolCall):
                item = _call_item(event, conversation.tools)
                key = "input" if item["type"] == "custom_tool_call" else "arguments"
                name = "custom_tool_call_input" if key == "input" else "function_call_arguments"
                text = item[key]
                index = open_(dict(item, **{key: ""}))
                item = out.items[index]
                item[key] = text
                ids = dict(item_id=item["id"], output_index=index)
                send(f"response.{name}.delta", **ids, delta=text)
                send(f"response.{name}.done", **ids, **{key: text})
                item["status"] = "completed"
                send("response.output_item.done", output_index=index, item=snapshot(item))
            else:
                close_item()
                out.finish(event)
                kind = "completed" if out.response["status"] == "completed" else "incomplete"
                send(f"response.{kind}", response=snapshot(out.response))
    finally:
        turn.close()
