"""transformers names that remote code uses and later releases removed, read from ``ast``.

Why: remote code is written for the transformers release of its day; run on a later one it
fails inside its own files, on a name that release took out. This table says, for each such
name, the last release checked that has it, the first checked that lacks it, and whether
codeferry serves the remote module a shim (``_hf.compat``); ``scan`` finds the names a
module's source uses, with their lines, so that ``inspect`` and ``doctor`` can say what a
model gets (a shim, or "needs transformers <= X") before anything runs.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

__all__ = ["Removed", "Use", "IMPORTS", "ATTRIBUTES", "CONFIG_DEFAULTS", "FLOOR", "scan",
           "installed", "applies", "remedy", "by_release", "release_for", "uses_in", "to_json", "render"]

#: The oldest transformers release codeferry runs on (pyproject.toml's floor): a release
#: environment older than this could not run codeferry's own worker.
FLOOR = "4.53"


@dataclass(frozen=True)
class Removed:
    """A name of transformers: the last checked release with it, the first checked without."""

    name: str
    last_with: str
    first_without: str
    shim: bool


def _r(name: str, last: str, first: str, shim: bool = True) -> Removed:
    return Removed(name, last, first, shim)


#: ``from module import name`` the installed release may lack: (module, name) -> entry.
IMPORTS: dict[tuple[str, str], Removed] = {
    (m, n): _r(f"{m}.{n}" + (" (legacy methods)" if n == "DynamicCache" else ""), last, first,
               shim) for m, n, last, first, shim in (
        ("transformers.modeling_attn_mask_utils", "_expand_mask", "-", "4.35", True),
        ("transformers.modeling_attn_mask_utils", "_make_causal_mask", "-", "4.35", True),
        ("transformers.models.llama.modeling_llama", "_expand_mask", "4.36", "4.47", True),
        ("transformers.models.llama.modeling_llama", "_make_causal_mask", "4.36", "4.47", True),
        ("transformers.utils", "is_torch_fx_available", "4.57", "5.0", True),
        ("transformers.utils.import_utils", "is_torch_fx_available", "4.57", "5.0", True),
        ("transformers.utils", "is_torch_sdpa_available", "4.57", "5.0", True),
        ("transformers.utils.import_utils", "is_torch_sdpa_available", "4.57", "5.0", True),
        ("transformers.pytorch_utils", "find_pruneable_heads_and_indices", "4.57", "5.0", True),
        ("transformers.modeling_utils", "Conv1D", "4.52", "4.56", True),
        ("transformers.modeling_utils", "SequenceSummary", "4.52", "4.56", False),
        ("transformers.generation.utils", "SampleOutput", "4.57", "5.0", True),
        ("transformers.generation.utils", "GreedySearchOutput", "4.57", "5.0", True),
        ("transformers.generation.utils", "BeamSearchOutput", "4.57", "5.0", True),
        ("transformers.generation", "DisjunctiveConstraint", "4.57", "5.0", False),
        ("transformers.generation.beam_constraints", "DisjunctiveConstraint", "4.57", "5.0",
         False),
        ("transformers.cache_utils", "HybridCache", "4.57", "5.0", False),
        ("transformers.deepspeed", "is_deepspeed_zero3_enabled", "4.36", "4.47", True),
        # present, but without from_legacy_cache / to_legacy_cache: a subclass adds them
        ("transformers.cache_utils", "DynamicCache", "4.57", "5.0", True),
    )
}

#: Attributes (``x.name``) remote code reads that later releases removed: name -> entry.
ATTRIBUTES: dict[str, Removed] = {
    n: _r(label, last, first) for n, label, last, first in (
        ("get_head_mask", "PreTrainedModel.get_head_mask", "4.57", "5.0"),
        ("get_extended_attention_mask", "PreTrainedModel.get_extended_attention_mask", "5.0",
         "5.23"),
        ("invert_attention_mask", "PreTrainedModel.invert_attention_mask", "5.0", "5.23"),
        ("from_legacy_cache", "DynamicCache.from_legacy_cache", "4.57", "5.0"),
        ("to_legacy_cache", "DynamicCache.to_legacy_cache", "4.57", "5.0"),
        ("get_usable_length", "DynamicCache.get_usable_length", "4.52", "4.56"),
        ("seen_tokens", "DynamicCache.seen_tokens", "4.52", "4.56"),
    )
}
# ChatGLM2/3's _update_model_kwargs_for_generation: the shim returns the shape the code unpacks
ATTRIBUTES["_extract_past_from_model_output"] = _r(
    "GenerationMixin._extract_past_from_model_output", "4.48", "4.52")

#: Attributes every ``PretrainedConfig`` had on transformers 4, with their defaults: a remote
#: config class that the installed release leaves without one gets it as a class attribute.
CONFIG_DEFAULTS: dict[str, object] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "early_stopping": False,
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "temperature": 1.0,
    "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None, "num_return_sequences": 1, "output_scores": False,
    "return_dict_in_generate": False, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "pad_token_id": None, "bos_token_id": None,
    "eos_token_id": None, "sep_token_id": None, "decoder_start_token_id": None,
    "torchscript": False, "tie_word_embeddings": True, "is_decoder": False,
    "add_cross_attention": False, "tie_encoder_decoder": False,
    "task_specific_params": None, "cross_attention_hidden_size": None,
}
for _name in CONFIG_DEFAULTS:
    ATTRIBUTES.setdefault(_name, _r(f"PretrainedConfig.{_name}", "4.57", "5.0"))

#: The model class that never calls ``post_init`` (transformers 5 sets this attribute there).
TIED_KEYS = _r("PreTrainedModel.all_tied_weights_keys (no post_init)", "4.57", "5.0")


@dataclass(frozen=True)
class Use:
    """One use of a removed name in a module: its line and the table's entry."""

    line: int
    removed: Removed


def _config_read(node: ast.Attribute) -> bool:
    """``config.x`` or ``self.config.x`` (or ``*_config.x``): where configs are read."""
    value = node.value
    if isinstance(value, ast.Name):
        return value.id == "config" or value.id.endswith("_config")
    return isinstance(value, ast.Attribute) and value.attr == "config"


def _calls_post_init(function: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "post_init"
               for n in ast.walk(function))


def _base_names(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
            for b in node.bases}


def _init_of(cls: ast.ClassDef) -> ast.FunctionDef | None:
    return next((item for item in cls.body
                 if isinstance(item, ast.FunctionDef) and item.name == "__init__"), None)


def _inits_without_post_init(tree: ast.Module) -> list[ast.FunctionDef]:
    """The ``__init__`` of a model class (one deriving, by name, from ``PreTrainedModel``,
    directly or in this module) that never calls ``post_init``, where a concrete model runs
    it: a class no other model class here derives from, itself or through classes that
    define no ``__init__``. A base such as ``PhiPreTrainedModel`` whose ``__init__`` only
    calls ``super().__init__`` is not one, when each model built on it calls ``post_init``."""
    found: dict[str, ast.ClassDef] = {}
    parents: dict[str, list[str]] = {}  # the in-module model classes each one derives from
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = _base_names(node)
        if "PreTrainedModel" in bases or bases & set(found):
            found[node.name] = node
            parents[node.name] = [b.id for b in node.bases
                                  if isinstance(b, ast.Name) and b.id in found]
    bases_in_use = {base for names in parents.values() for base in names}
    flagged: dict[int, ast.FunctionDef] = {}
    for name in found:
        if name in bases_in_use:
            continue  # not a concrete model: its subclasses are
        at: str | None = name
        while at is not None and _init_of(found[at]) is None:
            at = next(iter(parents[at]), None)  # the __init__ this model runs (its MRO's)
        init = _init_of(found[at]) if at is not None else None
        if init is not None and not _calls_post_init(init):
            flagged[init.lineno] = init
    return list(flagged.values())


def scan(source: str | bytes) -> list[Use]:
    """Every use of a removed name in ``source``, in line order (none for unparsable code)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # code too deep to parse
        return []
    uses: list[Use] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                entry = IMPORTS.get((node.module, alias.name))
                if entry is not None:
                    uses.append(Use(node.lineno, entry))
        elif isinstance(node, ast.Attribute):
            entry = ATTRIBUTES.get(node.attr)
            if entry is None or (node.attr in CONFIG_DEFAULTS and not _config_read(node)):
                continue
            if isinstance(node.ctx, ast.Load):
                uses.append(Use(node.lineno, entry))
    uses.extend(Use(init.lineno, TIED_KEYS) for init in _inits_without_post_init(tree))
    uses.sort(key=lambda u: (u.line, u.removed.name))
    return list(dict.fromkeys(uses))


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def written_for_4(version: str | None) -> bool:
    """Whether a config's ``transformers_version`` names a release before transformers 5."""
    return bool(version) and _key(str(version))[0] < 5


def installed() -> str | None:
    """The installed transformers release, from its metadata (nothing imported)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def applies(removed: Removed, version: str | None) -> bool:
    """Whether ``version`` of transformers lacks the name (at or after its first release
    without it)."""
    return version is not None and _key(version) >= _key(removed.first_without)


def remedy(removed: Removed) -> str:
    """What a model using ``removed`` gets from codeferry on a release that lacks it."""
    if removed.shim:
        return "shim"
    if removed.last_with == "-":
        return "fails on every release checked"
    return f"needs transformers <= {removed.last_with}"


def by_release(removed: Removed) -> bool:
    """Whether a release environment serves ``removed``: no shim does, and a release
    codeferry runs on (``FLOOR`` or later) still has it."""
    return (not removed.shim and removed.last_with != "-"
            and _key(removed.last_with) >= _key(FLOOR))


def release_for(found: list[tuple[str, Use]], version: str | None,
                written_for: str | None = None) -> str | None:
    """The release line (``"4.53"``) whose transformers the executor's workers run a model's
    code on, or ``None``: ``version`` (the installed) serves every name the code uses.

    Only names no shim serves count, and only those ``version`` lacks. The line is the
    release the code was written for (``written_for``: config.json's ``transformers_version``),
    raised to ``FLOOR`` and lowered to the oldest of those names' last releases (a later
    release than the code's own may still change what it computes: 4.56's ``DynamicCache``
    keeps only the window of a config with ``sliding_window``). ``None`` too when one of the
    names no release codeferry runs on has (``by_release``): the import check's error stands."""
    wanted = [use.removed for _, use in found
              if not use.removed.shim and applies(use.removed, version)]
    if not wanted or not all(by_release(r) for r in wanted):
        return None
    line = min((r.last_with for r in wanted), key=_key)
    if written_for and _key(written_for) < _key(line):
        own = ".".join(str(n) for n in _key(written_for)[:2])
        line = max(own, FLOOR, key=_key)
    return line


def uses_in(contents: Mapping[tuple[str | None, str], bytes]) -> list[tuple[str, Use]]:
    """``(file, use)`` of every removed name the Python files of ``contents`` use (a
    bundle's exact bytes; a cross-repo file is named ``repo--path``)."""
    found: list[tuple[str, Use]] = []
    for (repo, path), data in sorted(contents.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
        if path.endswith(".py"):
            name = f"{repo}--{path}" if repo else path
            found.extend((name, use) for use in scan(data))
    return found


def _gets(removed: Removed, version: str | None) -> str:
    return remedy(removed) if applies(removed, version) else "transformers' own"


def to_json(found: list[tuple[str, Use]], version: str | None) -> list[dict[str, object]]:
    """``inspect --json``'s ``removed_names``: one entry per use."""
    return [{"file": path, "line": use.line, "name": use.removed.name,
             "last_with": use.removed.last_with, "first_without": use.removed.first_without,
             "gets": _gets(use.removed, version)} for path, use in found]


def render(found: list[tuple[str, Use]], version: str | None, line: str | None = None) -> str:
    """The ``transformers names`` section of ``inspect`` and ``doctor`` (nothing when the code
    uses none): each removed name, what the code gets on the installed release, its uses;
    ``line``: the release the executor's workers run the code on (``release_for``)."""
    if not found:
        return ""
    by_name: dict[Removed, list[str]] = {}
    for path, use in found:
        by_name.setdefault(use.removed, []).append(f"{path}:{use.line}")
    out = [f"transformers names later releases removed (installed: {version or 'none'})"]
    if line is not None:
        out.append(f"  the executor's workers run this code on transformers {line} (a release "
                   "environment beside the installed packages: CODEFERRY_RELEASES)")
    width = max(len(r.name) for r in by_name)
    for removed, places in sorted(by_name.items(), key=lambda kv: kv[0].name):
        span = (f"gone in {removed.first_without}" if removed.last_with == "-" else
                f"in {removed.last_with}, gone in {removed.first_without}")
        out.append(f"  {removed.name:<{width}}  {_gets(removed, version)}  ({span})")
        out.extend(f"      {place}" for place in places)
    return "\n".join(out) + "\n"
