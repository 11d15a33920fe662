"""How the decode loop cuts its prompts and rows into runs (``decode.py``): pure, no torch.

Prompts into groups prefilled apart: a list of values split into consecutive runs, each run
costing its length times its largest value plus a fixed cost for the run itself (one more
forward); ``runs`` finds the cut that costs least. And the rows a compaction keeps, as runs
of consecutive rows it copies with one slice each (``blocks``).
"""

from __future__ import annotations

import functools

__all__ = ["CALL_TOKENS", "blocks", "prefill_runs", "runs"]

#: What one more prefill forward costs, in prompt tokens (``prefill_runs``): a call's fixed
#: cost (weights read, Python) against one token's share of a step, on CPU.
CALL_TOKENS = 16


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
