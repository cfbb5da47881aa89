"""Samplers and logits processors for mlx_lm.server's requests that a batch can share.

Stock makes every request a sampler and logits processors of its own: closures that say
nothing about what they do. mlx-lm's ``BatchGenerator`` then samples row by row unless all
rows hold the same sampler object, and applies logits processors row by row, each row a
slice, its own operations and a concatenation: at 32 rows with a temperature and a
``logit_bias``, about a thousand more operations a decode step than greedy rows without one
(counted with ``mlx_radix_plugin.tools.step_profile``), which on a GPU cost host time every
step. Here requests with the same sampling settings share one sampler, and a logit bias is
a ``LogitBias`` whose tokens and values a batch can read and apply to all its rows at once.
One request gets what stock gives it.

XTC draws its coin once a call: a sampler shared by a batch would toss it once for all its
rows, so a request with ``xtc_probability`` keeps a sampler of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

SHARED_SAMPLERS = 256  # distinct sampling settings remembered


class LogitBias:
    """mlx-lm's logit-bias processor (``logits.at[:, tokens].add(values)``), readable."""

    def __init__(self, bias: dict[int, float]):
        import mlx.core as mx

        self.tokens = list(bias)
        self.values = list(bias.values())
        self._indices = mx.array(self.tokens)
        self._values = mx.array(self.values)

    def __call__(self, tokens, logits):
        return logits.at[:, self._indices].add(self._values)


class Sampling:
    """Replacements for ``mlx_lm.server._make_sampler`` and ``_make_logits_processors``."""

    def __init__(self, make_sampler: Callable, make_logits_processors: Callable):
        self._make_sampler = make_sampler
        self._make_processors = make_logits_processors
        self._samplers: OrderedDict = OrderedDict()

    def sampler(self, args, tokenizer):
        s = args.sampling
        if s.xtc_probability > 0:
            return self._make_sampler(args, tokenizer)
        # The tokenizer gives XTC its special tokens, and nothing else.
        key = (s.temperature, s.top_p, s.top_k, s.min_p)
        sampler = self._samplers.get(key)
        if sampler is None:
            sampler = self._samplers[key] = self._make_sampler(args, tokenizer)
            if len(self._samplers) > SHARED_SAMPLERS:
                self._samplers.popitem(last=False)
        self._samplers.move_to_end(key)
        return sampler

    def logits_processors(self, args) -> list:
        bias = args.logits.logit_bias
        if not bias:
            return self._make_processors(args)
        # Stock's list, its logit bias (always first) made readable.
        rest = self._make_processors(replace(args, logits=replace(args.logits, logit_bias=None)))
        return [LogitBias(bias), *rest]
