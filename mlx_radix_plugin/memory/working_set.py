"""Working memory: what the engine holds beyond the model, the pool and its snapshots, held
to what the memory plan names for it.

The plan (budget.py) names working memory: the batches' buffers, a prefill chunk's
activations and a decode step's. What the engine holds in fact is measured here: MLX's peak
of live arrays, less the model, the pool's chunks, the snapshots and K/V held outside the pool
beyond the plan's reserve for it, for each prompt pass (``prefill``: from its first layer to
the next pass or the call's end, which takes in its evaluation) and for the rest of each
engine call (``decode``: its decode step, rows joining it).

On CUDA and Metal a buffer is freed only once the work reading it has run, and MLX's host
runs ahead of the device by up to ten committed graphs, so what a pass holds is not only what
its layers need at once but what the host built before the device caught up. So, where
``hold`` is on, MLX is held to the plan: its memory limit (``mx.set_memory_limit``) is set,
before each call and when the pool grows, to model + pool + snapshots + the named working
memory. Past that limit MLX's evaluation commits what it has and waits for work in flight to
finish, which frees what that work held, before it builds more (``eval_impl`` in
mlx/transforms.cpp), and its CUDA and Metal allocators release cached freed buffers to stay
under it. Nothing raises: a call that needs more than the limit runs, waiting where it passes
it. On this CPU the limit held a graph of 40 independent products to 7 MB of temporaries
against 23 MB without it (tests/test_working_set.py). On the H200 (8B, an agent loop of 16
clients on a 4,096-token prefix) it took the largest prompt pass from 17.0 to 15.1 GB; the
rest was one layer's live temporaries, which no wait frees, and which the pass's estimate
now counts (paged_batch.py: 9.9 GB after, against 9.2 GB named; docs/benchmarking.md, "Working
memory held to the plan").
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from .budget import MemoryPlan

PHASES = ("prefill", "decode")


class _Sized(Protocol):
    nbytes: int


class _Pool(Protocol):
    """What of the KV pool (pool.py, which holds the working set) is read here."""

    plan: MemoryPlan | None
    prefill_working_bytes: int | None
    nbytes: int
    buffer_bytes: int


class WorkingSet:
    """Measures the engine's working memory, by prompt pass and the rest of each call, and,
    if ``hold``, sets MLX's memory limit to the plan's before each call. ``snapshots`` is the
    store of a hybrid model's recurrent states (their bytes are the pool's, not working
    memory)."""

    def __init__(
        self, pool: _Pool, model_bytes: int, snapshots: _Sized | None = None, hold: bool = True
    ):
        if pool.plan is None:
            raise ValueError("a working set needs a pool built with a memory plan (for_model)")
        self.pool = pool
        self.model_bytes = model_bytes
        self.snapshots = snapshots
        self.hold = hold
        self.named = pool.plan.working_bytes
        # K/V held outside the pool up to this is working memory; beyond it, the pool's
        # ceiling pays for it (KVPool._room_for_chunk), so it counts with the pool.
        self.reserve = pool.prefill_working_bytes or 0
        # The most working memory a prompt pass held (prefill), and the rest of a call (decode).
        self.peaks = dict.fromkeys(PHASES, 0)
        self.peak_pass: dict | None = None  # the prompt pass with the most working memory
        self.limit: int | None = None  # what MLX's memory limit was last set to
        self._mlx_limit: int | None = None  # MLX's own, which ``release`` sets back
        self._peak = 0  # MLX's peak of live arrays before the last reset
        self._pass: dict | None = None  # the prompt pass measured now, if any

    def held(self) -> int:
        """Bytes the plan names apart from working memory: the model, the pool's chunks,
        the snapshots, K/V outside the pool beyond the reserve."""
        snapshots = self.snapshots.nbytes if self.snapshots is not None else 0
        over = max(0, self.pool.buffer_bytes - self.reserve)
        return self.model_bytes + self.pool.nbytes + snapshots + over

    def hold_limit(self) -> None:
        """Set MLX's memory limit to what the plan names now (if ``hold``); the pool calls it
        when it grows, so that a new chunk is not working memory past the limit for the
        rest of the call, where every evaluation would wait."""
        if not self.hold:
            return
        self.limit = self.held() + self.named
        previous = mx.set_memory_limit(self.limit)
        if self._mlx_limit is None:
            self._mlx_limit = previous

    def begin_call(self) -> None:
        self.hold_limit()
        self._peak = max(self._peak, mx.get_peak_memory())
        mx.reset_peak_memory()
        self._pass = None

    def begin_pass(self, description: dict) -> None:
        """A prompt pass starts (paged_batch.py): what the call held until now is measured,
        and from here until the next pass or the call's end is this pass's (its layers are
        built, then evaluated there), ``description`` saying its shape and path."""
        self._measure()
        self._pass = description

    def end_call(self) -> None:
        self._measure()
        self._pass = None

    def _measure(self) -> None:
        peak = mx.get_peak_memory()
        self._peak = max(self._peak, peak)
        mx.reset_peak_memory()
        # The pool may have grown meanwhile: its new chunk counts as the pool's.
        working = peak - self.held()
        phase = "decode" if self._pass is None else "prefill"
        if working > self.peaks[phase]:
            self.peaks[phase] = working
            if self._pass is not None:
                self.peak_pass = self._pass

    @property
    def mlx_peak_bytes(self) -> int:
        """MLX's peak of live arrays since start (each call resets MLX's own)."""
        return max(self._peak, mx.get_peak_memory())

    def release(self) -> None:
        """Set MLX's memory limit back to its own (a model load that keeps no pool)."""
        if self._mlx_limit is not None:
            mx.set_memory_limit(self._mlx_limit)
            self._mlx_limit = None
        self.limit = None

    def stats(self) -> dict:
        return {
            "working_bytes": self.named,
            **{f"working_peak_{phase}_bytes": peak for phase, peak in self.peaks.items()},
            "mlx_memory_limit_bytes": self.limit,
            "working_peak_prefill_pass": self.peak_pass,
        }
