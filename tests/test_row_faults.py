"""Guards that fail a row alone (engine/row_faults.py): a processor or sampler that raises
leaves its rows' logits as they were, and ``take`` names those rows and ends them."""

from types import SimpleNamespace

import mlx.core as mx
from mlx_lm_hooks.sampling import LogitBias

from mlx_radix_plugin.engine.row_faults import RowFaults


def raising(*args):
    raise ValueError("boom")


def batch(uids, samplers, processors):
    return SimpleNamespace(
        uids=uids, samplers=samplers, logits_processors=processors, max_tokens=[50] * len(uids)
    )


def test_a_processor_that_raises_fails_its_row_alone_and_then_passes_logits_through():
    faults = RowFaults()
    bias = LogitBias({3: 1.0})
    doubling = lambda tokens, logits: logits * 2  # noqa: E731
    samplers, processors = faults.guard([7, 8], [None, None], [[bias, raising], [doubling]])
    assert processors[0][0] is bias  # the step reads it to bias every row at once
    logits = mx.array([[1.0, 2.0]])
    assert processors[0][1](None, logits) is logits
    assert processors[1][0](None, logits).tolist() == [[2.0, 4.0]]
    b = batch([7, 8], samplers, processors)
    assert faults.take(b) == {7: "ValueError: boom"}
    assert b.max_tokens == [0, 50]  # it finishes at its next step
    assert processors[0][1](None, logits) is logits  # no second report
    assert faults.take(b) == {}


def test_a_sampler_that_raises_fails_the_rows_that_hold_it_and_they_take_the_argmax():
    faults = RowFaults()
    greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    samplers, _ = faults.guard([1, 2, 3], [raising, greedy, raising], None)
    assert samplers[0] is samplers[2]  # one guard per sampler: its rows sample at once
    logprobs = mx.array([[0.1, 0.9], [0.8, 0.2]])
    assert samplers[0](logprobs).tolist() == [1, 0]
    b = batch([1, 2, 3], samplers, [[], [], []])
    assert faults.take(b) == {1: "ValueError: boom", 3: "ValueError: boom"}
    assert b.max_tokens == [0, 50, 0]
    assert faults.take(b) == {}
