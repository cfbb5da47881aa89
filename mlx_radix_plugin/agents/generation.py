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
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlx_lm_hooks.server import GenerationFailed, ModelUnavailable, RequestRefused

from . import instructions
from .fields import ApiError
from .tools import Toolset

log = logging.getLogger("mlx_radix.agents")

# The tail decoded to tell which stop sequence ended an answer (the server strips it).
STOP_TAIL_TOKENS = 32


NO_TOOL_CALLING = (
    "tools: this model has no tool calling (its chat template and tokenizer name no "
    "tool-call format mlx-lm parses); send the request without tools"
)


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None
    # The API's name for a field where it is not chat completions' (mlx_lm_hooks' check of
    # what a batch can run names the field the client sent).
    names: dict[str, str] = field(default_factory=dict)


@dataclass
class Conversation:
    """A request in chat-completions form: what the chat template renders (its system
    messages placed per template at tokenization: instructions.py)."""

    messages: list[dict]
    tools: Toolset
    sampling: Sampling
    model: str
    salt: str | None = None


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
        tools = self._conversation.tools.for_parser
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
    tools = conversation.tools.rendered
    if tools and not tokenizer.has_tool_calling:
        raise ApiError(400, NO_TOOL_CALLING, "tools")
    template_args = generator.cli_args.chat_template_args
    return tokenizer.apply_chat_template(
        instructions.place(conversation.messages, tokenizer, template_args),
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        **template_args,
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
    tools = conversation.tools.rendered
    request = CompletionRequest("chat", "", conversation.messages, tools, None)
    request.cache_salt = conversation.salt
    request.param_names = s.names

    def messages_for(tokenizer) -> list[dict]:
        # Called where the prompt is rendered (hooks' tokenization), with its tokenizer.
        return instructions.place(conversation.messages, tokenizer, cli.chat_template_args)

    request.messages_for = messages_for
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
    if tools and not ctx.has_tool_calling:
        turn.close()
        raise ApiError(400, NO_TOOL_CALLING, "tools")
    return turn
