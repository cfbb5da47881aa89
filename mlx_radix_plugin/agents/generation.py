"""One agent request through mlx_lm.server's own generation: its arguments, its run, and
its output read as events.

Both agent APIs translate a request into what stock's chat completions hand the generation
thread: a ``CompletionRequest`` of OpenAI-style chat messages and tools, and
``GenerationArguments``. So they share its model, prompt cache (the radix pool or stock's),
batching, stop sequences, chat template and tool parser, and an agent's turn N+1 finds turn
N's prompt and answer cached however it arrived. The output is read once, here, as events
in the order the model wrote them (reasoning, text, tool calls, the end); each API renders
them its own way (the output processor apart from the engine, as in vLLM's v1).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlx_lm_hooks.salt import BadSalt, parse_salt
from mlx_lm_hooks.server import GenerationFailed, ModelUnavailable, RequestRefused

log = logging.getLogger("mlx_radix_plugin.agents")

# The tail decoded to tell which stop sequence ended an answer (the server strips it).
STOP_TAIL_TOKENS = 32


NO_TOOL_CALLING = (
    "tools: this model has no tool calling (its chat template and tokenizer name no "
    "tool-call format mlx-lm parses); send the request without tools"
)


class ApiError(Exception):
    """A request the API answers with an error of its own shape; ``param`` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            503: "overloaded_error",
        }.get(status, "api_error")


def bad(param: str, message: str) -> ApiError:
    """HTTP 400 naming the field: ``param`` is its path (``messages.2.content.0.type``)."""
    return ApiError(400, f"{param}: {message}", param)


# --- reading a request's fields: each names the field and what it accepts -----------------


def model_of(body: object) -> str:
    """The request's ``model``, once the body is known to be a JSON object."""
    if not isinstance(body, dict):
        raise bad("body", f"must be a JSON object, got {type(body).__name__}")
    return nonempty(body.get("model"), "model")


def nonempty(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(param, f"must be a non-empty string, got {value!r}")
    return value


def number(body: dict, name: str, low: float, high: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        limit = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise bad(name, f"must be {limit}, got {value!r}")
    return float(value)


def integer(body: dict, name: str, low: int, required: bool = False) -> int | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad(name, "is required: an integer")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(name, f"must be an integer of at least {low}, got {value!r}")
    return value


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


def strings(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad(name, f"must be a list of non-empty strings, got {value!r}")
    return list(value)


def text_of(value: Any, param: str, text_types: tuple[str, ...]) -> str:
    """A string, or the text of a list of text parts (``{"type": "text", "text": ...}``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(param, f"must be a string or a list of text blocks, got {value!r}")
    out = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in text_types or not isinstance(part.get("text"), str):
            raise bad(
                f"{param}.{i}",
                f"must be a text block ({' or '.join(text_types)} with a string 'text'), "
                f"got {part!r}",
            )
        out.append(part["text"])
    return "".join(out)


def logit_bias(body: dict) -> dict[int, float] | None:
    """``logit_bias``, as chat completions take it (token id -> bias): an extension of both
    APIs, as ``cache_salt`` is, so that one benchmark can ban EOS on every route."""
    value = body.get("logit_bias")
    if value is None:
        return None
    try:
        if not isinstance(value, dict):
            raise TypeError
        return {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise bad("logit_bias", f"must map token ids to numbers, got {value!r}") from None


def tool_list(value: object, one: Callable[[dict, str], dict]) -> list[dict] | None:
    """``tools`` in chat completions' form, ``one(tool, its path)`` reading each."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad("tools", f"must be a list of tools, got {value!r}")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise bad(f"tools.{i}", f"must be an object, got {tool!r}")
        tools.append(one(tool, f"tools.{i}"))
    return tools


def function_tool(tool: dict, at: str, schema_key: str, default_schema=None) -> dict:
    """One tool in chat completions' form (what chat templates render): its ``name``, the
    JSON schema under ``schema_key`` and an optional ``description``."""
    name, schema = nonempty(tool.get("name"), f"{at}.name"), tool.get(schema_key, default_schema)
    if not isinstance(schema, dict):
        raise bad(f"{at}.{schema_key}", f"must be a JSON schema object, got {schema!r}")
    function = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def named_tool(name: object, tools: list[dict] | None, param: str) -> None:
    """A ``tool_choice`` that names a tool must name one of ``tools``."""
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise bad(param, f"must name one of the tools {names}, got {name!r}")


def block_text(block: dict, param: str) -> str:
    """A text block's text."""
    if not isinstance(block.get("text"), str):
        raise bad(f"{param}.text", f"must be a string, got {block.get('text')!r}")
    return block["text"]


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None


@dataclass
class Conversation:
    """A request in chat-completions form: what the chat template renders."""

    messages: list[dict]
    tools: list[dict] | None
    sampling: Sampling
    model: str
    salt: str | None = None


def salt_of(body: dict) -> str | None:
    try:
        return parse_salt(body)
    except BadSalt as e:
        raise ApiError(400, str(e), "cache_salt") from e


# --- events -------------------------------------------------------------------------------


@dataclass
class Text:
    text: str


@dataclass
class Reasoning:
    text: str


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None  # the parser's, where the model's format carries one


@dataclass
class Finish:
    reason: str  # "stop", "length", "tool_calls" or "stop_sequence"
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


Event = Text | Reasoning | ToolCall | Finish


class Turn:
    """A request the generation thread has taken: ``events()`` reads its answer, ``close()``
    stops it and gives back what it holds (also when the client hangs up)."""

    def __init__(self, ctx, responses, conversation: Conversation, tokenizer):
        self.ctx = ctx
        self._responses = responses
        self._conversation = conversation
        self._tokenizer = tokenizer

    @property
    def prompt_tokens(self) -> int:
        return len(self.ctx.prompt)

    @property
    def cached_tokens(self) -> int:
        return max(self.ctx.prompt_cache_count, 0)

    def close(self) -> None:
        self.ctx.stop()
        self._responses.close()

    def events(self) -> Iterator[Event]:
        """The answer as events; the same reading of the text state machine as stock's
        chat completions (reasoning, normal text, tool sections), so the text is what a
        chat completion would have carried."""
        from mlx_lm.generate import TextStateMachine

        ctx = self.ctx
        tools = self._conversation.tools
        state = ctx.text_sm.make_state(ctx.initial_state)
        previous = ctx.initial_state
        tool_text = ""
        finish = "stop"
        made_tool_call = False
        tokens: list[int] = []
        for gen in self._responses:
            if gen.finish_reason == "stop":
                state, current = TextStateMachine.discard(state)
                segments = [(current, "")]
            elif gen.finish_reason == "length":
                state, segments = TextStateMachine.split(state, gen.text)
                state, flushed, current = TextStateMachine.flush(state)
                segments.append((current, flushed))
            else:
                state, segments = TextStateMachine.split(state, gen.text)
            for current, text in segments:
                if current == "reasoning":
                    if text:
                        yield Reasoning(text)
                elif current == "tool":
                    tool_text += text
                elif current == "normal":
                    if previous == "tool":
                        yield from self._tool_calls(tool_text, tools)
                        tool_text, made_tool_call = "", True
                    if text:
                        yield Text(text)
                previous = current
            tokens.append(gen.token)
            if gen.finish_reason is not None:
                finish = gen.finish_reason
        if previous == "tool" and tool_text:
            yield from self._tool_calls(tool_text, tools)
            made_tool_call = True
        stop_sequence = None
        if finish == "stop" and made_tool_call:
            finish = "tool_calls"
        elif finish == "stop":
            stop_sequence = self._stop_sequence(tokens)
            if stop_sequence is not None:
                finish = "stop_sequence"
        yield Finish(finish, stop_sequence, self.prompt_tokens, self.cached_tokens, len(tokens))

    def _tool_calls(self, text: str, tools) -> Iterator[ToolCall]:
        try:
            parsed = self.ctx.tool_parser(text, tools)
        except (ValueError, KeyError, TypeError) as e:  # json errors are ValueErrors
            # As stock: a call cut off mid-way (max_tokens) is dropped, with a warning.
            log.warning("a tool call could not be parsed (%s: %s); dropped", type(e).__name__, e)
            return
        for call in parsed if isinstance(parsed, list) else [parsed]:
            arguments = call.get("arguments") if isinstance(call, dict) else None
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    arguments = None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                log.warning("a tool call without a name was dropped: %r", call)
                continue
            if not isinstance(arguments, dict):
                log.warning("tool call %s has arguments that are no JSON object; dropped", call)
                continue
            yield ToolCall(call["name"], arguments, call.get("id"))

    def _stop_sequence(self, tokens: list[int]) -> str | None:
        """Which stop sequence ended the answer: the server strips it from the text, so the
        tail is decoded again (an end-of-sequence token is no stop sequence)."""
        stops = self._conversation.sampling.stop
        if not stops or not tokens or tokens[-1] in self._tokenizer.eos_token_ids:
            return None
        tail = self._tokenizer.decode(tokens[-STOP_TAIL_TOKENS:])
        found = [(tail.rfind(s), s) for s in stops if s in tail]
        return max(found)[1] if found else None


def render(generator, conversation: Conversation) -> list[int]:
    """The prompt's tokens, rendered as the generation thread renders it (stock's
    ``_tokenize``: the chat template with the server's ``--chat-template-args``)."""
    tokenizer = generator.model_provider.tokenizer
    if tokenizer is None:
        raise ApiError(503, "no model is loaded yet: send a message first, then count")
    if conversation.tools and not tokenizer.has_tool_calling:
        raise ApiError(400, NO_TOOL_CALLING, "tools")
    return tokenizer.apply_chat_template(
        conversation.messages,
        tools=conversation.tools,
        add_generation_prompt=True,
        tokenize=True,
        **generator.cli_args.chat_template_args,
    )


def start(generator, conversation: Conversation) -> Turn:
    """Hand ``conversation`` to the generation thread; returns once it is tokenized (and its
    cache found), or raises ``ApiError`` with what the client should hear."""
    from mlx_lm.server import (
        CompletionRequest,
        GenerationArguments,
        LogitsProcessorArguments,
        ModelDescription,
        SamplingArguments,
    )

    cli = generator.cli_args
    s = conversation.sampling
    # Agents name models of their own ("claude-...", "gpt-..."): a server started with
    # --model answers with it, whatever the name; one without loads the name, as stock does.
    model = "default_model" if cli.model else conversation.model
    args = GenerationArguments(
        model=ModelDescription(model=model, draft="default_model", adapter=None),
        sampling=SamplingArguments(
            temperature=cli.temp if s.temperature is None else s.temperature,
            top_p=cli.top_p if s.top_p is None else s.top_p,
            top_k=cli.top_k if s.top_k is None else s.top_k,
            min_p=cli.min_p,
            xtc_probability=0.0,
            xtc_threshold=0.0,
        ),
        logits=LogitsProcessorArguments(
            logit_bias=s.logit_bias,
            repetition_penalty=0.0,
            repetition_context_size=20,
            presence_penalty=0.0,
            presence_context_size=20,
            frequency_penalty=0.0,
            frequency_context_size=20,
        ),
        stop_words=s.stop,
        max_tokens=cli.max_tokens if s.max_tokens is None else s.max_tokens,
        num_draft_tokens=cli.num_draft_tokens,
        logprobs=False,
        top_logprobs=-1,
        seed=None,
        chat_template_kwargs=None,
    )
    request = CompletionRequest("chat", "", conversation.messages, conversation.tools, None)
    request.cache_salt = conversation.salt
    try:
        ctx, responses = generator.generate(request, args)
    except RequestRefused as e:
        raise ApiError(400, str(e)) from e
    except ModelUnavailable as e:
        raise ApiError(404, str(e), "model") from e
    except GenerationFailed as e:
        raise ApiError(503, str(e)) from e
    except RuntimeError as e:  # "generation thread died"
        raise ApiError(503, f"the server cannot generate now: {e}") from e
    turn = Turn(ctx, responses, conversation, generator.model_provider.tokenizer)
    if conversation.tools and not ctx.has_tool_calling:
        turn.close()
        raise ApiError(400, NO_TOOL_CALLING, "tools")
    return turn
