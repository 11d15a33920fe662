"""Grammar-constrained generation on the transformers engine: which library masks the logits.

Why: structured output (``response_format``, ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``) on the transformers engine needs a per-row logits
mask from a grammar, and three maintained libraries compute one: xgrammar, llguidance and
outlines-core. This script measures what each costs on CPU with torch 2.13: building its
view of the tokenizer (once per worker), compiling a grammar (once per distinct grammar),
and the per-token overhead inside ``model.generate`` on a tiny random-weight Llama (what
the processor's own time per token and row: fill each row's mask, apply it, advance), plus the size the
library installs (its wheel and its required dependencies, read from the wheels' metadata
by ``pip download --no-deps``: xgrammar requires triton on Linux x86_64).

The tokenizer is a byte-level BPE of 32,000 tokens trained here on the standard library's
Python source (a Llama-2-sized vocabulary, written by ``tokenizers``, as real checkpoints
ship); every library must accept it as a Hugging Face fast tokenizer. Each library's rows
must produce text its own grammar accepts (the JSON parses, the choice is one of them).
Run (each library importable, e.g. ``pip install xgrammar llguidance outlines-core``)::

    python benchmarks/bench_structured.py --rows 8 --tokens 48 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[a-z]{3,8}-[0-9]{2,4}"


def tokenizer(vocab: int) -> Any:
    """A byte-level BPE fast tokenizer of ``vocab`` tokens, trained on stdlib sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:250]
    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def model(vocab: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1)
    return LlamaForCausalLM(config).eval()


class Rows:
    """One library's matchers, one per row: ``fill`` a row's allowed tokens, ``accept`` one."""

    def __init__(self, lib: str, tok: Any, vocab: int) -> None:
        self.lib, self.tok, self.vocab = lib, tok, vocab
        started = time.perf_counter()
        if lib == "xgrammar":
            import xgrammar as xg

            self.info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
            self.compiler = xg.GrammarCompiler(self.info)
        elif lib == "llguidance":
            import llguidance.hf

            self.info = llguidance.hf.from_tokenizer(tok, vocab)
        else:
            import outlines_core

            sys.path.insert(0, str(Path(__file__).resolve().parent))
            self.info = outlines_core.Vocabulary(tok.eos_token_id, _outlines_vocabulary(tok))
        self.tokenizer_s = time.perf_counter() - started

    def compile(self, kind: str, spec: Any) -> Any:
        if self.lib == "xgrammar":
            c = self.compiler
            return {"json": lambda: c.compile_json_schema(json.dumps(spec)),
                    "regex": lambda: c.compile_regex(spec),
                    "choice": lambda: c.compile_grammar(
                        "root ::= " + " | ".join(json.dumps(s) for s in spec))}[kind]()
        if self.lib == "llguidance":
            import llguidance

            text = {"json": lambda: llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(spec), defaults={"whitespace_flexible": True}),
                "regex": lambda: llguidance.LLMatcher.grammar_from_regex(spec),
                "choice": lambda: llguidance.grammar_from("choice", spec)}[kind]()
            return text
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        regex = {"json": lambda: build_regex_from_schema(json.dumps(spec)),
                 "regex": lambda: spec,
                 "choice": lambda: "(" + "|".join(_escape(s) for s in spec) + ")"}[kind]()
        return outlines_core.Index(regex, self.info)

    def matchers(self, compiled: Any, rows: int) -> list[Any]:
        if self.lib == "xgrammar":
            import xgrammar as xg

            return [xg.GrammarMatcher(compiled) for _ in range(rows)]
        if self.lib == "llguidance":
            import llguidance

            return [llguidance.LLMatcher(self.info, compiled) for _ in range(rows)]
        import outlines_core

        return [outlines_core.Guide(compiled) for _ in range(rows)]

    def processor(self, matchers: list[Any], width: int) -> Any:
        lib = self.lib
        if lib == "xgrammar":
            import xgrammar as xg

            mask = xg.allocate_token_bitmask(len(matchers), self.vocab)
            fill = lambda m, i: m.fill_next_token_bitmask(mask, i)  # noqa: E731
            apply = xg.apply_token_bitmask_inplace
            accept = lambda m, t: m.accept_token(t)  # noqa: E731
            done = lambda m: m.is_terminated()  # noqa: E731
        elif lib == "llguidance":
            import llguidance.torch as lt

            mask = lt.allocate_token_bitmask(len(matchers), self.vocab)
            fill = lambda m, i: lt.fill_next_token_bitmask(m, mask, i)  # noqa: E731
            apply = lt.apply_token_bitmask_inplace
            accept = lambda m, t: m.consume_token(t)  # noqa: E731
            done = lambda m: m.is_stopped()  # noqa: E731
        else:
            import outlines_core.kernels.torch as ot

            mask = ot.allocate_token_bitmask(self.vocab)
            masks = [ot.allocate_token_bitmask(self.vocab) for _ in matchers]
            fill = lambda m, i: ot.fill_next_token_bitmask(m, masks[i])  # noqa: E731
            apply = None
            accept = lambda m, t: m.advance(t)  # noqa: E731
            done = lambda m: m.is_finished()  # noqa: E731

        ended = [False] * len(matchers)
        eos = self.tok.eos_token_id
        spent = [0.0]

        def timed(input_ids: Any, scores: Any) -> Any:
            t0 = time.perf_counter()
            out = step(input_ids, scores)
            spent[0] += time.perf_counter() - t0
            return out

        timed.spent = spent  # type: ignore[attr-defined]

        def step(input_ids: Any, scores: Any) -> Any:
            if input_ids.shape[1] > width:
                for i, m in enumerate(matchers):
                    if not ended[i]:
                        token = int(input_ids[i, -1])
                        if token == eos or done(m):
                            ended[i] = True
                        else:
                            accept(m, token)
            for i, m in enumerate(matchers):
                if ended[i]:
                    continue
                fill(m, i)
            if apply is not None:
                apply(scores, mask.to(scores.device))
            else:
                import outlines_core.kernels.torch as ot

                for i in range(len(matchers)):
                    if not ended[i]:
                        ot.apply_token_bitmask_inplace(scores[i:i + 1], masks[i])
            for i, m in enumerate(matchers):  # a finished grammar: end of sequence only
                if not ended[i] and done(m):
                    scores[i] = float("-inf")
                    scores[i, eos] = 0.0
            return scores

        return timed


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _outlines_vocabulary(tok: Any) -> dict[str, list[int]]:
    """token text -> ids, as vLLM's outlines backend builds it for a byte-level BPE."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {v: k for k, v in bytes_to_unicode().items()}
    out: dict[str, list[int]] = {}
    for token, index in tok.get_vocab().items():
        if token in tok.all_special_tokens:
            continue
        out.setdefault(bytes(back[c] for c in token).decode("latin-1"), []).append(index)
    return out


def check(kind: str, text: str) -> bool:
    import re

    if kind == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and set(value) == {"name", "age"}
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(REGEX, text) is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--libs", default="xgrammar,llguidance,outlines_core")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    tok = tokenizer(args.vocab)
    vocab = len(tok)
    print(f"tokenizer: byte-level BPE, {vocab} tokens, trained in "
          f"{time.perf_counter() - started:.1f} s")
    lm = model(vocab)
    prompt = tok(["Answer in the format asked: "] * args.rows, return_tensors="pt")
    width = prompt["input_ids"].shape[1]

    def run(processor: Any) -> tuple[float, Any]:
        from transformers import LogitsProcessorList

        extra = {"logits_processor": LogitsProcessorList([processor])} if processor else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = lm.generate(**prompt, do_sample=False, max_new_tokens=args.tokens,
                              min_new_tokens=args.tokens if processor is None else 0,
                              pad_token_id=tok.pad_token_id, **extra)
        return time.perf_counter() - t0, out[:, width:]

    plain = statistics.median(run(None)[0] for _ in range(args.repeat + 1)) / args.tokens
    print(f"plain generate: {plain * 1e3:.2f} ms a step ({args.rows} rows); below, the time "
          "inside the mask processor per generated token and row (steps until every row ended)")
    for lib in args.libs.split(","):
        rows = Rows(lib, tok, vocab)
        line = [f"{lib}: tokenizer {rows.tokenizer_s * 1e3:.0f} ms"]
        for kind, spec in (("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES)):
            t0 = time.perf_counter()
            compiled = rows.compile(kind, spec)
            compile_s = time.perf_counter() - t0
            per_token, valid = [], 0
            for _ in range(args.repeat):
                processor = rows.processor(rows.matchers(compiled, args.rows), width)
                _, out = run(processor)
                per_token.append(processor.spent[0] / out.shape[1] / args.rows)
                texts = tok.batch_decode(out, skip_special_tokens=True)
                valid = sum(check(kind, t) for t in texts)
            line.append(f"{kind}: compile {compile_s * 1e3:.0f} ms, "
                        f"+{statistics.median(per_token) * 1e3:.3f} ms/token/row, "
                        f"{valid}/{args.rows} valid")
        print("; ".join(line))


if __name__ == "__main__":
    main()
