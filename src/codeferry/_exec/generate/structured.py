"""Structured output: the request's constraint (``StructuredOutput``, read from any of a
body's spellings by ``structured_in``), and on the transformers engine each row's logits
masked by it.

The first part is pure (``params.SamplingParams`` holds the value; the parent checks it
before anything is sent); llguidance and torch are imported only where a worker masks.
A constraint (a JSON schema, any JSON object, a regular expression, a choice or a grammar)
becomes an llguidance grammar, and every row of it gets its own matcher: before each token
is picked, the tokens the grammar cannot take next are set to ``-inf`` (``Mask.mask``); the
token picked then advances the matcher (``Mask.advance``). Once the grammar is complete the
mask leaves only end-of-sequence, so the row ends there.

Why llguidance: measured against xgrammar and outlines-core on CPU with torch 2.13
(``benchmarks/bench_structured.py``, ``docs/executor.md``), it compiles a schema in about a
millisecond, its per-token cost was the lowest or close to it, it installs alone (7.7 MB,
no dependencies; xgrammar requires triton, a 286 MB wheel, on Linux x86_64) and it reads
every kind vLLM's servers take (outlines-core has no grammars). vLLM ships it too: the vLLM
engine is started with its ``guidance`` backend (``vllm_engine.py``), and the grammar text
is built here as vLLM's backend builds it (flexible whitespace in JSON; a GBNF grammar
converted to Lark), so both engines mask alike and greedy texts agree.

The mask is applied here with plain tensor operations: llguidance's own
``apply_token_bitmask_inplace`` is a ``torch.compile`` kernel, which costs each worker a
compilation (and a C++ compiler) on its first structured request.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import EngineRefusedError, ExtraMissingError, SamplingParamsError

__all__ = ["GUIDED", "STRUCTURED_KINDS", "Constrained", "Grammars", "Mask", "StructuredOutput",
           "check", "grammars", "require", "structured_in"]

INSTALL = "pip install 'codeferry[structured]'"


def _error(name: str, message: str, fix: str) -> SamplingParamsError:
    return SamplingParamsError(f"{name} {message}", field=name, fix=fix)


#: The ``guided_*`` body fields (vLLM's servers before ``structured_outputs``), each the
#: kind of ``StructuredOutput`` it asks for.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
#: The kinds of ``StructuredOutput``, as vLLM's ``StructuredOutputsParams`` names them.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "additionalItems",
               "propertyNames", "if", "then", "else", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _schema_fault(schema: Any, where: str) -> str | None:
    """What makes ``schema`` no JSON schema (``where``: its place, for the message), or
    ``None``. The shape only (types, sub-schemas, ``required``): what a keyword means is the
    grammar library's to read, and a feature it lacks is its error, in the worker."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, Mapping):
        return f"{where} is {json.dumps(schema)[:60]}, not a schema (a JSON object)"
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [] if kinds is None else [kinds]:
        if kind not in _SCHEMA_TYPES:
            return (f"{where}.type is {json.dumps(kind)[:40]}, not one of "
                    f"{', '.join(sorted(_SCHEMA_TYPES))}")
    faults: list[str | None] = []
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], Mapping):
                return f"{where}.{key} is not an object of schemas"
            faults += [_schema_fault(v, f"{where}.{key}.{k}") for k, v in schema[key].items()]
    for key in _SCHEMA_ONE:
        if key in schema:
            items = schema[key]
            faults += ([_schema_fault(v, f"{where}.{key}[{i}]") for i, v in enumerate(items)]
                       if key == "items" and isinstance(items, list)
                       else [_schema_fault(items, f"{where}.{key}")])
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                return f"{where}.{key} is not a non-empty list of schemas"
            faults += [_schema_fault(v, f"{where}.{key}[{i}]") for i, v in enumerate(schema[key])]
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{where}.required is not a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum is not a list"
    return next((fault for fault in faults if fault is not None), None)


def _regex_fault(pattern: str) -> str | None:
    """Why ``pattern`` is no regular expression, or ``None``. Python's ``re`` reads it; a
    pattern with Unicode classes (``\\p{L}``), which the grammar library reads and ``re``
    does not, is left to the library."""
    if "\x00" in pattern:
        return "holds a NUL character"
    try:
        re.compile(pattern)
    except re.error as exc:
        if "\\p" in pattern or "\\P" in pattern:
            return None
        return f"is no regular expression ({exc})"
    return None


@dataclass(frozen=True)
class StructuredOutput:
    """What every completion of a request must match: one constraint, as vLLM's
    ``StructuredOutputsParams`` holds it (``kind``, ``STRUCTURED_KINDS``): a JSON schema
    (``json``), any JSON object (``json_object``), a regular expression (``regex``), one of
    some strings (``choice``) or a grammar (``grammar``: GBNF/EBNF as vLLM's servers take
    it, or Lark).

    Why a value of its own: it is a field of ``SamplingParams``, so it must be frozen,
    hashable (requests with equal constraints share a ``generate`` call, ``group_key``) and
    pickle to any worker. ``value`` is the schema as JSON text (its properties in the order
    given: the order a model writes them), the pattern, the grammar, or the choices.
    A malformed constraint raises ``SamplingParamsError`` naming ``structured_outputs``
    (``from_body``: the body key it came from).
    """

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _constraint(self.kind, self.value,
                                                      "structured_outputs"))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], name: str = "structured_outputs"
                  ) -> StructuredOutput:
        """vLLM's ``structured_outputs`` spelling: ``{"json": schema}``, ``{"regex": ...}``,
        ``{"choice": [...]}``, ``{"grammar": ...}`` or ``{"json_object": true}``, one of them."""
        given = [k for k in STRUCTURED_KINDS if spec.get(k) is not None]
        other = sorted(set(spec) - set(STRUCTURED_KINDS))
        if len(given) != 1 or other:
            raise _error(name, f"is {json.dumps(dict(spec))[:120]}: it needs exactly one of "
                         f"{', '.join(STRUCTURED_KINDS)}"
                         + (f" (not {', '.join(other)})" if other else "") + ".",
                         f'give {name} as {{"json": SCHEMA}}, {{"regex": "..."}}, '
                         '{"choice": [...]}, {"grammar": "..."} or {"json_object": true}.')
        kind = given[0]
        return _structured(kind, spec[kind], name)

    def schema(self) -> Any:
        """The JSON schema of a ``json`` or ``json_object`` constraint (``json_object``: any
        object, as vLLM compiles it)."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json":
            raise ValueError(f"a {self.kind} constraint has no JSON schema")
        return json.loads(str(self.value))

    def to_vllm(self) -> dict[str, Any]:
        """vLLM's ``StructuredOutputsParams`` keywords (and the JSON the run record keeps)."""
        if self.kind == "json":
            return {"json": self.schema()}
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind == "choice":
            return {"choice": list(self.value)}
        return {self.kind: self.value}


def _constraint(kind: str, value: Any, name: str) -> str | tuple[str, ...]:
    """``value`` of a ``kind`` constraint, checked and in its stored form (see
    ``StructuredOutput``); a malformed one raises ``SamplingParamsError`` naming ``name``."""
    if kind not in STRUCTURED_KINDS:
        raise _error(name, f"asks for {kind!r}, not one of {', '.join(STRUCTURED_KINDS)}.",
                     f"give one of {', '.join(STRUCTURED_KINDS)}.")
    if kind == "json_object":
        if value not in ("", True):
            raise _error(name, f"json_object is {value!r}; only true asks for it.",
                         "give json_object as true, or leave it out.")
        return ""
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise _error(name, f"is not valid JSON ({exc}).",
                             "give the JSON schema as an object (or its JSON text).") from None
        fault = _schema_fault(schema, "the schema")
        if fault is not None:
            raise _error(name, f"is no JSON schema: {fault}.",
                         'give a JSON schema, e.g. {"type": "object", "properties": '
                         '{"name": {"type": "string"}}}.')
        return json.dumps(schema, separators=(",", ":"))
    if kind == "choice":
        items = value
        if not isinstance(items, (list, tuple)) or not items or not all(
                isinstance(c, str) for c in items):
            raise _error(name, f"is {json.dumps(value)[:80]}, not a non-empty list of strings.",
                         'give the choices as ["yes", "no"].')
        return tuple(items)
    if not isinstance(value, str):
        raise _error(name, f"is {json.dumps(value)[:80]}, not a string.",
                     f"give the {kind} as a string.")
    if kind == "regex":
        fault = _regex_fault(value)
        if fault is not None:
            raise _error(name, f"{fault}.", "give a regular expression such as "
                         '"[a-z]+-[0-9]{2}".')
    elif not value.strip():
        raise _error(name, "is an empty grammar.", "give a GBNF/EBNF or Lark grammar, e.g. "
                     'root ::= "yes" | "no".')
    return value


def _structured(kind: str, value: Any, name: str) -> StructuredOutput:
    """A ``StructuredOutput``, its errors naming ``name`` (the body key it came from)."""
    checked = _constraint(kind, value, name)
    return StructuredOutput(kind, checked)


def _from_response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object``, or
    ``json_schema`` with its ``json_schema.schema``, as vLLM's servers read it."""
    name = "response_format"
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if schema is None:
            raise _error(name, "is json_schema without json_schema.schema.",
                         'give {"type": "json_schema", "json_schema": {"name": "...", '
                         '"schema": {...}}}.')
        return _structured("json", schema, name)
    raise _error(name, f"has type {json.dumps(kind)[:60] if kind is not None else 'none'}; "
                 "json_object, json_schema and text are supported.",
                 'give {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                 '{"name": "...", "schema": {...}}}.')


def structured_in(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The one constraint a body asks for, under any of its spellings (``structured_outputs``,
    ``response_format``, ``guided_*``); two that constrain refuse the request, as vLLM does."""
    found: list[tuple[str, StructuredOutput]] = []
    for key in ("structured_outputs", "response_format", *GUIDED):
        value = body.get(key)
        if value is None:
            continue
        if key == "structured_outputs":
            if isinstance(value, StructuredOutput):
                got: StructuredOutput | None = value
            elif isinstance(value, Mapping):
                got = StructuredOutput.from_spec(value, key)
            else:
                raise _error(key, f"is {json.dumps(value)[:80]}, not an object.",
                             'give structured_outputs as {"json": SCHEMA} (or regex, choice, '
                             'grammar, json_object).')
        elif key == "response_format":
            got = _from_response_format(value)
        else:
            got = _structured(GUIDED[key], value, key)
        if got is not None:
            found.append((key, got))
    if len(found) > 1:
        raise _error(found[1][0], f"and {found[0][0]} both constrain the output; a request "
                     "takes one.", f"keep one of {found[0][0]} and {found[1][0]}.")
    return found[0][1] if found else None



def require() -> Any:
    """The ``llguidance`` module, or ``ExtraMissingError`` saying how to install it."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise ExtraMissingError(
            "structured output (response_format, structured_outputs, guided_json, "
            "guided_regex, guided_choice, guided_grammar) on the transformers engine needs "
            f"llguidance, which this Python cannot import ({exc}).", extra="structured",
            fix=f"{INSTALL} where the workers run (or use engine='vllm', which ships it).",
        ) from None
    return llguidance


def grammar_text(llguidance: Any, constraint: StructuredOutput) -> str:
    """The llguidance grammar of ``constraint``, as vLLM's ``guidance`` backend builds it."""
    matcher = llguidance.LLMatcher
    flexible = {"whitespace_flexible": True}
    if constraint.kind in ("json", "json_object"):
        return str(matcher.grammar_from_json_schema(json.dumps(constraint.schema()),
                                                    defaults=flexible))
    if constraint.kind == "regex":
        return str(matcher.grammar_from_regex(constraint.value))
    if constraint.kind == "choice":
        return str(llguidance.grammar_from("choice", json.dumps(list(constraint.value))))
    return str(llguidance.grammar_from("grammar", constraint.value))


class Grammars:
    """A worker's grammars for one tokenizer: llguidance's view of the tokenizer (built once:
    about a second for a 32,000-token vocabulary) and each constraint's compiled grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.llguidance = require()
        try:
            self.tokenizer = self.llguidance.hf.from_tokenizer(
                tokenizer, max(int(vocab_size), len(tokenizer)))
        except ValueError as exc:
            raise EngineRefusedError(
                f"structured output needs a fast tokenizer; this model's is "
                f"{type(tokenizer).__name__} ({exc}).", engine="transformers",
                fix="give the model a tokenizer.json (a fast tokenizer), or send the request "
                "without structured output.") from exc
        self.vocab = int(self.tokenizer.vocab_size)
        self.texts: dict[StructuredOutput, str] = {}

    def check(self, constraint: StructuredOutput) -> str:
        """``constraint``'s grammar, compiled once; one llguidance refuses raises
        ``SamplingParamsError`` naming ``structured_outputs`` (before any generation)."""
        if constraint not in self.texts:
            try:
                text = grammar_text(self.llguidance, constraint)
                matcher = self.llguidance.LLMatcher(self.tokenizer, text, log_level=0)
                fault = matcher.get_error() if matcher.is_error() else None
            except (ValueError, RuntimeError, TypeError) as exc:
                fault = str(exc)
            if fault:
                raise SamplingParamsError(
                    f"structured_outputs: llguidance refused the {constraint.kind} "
                    f"constraint: {str(fault).splitlines()[0][:300]}.", field="structured_outputs",
                    fix="simplify the schema, pattern or grammar to what llguidance reads.")
            self.texts[constraint] = text
        return self.texts[constraint]

    def matcher(self, constraint: StructuredOutput) -> Any:
        """A fresh matcher of ``constraint`` for one row."""
        return self.llguidance.LLMatcher(self.tokenizer, self.check(constraint), log_level=0)


_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, Grammars] = weakref.WeakKeyDictionary()


def grammars(tokenizer: Any, model: Any) -> Grammars:
    """The ``Grammars`` of a worker's tokenizer, for ``model``'s logits (its vocabulary size)."""
    if tokenizer not in _BY_TOKENIZER:
        vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
        _BY_TOKENIZER[tokenizer] = Grammars(tokenizer, vocab)
    return _BY_TOKENIZER[tokenizer]


def check(tokenizer: Any, model: Any, constraints: Any) -> None:
    """Every constraint of a batch compiled before anything of it generates: a missing
    llguidance (``ExtraMissingError``) or a grammar it refuses (``SamplingParamsError``)
    fails the batch here, not halfway through."""
    wanted = {c for c in constraints if c is not None}
    if wanted:
        found = grammars(tokenizer, model)
        for constraint in wanted:
            found.check(constraint)


class Mask:
    """Rows' matchers, by key (a row of ``generate``'s batch, a request of the decode loop):
    ``mask`` forbids in a step's logits what each row's grammar cannot take next, ``advance``
    feeds a row the token it took. Rows without a matcher, and rows that ended (a stop
    token: ``ends``), are left alone."""

    def __init__(self, grammars: Grammars, ends: set[int]) -> None:
        import torch

        self.grammars, self.ends = grammars, ends
        self.matchers: dict[int, Any] = {}
        self.words = (grammars.vocab + 31) // 32
        self.shift = torch.arange(32, dtype=torch.int32)

    def add(self, key: int, constraint: StructuredOutput) -> None:
        self.matchers[key] = self.grammars.matcher(constraint)

    def drop(self, key: int) -> None:
        self.matchers.pop(key, None)

    def mask(self, scores: Any, keys: list[int]) -> None:
        """Forbid in ``scores`` (row ``i`` is key ``keys[i]``) the tokens each row's grammar
        cannot take next (a finished grammar: all but end-of-sequence)."""
        import torch

        live = [(at, key) for at, key in enumerate(keys) if key in self.matchers]
        if not live:
            return
        bits = torch.full((len(live), self.words), -1, dtype=torch.int32)
        fill = self.grammars.llguidance.torch.fill_next_token_bitmask
        for row, (_, key) in enumerate(live):
            fill(self.matchers[key], bits, row)
        unpacked = ((bits.unsqueeze(-1) >> self.shift) & 1).reshape(len(live), -1)
        vocab = scores.shape[-1]
        allowed = torch.zeros((len(live), vocab), dtype=torch.bool)
        width = min(vocab, unpacked.shape[1])
        allowed[:, :width] = unpacked[:, :width].bool()
        at = torch.tensor([a for a, _ in live], device=scores.device)
        scores[at] = scores[at].masked_fill(~allowed.to(scores.device), float("-inf"))

    def took(self, key: int, token: int, ended: bool) -> None:
        """The decode loop's row ``key`` took ``token``, and ended there or not."""
        if ended:
            self.drop(key)
        else:
            self.advance(key, token)

    def advance(self, key: int, token: int) -> None:
        """Row ``key`` took ``token``: its matcher moves on; at a stop token it has ended."""
        matcher = self.matchers.get(key)
        if matcher is None:
            return
        if token in self.ends:
            self.drop(key)
        elif not matcher.is_stopped():
            matcher.consume_token(token)


class Constrained:
    """A ``generate`` logits processor: ``Mask`` over the call's rows (prompts times ``n``),
    each row's new token read from ``input_ids`` past the prompts' ``width``."""

    def __init__(self, grammars: Grammars, constraint: StructuredOutput, width: int,
                 ends: set[int]) -> None:
        self.grammars, self.constraint, self.width, self.ends = grammars, constraint, width, ends
        self.rows: Mask | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        keys = list(range(scores.shape[0]))
        if self.rows is None:
            self.rows = Mask(self.grammars, self.ends)
            for key in keys:
                self.rows.add(key, self.constraint)
        if input_ids.shape[1] > self.width:
            for key, token in enumerate(input_ids[:, -1].tolist()):
                self.rows.advance(key, int(token))
        self.rows.mask(scores, keys)
        return scores
