"""The benchmark's workloads (DESIGN.md section 5), their seeded requests, and presets.

A workload builds *clients*: functions that send requests one after another through a
``send(key, path, body)`` callable and get the generated text back. Clients run
concurrently; a workload's concurrency is its number of clients. Every request has a
key, so the outputs of the two servers are compared request by request whatever order
they finished in. A workload may also have warm-up requests, sent one by one before its
clients start and not measured.

Prompts are made of words that are one token each for the model's tokenizer, so a
prompt of N words is N tokens and a shared prefix stays a token-exact shared prefix.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import ClassVar

from ...agents import messages as agent_messages
from .servers import ServerProcess, event_text, openai_usage

Send = Callable[[Hashable, str, dict], str]
Request = tuple[str, dict]  # (path, body)
Client = Callable[[Send], None]

WORD = re.compile(r"[A-Za-z][A-Za-z0-9]{0,15}")


class PromptError(ValueError):
    """The model's tokenizer cannot give prompts of exact token counts."""


def context_tokens(model_dir: Path) -> int | None:
    """Most tokens the model reads, as its config says (a multimodal one's text config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    limit = config.get("max_position_embeddings")
    return limit if isinstance(limit, int) and limit > 0 else None


def too_long(workloads: list[Workload], model_dir: Path) -> dict[str, str]:
    """The workloads whose prompts pass the model's context, each with why."""
    context = context_tokens(model_dir)
    return {
        w.name: (
            f"the {w.name} workload's prompts reach {w.longest_prompt:,} tokens and this "
            f"model reads {context:,}: serve a model with a longer context (--random "
            "tiny-long on a CPU)"
        )
        for w in workloads
        if context and w.longest_prompt and w.longest_prompt > context
    }


def fits(workloads: list[Workload], model_dir: Path) -> None:
    """Raises ``PromptError`` naming a workload whose prompts pass the model's context."""
    for why in too_long(workloads, model_dir).values():
        raise PromptError(why)


def single_token_words(model_dir: Path, limit: int = 4096) -> list[str]:
    """Up to ``limit`` words that each encode to one token, also when joined by spaces.

    Read from the model's ``tokenizer.json`` in id order (common words first in BPE
    vocabularies). A word qualifies when " w w" encodes to its id twice: then any
    space-joined run of such words is exactly one token per word.
    """
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise PromptError(f"{path} not found: the benchmark builds prompts from tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    found: list[str] = []
    for token_id in range(tok.get_vocab_size()):
        word = tok.decode([token_id]).strip()
        if not WORD.fullmatch(word):
            continue
        if tok.encode(f" {word} {word}", add_special_tokens=False).ids == [token_id] * 2:
            found.append(word)
            if len(found) == limit:
                break
    if len(found) < 64:
        raise PromptError(
            f"{path}: only {len(found)} words encode to one token each (64 needed); "
            "the benchmark needs a tokenizer that splits on spaces (byte-level BPE, word-level)"
        )
    return found


class Prompts(random.Random):
    """Seeded text of exact token counts, the same for both servers."""

    def __init__(self, seed: str, words: list[str]):
        super().__init__(seed)
        self.words = words
        self._kept: dict[str, str] = {}

    def text(self, tokens: int) -> str:
        return "".join(" " + self.choice(self.words) for _ in range(tokens))

    def kept(self, name: str, tokens: int) -> str:
        """Text drawn at the first call for ``name`` and returned again after: a prefix that
        a workload's warm-up and its clients share (both draw from one ``Prompts``)."""
        if name not in self._kept:
            self._kept[name] = self.text(tokens)
        return self._kept[name]


@dataclass(frozen=True)
class Sampling:
    """Greedy requests, streamed with usage; ``logit_bias`` may ban EOS so random-weight
    models generate full-length outputs."""

    logit_bias: dict[str, float] = field(default_factory=dict)

    def _common(self, max_tokens: int) -> dict:
        body = {
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        if self.logit_bias:
            body["logit_bias"] = self.logit_bias
        return body

    def completion(self, prompt: str, max_tokens: int) -> Request:
        return "/v1/completions", {"prompt": prompt, **self._common(max_tokens)}

    def chat(self, messages: list[dict], max_tokens: int) -> Request:
        return "/v1/chat/completions", {"messages": messages, **self._common(max_tokens)}

    def messages(self, system: str, messages: list[dict], max_tokens: int) -> Request:
        """A Messages API request (``logit_bias`` is the plugin's extension of it)."""
        body = {"model": "bench", "system": system, "messages": messages, "temperature": 0.0}
        body["max_tokens"] = max_tokens
        if self.logit_bias:
            body["logit_bias"] = self.logit_bias
        return "/v1/messages", body


def stock_form(path: str, body: dict) -> Request:
    """What stock mlx_lm.server, which has no Messages API, is sent in its place: the same
    conversation through chat completions, as the plugin translates it."""
    if path != "/v1/messages":
        return path, body
    conversation = agent_messages.conversation(body)
    chat = {
        "messages": conversation.messages,
        "max_tokens": body["max_tokens"],
        "temperature": body.get("temperature", 0.0),
        "stream_options": {"include_usage": True},
    }
    if body.get("logit_bias"):
        chat["logit_bias"] = body["logit_bias"]
    return "/v1/chat/completions", chat


def _pool(requests: list[tuple[Hashable, Request]], concurrency: int) -> list[Client]:
    """``concurrency`` clients taking the requests in order from one queue."""
    queue = deque(requests)

    def client(send: Send) -> None:
        while True:
            try:
                key, (path, body) = queue.popleft()
            except IndexError:
                return
            send(key, path, body)

    return [client] * concurrency


@dataclass(frozen=True)
class Workload(ABC):
    """Sizes of one workload; ``build`` turns them into clients for one server's run."""

    name: ClassVar[str]
    # Poll the plugin's stats while the workload runs, for the most K/V live requests held.
    poll_pool: ClassVar[bool] = False
    # Report decode tokens/s per run from the replies' first-token and end times.
    decode_rate: ClassVar[bool] = False
    # Runs on fresh server processes that it stops and starts again (``run_workload``'s
    # ``restart``), not on the servers the other workloads share.
    restarts: ClassVar[bool] = False
    # Replies keyed (client, turn): the report gives each turn's TTFT and cached share.
    per_turn: ClassVar[bool] = False

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def repeats(self) -> int:
        """Runs per server; the servers alternate which goes first each time."""
        return 1

    @property
    @abstractmethod
    def total_requests(self) -> int:
        """Requests per run."""

    @property
    def one_copy_tokens(self) -> int | None:
        """Tokens of one copy of the K/V the live requests need, where the workload polls
        the pool; the K/V held is reported against it."""
        return None

    @property
    def longest_prompt(self) -> int | None:
        """Tokens of text in its longest prompt, where that may be past a model's context."""
        return None

    def warmup(self, p: Prompts, s: Sampling) -> list[Request]:
        """Requests sent before the clients, one at a time, neither timed nor reported;
        drawn from the same ``p`` just before ``build``."""
        return []

    @abstractmethod
    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        """The clients of one run; the same ``p`` seed gives the same requests."""


@dataclass(frozen=True)
class SharedPrefix(Workload):
    """SGLang's generated-shared-prefix: ``groups`` system prompts with ``questions``
    questions each, shuffled, sent by ``concurrency`` clients."""

    groups: int
    questions: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    concurrency: int
    name: ClassVar[str] = "shared_prefix"

    @property
    def total_requests(self) -> int:
        return self.groups * self.questions

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        systems = [p.text(self.system_tokens) for _ in range(self.groups)]
        reqs = [
            ((g, q), s.completion(systems[g] + p.text(self.question_tokens), self.output_tokens))
            for g in range(self.groups)
            for q in range(self.questions)
        ]
        p.shuffle(reqs)
        return _pool(reqs, self.concurrency)


@dataclass(frozen=True)
class Burst(Workload):
    """``requests`` requests on one new prefix, sent at once: stock computes the prefix
    once per request; the ideal is once. Each of ``rounds`` rounds has a new prefix; the
    report gives the first apart from the rest, since a server's first burst also pays
    first-use costs (on this project's VM, first touch of memory: about 3 s a GB)."""

    requests: int
    prefix_tokens: int
    question_tokens: int
    output_tokens: int
    rounds: int = 1
    name: ClassVar[str] = "burst"

    @property
    def repeats(self) -> int:
        return self.rounds

    @property
    def total_requests(self) -> int:
        return self.requests

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        prefix = p.text(self.prefix_tokens)
        reqs = [
            (i, s.completion(prefix + p.text(self.question_tokens), self.output_tokens))
            for i in range(self.requests)
        ]
        return _pool(reqs, self.requests)


@dataclass(frozen=True)
class PrefixRepetition(Workload):
    """``prefixes`` prefixes cycled over ``requests`` sequential requests. With more
    prefixes than stock's 10 prompt-cache entries, its LRU order evicts each prefix
    just before it comes round again; a pool that holds them all hits every time."""

    prefixes: int
    requests: int
    prefix_tokens: int
    question_tokens: int
    output_tokens: int
    name: ClassVar[str] = "prefix_repetition"

    @property
    def total_requests(self) -> int:
        return self.requests

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        prefixes = [p.text(self.prefix_tokens) for _ in range(self.prefixes)]
        reqs = []
        for i in range(self.requests):
            prompt = prefixes[i % self.prefixes] + p.text(self.question_tokens)
            reqs.append((i, s.completion(prompt, self.output_tokens)))
        return _pool(reqs, 1)


@dataclass(frozen=True)
class MultiTurn(Workload):
    """``clients`` concurrent chats of ``rounds`` rounds on one system prompt; each round
    sends the whole history (with the server's own earlier replies) and a new user turn."""

    clients: int
    rounds: int
    system_tokens: int
    turn_tokens: int
    output_tokens: int
    name: ClassVar[str] = "multi_turn"

    @property
    def total_requests(self) -> int:
        return self.clients * self.rounds

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        system = p.text(self.system_tokens)
        # Drawn here, not in the client threads, so both servers get the same turns.
        turns = [
            [p.text(self.turn_tokens) for _ in range(self.rounds)] for _ in range(self.clients)
        ]

        def chat(c: int, send: Send) -> None:
            messages = [{"role": "system", "content": system}]
            for r, turn in enumerate(turns[c]):
                messages.append({"role": "user", "content": turn})
                reply = send((c, r), *s.chat(list(messages), self.output_tokens))
                messages.append({"role": "assistant", "content": reply})

        return [partial(chat, c) for c in range(self.clients)]


@dataclass(frozen=True)
class Conversations(Workload):
    """The commonest load of all: ``sessions`` chats that share little, each growing turn by
    turn. One short system prompt, then each session's own opening message of
    ``opening_tokens`` (a pasted text, a question with its context) and ``turns`` - 1 more
    turns of ``turn_tokens``, every request the whole history with the server's own replies.
    Session ``i`` starts ``arrival_s * i`` seconds after the first and each waits ``think_s``
    between its turns, so the histories in flight overlap as users' do: each server's cache
    must keep every session's history for its next turn (issue 59)."""

    sessions: int
    turns: int
    system_tokens: int
    opening_tokens: int
    turn_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    think_s: float = 0.0
    name: ClassVar[str] = "conversations"
    per_turn: ClassVar[bool] = True

    @property
    def total_requests(self) -> int:
        return self.sessions * self.turns

    @property
    def longest_prompt(self) -> int:
        """A session's last request (the template's marks come on top)."""
        later = self.turns - 1
        return (
            self.system_tokens
            + self.opening_tokens
            + later * self.turn_tokens
            + later * self.output_tokens
        )

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        system = p.text(self.system_tokens)
        # Drawn here, not in the client threads, so both servers get the same turns.
        texts = [
            [p.text(self.opening_tokens)]
            + [p.text(self.turn_tokens) for _ in range(self.turns - 1)]
            for _ in range(self.sessions)
        ]

        def session(c: int, send: Send) -> None:
            time.sleep(self.arrival_s * c)
            messages = [{"role": "system", "content": system}]
            for t, text in enumerate(texts[c]):
                if t:
                    time.sleep(self.think_s)
                messages.append({"role": "user", "content": text})
                reply = send((c, t), *s.chat(list(messages), self.output_tokens))
                messages.append({"role": "assistant", "content": reply})

        return [partial(session, c) for c in range(self.sessions)]


@dataclass(frozen=True)
class AgentSession(Workload):
    """A coding agent's sessions through the Messages API, in Claude Code's shape:
    ``clients`` sessions on one system prompt of ``system_tokens`` (an agent's instructions
    and tool definitions), each ``turns`` turns. A turn is a user message, then
    ``requests_per_turn`` requests: each reply but the last calls a tool, whose result of
    ``result_tokens`` the client appends before the next request; the last reply answers.
    Stock, which has no Messages API, gets the same conversations through its chat
    completions (``stock_form``)."""

    clients: int
    turns: int
    system_tokens: int
    result_tokens: int
    output_tokens: int
    requests_per_turn: int = 1
    name: ClassVar[str] = "agent"
    per_turn: ClassVar[bool] = True

    @property
    def total_requests(self) -> int:
        return self.clients * self.turns * self.requests_per_turn

    @property
    def longest_prompt(self) -> int:
        """A session's last request (the template's marks come on top)."""
        calls = self.requests_per_turn - 1
        turn = self.result_tokens * (1 + calls) + self.output_tokens * self.requests_per_turn
        return self.system_tokens + self.turns * turn

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        system = p.text(self.system_tokens)
        texts = [
            [p.text(self.result_tokens) for _ in range(self.turns * self.requests_per_turn)]
            for _ in range(self.clients)
        ]

        def session(c: int, send: Send) -> None:
            messages: list[dict] = []
            own = iter(texts[c])
            for t in range(self.turns):
                messages.append({"role": "user", "content": next(own)})
                for r in range(self.requests_per_turn):
                    reply = send((c, t, r), *s.messages(system, list(messages), self.output_tokens))
                    content = [{"type": "text", "text": reply}]
                    if r == self.requests_per_turn - 1:
                        messages.append({"role": "assistant", "content": content})
                        continue
                    call = {"type": "tool_use", "id": f"toolu_{c}_{t}_{r}", "name": "run"}
                    call["input"] = {"step": r}
                    messages.append({"role": "assistant", "content": [*content, call]})
                    result = {"type": "tool_result", "tool_use_id": call["id"]}
                    result["content"] = next(own)
                    messages.append({"role": "user", "content": [result]})

        return [partial(session, c) for c in range(self.clients)]


@dataclass(frozen=True)
class Decode(Workload):
    """``batch`` concurrent requests, short distinct prompts, long outputs: aggregate
    generated tokens/s, run ``rounds`` times per server."""

    batch: int
    prompt_tokens: int
    output_tokens: int
    rounds: int
    name: ClassVar[str] = "decode"

    @property
    def repeats(self) -> int:
        return self.rounds

    @property
    def total_requests(self) -> int:
        return self.batch

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        reqs = [
            (i, s.completion(p.text(self.prompt_tokens), self.output_tokens))
            for i in range(self.batch)
        ]
        return _pool(reqs, self.batch)


@dataclass(frozen=True)
class LivePrefix(Workload):
    """``requests`` requests live at once on one ``prefix_tokens``-token prefix, each with
    its own question: the K/V the plugin holds for them is polled and set against one copy."""

    requests: int
    prefix_tokens: int
    question_tokens: int
    output_tokens: int
    poll_pool: ClassVar[bool] = True

    @property
    def total_requests(self) -> int:
        return self.requests

    @property
    def one_copy_tokens(self) -> int:
        return self.prefix_tokens + self.requests * (self.question_tokens + self.output_tokens)


@dataclass(frozen=True)
class Memory(LivePrefix):
    """A burst on a new prefix: peak process memory, and the K/V bytes the plugin holds
    meanwhile (pool pages and batch buffers)."""

    name: ClassVar[str] = "memory"

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        return Burst(**self.params()).build(p, s)


@dataclass(frozen=True)
class DecodeShared(LivePrefix):
    """Decode over a shared cached prefix: the requests sent at once with long outputs, run
    ``rounds`` times per server. A warm-up request on the same prefix (another question)
    caches it on both servers first, so the rounds time decoding, not the prefix's prefill."""

    rounds: int
    name: ClassVar[str] = "decode_shared"
    decode_rate: ClassVar[bool] = True
    WARMUP_OUTPUT_TOKENS: ClassVar[int] = 2  # enough for both servers to cache the prompt

    @property
    def repeats(self) -> int:
        return self.rounds

    @property
    def warmup_tokens(self) -> int:
        """The warm-up request's prompt and output."""
        return self.prefix_tokens + self.question_tokens + self.WARMUP_OUTPUT_TOKENS

    def warmup(self, p: Prompts, s: Sampling) -> list[Request]:
        prompt = p.kept("prefix", self.prefix_tokens) + p.text(self.question_tokens)
        return [s.completion(prompt, self.WARMUP_OUTPUT_TOKENS)]

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        prefix = p.kept("prefix", self.prefix_tokens)
        reqs = [
            (i, s.completion(prefix + p.text(self.question_tokens), self.output_tokens))
            for i in range(self.requests)
        ]
        return _pool(reqs, self.requests)


@dataclass(frozen=True)
class Restart(Workload):
    """A warm restart: a request on a new ``prefix_tokens``-token prefix, then the server
    stopped cleanly (SIGTERM, waited for) and started again, then a request on the same
    prefix with another question. That request's TTFT is measured from its send, once the
    new process answers and has had the benchmark's usual first request, so the model's load
    is left out. The plugin runs with its disk tier on (in a new directory each round) and
    reads the prefix's pages back; stock starts with nothing cached and computes it again.
    Each of ``rounds`` rounds has a new prefix and new processes."""

    prefix_tokens: int
    question_tokens: int
    output_tokens: int
    rounds: int = 1
    name: ClassVar[str] = "restart"
    restarts: ClassVar[bool] = True
    AFTER: ClassVar[str] = "after"  # the measured reply's key (the one before: ``Run.before``)

    @property
    def repeats(self) -> int:
        return self.rounds

    @property
    def total_requests(self) -> int:
        return 2  # one before the restart, one after

    def _texts(self, p: Prompts) -> tuple[str, str, str]:
        """The prefix and the two questions, drawn in this order whoever asks first."""
        prefix = p.kept("prefix", self.prefix_tokens)
        return prefix, p.kept("before", self.question_tokens), p.kept("after", self.question_tokens)

    def before(self, p: Prompts, s: Sampling) -> Request:
        """The request sent before the restart (not timed against anything)."""
        prefix, question, _ = self._texts(p)
        return s.completion(prefix + question, self.output_tokens)

    def build(self, p: Prompts, s: Sampling) -> list[Client]:
        prefix, _, question = self._texts(p)
        return _pool([(self.AFTER, s.completion(prefix + question, self.output_tokens))], 1)


@dataclass(frozen=True)
class Preset:
    workloads: tuple[Workload, ...]


PRESETS: dict[str, Preset] = {
    # CI: seconds on a tiny model, a few minutes on SmolLM2-135M on 2 CPU cores.
    "smoke": Preset(
        (
            SharedPrefix(2, 4, 64, 8, 4, concurrency=4),
            Burst(4, 64, 8, 4),
            PrefixRepetition(12, 24, 32, 4, 2),
            MultiTurn(2, 3, 32, 8, 4),
            Conversations(3, 3, 8, 48, 8, 4, arrival_s=0.05),
            Decode(4, 8, 16, rounds=2),
            DecodeShared(4, 64, 8, 16, rounds=2),
            Memory(8, 128, 8, 8),
            Restart(128, 8, 4),
            AgentSession(1, 3, 256, 16, 8, requests_per_turn=2),
        ),
    ),
    "small": Preset(
        (
            SharedPrefix(4, 4, 256, 32, 8, concurrency=4),
            Burst(8, 500, 16, 8),
            PrefixRepetition(12, 36, 128, 16, 4),
            MultiTurn(4, 3, 128, 24, 16),
            Conversations(6, 4, 16, 256, 32, 16, arrival_s=0.5, think_s=0.5),
            Decode(8, 32, 64, rounds=3),
            DecodeShared(8, 1024, 16, 64, rounds=3),
            Memory(8, 1024, 16, 16),
            Restart(2048, 16, 8, rounds=3),
            AgentSession(1, 4, 1024, 32, 16, requests_per_turn=3),
        ),
    ),
    # DESIGN.md's baselines: shared prefix 4 x 8 of ~600 tokens, burst of 8 on a new
    # 500-token prefix, decode of 8 x 128 tokens over 5 alternating rounds; shared-prefix
    # decode's acceptance run: 8 x 128 tokens on one cached 2,048-token prefix.
    "medium": Preset(
        (
            SharedPrefix(4, 8, 512, 64, 16, concurrency=8),
            Burst(8, 500, 16, 8, rounds=3),
            PrefixRepetition(16, 48, 256, 16, 8),
            MultiTurn(4, 4, 256, 32, 32),
            # Chats side by side (issue 59): 8 sessions of 5 turns, a 512-token opening
            # each, starting 2 s apart, 1 s between a reply and the next turn.
            Conversations(8, 5, 32, 512, 48, 32, arrival_s=2.0, think_s=1.0),
            Decode(8, 32, 128, rounds=5),
            DecodeShared(8, 2048, 16, 128, rounds=3),
            Memory(8, 1024, 16, 32),
            Restart(4096, 16, 8, rounds=3),
            # Claude Code's and Codex's sessions (docs/agents.md): about 24k tokens of
            # instructions and tools, then turns of 3 requests, tool results between them. It
            # needs a model that reads 32k tokens (the default model reads 8,192):
            # `--random tiny-long` on a CPU.
            AgentSession(2, 4, 24000, 384, 24, requests_per_turn=3),
        ),
    ),
}
WORKLOADS = tuple(w.name for w in PRESETS["smoke"].workloads)


@dataclass
class Reply:
    text: str
    usage: dict
    ttft_s: float | None  # None: no text came back
    # time.perf_counter() at the first text and at the end of the stream: comparable across
    # one run's requests, for the decode rate while they all decode.
    first_token_at: float | None = None
    done_at: float | None = None


@dataclass
class Run:
    """One workload on one server: what the clients saw and what the process spent."""

    server: str
    workload: str
    wall_s: float
    replies: dict[Hashable, Reply]
    cpu_s: float | None = None
    peak_rss_bytes: int | None = None
    peak_rss_method: str | None = None
    # From /v1/cache/stats deltas; None from stock, which has no such endpoint.
    stats_prompt_tokens: int | None = None
    stats_cached_tokens: int | None = None
    # K/V bytes live requests held: their locked pool pages plus mlx-lm's batch buffers.
    kv_bytes_held_peak: int | None = None
    # The same at moments when every live request decodes and nothing is being prefilled.
    kv_bytes_held_decode_peak: int | None = None
    pool_bytes_per_token: float | None = None
    decode_paths: list[str] | None = None  # the plugin's decode paths seen, in order
    # A workload that restarts its server: the reply before the restart, and ``restarted``,
    # what the restart and (from the plugin's stats) the disk tier did; see ``run_workload``.
    before: Reply | None = None
    restarted: dict | None = None


# What a restart hands back: the new server (up, its first request sent) and
# {"exit_code": the old process's exit status (None: it was killed, not stopped),
#  "stop_s": seconds from SIGTERM to its exit, "start_s": seconds until the new one answered}.
Restarter = Callable[[ServerProcess], tuple[ServerProcess, dict]]
# The disk tier's counters a restart reports, as deltas over the measured request.
DISK_DELTAS = ("disk_hits", "disk_pages_read", "disk_restore_seconds")


def _request(server: ServerProcess, name: str, path: str, body: dict) -> Reply:
    """Send one streamed request; what came back and when."""
    start = time.perf_counter()
    first: list[float] = []
    events = server.stream(path, body, on_first=lambda: first.append(time.perf_counter()))
    done = time.perf_counter()
    text = "".join(event_text(e) for e in events)
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    if usage is None:
        raise RuntimeError(f"{name}: no usage in the streamed response of {path}")
    usage = openai_usage(usage)
    first_at = first[0] if first else None
    ttft = None if first_at is None else first_at - start
    return Reply(text, usage, ttft, first_at, done)


def run_workload(
    server: ServerProcess,
    name: str,
    workload: Workload,
    prompts: Prompts,
    sampling: Sampling,
    on_reply: Callable[[], None] = lambda: None,
    restart: Restarter | None = None,
) -> Run:
    """Run ``workload`` on ``server``; ``on_reply()`` after each request finishes. A
    workload that ``restarts`` sends its ``before`` request to ``server``, then measures
    its clients on the server ``restart(server)`` hands back."""
    replies: dict[Hashable, Reply] = {}

    def send(key: Hashable, path: str, body: dict) -> str:
        if name == "stock":
            path, body = stock_form(path, body)
        replies[key] = reply = _request(server, name, path, body)
        on_reply()
        return reply.text

    before = restarted = None
    if workload.restarts:
        if restart is None:
            raise ValueError(f"{workload.name} restarts its server: run_workload needs restart")
        before = _request(server, name, *workload.before(prompts, sampling))
        on_reply()
        old_stats = server.stats()
        server, restarted = restart(server)
        restarted = dict(restarted)
        if old_stats is not None:
            # Written through while the old process ran; its clean stop wrote the rest.
            restarted["disk_pages_written_before_stop"] = old_stats.get("disk_pages_written")
    # Before the measured window: the stats deltas and the pool's baseline leave it out.
    for path, body in workload.warmup(prompts, sampling):
        server.stream(path, body)
    clients = workload.build(prompts, sampling)
    cpu_before, stats_before = server.cpu_seconds(), server.stats()
    poller = _PoolPoller(server, stats_before) if workload.poll_pool and stats_before else None
    with server.peak_rss() as peak:
        if poller:
            poller.start()
        wall = _concurrently([partial(c, send) for c in clients])
        if poller:
            poller.stop()
    cpu_after, stats_after = server.cpu_seconds(), server.stats()
    run = Run(
        name, workload.name, wall, replies, peak_rss_bytes=peak.bytes, peak_rss_method=peak.method
    )
    if cpu_before is not None and cpu_after is not None:
        run.cpu_s = round(cpu_after - cpu_before, 3)
    if stats_before and stats_after:
        run.stats_prompt_tokens = stats_after["prompt_tokens"] - stats_before["prompt_tokens"]
        run.stats_cached_tokens = stats_after["cached_tokens"] - stats_before["cached_tokens"]
        slots = stats_after["pages_total"] * stats_after["page_size"]
        run.pool_bytes_per_token = stats_after["pool_bytes_total"] / slots if slots else None
    if poller:
        run.kv_bytes_held_peak, run.decode_paths = poller.peak, poller.paths
        run.kv_bytes_held_decode_peak = poller.decode_peak
    if workload.restarts:
        run.before = before
        if stats_before and stats_after:
            # The new process's counters; its first request read nothing back.
            restarted["page_size"] = stats_after["page_size"]
            restarted["disk_pages_at_start"] = stats_before.get("disk_pages")
            for key in DISK_DELTAS:
                a, b = stats_after.get(key), stats_before.get(key)
                restarted[key] = None if a is None or b is None else round(a - b, 6)
        run.restarted = restarted
    return run


class _PoolPoller(threading.Thread):
    """Reads the plugin's stats every 20 ms; keeps the most K/V bytes live requests held
    and the decode paths the batch took."""

    def __init__(self, server: ServerProcess, before: dict):
        super().__init__(daemon=True)
        self.server, self.peak = server, 0
        self.decode_peak: int | None = None
        self.paths: list[str] = []
        self.page_bytes = before["pool_bytes_total"] // before["pages_total"]
        self.locked_before = before["pages_locked"]
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            self.sample(self.server.stats())

    def sample(self, stats: dict) -> None:
        # Locked pages are those live requests hold (pages cached by earlier workloads are
        # evictable); the batch buffers hold copies outside the pool. Both come from one
        # response, so they add up to what was held at one moment. A server older than
        # buffer_bytes has it uncounted.
        pages = max(0, stats["pages_locked"] - self.locked_before)
        held = pages * self.page_bytes + stats.get("buffer_bytes", 0)
        self.peak = max(self.peak, held)
        if stats.get("decode_rows") and stats.get("prefill_buffer_bytes") == 0:
            decoding = pages * self.page_bytes + stats["decode_buffer_bytes"]
            self.decode_peak = max(self.decode_peak or 0, decoding)
        path = stats.get("decode_path")
        if path is not None and path not in self.paths:
            self.paths.append(path)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _concurrently(fns: list[Callable[[], None]]) -> float:
    """Run ``fns`` in threads; the wall time, or the first exception any of them raised."""
    errors: list[BaseException] = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(f,)) for f in fns]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def eos_logit_bias(model_dir: Path) -> dict[str, float]:
    """A ``logit_bias`` that bans the model's EOS ids (``eos_token_id`` of config.json)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        raise PromptError(f"{model_dir}/config.json has no eos_token_id to ban")
    ids = eos if isinstance(eos, list) else [eos]
    return {str(i): -100.0 for i in ids}
