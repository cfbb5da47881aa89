"""Grouping a decode batch's rows by the prefix pages they share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_radix_plugin.memory.prefix_groups import PrefixGroup, group_rows

PS = 4


def test_rows_on_one_system_prompt_form_one_group():
    system = [10, 11, 12, 13]
    tables = [system + [20 + i, 30 + i] for i in range(3)]
    groups = group_rows(tables, [6 * PS] * 3, PS)
    assert groups == [PrefixGroup((0, 1, 2), tuple(system))]
    assert groups[0].tokens(PS) == 16


def test_a_common_first_page_does_not_pull_a_group_shallow():
    # Rows 0-2 share 4 pages; row 3 shares only the first page (a chat template's head).
    tables = [[1, 2, 3, 4, 10 + i] for i in range(3)] + [[1, 99, 98]]
    groups = group_rows(tables, [5 * PS] * 3 + [3 * PS], PS)
    assert groups == [PrefixGroup((0, 1, 2), (1, 2, 3, 4)), PrefixGroup((3,), (1, 99, 98))]


def test_two_system_prompts_give_two_groups_in_batch_order():
    tables = [[1, 2, 5], [7, 8, 6], [1, 2, 9], [7, 8, 4]]
    groups = group_rows(tables, [3 * PS] * 4, PS)
    assert groups == [PrefixGroup((0, 2), (1, 2)), PrefixGroup((1, 3), (7, 8))]


def test_only_whole_written_pages_count():
    # Row 1 has written 5 tokens: its second page is not a whole page yet.
    groups = group_rows([[1, 2, 3], [1, 2]], [3 * PS, PS + 1], PS)
    assert groups == [PrefixGroup((0, 1), (1,))]
    groups = group_rows([[1, 2, 3], [1, 2]], [3 * PS, PS - 1], PS)
    assert groups == [PrefixGroup((0,), (1, 2, 3)), PrefixGroup((1,), ())]


def test_nested_sharing_takes_the_level_that_saves_most():
    # All 4 share 3 pages; rows 0-1 share 2 more: 3 x 3 = 9 saved beats 1 x 5 = 5.
    tables = [[1, 2, 3, 4, 5, 10], [1, 2, 3, 4, 5, 11], [1, 2, 3, 12], [1, 2, 3, 13]]
    groups = group_rows(tables, [len(t) * PS for t in tables], PS)
    assert groups == [PrefixGroup((0, 1, 2, 3), (1, 2, 3))]


def test_empty_rows_and_bad_input():
    assert group_rows([[], [5]], [2, PS], PS) == [PrefixGroup((0,), ()), PrefixGroup((1,), (5,))]
    assert group_rows([], [], PS) == []
    with pytest.raises(ValueError, match="2 page tables for 1 lengths"):
        group_rows([[1], [2]], [PS], PS)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        group_rows([[1]], [1], 0)


batches = st.lists(
    st.tuples(st.lists(st.integers(0, 5), max_size=6), st.integers(0, 3)), min_size=1, max_size=8
)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_groups_partition_the_rows_and_share_real_prefixes(batch):
    # Page ids from a small alphabet make shared prefixes common; a row's tail is partial.
    tables = [pages for pages, _ in batch]
    lengths = [len(pages) * PS - min(tail, len(pages) * PS) for pages, tail in batch]
    groups = group_rows(tables, lengths, PS)
    rows = [r for g in groups for r in g.rows]
    assert sorted(rows) == list(range(len(batch)))
    assert [g.rows[0] for g in groups] == sorted(g.rows[0] for g in groups)
    for g in groups:
        assert list(g.rows) == sorted(g.rows)
        for r in g.rows:
            whole = tables[r][: lengths[r] // PS]
            assert tuple(whole[: len(g.pages)]) == g.pages
        if len(g.rows) == 1:
            (r,) = g.rows
            assert len(g.pages) == lengths[r] // PS
        else:
            assert g.pages, "a group of several rows shares at least one page"
