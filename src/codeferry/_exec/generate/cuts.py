"""How the decode loop cuts its rows and prompts into runs (``decode.py``): pure, no torch.

Two cuts of one kind: a list of values split into consecutive runs, each run costing its
length times its largest value plus a fixed cost for the run itself (one more attention
call, one more forward). ``runs`` finds the cut that costs least. And the rows a compaction
keeps, as runs of consecutive rows it copies with one slice each (``blocks``).
"""

from __future__ import annotations

import functools

__all__ = ["CALL_COLUMNS", "CALL_TOKENS", "blocks", "prefill_runs", "runs", "spans"]

#: What one more attention call costs, in cache columns of one row (``spans``), and one
#: more prefill forward, in prompt tokens (``prefill_runs``): a call's fixed cost (weights
#: read, Python) against one row's column or one token's share of a step, on CPU.
CALL_COLUMNS, CALL_TOKENS = 64, 16


@functools.lru_cache(maxsize=256)
def runs(values: tuple[int, ...], call: int) -> tuple[tuple[int, int], ...]:
    """``values`` cut into consecutive runs, ``(first, end)`` each, that cost least: a run of
    ``n`` values costs ``n * max(its values) + call``. A dynamic program, quadratic in the
    values; remembered, since the same cut is asked again until rows leave or join."""
    count = len(values)
    best, cut = [0] * (count + 1), [0] * (count + 1)
    for end in range(1, count + 1):
        high, best[end], cut[end] = values[end - 1], best[end - 1] + call + values[end - 1], end - 1
        for first in range(end - 2, -1, -1):
            high = max(high, values[first])
            cost = best[first] + call + (end - first) * high
            if cost < best[end]:
                best[end], cut[end] = cost, first
    out: list[tuple[int, int]] = []
    end = count
    while end:
        out.append((cut[end], end))
        end = cut[end]
    return tuple(reversed(out))


@functools.lru_cache(maxsize=256)
def spans(starts: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Rows cut into runs that attend apart (``attention.SPANS``): ``(first row, end row,
    first column)`` each; ``starts``: each row's first real cache column.

    Why: the cache is a rectangle, each row left-padded to the longest; a row whose prompt
    was short reads padding columns at every step and layer (on the benchmark's prompts of
    6 to 51 tokens, up to half the cache). A run of ``n`` rows reads ``n * (length - its
    first column)``: the cut that reads least is ``runs`` of the negated starts, whatever
    the length. Asked at every decode step: remembered, like ``runs``.
    """
    return tuple((a, b, min(starts[a:b])) for a, b in runs(tuple(-s for s in starts),
                                                           CALL_COLUMNS))


def prefill_runs(lengths: list[int]) -> tuple[tuple[int, int], ...]:
    """Prompts (longest first) cut into groups prefilled apart: each group is padded to its
    own longest prompt, not to the longest of all (on the benchmark's prompts of 6 to 51
    tokens, padding was two thirds of one prefill's tokens)."""
    return runs(tuple(lengths), CALL_TOKENS)


def blocks(rows: list[int]) -> list[tuple[int, int, int]]:
    """``rows`` (increasing) as runs of consecutive rows: ``(first, end, where)`` each, rows
    ``first..end`` of the old buffer landing at row ``where`` of the new one. Copying a run is
    one slice copy; indexing rows with a list copies them twice (a gathered temporary first)."""
    out: list[tuple[int, int, int]] = []
    for at, row in enumerate(rows):
        if out and out[-1][1] == row:
            first, _, where = out[-1]
            out[-1] = (first, row + 1, where)
        else:
            out.append((row, row + 1, at))
    return out
