"""Which way a worker generates: continuous batching (paged cache) or batched ``generate``.

transformers 5 can generate with continuous batching: ``model.generate_batch(token_ids)``
schedules requests into one stream of forward passes over a paged KV cache, so a short
prompt neither waits for nor is padded to the long one beside it. It works only for some
models (an attention implementation it can page: ``sdpa``, ``eager``, flash), only for
greedy or plain sampling, and it fails *quietly*: an error in its generation thread is
logged and the request comes back missing or empty. So each worker decides per model at
start-up (``choose_path``): a tiny greedy generation both ways, compared token for token.
Its answer travels in the worker's ready message (``info["generate_path"]``).

Measured, continuous batching is slower than ``generate`` over length-sorted batches: on
CPU (benchmarks/bench_vs_vllm.py) its scheduler and paged-attention bookkeeping cost more
per step than the padding it saves when the planner has already grouped prompts by length;
on an H200 (benchmarks/bench_generation.py --device cuda, transformers 5.23, a 217M Llama,
``docs/benchmarks.md``) it made 177 generated tokens/s where the decode loop made 1336 and
one ``generate`` of every prompt 1977. ``auto`` therefore never takes it (the decode loop
first, ``stream.choose``, then batched ``generate``); ``continuous`` asks for it anywhere it
works.

``generate_batch`` runs in a thread of its own, and tensors made under
``torch.inference_mode`` in the caller's thread cannot be updated there, so it is never
called inside ``inference_mode`` (it takes ``no_grad`` itself).

What it relies on in transformers: ``generate_batch`` (a model without it is answered
batched), its ``continuous_batching_config`` keyword, ``ContinuousBatchingConfig``, the
``continuous_batching.utils`` logger and its outputs' ``error`` and ``generated_tokens``
(5.x; 4.53 has ``generate_batch`` but none of the rest). All are used inside ``_probe``,
so one missing or renamed fails the probe and the worker generates batched, its reason
said. ``lighter_min_new_tokens`` relies on ``generate`` running custom logits processors
after its own (``tests/exec/generate/test_generate_paths.py`` compares the tokens).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .params import eos_ids

__all__ = ["GENERATE_PATHS", "choose_path", "continuous_supports", "generate_continuous"]

#: The requests ``choose_path`` answers (``stream.choose`` answers ``auto`` and ``decode``).
GENERATE_PATHS: tuple[str, ...] = ("continuous", "batched")

#: ``generate`` options the continuous path honours exactly; any other sends a call batched.
_SUPPORTED = {"max_new_tokens", "min_new_tokens", "do_sample", "pad_token_id", "eos_token_id"}


#: Tokens a page of the paged cache holds, and the most tokens one forward pass takes.
PAGE_TOKENS = 32
MAX_FORWARD_TOKENS = 4096


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _quiet() -> Iterator[_Collect]:
    """Keep transformers' continuous-batching log off the worker's stderr, and collect it:
    its errors are the only account of a request that failed in the generation thread."""
    from transformers.generation.continuous_batching import utils

    log: logging.Logger = utils.logger  # "ContinuousBatchingLogger", not under "transformers"
    collect = _Collect()
    saved = log.propagate, log.level
    log.addHandler(collect)
    log.propagate, log.level = False, logging.WARNING
    hidden = [h for h in log.handlers if h is not collect]
    for handler in hidden:
        log.removeHandler(handler)
    try:
        yield collect
    finally:
        log.removeHandler(collect)
        for handler in hidden:
            log.addHandler(handler)
        log.propagate, log.level = saved


def continuous_supports(options: dict[str, Any]) -> bool:
    """Whether a call's ``generate`` options mean the same on the continuous path.

    Greedy only (its sampling draws other numbers than ``generate``'s), and a minimum
    length only when it is the maximum too (then end-of-sequence is simply off).
    """
    if set(options) - _SUPPORTED or options.get("do_sample", False):
        return False
    low = options.get("min_new_tokens") or 0
    return low in (0, options.get("max_new_tokens"))


def generate_continuous(model: Any, prompts: list[list[int]], options: dict[str, Any],
                        eos_token_id: Any) -> list[list[int]]:
    """New tokens per prompt, by ``model.generate_batch``; raises when any request failed."""
    from transformers import GenerationConfig

    new = int(options["max_new_tokens"])
    eos = eos_ids(eos_token_id)
    # min_new_tokens == max_new_tokens: generate masks end-of-sequence on every step (its
    # MinNewTokensLengthLogitsProcessor, which continuous batching drops); the same mask
    # here is suppress_tokens, with stopping off.
    until_max = (options.get("min_new_tokens") or 0) == new
    config = GenerationConfig(  # type: ignore[no-untyped-call]  # untyped in transformers
        do_sample=False, max_new_tokens=new, eos_token_id=-1 if until_max or not eos else eos,
        suppress_tokens=eos if until_max and eos else None,
        pad_token_id=options.get("pad_token_id"))
    with _quiet() as log:
        results = model.generate_batch(prompts, generation_config=config, progress_bar=False,
                                       continuous_batching_config=_sized(prompts, new))
    outputs = list(results.values())
    if len(outputs) != len(prompts) or any(o.error is not None for o in outputs):
        errors = [o.error for o in outputs if o.error] + log.messages
        raise RuntimeError(f"continuous batching returned {len(outputs)} of {len(prompts)} "
                           f"results: {'; '.join(errors[:3]) or 'no error logged'}")
    return [list(o.generated_tokens) for o in outputs]


def _sized(prompts: list[list[int]], new: int) -> Any:
    """A paged cache sized for these requests. Left to itself, transformers sizes it from the
    device's free memory, which on CPU (without psutil) means a default that took 13 GB
    and 15 s per call here; each request needs its own pages for prompt and new tokens."""
    from transformers import ContinuousBatchingConfig

    pages = sum(-(-(len(p) + new) // PAGE_TOKENS) for p in prompts)
    return ContinuousBatchingConfig(
        page_size=PAGE_TOKENS, num_blocks=pages + 1, max_requests_per_batch=len(prompts),
        max_batch_tokens=min(MAX_FORWARD_TOKENS, sum(len(p) for p in prompts) + len(prompts)),
        allow_block_sharing=False)


def _batched(model: Any, prompts: list[list[int]], options: dict[str, Any]) -> list[list[int]]:
    """What the batched path computes for the same prompts: left-padded ``generate``."""
    import torch

    width, pad = max(len(p) for p in prompts), options["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **options)
    return [row.tolist() for row in out[:, width if echoes_prompt(model, pad) else 0:]]


def _probe(model: Any, pad: int) -> str | None:
    """``None`` when continuous batching gives exactly the batched path's greedy tokens."""
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    if vocab < 8:
        return "the model has no usable vocab_size"
    prompts = [[(3 + 5 * i) % vocab for i in range(7)], [(4 + 3 * i) % vocab for i in range(3)]]
    eos = model.generation_config.eos_token_id
    try:
        for low in (4, 0):  # every output 4 tokens long; and stopped at end-of-sequence
            options = {"max_new_tokens": 4, "min_new_tokens": low, "pad_token_id": pad}
            expected = _batched(model, prompts, options)
            got = generate_continuous(model, prompts, options, eos)
            if [_until(row, eos) for row in got] != [_until(row, eos) for row in expected]:
                return "continuous batching gave other greedy tokens than generate"
    except Exception as exc:  # noqa: BLE001 - any failure means: not for this model
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _until(row: list[int], eos: Any) -> list[int]:
    """The tokens up to and including the first end-of-sequence (then generate pads)."""
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    for at, token in enumerate(row):
        if token in ends:
            return row[:at + 1]
    return row


def choose_path(model: Any, requested: str, pad_token_id: int | None) -> tuple[str, str]:
    """The path a worker asked for ``continuous`` or ``batched`` takes, and why:
    ``("continuous" | "batched", reason)``. ``auto`` never reaches continuous batching:
    ``stream.choose`` answers it (the decode loop, else batched ``generate``)."""
    if requested not in GENERATE_PATHS:
        raise ValueError(f"choose_path answers 'continuous' or 'batched', got {requested!r} "
                         "(stream.choose decides 'auto' and 'decode')")
    if requested == "batched":
        return "batched", "asked for (generate_path='batched')"
    if not hasattr(model, "generate_batch"):
        return "batched", "this transformers has no continuous batching (generate_batch)"
    failure = _probe(model, 0 if pad_token_id is None else pad_token_id)
    if failure is not None:
        return "batched", f"continuous batching does not work for this model: {failure}"
    return "continuous", "a greedy probe matched generate token for token"


class _NoEndBefore:
    """A logits processor: end-of-sequence is impossible until the sequence is ``length``
    tokens long, written into the scores in place.

    What ``min_new_tokens`` means, for a fraction of its cost: transformers turns that one
    option into two processors (``MinLength`` and ``MinNewTokensLength``), each of which
    clones the whole ``batch x vocab`` score matrix and writes it again with ``torch.where``
    at every step, about a tenth of a small model's decode time on CPU. The scores it gets
    are generate's own float32 copy of the logits, so writing into them is safe.
    """

    def __init__(self, ends: list[int], length: int) -> None:
        self.ends, self.length = ends, length

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if input_ids.shape[-1] < self.length:
            scores[:, [e for e in self.ends if 0 <= e < scores.shape[-1]]] = float("-inf")
        return scores


_ECHOES: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def echoes_prompt(model: Any, pad: int) -> bool:
    """Whether the model's ``generate`` returns the prompt before the new tokens, as
    transformers' own does. A vision-language wrapper (InternVL, MiniCPM-V...) whose
    ``generate`` embeds the ids and calls its language model's ``generate`` with
    ``inputs_embeds`` returns the new tokens only, and its logits processors see those only.
    transformers' own ``generate`` does; another is found once per model by generating one
    token after a two-token prompt."""
    known = _ECHOES.get(model)
    if known is not None:
        return known
    import torch
    from transformers import GenerationMixin

    if getattr(type(model), "generate", None) is GenerationMixin.generate:
        known = True
    else:
        prompt = torch.tensor([[3, 4]], device=model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=1, do_sample=False, pad_token_id=pad)
        sequences = getattr(out, "sequences", out)
        known = bool(sequences.shape[1] > 2 and sequences[0, :2].tolist() == [3, 4])
    _ECHOES[model] = known
    return known


_PADS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
#: What the padding probe generates: enough steps to see a mask dropped after the first.
_PAD_PROBE_TOKENS = 3
#: The probe's prompts at start-up, through the model's own tokenizer (which adds what the
#: model's code looks for, as ChatGLM-6B's ``[gMASK]``).
_PAD_PROBE_TEXTS = ("hi", "a longer prompt, beside which the short one is padded")


def pads_safely(model: Any, short: list[int], long: list[int], pad: int) -> bool | None:
    """Whether left padding leaves a row's greedy tokens as they are alone, found once per
    model by generating ``short`` alone and left-padded beside ``long``. Code that drops a
    0/1 attention mask (ChatGLM-6B's takes only its tokenizer's 4-D boolean one, and computes
    its context and positions from the padded row) gives a padded row other tokens, with no
    error: such a model gets one ``generate`` call per prompt length. ``None`` (and nothing
    kept) when the probe itself failed on these prompts."""
    known = _PADS.get(model)
    if known is not None:
        return known
    if len(short) >= len(long):
        return True  # nothing to pad: ask another time
    options = {"max_new_tokens": _PAD_PROBE_TOKENS, "pad_token_id": pad}
    eos = model.generation_config.eos_token_id
    try:
        alone = _batched(model, [short], options)[0]
        padded = _batched(model, [long, short], options)[1]
    except Exception:  # noqa: BLE001 - these prompts are not this model's: ask another time
        return None
    known = _until(alone, eos) == _until(padded, eos)
    _PADS[model] = known
    return known


def padding_note(model: Any, tokenizer: Any, pad: int) -> str:
    """What ``choose_path``'s reason adds for the batched path: nothing, or that left padding
    changes this model's tokens (``pads_safely`` on two prompts its tokenizer makes)."""
    short, long = (list(tokenizer(text)["input_ids"]) for text in _PAD_PROBE_TEXTS)
    if pads_safely(model, short, long, pad) is not False:
        return ""
    return ("; left padding changes its greedy tokens (its code drops the attention mask): "
            "one generate call per prompt length")



def lighter_min_new_tokens(options: dict[str, Any], prompt_length: int,
                           config: Any) -> dict[str, Any]:
    """``options`` for ``generate`` with ``min_new_tokens`` done by ``_NoEndBefore``; the
    same tokens, greedy or sampled: custom processors run after generate's own and before
    its warpers (temperature, top-k, ...), and every one of generate's own that could run
    between commutes with forbidding a token, but a forced end-of-sequence, which must win
    (then ``options`` stay as they are). ``config``: the model's generation config."""
    low = options.get("min_new_tokens")
    eos = options.get("eos_token_id", getattr(config, "eos_token_id", None))
    forced = options.get("forced_eos_token_id", getattr(config, "forced_eos_token_id", None))
    if not isinstance(low, int) or low <= 0 or eos is None or forced is not None:
        return options  # nothing to enforce, or transformers would enforce nothing
    from transformers import LogitsProcessorList

    ends = [eos] if isinstance(eos, int) else [int(e) for e in eos]
    given = options.get("logits_processor") or []
    rest = {k: v for k, v in options.items() if k not in ("min_new_tokens", "logits_processor")}
    return {**rest, "logits_processor": LogitsProcessorList(
        [_NoEndBefore(ends, prompt_length + low), *given])}
