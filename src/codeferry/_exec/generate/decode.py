"""A decode loop for CPU batch generation: rows leave when they end, new rows take their place.

Why not ``model.generate`` on a padded batch: on a decode-heavy job (hundreds of new
tokens, each output ending at its own end-of-sequence) a padded batch computes every row
until its longest row ends, and transformers' ``DynamicCache`` grows by ``torch.cat`` at
every step, copying the whole cache each time (quadratic in the output length). And why
not transformers' continuous batching (``generate_batch``): on CPU its scheduler and paged
attention cost more per step than they save (``generation.py``). This loop calls the
model's ``forward`` itself:

- a prefill of a group of left-padded prompts computes logits for the last position only
  (``logits_to_keep=1``), then every step feeds one token per row; the prompts are prefilled
  in groups of like lengths (``prefill_runs``), each padded to its own longest, all groups
  of one fill written into one buffer, joined to the batch once (joining each group copied
  the whole cache once a group: a fifth of a 64-prompt prefill's time);
- the cache is ``_Layer``: per layer one preallocated buffer, written in place; for a model
  whose attention ``attention.enable`` switched, in float32 (faster on CPU for half
  precision) and a little longer than its columns: a step reads it whole (``CACHE``);
- a row that ends (its end-of-sequence, its ``max_new_tokens``) stops being computed: the
  batch is compacted (rows selected, and cache columns that only padding fills any more
  dropped) once an eighth of it has ended, so compaction copies the cache rarely;
- when a quarter of the rows (``max_rows``) are free and prompts are waiting, they are
  prefilled as a group and merged in, right-aligned (left padding, masked), so a long
  output never holds a half-empty batch.

Each row has its own options (``RowOptions``): new-token limits, end-of-sequence ids,
greedy or sampled (temperature, top-k, top-p, seed), structured output (its own grammar
matcher masks its logits: ``structured.py``). Greedy rows give ``generate``'s tokens
(positions from the attention mask as ``generate`` computes them, float32 argmax;
``test_decode.py`` checks it). A model whose cache is not plain full attention (sliding
windows, states) is not run here (``calling.supports``), and the worker's probe
(``stream.probe``) compares the loop with ``generate`` on the model before taking it.

What the loop relies on in transformers, each decided by what the model does, not by the
names of its parameters (releases rename them: 5.25's forwards take ``cache``, not
``past_key_values``): the keywords the cache and ``logits_to_keep`` go in (``calling.py``:
a two-token forward per spelling transformers has used, once per model); the layered cache (``DynamicCache(config=...)``, its
``DynamicLayer``s, which ``_Layer`` extends: ``calling.supports`` refuses a transformers without
them, and any other cache layer kind); the rest (``attention_mask``, ``position_ids``) the
probe decides: tokens equal to ``generate``'s, rows leaving and joining.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .attention import CACHE, SLACK, cache_dtype, empty_keys, kv_shape
from .calling import Calling, calling
from .cuts import blocks, prefill_runs

__all__ = ["Engine", "RowOptions", "decode", "rows_for"]

#: Rows decoded together at most, and the KV-cache bytes they may hold (CPU defaults).
MAX_ROWS, KV_BUDGET = 64, 1 << 30


@dataclass(frozen=True)
class RowOptions:
    """How one row is generated."""

    max_new_tokens: int
    eos: tuple[int, ...] = ()
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    #: A row with a seed draws from its own generator: the same seed, the same tokens.
    seed: int | None = None
    #: What the text must match (``structured.StructuredOutput``; its matcher masks the row).
    structured: Any = None


def rows_for(model: Any, longest: int, kv_budget: int = KV_BUDGET,
             max_rows: int = MAX_ROWS) -> int:
    """Rows decoded together: ``max_rows``, fewer when their cache, ``longest`` positions a
    row (prompt plus new tokens), would pass ``kv_budget`` bytes."""
    heads, dim = kv_shape(model)
    stored = cache_dtype(model)
    size = stored.itemsize if stored is not None else next(model.parameters()).element_size()
    layers = int(model.config.get_text_config().num_hidden_layers)
    per_row = 2 * layers * heads * dim * size * max(1, longest)
    return int(max(1, min(max_rows, kv_budget // per_row)))


def _layer_class() -> Any:
    import torch
    from transformers.cache_utils import DynamicLayer

    class _Layer(DynamicLayer):  # type: ignore[no-untyped-call]  # untyped in transformers
        """A ``DynamicLayer`` over a preallocated buffer: ``update`` writes in place.

        Columns past ``length`` are read only by codeferry's attention (``store``; masked,
        ``attention.CACHE``), which zeroes its buffers; other buffers are made empty and only
        their padding columns (masked: 0 times leftover NaN is NaN) zeroed.
        """

        capacity = 0
        #: The dtype keys and values are stored in (``attention.cache_dtype``), else theirs.
        store: Any = None
        #: Rows to make the buffer for (a fill's runs ``share`` it), where this layer writes.
        rows, at = 0, (0, 0)

        def update(self, key_states: Any, value_states: Any, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.dtype, self.device = self.store or key_states.dtype, key_states.device
                self.is_initialized, self.length = True, 0
                shape = (max(self.rows, key_states.shape[0]), key_states.shape[1],
                         self.room(key_states.shape[-2], self.capacity), key_states.shape[-1])
                self.kbuf, self.vbuf = self._buffers(shape)
            (row, column), rows = self.at, key_states.shape[0]
            first, end = column + self.length, column + self.length + key_states.shape[-2]
            if end > self.kbuf.shape[-2]:  # past the capacity: grow
                self.resize(list(range(self.kbuf.shape[0])), 0, self.room(end, end + end // 2))
            self.kbuf[row:row + rows, :, first:end] = key_states
            self.vbuf[row:row + rows, :, first:end] = value_states
            self.length = end - column
            self.keys, self.values = (b[row:row + rows, :, column:end] for b in (self.kbuf, self.vbuf))
            return self.keys, self.values

        def share(self, owner: Any, row: int, rows: int, column: int) -> None:
            """Write ``rows`` rows into ``owner``'s buffer from ``row``, right-aligned at
            ``column``: the columns before it are left padding, zeroed."""
            self.kbuf, self.vbuf, self.at, self.length = owner.kbuf, owner.vbuf, (row, column), 0
            for buffer in (self.kbuf, self.vbuf):
                buffer[row:row + rows, :, :column].zero_()
            self.dtype, self.device, self.is_initialized = owner.dtype, owner.device, True
            self.keys, self.values = self.kbuf[:0], self.vbuf[:0]  # empty: no columns yet

        def room(self, needed: int, planned: int) -> int:
            """A buffer's columns: ``planned``, or under ours a quarter more than ``needed``."""
            return max(needed, planned) if self.store is None else needed + max(SLACK, needed // 4)

        def _buffers(self, shape: tuple[int, ...]) -> tuple[Any, Any]:
            ours, make = self.store is not None, torch.zeros if self.store is not None else torch.empty
            return (empty_keys(shape, self.dtype, self.device, ours),
                    make(shape, dtype=self.dtype, device=self.device))

        def _new(self, rows: int, capacity: int) -> tuple[Any, Any]:
            return self._buffers((rows, self.kbuf.shape[1], capacity, self.kbuf.shape[3]))

        def _place(self, new: tuple[Any, Any], at: int, pad: int, rows: list[int],
                   start: int) -> None:
            """Copy ``rows`` (columns ``start..length``) into ``new`` from row ``at``, after
            ``pad`` zeroed columns."""
            kept, runs = self.length - start, blocks(rows)
            for buffer, old in zip(new, (self.kbuf, self.vbuf), strict=True):
                buffer[at:at + len(rows), :, :pad].zero_()
                for first, end, where in runs:
                    buffer[at + where:at + where + end - first, :, pad:pad + kept] = (
                        old[first:end, :, start:self.length])

        def _use(self, new: tuple[Any, Any], length: int) -> None:
            self.kbuf, self.vbuf = new
            self.length = length
            self.keys, self.values = self.kbuf[:, :, :length], self.vbuf[:, :, :length]

        def resize(self, rows: list[int], start: int, capacity: int) -> None:
            """Keep ``rows`` (increasing) and the columns from ``start``, in a buffer of
            ``capacity`` columns."""
            kept = self.length - start
            new = self._new(len(rows), max(capacity, kept))
            self._place(new, 0, 0, rows, start)
            self._use(new, kept)

        def append_rows(self, other: Any, capacity: int) -> None:
            """Add ``other``'s rows below these, both right-aligned on the longer length."""
            length = max(self.length, other.length)
            mine, theirs = self.kbuf.shape[0], other.kbuf.shape[0]
            new = self._new(mine + theirs, self.room(length, capacity))
            self._place(new, 0, length - self.length, list(range(mine)), 0)
            other._place(new, mine, length - other.length, list(range(theirs)), 0)
            self._use(new, length)

    return _Layer


class _Batch:
    """The rows being decoded: their cache, attention mask, positions and tokens so far."""

    def __init__(self, model: Any, layer: Any, store: Any, call: Calling) -> None:
        self.model, self.layer, self.store, self.call = model, layer, store, call
        self.cache: Any = None
        self.mask: Any = None      # [rows, cache length + 1]: the real tokens, then the next
        self.position: Any = None  # [rows, 1]: the next token's position in its row
        self.last: Any = None      # [rows, 1]: the token each row feeds next
        self.rows: list[int] = []  # the request index of each row
        self.done: list[bool] = []
        self.fill = 0  # the rows of a fill (``Engine.step``) prefilled in runs, longest first
        self.fresh: list[Any] = []  # its buffer, then each run's mask and next positions

    def new_cache(self, capacity: int, rows: int = 0) -> Any:
        return _new_cache(self.model, self.layer, capacity, self.store, rows)

    def prefill(self, prompts: list[list[int]], indices: list[int], pad: int,
                capacity: int, keep: bool) -> Any:
        """Run ``prompts`` (left-padded), a run of a fill of ``fill`` rows, longest first; the
        last logits, float32. A fill's runs write into one buffer (its layers' ``share``), joined
        to the batch once, after its last run (``_join``), not copied in once a run."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        position = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        if not self.fresh:  # the fill's first run, its longest prompts: the buffer
            self.fresh = [cache := self.new_cache(capacity if self.cache is None else width,
                                                  self.fill)]
        else:
            cache, (owner, *runs) = self.new_cache(width), self.fresh
            for mine, theirs in zip(owner.layers, cache.layers, strict=True):
                theirs.share(mine, sum(len(m) for m, _ in runs), len(prompts),
                             owner.layers[0].length - width)
        call = self.call
        kwargs = {call.keep: 1} if keep and call.keep else {}
        out = self.model(input_ids=ids.to(self.model.device),
                         attention_mask=mask.to(self.model.device),
                         position_ids=position.to(self.model.device),
                         **{call.cache: cache}, **call.options, **kwargs)
        self.fresh.append((mask, mask.sum(-1, keepdim=True)))
        self.rows += indices
        self.done += [False] * len(indices)
        if sum(len(m) for m, _ in self.fresh[1:]) == self.fill:
            self._join(capacity)
        return out.logits[:, -1, :].float()

    def _join(self, capacity: int) -> None:
        """The fill's buffer becomes the batch's cache, or joins it below its rows."""
        import torch

        fresh, *runs = self.fresh
        self.fresh, width = [], fresh.layers[0].length
        for layer in fresh.layers:  # every row of the fill, not only its first run's
            layer._use((layer.kbuf, layer.vbuf), layer.length)
        mask = torch.cat([_pad_left(m, width) for m, _ in runs])
        last = torch.cat([p for _, p in runs])
        if self.cache is None:
            self.cache, self.mask, self.position = fresh, mask, last
            return
        grown = max(self.mask.shape[1], width)
        for mine, theirs in zip(self.cache.layers, fresh.layers, strict=True):
            mine.append_rows(theirs, max(capacity, mine.kbuf.shape[-2]))
        self.mask = torch.cat([_pad_left(self.mask, grown), _pad_left(mask, grown)])
        self.position = torch.cat([self.position, last])

    def compact(self) -> None:
        """Drop the rows that ended, and the columns only padding fills any more."""
        import torch

        keep = [i for i, done in enumerate(self.done) if not done]
        if not keep:
            self.cache = self.mask = self.position = self.last = None
            self.rows, self.done = [], []
            return
        index = torch.tensor(keep)
        mask = self.mask[index]
        start = int((mask.sum(0) > 0).nonzero()[0, 0]) if mask.shape[1] else 0
        for layer in self.cache.layers:
            layer.resize(keep, start, layer.kbuf.shape[-2] - start)
        self.mask, self.position = mask[:, start:], self.position[index]
        self.last = self.last[index]
        self.rows = [self.rows[i] for i in keep]
        self.done = [False] * len(keep)

    def step(self) -> Any:
        """One token for every row: the next logits, float32."""
        import torch

        self.mask = torch.cat([self.mask, torch.ones((self.mask.shape[0], 1),
                                                     dtype=self.mask.dtype)], dim=1)
        device = self.model.device  # codeferry's attention reads its layers' whole buffers:
        extra = {CACHE: self.cache} if self.store is not None and self.call.passes else {}
        out = self.model(input_ids=self.last.to(device), attention_mask=self.mask.to(device),
                         position_ids=self.position.to(device),
                         **{self.call.cache: self.cache}, **self.call.options, **extra)
        self.position = self.position + 1
        return out.logits[:, -1, :].float()


def _new_cache(model: Any, layer: Any, capacity: int, store: Any, rows: int = 0) -> Any:
    """A ``DynamicCache`` for ``model`` whose layers are ``layer``s (``_Layer``), their
    buffers made for ``rows`` rows at least."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    layers = [layer() for _ in cache.layers]
    for one in layers:
        one.capacity, one.store, one.rows = capacity, store, rows
    cache.layers = layers
    return cache


def _pad_left(mask: Any, width: int) -> Any:
    import torch

    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))  # zeros on the left


class _Chooser:
    """Picks each row's next token from its logits: argmax, or a draw as ``generate``
    samples (temperature, then top-k, then top-p), all sampled rows at once: a row's
    top-k (or, without one, its whole vocabulary) sorted once, top-p cut within it."""

    def __init__(self, options: dict[int, RowOptions], model: Any, tokenizer: Any) -> None:
        self.options = options  # the engine's: rows come and go
        self.generators: dict[int, Any] = {}
        self.model, self.tokenizer = model, tokenizer
        self.masks: Any = None  # ``structured.Mask`` of the structured rows, from the first

    def add(self, index: int, option: RowOptions) -> None:
        if option.do_sample and option.seed is not None:
            import torch

            self.generators[index] = torch.Generator().manual_seed(option.seed)
        if option.structured is not None:
            from .structured import Mask, grammars

            self.masks = self.masks or Mask(grammars(self.tokenizer, self.model), set())
            self.masks.add(index, option.structured)

    def pick(self, logits: Any, rows: list[int], counts: list[int]) -> list[int]:
        options = [self.options[r] for r in rows]
        if self.masks is not None:
            self.masks.mask(logits, rows)
        for at, (option, count) in enumerate(zip(options, counts, strict=True)):
            if option.eos and count < option.min_new_tokens:
                logits[at, list(option.eos)] = float("-inf")
        # max's indices are argmax's (the first maximum, NaN first, as ``generate``'s
        # argmax), computed about 3x faster on CPU: 0.25 against 0.75 ms for 32 x 32,000.
        tokens: list[int] = logits.max(-1).indices.tolist()
        sampled = [at for at, option in enumerate(options) if option.do_sample]
        if sampled:
            drawn = self._draw(logits[sampled], [options[at] for at in sampled],
                               [self.generators.get(rows[at]) for at in sampled])
            for at, token in zip(sampled, drawn, strict=True):
                tokens[at] = token
        return tokens

    @staticmethod
    def _draw(scores: Any, options: list[RowOptions], generators: list[Any]) -> list[int]:
        import torch

        vocab = scores.shape[-1]
        temperature = torch.tensor([max(o.temperature, 1e-6) for o in options],
                                   device=scores.device)
        ks = [o.top_k if 0 < o.top_k < vocab else vocab for o in options]
        values, order = torch.topk(scores / temperature.unsqueeze(-1), max(ks))  # sorted
        # The draw on CPU, wherever the model runs: a seed's generator is a CPU one, and
        # the same seed draws the same tokens on every device (the top-k only crosses).
        values, order = values.cpu(), order.cpu()
        rank = torch.arange(values.shape[-1]).unsqueeze(0)
        values = values.masked_fill(rank >= torch.tensor(ks).unsqueeze(-1), float("-inf"))
        top_p = torch.tensor([o.top_p for o in options]).unsqueeze(-1)
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs  # the mass of the better tokens: keeps at least one
        probs = probs.masked_fill(before >= top_p, 0.0)
        picks = []
        for row, generator in enumerate(generators):
            picks.append(int(order[row, torch.multinomial(probs[row], 1, generator=generator)]))
        return picks


class Engine:
    """Rows of any number of groups decoded together: a group is added (``add``) while
    others run, and ``step`` hands back each group once all of its rows ended.

    Why groups: a worker gets its prompts in batches, one message each. Decoding a batch
    alone, its rows end one by one and the last few are computed nearly alone (every step
    reads all the weights for a handful of rows); merging the next batch's prompts in as
    rows free up keeps the width, and each batch is answered as soon as its own rows end.
    """

    def __init__(self, model: Any, *, pad_token_id: int, max_rows: int | None = None,
                 tokenizer: Any = None) -> None:  # tokenizer: for structured rows' grammars
        self.model, self.pad, self.max_rows = model, pad_token_id, max_rows
        call = calling(model)
        if isinstance(call, str):
            raise ValueError(f"the decode loop cannot call this model: {call}")
        self.keep = call.keep is not None
        self.batch = _Batch(model, _layer_class(), cache_dtype(model), call)
        self.prompts: dict[int, list[int]] = {}
        self.options: dict[int, RowOptions] = {}
        self.outputs: dict[int, list[int]] = {}
        self.group_of: dict[int, int] = {}
        self.groups: dict[int, list[int]] = {}
        self.left: dict[int, int] = {}  # a group's rows not ended yet
        self.waiting: list[int] = []    # first come, first in; longest first within a group
        self.finished: list[tuple[int, list[list[int]]]] = []
        self.chooser = _Chooser(self.options, model, tokenizer)
        self.rows = 1
        self._next, self._next_group, self._longest = 0, 0, 1

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.batch.rows or self.finished)

    def add(self, prompts: list[list[int]], options: list[RowOptions]) -> int:
        """Queue ``prompts`` (token ids), one ``RowOptions`` each; their group's number."""
        if len(options) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(options)} row options")
        group, self._next_group = self._next_group, self._next_group + 1
        indices = list(range(self._next, self._next + len(prompts)))
        self._next += len(prompts)
        for index, prompt, option in zip(indices, prompts, options, strict=True):
            self.prompts[index], self.options[index], self.outputs[index] = prompt, option, []
            self.group_of[index] = group
            self.chooser.add(index, option)
            self._longest = max(self._longest, len(prompt) + option.max_new_tokens)
        self.groups[group] = indices
        live = [i for i in indices if self.options[i].max_new_tokens > 0]
        self.left[group] = len(live)
        self.waiting += sorted(live, key=lambda i: -len(self.prompts[i]))
        self.rows = self.max_rows or rows_for(self.model, self._longest)
        if not live:
            self._finish(group)
        return group

    def step(self) -> list[tuple[int, list[list[int]]]]:
        """One prefill of waiting prompts, or one token for every row (call it under
        ``torch.inference_mode``); the groups that ended, each with its rows' new tokens."""
        import torch

        batch, rows = self.batch, self.rows
        free = rows - (len(batch.rows) - sum(batch.done))
        if self.waiting and (not batch.rows or free >= max(1, rows // 4)):
            if any(batch.done):
                batch.compact()
            group, self.waiting = self.waiting[:free], self.waiting[free:]
            group.sort(key=lambda i: -len(self.prompts[i]))
            present = batch.rows + group
            capacity = max(len(self.prompts[i]) + self.options[i].max_new_tokens
                           - len(self.outputs[i]) for i in present) + (
                               batch.mask.shape[1] if batch.rows else 0)
            batch.fill = len(group)
            for a, b in prefill_runs([len(self.prompts[i]) for i in group]):
                part = group[a:b]
                logits = batch.prefill([self.prompts[i] for i in part], part, self.pad,
                                       capacity, self.keep)
                tokens = self.chooser.pick(logits, part, [0] * len(part))
                last = torch.tensor(tokens).unsqueeze(-1)
                batch.last = last if batch.last is None else torch.cat([batch.last, last])
                self._record(tokens, offset=len(batch.rows) - len(part))
        elif batch.rows:
            # ended rows leave in runs, or at once when their group was handed back (``_finish``)
            if sum(batch.done) * 8 >= len(batch.rows) or any(r not in self.options for r in batch.rows):
                batch.compact()
            if batch.rows:
                logits = batch.step()
                counts = [len(self.outputs[r]) for r in batch.rows]
                tokens = self.chooser.pick(logits, batch.rows, counts)
                batch.last = torch.tensor(tokens).unsqueeze(-1)
                self._record(tokens, offset=0)
        finished, self.finished = self.finished, []
        return finished

    def _record(self, tokens: list[int], offset: int) -> None:
        """Append each live row's token; mark the rows that ended, finish their groups."""
        batch = self.batch
        for at, token in enumerate(tokens, start=offset):
            if batch.done[at]:
                continue
            row = batch.rows[at]
            self.outputs[row].append(token)
            option = self.options[row]
            ended = token in option.eos or len(self.outputs[row]) >= option.max_new_tokens
            if self.chooser.masks is not None:
                self.chooser.masks.took(row, token, ended)
            if ended:
                batch.done[at] = True
                group = self.group_of[row]
                self.left[group] -= 1
                if not self.left[group]:
                    self._finish(group)

    def _finish(self, group: int) -> None:
        indices = self.groups.pop(group)
        del self.left[group]
        self.finished.append((group, [self.outputs[i] for i in indices]))
        for index in indices:
            for table in (self.prompts, self.options, self.outputs, self.group_of,
                          self.chooser.generators, getattr(self.chooser.masks, "matchers", {})):
                table.pop(index, None)


def decode(model: Any, prompts: list[list[int]], options: list[RowOptions], *,
           pad_token_id: int, max_rows: int | None = None, tokenizer: Any = None) -> list[list[int]]:
    """The new tokens of every prompt (each row's end-of-sequence included, as ``generate``
    returns it, padding removed). ``max_rows``: rows decoded together (``rows_for``)."""
    import torch

    engine = Engine(model, pad_token_id=pad_token_id, max_rows=max_rows, tokenizer=tokenizer)
    engine.add(prompts, options)
    outputs: list[list[int]] = []
    with torch.inference_mode():
        while engine.busy:
            for _, rows in engine.step():
                outputs = rows
    return outputs
