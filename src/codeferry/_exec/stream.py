"""How a worker generates with the decode loop (``decode.py``): whether it may (``probe``,
``choose``), one batch (``generate``), and every batch it holds at once (``Stream``).

Why a stream: the scheduler keeps up to two batches in a worker's pipe. Decoded one after
the other, each batch ends in a tail where its last rows run nearly alone, and every step
still reads all the weights. The worker's serving loop (``worker._serve``) instead hands each
``generate`` message to its ``Stream``: the message's prompts join the running loop as rows
free up, and its reply goes out as soon as its own rows ended, while the next batch's rows
are already being computed. A message whose options the loop does not do is answered by
``generate`` as before, once the stream has drained.
"""

from __future__ import annotations

from typing import Any

from .decode import Engine, RowOptions, decode, ids, row_options, supports

__all__ = ["Stream", "choose", "generate", "probe"]


class Stream:
    """Generate requests (request id, texts, options) decoded together on one model."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.engine: Engine | None = None
        self.requests: dict[int, int] = {}  # the engine's group -> the request's id

    @property
    def busy(self) -> bool:
        return self.engine is not None and self.engine.busy

    def take(self, request_id: int, texts: list[str], options: dict[str, Any]) -> bool:
        """Join the loop with ``texts``; ``False`` when an option is one the loop does not do
        (the caller answers it with ``generate``, after ``drain``)."""
        rows = row_options(options, self.model.generation_config)
        if rows is None:
            return False
        if self.engine is None:
            pad = options.get("pad_token_id", self.tokenizer.pad_token_id)
            self.engine = Engine(self.model, pad_token_id=0 if pad is None else int(pad))
        prompts = [list(row) for row in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]
        self.requests[self.engine.add(prompts, [rows] * len(prompts))] = request_id
        return True

    def step(self) -> list[tuple[int, bool, Any]]:
        """One step of the loop: ``(request id, True, texts)`` for each request that ended,
        or, when the step raised, ``(request id, False, the error)`` for every request in it
        (the loop starts afresh: the scheduler retries them as it retries a failed batch)."""
        import torch

        assert self.engine is not None
        try:
            with torch.inference_mode():
                ended = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - every request in the loop gets it
            failed = [(request, False, exc) for request in self.requests.values()]
            self.engine, self.requests = None, {}
            return failed
        return [(self.requests.pop(group), True,
                 [str(self.tokenizer.decode(row, skip_special_tokens=True)) for row in rows])
                for group, rows in ended]


def probe(model: Any, pad: int) -> str | None:
    """``None`` when the loop gives ``generate``'s greedy tokens on this model (rows that
    leave and rows that join included); otherwise why not."""
    why = supports(model)
    if why is not None:
        return why
    import torch

    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    if vocab < 8:
        return "the model has no usable vocab_size"
    prompts = [[(3 + 5 * i) % vocab for i in range(7)], [(4 + 3 * i) % vocab for i in range(3)],
               [(5 + 7 * i) % vocab for i in range(5)]]
    lengths = (6, 3, 5)
    eos = ids(model.generation_config.eos_token_id)
    try:  # every row exactly its length long: end-of-sequence masked, as generate masks it
        got = decode(model, prompts, [RowOptions(n, eos, n) for n in lengths], pad_token_id=pad,
                     max_rows=2)
        for prompt, new, row in zip(prompts, lengths, got, strict=True):
            with torch.inference_mode():
                out = model.generate(input_ids=torch.tensor([prompt], device=model.device),
                                     do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                     pad_token_id=pad)
            if out[0, len(prompt):].tolist() != row:
                return "the decode loop gave other greedy tokens than generate"
    except Exception as exc:  # noqa: BLE001 - any failure means: not for this model
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def choose(model: Any, requested: str, device: str, pad: int | None) -> tuple[str, str] | None:
    """``("decode", why)`` when a worker generates with this loop; ``None``: the other paths
    decide (``generation.choose_path``). ``auto`` takes it on CPU, where it was measured
    (``benchmarks/bench_generation.py``); ``decode`` asks for it anywhere it works."""
    if requested not in ("auto", "decode") or (requested == "auto" and
                                                not device.startswith("cpu")):
        return None
    failure = probe(model, 0 if pad is None else pad)
    if failure is None:
        return "decode", "a greedy probe of the decode loop matched generate token for token"
    if requested == "decode":
        return "batched", f"the decode loop does not work for this model: {failure}"
    return None


def generate(model: Any, tokenizer: Any, texts: list[str],
             options: dict[str, Any]) -> list[str] | None:
    """A worker's ``generate`` by the loop: texts out, or ``None`` when an option is one the
    loop does not do (the caller then runs ``generate``)."""
    rows = row_options(options, model.generation_config)
    if rows is None:
        return None
    prompts = [list(row) for row in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    pad = options.get("pad_token_id", tokenizer.pad_token_id)
    out = decode(model, prompts, [rows] * len(prompts), pad_token_id=0 if pad is None else int(pad))
    return [str(tokenizer.decode(row, skip_special_tokens=True)) for row in out]
