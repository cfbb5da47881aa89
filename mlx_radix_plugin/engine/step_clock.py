"""Where the generation thread's time goes while requests decode, by part.

``/v1/cache/stats`` shows the totals (``decode_step_seconds``) and the steps they cover
(``decode_steps_timed``); a benchmark takes the difference over a run. The parts:

- ``build``: Python building a decode step's graph (the model's call, processors, sampling);
- ``launch``: ``mx.async_eval`` of it (on a GPU, encoding and launching its kernels);
- ``wait``: ``mx.eval`` of the step before, waiting for the device;
- ``read``: its tokens and log-probabilities to the host, and the rows' responses;
- ``batch``: mlx-lm's ``BatchGenerator`` around the step (admission, prefill, rows moved
  between its batches);
- ``pool``: the step's pool writes scheduled (``async_eval`` of the pool's arrays);
- ``engine``: the rest of the engine's call (page commits, decode path, stats);
- ``outside``: between the engine's calls, the server's own work (detokenizing, queues,
  admission).

They add up to the generation thread's wall time over the steps timed. Only calls that
decode are timed; the time before the first of a run of them is not counted.
"""

from __future__ import annotations

import time

PARTS = ("build", "launch", "wait", "read", "batch", "pool", "engine", "outside")


class StepClock:
    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self._call_start: float | None = None
        self._call = dict.fromkeys(PARTS, 0.0)  # this call's parts, kept if it decodes
        self._in_call = 0.0  # their sum: read at every part's start and end
        self._last_end: float | None = None

    def begin_call(self) -> None:
        now = time.perf_counter()
        self._call = dict.fromkeys(PARTS, 0.0)
        self._in_call = 0.0
        self._gap = now - self._last_end if self._last_end is not None else 0.0
        self._call_start = now

    def add(self, part: str, seconds: float) -> None:
        self._call[part] += seconds
        self._in_call += seconds

    def part(self, name: str) -> _Part:
        """Count the time inside as ``name``, less what parts within it counted."""
        return _Part(self, name)

    def end_call(self, decoded: bool) -> None:
        """``decoded``: whether the call ran a decode step; when it did not, nor does the
        gap before the next call count (the server may be idle)."""
        now = time.perf_counter()
        if decoded:
            call = self._call
            call["engine"] += now - self._call_start - self._in_call
            call["outside"] = self._gap
            seconds = self.seconds
            for part in PARTS:
                seconds[part] += call[part]
            self.steps += 1
            self._last_end = now
        else:
            self._last_end = None

    def stats(self) -> dict:
        return {
            "decode_step_seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "decode_steps_timed": self.steps,
        }


class _Part:
    """``StepClock.part``'s block: a class, not a generator's context manager, which costs
    a generator's setup and teardown twice in every engine call."""

    __slots__ = ("clock", "name", "start", "inner")

    def __init__(self, clock: StepClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.start, self.inner = time.perf_counter(), self.clock._in_call

    def __exit__(self, *exc) -> None:
        clock = self.clock
        clock.add(self.name, time.perf_counter() - self.start - (clock._in_call - self.inner))
