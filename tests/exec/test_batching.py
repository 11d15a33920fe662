"""The batch planner: every input exactly once, the token budget, windows; padding waste."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codeferry._exec.batching import estimate_tokens, fixed_batches, padding_waste, plan_batches

LENGTHS = st.lists(st.integers(min_value=1, max_value=300), max_size=200)
BUDGET = st.integers(min_value=1, max_value=4096)
SIZE = st.integers(min_value=1, max_value=64)
WINDOW = st.integers(min_value=1, max_value=128)
SPREAD = st.integers(min_value=1, max_value=8)


@given(LENGTHS, BUDGET, SIZE, WINDOW, SPREAD)
def test_every_index_is_in_exactly_one_batch(lengths: list[int], budget: int, size: int,
                                             window: int, spread: int) -> None:
    batches = plan_batches(lengths, max_batch_tokens=budget, max_batch_size=size,
                           window=window, spread=spread)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(batches)  # no empty batch


@given(LENGTHS, BUDGET, SIZE, WINDOW)
def test_budget_and_size_hold_except_for_one_overlong_input(lengths: list[int], budget: int,
                                                            size: int, window: int) -> None:
    for batch in plan_batches(lengths, max_batch_tokens=budget, max_batch_size=size,
                              window=window):
        assert len(batch) <= size
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= budget or len(batch) == 1


@given(LENGTHS, BUDGET, SIZE, WINDOW, SPREAD)
def test_no_batch_mixes_windows_and_windows_come_in_order(
        lengths: list[int], budget: int, size: int, window: int, spread: int) -> None:
    batches = plan_batches(lengths, max_batch_tokens=budget, max_batch_size=size,
                           window=window, spread=spread)
    windows = [{i // window for i in batch} for batch in batches]
    assert all(len(w) == 1 for w in windows)
    order = [w.pop() for w in windows]
    assert order == sorted(order)  # a stream's outputs are held back one window at most


@given(LENGTHS, BUDGET, SIZE, WINDOW, SPREAD)
def test_each_window_is_cut_into_a_multiple_of_spread(lengths: list[int], budget: int, size: int,
                                                     window: int, spread: int) -> None:
    batches = plan_batches(lengths, max_batch_tokens=budget, max_batch_size=size,
                           window=window, spread=spread)
    for start in range(0, len(lengths), window):
        members = min(window, len(lengths) - start)
        count = sum(1 for b in batches if b[0] // window == start // window)
        assert count % spread == 0 or count == members


def padded(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max(lengths[i] for i in batch)


@given(LENGTHS, BUDGET, SIZE)
def test_sorting_never_pads_more_than_input_order(lengths: list[int], budget: int,
                                                  size: int) -> None:
    # The same cap and budget applied to consecutive inputs (what a fixed count did):
    # grouping by length wastes at most as much, for any input.
    planned = plan_batches(lengths, max_batch_tokens=10**9, max_batch_size=size,
                           window=max(1, len(lengths)))
    assert padding_waste(planned, lengths) <= padding_waste(
        fixed_batches(len(lengths), size), lengths) + 1e-12


def test_a_short_input_is_not_padded_into_a_batch_of_long_ones() -> None:
    # hypothesis's counterexample to the greedy cut: [[4, 2, 3, 0], [1]] pads 13 slots where
    # input order pads 11; the least padding among the fewest batches pads 11
    lengths = [1, 1, 2, 2, 3]
    planned = plan_batches(lengths, max_batch_tokens=10**9, max_batch_size=4, window=5)
    assert planned == [[4, 2, 3], [0, 1]]
    assert sum(padded(b, lengths) for b in planned) == 11


def test_skewed_prompts_waste_less_padding_than_batches_of_8() -> None:
    lengths = [3 + int(45 * ((i * 37) % 128 / 127) ** 3) for i in range(128)]
    planned = plan_batches(lengths, max_batch_tokens=1024, max_batch_size=64, window=1024)
    # fewer, wider batches (4 instead of 16) with about half the padding (0.34 vs 0.65)
    assert len(planned) == 4
    assert padding_waste(planned, lengths) < 0.6 * padding_waste(fixed_batches(128, 8), lengths)
    assert max(lengths[i] for i in planned[0]) == max(lengths)  # the longest batch goes first
    # spread over 2 workers: 4 batches of about equal cost, not 3 and a remainder
    two = plan_batches(lengths, max_batch_tokens=2048, max_batch_size=64, window=1024, spread=2)
    costs = [padded(b, lengths) for b in two]
    assert len(two) == 4 and max(costs) < 1.5 * min(costs)


def test_estimate_tokens_orders_texts_like_their_length() -> None:
    assert estimate_tokens("") == 2
    assert estimate_tokens("a few words") < estimate_tokens("a few more words than that")
    assert estimate_tokens("é" * 8) == 4 + 2  # bytes, not characters
    assert estimate_tokens([5, 6, 7]) == 3


@pytest.mark.parametrize("bad", [{"max_batch_tokens": 0}, {"max_batch_size": 0},
                                 {"window": 0}, {"spread": 0}])
def test_nonpositive_settings_are_refused(bad: dict[str, int]) -> None:
    settings = {"max_batch_tokens": 10, "max_batch_size": 2, "window": 4, **bad}
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_batches([1, 2, 3], **settings)
