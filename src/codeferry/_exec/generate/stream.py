"""How a worker generates: the path it takes (``choose``, the one chooser), whether the
decode loop (``decode.py``) gives ``generate``'s tokens on a model (``probe``), and every
batch it holds at once in that loop (``Stream``).

Why a stream: the scheduler keeps up to two batches in a worker's pipe. Decoded one after
the other, each batch ends in a tail where its last rows run nearly alone, and every step
still reads all the weights. The worker's serving loop (``workers.worker``) instead hands
each batch to its ``Stream``, group by group (``complete.plan``): the batch's prompts join
the running loop as rows free up, and its reply goes out as soon as its own rows ended,
while the next batch's rows are already being computed. A batch with a group the loop does
not do (``complete.loop_rows``: ``n`` above 1, logprobs, penalties or ``min_p``) is answered
by ``complete`` on its plan, once the stream has drained.

The choice reads no parameter name and no transformers version: the loop's cache must fit
(``calling.supports``: layer kinds), its keywords are those the model's forward writes the
cache under (``calling.py``), and ``probe`` compares its tokens with ``generate``'s.
"""

from __future__ import annotations

from typing import Any

from ... import _settings
from .attention import disable, enable, layout_note
from .calling import calling, supports
from .complete import Planned, Planner, Requests, loop_rows, plan
from .decode import Engine, RowOptions, decode
from .generation import choose_path
from .params import eos_ids

__all__ = ["Stream", "choose", "probe"]


class Stream:
    """``Complete`` batches (request id, requests, defaults) decoded together on one model."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.engine: Engine | None = None
        #: The engine's group -> the request's id, its ``Planned`` and the group's members.
        self.requests: dict[int, tuple[int, Planned, list[int]]] = {}
        self.left: dict[int, int] = {}  # a request's groups still decoding
        self._empty: list[int] = []  # batches of no request at all: answered next

    @property
    def busy(self) -> bool:
        return bool(self._empty) or (self.engine is not None and self.engine.busy)

    def take(self, request_id: int, worker: Planner, work: Requests) -> Planned | None:
        """Join the loop with a ``Complete`` batch (``complete.plan``: its groups become the
        loop's): ``None``. When a group is one the loop does not do, the batch as planned:
        the caller answers it with ``complete`` on that plan, once the loop has drained."""
        planned = plan(worker, work.requests, work.defaults, work.chat_template)
        looped = [loop_rows(worker, [planned.resolved[i] for i in members], planned.ends)
                  for members in planned.groups]
        if any(rows is None for rows in looped):
            return planned
        if any(r.structured is not None for r in planned.resolved):
            from .structured import check  # refused whole, before any group joins the loop

            check(self.tokenizer, self.model, [r.structured for r in planned.resolved])
        engine = self._engine()
        self.left[request_id] = len(planned.groups)
        for members, rows in zip(planned.groups, looped, strict=True):
            assert rows is not None
            group = engine.add([planned.rendered[i][1] for i in members], rows)
            self.requests[group] = (request_id, planned, members)
        if not planned.groups:
            del self.left[request_id]
            self._empty.append(request_id)
        return None

    def _engine(self) -> Engine:
        if self.engine is None:
            pad = self.tokenizer.pad_token_id
            self.engine = Engine(self.model, pad_token_id=0 if pad is None else int(pad),
                                 tokenizer=self.tokenizer)
        return self.engine

    def step(self) -> list[tuple[int, bool, Any]]:
        """One step of the loop: ``(request id, True, results)`` for each batch that ended,
        or, when the step raised, ``(request id, False, the error)`` for every request in it
        (the loop starts afresh: the scheduler retries them as it retries a failed batch)."""
        import torch

        replies: list[tuple[int, bool, Any]] = [(r, True, []) for r in self._empty]
        self._empty = []
        if self.engine is None:
            return replies
        try:
            with torch.inference_mode():
                ended = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - every request in the loop gets it
            failed = dict.fromkeys(request for request, _, _ in self.requests.values())
            self.engine, self.requests, self.left = None, {}, {}
            return replies + [(request, False, exc) for request in failed]
        for group, rows in ended:
            request, planned, members = self.requests.pop(group)
            planned.fill(self.tokenizer, members, [[(row, None)] for row in rows])
            self.left[request] -= 1
            if not self.left[request]:
                del self.left[request]
                replies.append((request, True, planned.done()))
        return replies


#: How far a token's logit may lie below the best one and still be a tie: units of the
#: dtype's rounding (``eps``) at the logits' scale. Batched and single-row products round
#: apart, and in half precision two logits are often exactly equal (a 217M bfloat16 Llama:
#: a gap of 0.0 at scale 20.5), where ``argmax`` takes whichever came out ahead.
TIE_EPS = 4


def _tied(logits: Any, best: int, other: int, dtype: Any) -> bool:
    """Whether ``other`` is as good a greedy pick as ``best`` under the rounding of ``dtype``,
    the model's (a model may hand back float32 logits it computed in half precision)."""
    import torch

    scale = max(1.0, float(logits.abs().max()))
    slack = TIE_EPS * torch.finfo(dtype).eps * scale
    return bool(float(logits[best]) - float(logits[other]) <= slack)


def _follows(model: Any, prompt: list[int], row: list[int], pad: int) -> bool:
    """Whether ``row`` is ``generate``'s greedy continuation of ``prompt`` (exactly
    ``len(row)`` tokens), a step that picked a token tied with ``generate``'s included:
    ``generate`` then goes on from the loop's token, so every step is still compared."""
    import torch

    done, new = 0, len(row)
    while done < new:
        left = new - done
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([prompt + row[:done]], device=model.device),
                                 do_sample=False, max_new_tokens=left, min_new_tokens=left,
                                 pad_token_id=pad, output_logits=True,
                                 return_dict_in_generate=True)
        want = out.sequences[0, len(prompt) + done:].tolist()
        apart = next((k for k, (a, b) in enumerate(zip(want, row[done:], strict=True)) if a != b),
                     None)
        if apart is None:
            return True
        if not _tied(out.logits[apart][0], want[apart], row[done + apart], model.dtype):
            return False
        done += apart + 1
    return True


def probe(model: Any, pad: int) -> str | None:
    """``None`` when the loop gives ``generate``'s greedy tokens on this model (rows that
    leave and rows that join included; a pick between tied logits is either's); otherwise
    why not."""
    why = supports(model)
    if why is not None:
        return why
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    if vocab < 8:
        return "the model has no usable vocab_size"
    call = calling(model)
    if isinstance(call, str):
        return call
    prompts = [[(3 + 5 * i) % vocab for i in range(7)], [(4 + 3 * i) % vocab for i in range(3)],
               [(5 + 7 * i) % vocab for i in range(5)]]
    lengths = (6, 3, 5)
    eos = tuple(eos_ids(model.generation_config.eos_token_id))
    try:  # every row exactly its length long: end-of-sequence masked, as generate masks it
        got = decode(model, prompts, [RowOptions(n, eos, n) for n in lengths], pad_token_id=pad,
                     max_rows=2)
        for prompt, new, row in zip(prompts, lengths, got, strict=True):
            if len(row) != new or not _follows(model, prompt, row, pad):
                return "the decode loop gave other greedy tokens than generate"
    except Exception as exc:  # noqa: BLE001 - any failure means: not for this model
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def choose(model: Any, requested: str, device: str, pad: int | None) -> tuple[str, str]:
    """The path a worker generates on, and why: for ``auto`` and ``decode``, ``("decode",
    why)`` where the loop's probe matches on this model, on any device, else ``("batched",
    why not)``; ``continuous`` and ``batched`` as ``generation.choose_path`` answers them.
    The loop measured ahead of batched ``generate`` and continuous batching on CPU and on an
    H200 alike (``benchmarks/bench_generation.py``, ``docs/benchmarks.md``)."""
    if requested not in ("auto", "decode"):
        return choose_path(model, requested, pad)
    if device.startswith("cpu") and _settings.cpu_float32_attention() and enable(model):
        if probe(model, 0 if pad is None else pad) is None:
            return "decode", ("a greedy probe of the decode loop, with codeferry's attention "
                              "(whole buffers; float32 keys for half precision), matched "
                              "generate token for token (tied logits either way); "
                              + layout_note(model))
        disable(model)
    failure = probe(model, 0 if pad is None else pad)
    if failure is None:
        return "decode", ("a greedy probe of the decode loop matched generate token for token "
                          "(tied logits either way)")
    return "batched", f"the decode loop does not work for this model: {failure}"
