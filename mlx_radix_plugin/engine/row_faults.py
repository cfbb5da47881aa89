"""A row whose own work fails inside a step is failed alone; the rest of the batch goes on.

Every row of a batch runs in one step, and each row's logits processors and sampler add to
that step's graph: an exception raised by one of them (a plugin's processor, a setting no
check foresaw) ended the step, and mlx_lm_hooks failed every request of the batch with it.
Here each row's processors, and each sampler, run behind a guard. One that raises leaves the
logits it was given as they were (a sampler's rows take the most likely token); its rows are
reported by ``RowFaults.take``, which ends them at their next step with their pages given
back as any finished row's, and the server answers their requests with an error
(mlx_lm_hooks' ``RowFailed``).

What fails inside the graph's evaluation (an allocation) belongs to no row: that still
fails the batch (mlx_lm_hooks' ``GenerationFailed``).
"""

from __future__ import annotations

import logging
import weakref

import mlx.core as mx
from mlx_lm_hooks.sampling import LogitBias

log = logging.getLogger("mlx_radix")


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


class _GuardedProcessor:
    """A row's logits processor; once it has raised, the row's logits pass through."""

    __slots__ = ("processor", "uid", "tripped", "error")

    def __init__(self, processor, uid: int, tripped: list):
        self.processor, self.uid, self.tripped, self.error = processor, uid, tripped, None

    def __call__(self, tokens, logits):
        if self.error is not None:
            return logits
        try:
            return self.processor(tokens, logits)
        except Exception as e:
            log.warning("a logits processor of request %d failed: %s", self.uid, _why(e))
            self.error = _why(e)
            self.tripped.append(self)
            return logits


class _GuardedSampler:
    """A sampler shared by the rows that hold it; if it raises, they take the argmax."""

    __slots__ = ("sampler", "tripped", "error", "__weakref__")

    def __init__(self, sampler, tripped: list):
        self.sampler, self.tripped, self.error = sampler, tripped, None

    def __call__(self, logprobs):
        try:
            return self.sampler(logprobs)
        except Exception as e:
            log.warning("a sampler failed: %s", _why(e))
            self.error = _why(e)
            self.tripped.append(self)
            return mx.argmax(logprobs, axis=-1)


class RowFaults:
    """Guards for the rows a batch generator inserts, and the rows whose guards tripped."""

    def __init__(self):
        self._tripped: list = []  # guards that raised since the last ``take``
        # One guard per sampler object: rows with the same settings share a sampler
        # (mlx_lm_hooks/sampling.py), and a batch samples them in one call only while
        # they hold the same object (decode_step.py).
        self._samplers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def guard(self, uids: list[int], samplers: list | None, processors: list | None):
        """``samplers`` and ``processors`` (one entry a row, as ``insert_segments`` takes
        them) behind guards. A ``LogitBias`` stays as it is: the step reads it to bias
        every row at once, and its ids were checked against the vocabulary before."""
        if samplers is not None:
            samplers = [None if s is None else self._sampler(s) for s in samplers]
        if processors is not None:
            processors = [
                [
                    p if isinstance(p, LogitBias) else _GuardedProcessor(p, uid, self._tripped)
                    for p in row or ()
                ]
                for uid, row in zip(uids, processors)
            ]
        return samplers, processors

    def _sampler(self, sampler):
        try:
            guard = self._samplers.get(sampler)
        except TypeError:  # not weakly referable: a guard of its own
            return _GuardedSampler(sampler, self._tripped)
        if guard is None:
            guard = self._samplers[sampler] = _GuardedSampler(sampler, self._tripped)
        return guard

    def take(self, batch) -> dict[int, str]:
        """Rows of ``batch`` (mlx-lm's ``GenerationBatch``) whose processors or sampler
        raised since the last call, ``uid -> why``; each is ended at its next step, as a
        row is at its length."""
        if not self._tripped:
            return {}
        tripped, self._tripped[:] = list(self._tripped), []
        failed = {g.uid: g.error for g in tripped if isinstance(g, _GuardedProcessor)}
        samplers = {id(g): g.error for g in tripped if isinstance(g, _GuardedSampler)}
        for uid, sampler in zip(batch.uids, batch.samplers or ()):
            if id(sampler) in samplers:
                failed.setdefault(uid, samplers[id(sampler)])
        for g in tripped:
            if isinstance(g, _GuardedSampler):
                g.error = None  # the rows that held it are ended; others may use it
        for i, uid in enumerate(batch.uids):
            if uid in failed:
                batch.max_tokens[i] = 0
        return failed
