"""System and developer messages after the first, placed where the chat template can render
them.

Agent clients give instructions mid-conversation: Claude Code sends a system message after
the user's first one (its environment, per-turn control) and system messages that add or
remove tools; Codex sends developer messages (read as system ones) ahead of its user
messages. Templates differ: Qwen's and Llama's render a system message anywhere, in place;
others raise (roles must alternate), or drop or move it. So each template is asked once,
with a probe conversation, whether it renders system messages in place, in order:

- where it does, the messages go to it as they are;
- where it does not, the leading system messages become one, every later one becomes a
  user message, and each run of consecutive user messages becomes one (their texts joined).

Either way the placement of a message depends only on the messages before and next to it,
and a client appends to its history: a turn renders as a prefix of the next turn (up to the
generation prompt at its end), so the cache serves the history turn after turn.
"""

from __future__ import annotations

import logging
import threading
import weakref

log = logging.getLogger("mlx_radix.agents")

JOIN = "\n\n"
# The probe: each marker must come out of the template once, in this order.
_MARKERS = ("mlxradixU1", "mlxradixS1", "mlxradixA1", "mlxradixU2", "mlxradixS2")
_PROBE = [
    {"role": "system", "content": "mlxradixS0"},
    {"role": "user", "content": _MARKERS[0]},
    {"role": "system", "content": _MARKERS[1]},
    {"role": "assistant", "content": _MARKERS[2]},
    {"role": "user", "content": _MARKERS[3]},
    {"role": "system", "content": _MARKERS[4]},
]
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}},
}

_answers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def renders_in_place(tokenizer, template_args: dict) -> bool:
    """Whether ``tokenizer``'s chat template renders system messages after the first where
    they stand (asked once per tokenizer, with and without tools where it has tool calling)."""
    with _lock:
        known = _answers.get(tokenizer)
    if known is not None:
        return known
    tool_sets = [None, [_PROBE_TOOL]] if getattr(tokenizer, "has_tool_calling", False) else [None]
    answer = all(_in_order(tokenizer, tools, template_args) for tools in tool_sets)
    if not answer:
        log.info(
            "this model's chat template renders no system message after the first in place: "
            "such messages join the user turn next to them"
        )
    with _lock:
        _answers[tokenizer] = answer
    return answer


def _in_order(tokenizer, tools, template_args: dict) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in _PROBE],
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **template_args,
        )
    except Exception:  # noqa: BLE001 - templates raise what they like (jinja's raise_exception)
        return False
    if not isinstance(text, str):
        return False
    where = [text.find(m) for m in _MARKERS]
    return all(w >= 0 for w in where) and where == sorted(where)


def place(messages: list[dict], tokenizer, template_args: dict) -> list[dict]:
    """``messages`` as this tokenizer's template can render them (see the module's doc)."""
    if renders_in_place(tokenizer, template_args):
        return messages
    return fold(messages)


def fold(messages: list[dict]) -> list[dict]:
    """The leading system messages as one, later system messages as user ones, and runs of
    user messages as one."""
    out: list[dict] = []
    leading = True
    for message in messages:
        role = message["role"]
        if role == "system" and leading and out:
            out[-1] = {"role": "system", "content": out[-1]["content"] + JOIN + message["content"]}
            continue
        leading = leading and role == "system"
        if role == "system" and not leading:
            message = {"role": "user", "content": message["content"]}
        if message["role"] == "user" and out and _plain_user(out[-1]) and _plain_user(message):
            out[-1] = {"role": "user", "content": out[-1]["content"] + JOIN + message["content"]}
            continue
        out.append(message)
    return out


def _plain_user(message: dict) -> bool:
    return message["role"] == "user" and isinstance(message.get("content"), str)
