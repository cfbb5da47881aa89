"""The engine's decode step: mlx-lm's ``GenerationBatch`` with its per-row work done in bulk.

mlx-lm applies each row's logits processors on a slice of its own and samples row by row
unless every row holds the same sampler object. Each row's operations then enter every step
of the batch. Counted with ``tools/step_profile.py`` (CPU, 32 rows, the tiny shape, whose
model adds ~160 operations a layer there): 386 operations a step for greedy rows without
processors, 1,378 with a temperature and a ``logit_bias`` (mlx_lm.server gives every request
a sampler and processors of its own). Here:

- rows whose sampler is the same object sample in one call (mlx_lm_hooks/sampling.py gives
  requests with the same settings the same sampler); greedy rows are the argmax stock takes;
- a ``LogitBias`` (mlx_lm_hooks/sampling.py), first in a request's processors as in stock's
  list, is applied to every row that has one in one scatter, with the same additions; rows
  whose processors are no more than that keep no token context (a logit bias reads none);
- any other processor runs on its row, with the row's context, as in stock;
- the sampled tokens' log-probabilities are picked in the step's own graph and read with
  its tokens, one ``tolist`` for the batch's: mlx_lm.server reads ``logprobs[token].item()``
  for every row of every step, which on an MLX row is one more operation and a wait each
  (``TokenLogprobs`` answers it from the host).

The first step of rows that join is mlx-lm's own (it runs as their batch is made); their
first tokens' log-probabilities are picked together, once, when that step is read.

mlx-lm hands a step's tokens over in the next call, after launching the step behind it, so
a launch overlaps the wait for its tokens. Where a launch runs the graph before it returns
(MLX's CPU backend), every token instead waits for the next step's forward pass as well, the
first one included: ``first_tokens`` hands joining rows' first tokens over in the call that
computed them (the engine calls it there: generator.py, ``FIRST_TOKENS_AT_ONCE``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm_hooks.sampling import LogitBias

from .step_clock import StepClock


class HostScalar:
    """A value already on the host, read as an MLX scalar's ``item()`` reads it."""

    __slots__ = ("value", "dtype")

    def __init__(self, value: float, dtype: mx.Dtype):
        self.value, self.dtype = value, dtype

    def item(self) -> float:
        return self.value


class TokenLogprobs(mx.array):
    """A response's log-probabilities, the MLX row mlx-lm hands over, that also holds its
    sampled token's value on the host: ``[token]`` answers from there, without an MLX
    operation; any other use is the array's own.

    mlx_lm.server reads ``logprobs[token].item()`` for every row of every step, on the
    generation thread. On an MLX scalar, ``item()`` evaluates it with the GIL released:
    32 rows gave 32 handler threads (woken by the tokens queued for them just before) 32
    chances a step to take the GIL from the generation thread, whose Python (the next
    step's graph) then waited behind theirs.
    """

    __slots__ = ("token", "value")

    @classmethod
    def of(cls, row: mx.array, token: int, value: float) -> TokenLogprobs:
        # The array's own constructor, with no Python ``__init__`` around it, and slots, not
        # a dict: made for every row of every step (32 rows, 2 CPU cores: 15 against 22 us).
        out = cls(row)
        out.token, out.value = token, value
        return out

    def __getitem__(self, index):
        if type(index) is int and index == self.token:
            return HostScalar(self.value, self.dtype)
        return super().__getitem__(index)


class BulkGenerationBatch(GenerationBatch):
    """mlx-lm's generation batch, stepped as the module's docstring says."""

    clock: StepClock | None = None  # the engine's, which the stats show
    # Arrays the step's launch also evaluates, asked for once its graph is built: the
    # pool's, whose pending writes include this step's K/V (generator.py).
    launch_with: Callable[[], list[mx.array]] | None = None

    def __init__(self, model, uids, *args, **kwargs):
        # The sampled tokens' log-probabilities: the last step's array, where it holds every
        # row's in order (no row has joined or left since: read whole); else per row, as
        # (array of a step, row), or None for rows whose step was mlx-lm's.
        self._next_picked: mx.array | list[tuple[mx.array, int] | None] = [None] * len(uids)
        # Per row: its stop matcher before its first token, where ``first_tokens`` handed
        # that token over already; else None.
        self._early: list[StopSequences.Matcher | None] = [None] * len(uids)
        super().__init__(model, uids, *args, **kwargs)

    def next(self):
        """mlx-lm's ``next``, less the first tokens ``first_tokens`` handed over: those
        rows are counted and matched again from where they stood, with the same result."""
        if self._early.count(None) == len(self._early):  # the usual step: no row handed over
            return super().next()
        early = {self.uids[i] for i, m in enumerate(self._early) if m is not None}
        for i, matcher in enumerate(self._early):
            if matcher is not None:
                self._matchers[i] = matcher
                self._num_tokens[i] -= 1
        self._early = [None] * len(self.uids)
        return [r for r in super().next() if r.uid not in early]

    def first_tokens(self) -> list:
        """Responses for the first tokens of the rows that joined since the last ``next``,
        which their own first step has computed; a row whose first token ends it waits
        for ``next`` as in stock, whose finished rows hold that token's K/V."""
        if 0 not in self._num_tokens:  # the usual call: every row has a token already
            return []
        fresh = [
            i for i, (n, m) in enumerate(zip(self._num_tokens, self._early)) if not n and m is None
        ]
        if not fresh:
            return []
        rows = [self._next_logprobs[i] for i in fresh]
        mx.eval(self._next_tokens, rows)
        tokens = self._next_tokens.tolist()
        by_row = self._picked_by_row()
        picked = [by_row[i] for i in fresh]
        values = _host_values(picked, rows, [tokens[i] for i in fresh])
        responses = []
        for i, row, value in zip(fresh, rows, values):
            token, probe = tokens[i], copy.copy(self._matchers[i])
            if self.max_tokens[i] <= 1 or probe.advance(token):
                continue
            self._early[i], self._matchers[i] = self._matchers[i], probe
            self._num_tokens[i] = 1
            responses.append(
                self.Response(
                    uid=self.uids[i],
                    token=token,
                    logprobs=TokenLogprobs.of(row, token, value),
                    finish_reason=None,
                    prompt_cache=None,
                    all_tokens=None,
                )
            )
        return responses

    def _step(self):
        start = time.perf_counter()
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        current_picked = self._next_picked
        inputs = self._current_tokens

        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logits, token_context = self._process(logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._sample(logprobs)
        picked = mx.take_along_axis(logprobs, sampled[:, None], axis=-1)[:, 0]
        self._next_tokens = sampled
        # The rows are slices of ``logprobs``, launched whole: a row's own operation runs
        # only if something reads past ``[token]`` (top log-probabilities).
        self._next_logprobs = list(logprobs)
        self._next_picked = picked
        built = time.perf_counter()
        extra = self.launch_with() if self.launch_with is not None else []
        mx.async_eval(sampled, picked, logprobs, token_context, extra)
        launched = time.perf_counter()

        # As mlx-lm: the tokens in the K/V cache are those of the step before.
        whole = isinstance(current_picked, mx.array)
        if whole:
            mx.eval(inputs, current_picked)
        else:
            mx.eval(inputs, [p[0] for p in current_picked if p])
        waited = time.perf_counter()
        tokens = inputs.tolist()
        for sti, ti in zip(self.tokens, tokens):
            sti.append(ti)
        if whole:
            values = current_picked.tolist()
        else:
            values = _host_values(current_picked, self._current_logprobs, tokens)
        rows = [
            TokenLogprobs.of(row, token, value)
            for row, token, value in zip(self._current_logprobs, tokens, values)
        ]
        if self.clock is not None:
            self.clock.add("build", built - start)
            self.clock.add("launch", launched - built)
            self.clock.add("wait", waited - launched)
            self.clock.add("read", time.perf_counter() - waited)
        return tokens, rows

    def extend(self, batch):
        joining = len(batch.uids)
        super().extend(batch)
        self._next_picked = self._picked_by_row() + [None] * joining
        self._early += [None] * joining

    def filter(self, keep):
        super().filter(keep)
        picked = self._picked_by_row()
        self._next_picked = [picked[i] for i in keep]
        self._early = [self._early[i] for i in keep]

    def _picked_by_row(self) -> list[tuple[mx.array, int] | None]:
        """``_next_picked`` row by row."""
        picked = self._next_picked
        if isinstance(picked, mx.array):
            return [(picked, i) for i in range(picked.shape[0])]
        return picked

    def _process(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list]:
        """Every row's logits processors applied: logit biases in one scatter, the rest per
        row. Returns the logits and the token contexts the step updated."""
        if not any(self.logits_processors):
            return logits, []
        rows, cols, values, rest = [], [], [], {}
        for e, processors in enumerate(self.logits_processors):
            processors = list(processors or ())
            if processors and isinstance(processors[0], LogitBias):
                bias = processors.pop(0)
                rows += [e] * len(bias.tokens)
                cols += bias.tokens
                values += bias.values
            if processors:
                rest[e] = processors
        if rows:
            logits = logits.at[mx.array(rows), mx.array(cols)].add(mx.array(values))
        if not rest:
            return logits, []
        parts, token_context = [], []
        for e in range(len(self.uids)):
            row = logits[e : e + 1]
            if e in rest:
                context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in rest[e]:
                    row = processor(context, row)
            parts.append(row)
        return mx.concatenate(parts, axis=0), token_context

    def _sample(self, logprobs: mx.array) -> mx.array:
        """One call of each distinct sampler on its rows, the tokens in row order."""
        first = self.samplers[0] if self.samplers else None
        if all(s is first for s in self.samplers):  # the usual batch: one sampler
            return (self.fallback_sampler if first is None else first)(logprobs)
        samplers = [self.fallback_sampler if s is None else s for s in self.samplers]
        groups: dict[int, tuple] = {}
        for e, s in enumerate(samplers):
            groups.setdefault(id(s), (s, []))[1].append(e)
        if len(groups) == 1:
            return samplers[0](logprobs)
        order, parts = [], []
        for sampler, rows in groups.values():
            order += rows
            parts.append(sampler(logprobs[mx.array(rows)]))
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return mx.concatenate(parts, axis=0)[mx.array(inverse)]


def _host_values(picked: list, rows: list, tokens: list[int]) -> list[float]:
    """Each row's sampled log-probability as a Python float: one ``tolist`` of each step's
    picked array, and for rows whose step was mlx-lm's, their picks stacked once."""
    arrays = {id(p[0]): p[0] for p in picked if p}  # a step's rows share one array
    host = {key: a.tolist() for key, a in arrays.items()}
    values = [host[id(p[0])][p[1]] if p else None for p in picked]
    missing = [e for e, v in enumerate(values) if v is None]
    if missing:
        found = mx.stack([rows[e][tokens[e]] for e in missing]).astype(mx.float32).tolist()
        for e, v in zip(missing, found):
            values[e] = v
    return values
