"""The index of in-flight prompts: a state machine against comparing every prompt's tokens."""

from __future__ import annotations

import gc
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mlx_radix_plugin.cache import inflight
from mlx_radix_plugin.cache.inflight import InflightPrompts

PAGE = 2
# Few token values and short prompts, so that prompts share prefixes often.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=9)
keys = st.sampled_from(["m", "n"])


class Table:
    def __init__(self, model_key, tokens):
        self.model_key, self.tokens, self.released = model_key, tokens, False


def expected(tables: dict, model_key, tokens: list[int], than: int):
    """The first fetched live table sharing the most whole pages, by comparing tokens."""
    best, best_len = None, than
    for _, table in sorted(tables.items()):
        if table.released or table.model_key != model_key:
            continue
        limit = min(len(table.tokens), len(tokens) - 1)
        common = next(
            (i for i, (a, b) in enumerate(zip(table.tokens[:limit], tokens[:limit])) if a != b),
            limit,
        )
        if common // PAGE * PAGE > best_len:
            best, best_len = table, common // PAGE * PAGE
    return best, best_len


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = InflightPrompts(PAGE)
        self.tables: dict[int, Table] = {}  # fetch number -> table the test still holds
        self.numbers = itertools.count()

    @rule(model_key=keys, tokens=prompts)
    def fetch(self, model_key, tokens):
        number, table = next(self.numbers), Table(model_key, tokens)
        self.index.add(number, table)
        self.tables[number] = table

    @rule(data=st.data())
    def commit(self, data):
        if self.tables:
            number = data.draw(st.sampled_from(sorted(self.tables)))
            self.index.pop(number)
            del self.tables[number]

    @rule(data=st.data())
    def release(self, data):
        # Released but not popped: the index must pass over it.
        if self.tables:
            self.tables[data.draw(st.sampled_from(sorted(self.tables)))].released = True

    @rule(data=st.data())
    def collect(self, data):
        # Dropped without a pop (a request that failed): it leaves the index with it. A
        # table is in no cycle: its last reference frees it. Only the young generation is
        # collected: a full collection, in the suite's heap, took 43 s of this test's runs.
        if self.tables:
            del self.tables[data.draw(st.sampled_from(sorted(self.tables)))]
            gc.collect(0)

    @rule(model_key=keys, tokens=prompts, than=st.sampled_from([0, 2, 4]))
    def longest(self, model_key, tokens, than):
        table, n = self.index.longest(model_key, tokens, than)
        want, want_n = expected(self.tables, model_key, tokens, than)
        assert (table, n) == (want, want_n)

    @invariant()
    def holds_only_what_is_in_flight(self):
        assert len(self.index) == len(self.tables)


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestIndexMachine = IndexMachine.TestCase


def test_a_hash_collision_shares_nothing(monkeypatch) -> None:
    """Two prefixes under one key: the tokens are compared, and nothing is shared."""
    monkeypatch.setattr(inflight, "page_keys", lambda key, tokens, ps, pages: list(range(pages)))
    index = InflightPrompts(PAGE)
    other = Table("m", [1, 1, 1, 1, 1])
    index.add(0, other)
    assert index.longest("m", [2, 2, 2, 2, 2], 0) == (None, 0)
    assert index.longest("m", [1, 1, 1, 1, 2], 0) == (other, 4)


def test_a_burst_follows_its_first_request() -> None:
    """32 requests on one new 2,080-token prefix, fetched in turn: each follows the first
    (a tie goes to the first fetched), over the prefix's whole pages."""
    index, tables = InflightPrompts(16), []
    prefix = list(range(2048))
    for i in range(32):
        tokens = prefix + [10_000 + i] * 32
        assert index.longest("m", tokens, 0) == ((None, 0) if i == 0 else (tables[0], 2048))
        tables.append(Table("m", tokens))
        index.add(i, tables[-1])
    assert index.longest("m", prefix + [10_000] * 40, 0) == (tables[0], 2080)
