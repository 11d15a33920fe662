"""Batch planning: which inputs go together, sized by padded tokens rather than by count.

A batch costs what its padded tensor costs: ``batch size x longest input`` tokens (plus,
for generation, the new tokens of every row). A fixed count of 8 pads a 3-word prompt to
the 48-word prompt next to it and, for short prompts, leaves the matrix multiplies too
narrow to use the cores. So inputs are sorted by length and cut into batches that fill a
token budget. The sort is done only within a *window* of consecutive inputs: a stream's
outputs still come out roughly in input order (``codeferry run`` writes them in order,
holding back at most a window's worth), and every output keeps its input's index.

Within a window the longest batches come first: they take longest, and the short ones
behind them fill the gaps between workers at the end (longest-processing-time first).

Lengths are estimates made in the parent, which has no tokenizer loaded (importing
transformers there would cost seconds of start-up, and a remote-code tokenizer would run
its code in one more process): ``estimate_tokens`` counts UTF-8 bytes, about four per
token for BPE vocabularies, a little fewer for WordPiece. Only the order and the rough
size matter: the worker pads each batch to its real longest row.

Pure: no torch, no processes. ``tests/exec/test_batching.py`` checks the invariants with
hypothesis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import SamplingParamsError
from .engines.base import Complete, Rpc, Work
from .generate.params import Request, SamplingParams, group_key, resolve

__all__ = ["estimate_tokens", "plan_batches", "padding_waste", "fixed_batches", "batch_limits",
           "grouped_batches", "halves", "context_error", "check_context"]

#: UTF-8 bytes per token, roughly, for the vocabularies of current models.
BYTES_PER_TOKEN = 4
#: Special tokens a tokenizer adds around a text (BOS/CLS, EOS/SEP).
SPECIAL_TOKENS = 2
#: The most UTF-8 bytes one token spans, about: a text has at least its bytes / this many
#: tokens (a lower bound: the parent, with no tokenizer, refuses only what cannot fit).
MOST_BYTES_PER_TOKEN = 8
#: Defaults of ``batch_limits``: padded tokens and rows per batch.
CPU_BATCH_TOKENS, CPU_BATCH_SIZE = 2048, 64
ACCELERATOR_BATCH_TOKENS, ACCELERATOR_BATCH_SIZE = 16384, 256


def estimate_tokens(item: Any) -> int:
    """A cheap token count of one input: bytes for text, the length of a token list."""
    if isinstance(item, str):
        return math.ceil(len(item.encode("utf-8")) / BYTES_PER_TOKEN) + SPECIAL_TOKENS
    if isinstance(item, (list, tuple)):
        return max(1, len(item))
    return estimate_tokens(str(item))


def fixed_batches(n: int, size: int) -> list[list[int]]:
    """Consecutive batches of ``size`` inputs, in input order (an explicit ``batch_size``)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]


def plan_batches(lengths: Sequence[int], *, max_batch_tokens: int, max_batch_size: int,
                 window: int, spread: int = 1) -> list[list[int]]:
    """Group input indices into batches of similar length.

    Every index ``0..len(lengths)-1`` is in exactly one batch. A batch never mixes
    windows (``[0, window)``, ``[window, 2*window)``...), holds at most ``max_batch_size``
    inputs, and its padded size ``len(batch) * max(lengths of batch)`` is at most
    ``max_batch_tokens`` unless it is a single input longer than the budget.

    ``spread``: the workers that share the batches. Each window is cut into a multiple of
    ``spread`` batches (when it has that many inputs) whose largest padded size is as
    small as it can be: a window's batches are about equally costly, so the workers
    finish together instead of one waiting on a last batch of a few leftovers.
    """
    if max_batch_tokens < 1 or max_batch_size < 1 or window < 1 or spread < 1:
        raise ValueError("max_batch_tokens, max_batch_size, window and spread must be >= 1")
    batches: list[list[int]] = []
    for start in range(0, len(lengths), window):
        members = sorted(range(start, min(start + window, len(lengths))),
                         key=lambda i: (-lengths[i], i))
        batches += _balanced(members, lengths, max_batch_tokens, max_batch_size, spread)
    return batches


def _balanced(ordered: list[int], lengths: Sequence[int], budget: int, cap: int,
              spread: int) -> list[list[int]]:
    """The cut of ``ordered`` into ``k`` batches (the budget's count, rounded up to a
    multiple of ``spread``): with ``spread`` > 1 the smallest largest padded size first (the
    workers finish together), then the least padding in all (one worker: only that)."""
    k = min(len(ordered), -(-len(_cut(ordered, lengths, budget, cap)) // spread) * spread)
    bound = budget
    if spread > 1:
        low, high = 1, budget  # a cut with the full budget needs no more than k batches
        while low < high:  # the least budget that still needs no more than k batches
            middle = (low + high) // 2
            if len(_cut(ordered, lengths, middle, cap)) <= k:
                high = middle
            else:
                low = middle + 1
        bound = low
    batches = _least_padding(ordered, lengths, bound, cap)
    while len(batches) < k:  # halving a batch never makes any batch, or the sum, larger
        widest = max(range(len(batches)), key=lambda j: len(batches[j]))
        batch = batches[widest]
        batches[widest:widest + 1] = [batch[:len(batch) // 2], batch[len(batch) // 2:]]
    return batches


def _least_padding(ordered: list[int], lengths: Sequence[int], bound: int,
                   cap: int) -> list[list[int]]:
    """The cut of ``ordered`` (longest first) into runs of at most ``cap`` rows, each padded
    to at most ``bound`` tokens (or a single row): the fewest runs, and of those the one
    whose padded sizes add up to the least. A cut of sorted inputs into runs is as good as
    any grouping of them (a group that holds the longest input is padded to it whatever else
    it holds, so it best takes the next longest), so dynamic programming over the runs' ends
    finds it, in ``len(ordered) x cap`` steps; the greedy cut (``_cut``) has as few runs, but
    may pad a lone short input into a batch of long ones where input order would not."""
    width = [lengths[i] for i in ordered]
    # best[i]: (runs, padded tokens) of the best cut of the first i inputs; start[i]: its last run's
    best: list[tuple[int, int]] = [(0, 0)] + [(len(ordered) + 1, 0)] * len(ordered)
    start = [0] * (len(ordered) + 1)
    for i in range(1, len(ordered) + 1):
        for first in range(i - 1, max(-1, i - 1 - cap), -1):
            padded = (i - first) * width[first]
            if i - first > 1 and padded > bound:
                break  # a run from an earlier (longer) input pads more still
            cost = (best[first][0] + 1, best[first][1] + padded)
            if cost < best[i]:
                best[i], start[i] = cost, first
    batches: list[list[int]] = []
    end = len(ordered)
    while end:
        batches.append(ordered[start[end]:end])
        end = start[end]
    return batches[::-1]


def _cut(ordered: list[int], lengths: Sequence[int], budget: int, cap: int) -> list[list[int]]:
    """Cut indices sorted longest first into batches: the first row sets the padded length."""
    batches: list[list[int]] = []
    current: list[int] = []
    for index in ordered:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) >= cap or (len(current) + 1) * longest > budget):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def padding_waste(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """The share of padded token slots that hold padding: 0.0 means no padding at all."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    real = sum(lengths[i] for b in batches for i in b)
    return 0.0 if padded == 0 else 1.0 - real / padded


def batch_limits(device: str, max_batch_tokens: int | None) -> tuple[int, int]:
    """``(max_batch_tokens, max_batch_size)`` for ``device``: ``max_batch_tokens`` if given.

    CPU: measured on 2 cores (README "Throughput", ``benchmarks/bench_vs_vllm.py``): a
    worker's throughput grows with the batch (fewer decode steps for the same outputs)
    more than padding costs it, up to about 64 rows. 2048 tokens cut 128 prompts of skewed
    lengths into 4 batches, a pair per worker; 1024 into 8, 0.65-0.75x as fast; batches of 8,
    0.4x. An accelerator wants wider batches still; the limit there is memory, which the
    budget bounds.
    """
    cpu = device.split(":")[0] in ("cpu", "mps")
    tokens = max_batch_tokens or (CPU_BATCH_TOKENS if cpu else ACCELERATOR_BATCH_TOKENS)
    if tokens < 1:
        raise ValueError("max_batch_tokens must be at least 1")
    return tokens, (CPU_BATCH_SIZE if cpu else ACCELERATOR_BATCH_SIZE)


def grouped_batches(requests: Sequence[Any], defaults: SamplingParams | None, size: int | None,
                    plan: Callable[[Sequence[int]], list[list[int]]],
                    window: int, *, context: int | None = None) -> list[list[int]]:
    """Batches of requests that can share ``generate`` calls: within each window, the
    requests of one group (``params.group_key``, as far as the parent can tell without the
    model's generation_config) planned apart, by length or ``size`` at a time. A request
    that cannot fit ``context`` tokens raises first (``check_context``)."""
    check_context(requests, defaults, context)
    batches: list[list[int]] = []
    for start in range(0, len(requests), window):
        groups: dict[Any, list[int]] = {}
        for i in range(start, min(start + window, len(requests))):
            params = (requests[i].params or SamplingParams()).over(defaults)
            groups.setdefault(group_key(resolve(params, {}), i), []).append(i)
        for members in groups.values():
            if size:
                batches += [members[j:j + size] for j in range(0, len(members), size)]
                continue
            lengths = [estimate_tokens(requests[i].size_hint()) + resolve(
                (requests[i].params or SamplingParams()).over(defaults), {}).max_tokens
                for i in members]
            batches += [[members[j] for j in batch] for batch in plan(lengths)]
    return batches



def halves(work: Work, indices: list[int], inputs: list[Any]) -> list[tuple[list[int], Work,
                                                                          list[Any]]]:
    """A failed batch's two halves (its ``indices``, its ``work`` and the ``inputs`` an error
    names), the first half first; none when ``work`` is not of inputs or has only one."""
    if len(indices) < 2 or isinstance(work, Rpc):
        return []
    items = list(work.requests if isinstance(work, Complete) else work.texts)
    middle = len(indices) // 2
    return [(indices[part], work.part(items[part]), inputs[part])
            for part in (slice(None, middle), slice(middle, None))]


def context_error(request: Request, defaults: SamplingParams | None,
                  context: int | None) -> SamplingParamsError | None:
    """Why ``request`` (over ``defaults``) cannot fit a context of ``context`` tokens, as
    vLLM refuses ``max_tokens`` above ``max_model_len`` minus the prompt's tokens; ``None``
    when it may fit. The prompt counts at least ``MOST_BYTES_PER_TOKEN`` bytes a token."""
    if context is None:
        return None
    asked = (request.params or SamplingParams()).over(defaults).max_tokens
    prompt = max(1, math.ceil(len(request.size_hint().encode("utf-8", "replace"))
                              / MOST_BYTES_PER_TOKEN))
    if prompt + (asked or 1) <= context:
        return None
    what = (f"max_tokens {asked} and a prompt of at least {prompt} tokens do not fit" if asked
            else f"a prompt of at least {prompt} tokens does not fit")
    return SamplingParamsError(
        f"{what} the model's context of {context} tokens (max_model_len).", field="max_tokens",
        fix=(f"give max_tokens at most {context - prompt}, or shorten the prompt"
             if context > prompt else "shorten the prompt")
        + "; a model that takes longer sequences than its config.json says: pass "
        "--max-model-len N (max_model_len=N).")


def check_context(requests: Sequence[Request], defaults: SamplingParams | None,
                  context: int | None) -> None:
    """Raise the ``context_error`` of the first of ``requests`` that has one, naming it."""
    for index, request in enumerate(requests):
        error = context_error(request, defaults, context)
        if error is not None:
            raise SamplingParamsError(f"request {index}: {error.message}", field=error.field,
                                      fix=error.fix)
