"""What a factory model looks like: :class:`ModelSpec`, its switches and the preset specs.

Kept apart from the code that renders and writes the files (``_contents``, ``_factory``) so
that a spec, and the fixed facts every rendered model shares (layer count, tokenizer
alphabet, asset names), can be read without the templates.
"""

from __future__ import annotations

import keyword
import os
import re
import string
from dataclasses import dataclass

__all__ = ["DEMO_SPEC", "HELPER_KINDS", "LARGEST_SPEC", "ModelSpec"]

HELPER_KINDS: tuple[str, ...] = (
    "flat",
    "subpackage",
    "from_dot",
    "function_body",
    "try_except",
    "star",
)
"""The shapes of relative import a modeling module can use to reach its helper files."""

NUM_LAYERS = 2
INITIALIZER_RANGE = 0.02
MAX_POSITIONS = 256
ASSET_FILE = "position_table.json"
BIG_ASSET_FILE = "tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
# Char-level alphabet, most useful characters first so that small vocabularies still cover text.
ALPHABET = string.ascii_lowercase + " " + string.digits + ".,!?'\"-:;()\n" + string.ascii_uppercase
ALPHABET += "".join(c for c in string.punctuation if c not in ALPHABET)
MAX_TOKENIZER_VOCAB = len(SPECIAL_TOKENS) + len(ALPHABET)  # 100
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True)
class ModelSpec:
    """What the written model repository looks like; every switch reproduces one real-world shape.

    Attributes:
        name: lowercase identifier; files are ``configuration_{name}.py``, ``modeling_{name}.py``...
            and classes ``{Name}Config``, ``{Name}Model``, ``{Name}ForCausalLM``...
        model_keys_first: ``auto_map`` lists the ``AutoModel*`` keys before ``AutoConfig`` (some
            hub repos do, and loaders must not depend on the order).
        helpers: a subset of :data:`HELPER_KINDS`; each adds helper files reached by the modeling
            module through that import shape, and the forward pass really uses them.
        config_helper: the configuration module itself does
            ``from .config_defaults import DEFAULTS``.
        tokenizer: ship a custom char-level slow tokenizer (``AutoTokenizer`` in ``auto_map``).
        processor: ship a custom image processor and processor; implies ``tokenizer``.
        nested_subconfig: ``config.json`` holds an ``llm_config`` with its own remote ``auto_map``,
            built by the main config class (like InternVL).
        cross_repo: a repo id such as ``"org/shared-heads"``; ``auto_map`` then references
            ``AutoModelForSequenceClassification`` code that lives in that other repository.
        asset: a data file next to the modules, read at import time via ``Path(__file__).parent``.
        big_asset: size in bytes of a ``tokenizer.json`` (0: none) that the configuration module
            names and reads lazily through ``__file__`` (``read_big_asset()``), like the 9 MB
            ``tokenizer.json`` of Llama-3. Deterministic JSON, written at call time, never stored.
        marker: absolute path of a file the configuration and modeling modules append a line to
            when imported: proves whether a command executed the model code.
        custom_generate: ship ``custom_generate/generate.py`` (importing ``.sampling`` beside it)
            and ``custom_generate/requirements.txt``: the code transformers runs in place of
            ``generate()``, a door besides ``auto_map``; with ``marker`` it appends a line too.
        generic_names: modules are named ``configuration.py``, ``modeling.py``, ``utils.py``... so
            that two different models share module names.
        hidden_size: width of the model (even, 8 to 64), which keeps the weights tiny.
        vocab_size: number of token ids (8 to 1024; at most 100 with a tokenizer).
        seed: seed of the weights.
    """

    name: str = "tiny"
    model_keys_first: bool = False
    helpers: tuple[str, ...] = ()
    config_helper: bool = False
    tokenizer: bool = False
    processor: bool = False
    nested_subconfig: bool = False
    cross_repo: str | None = None
    asset: bool = False
    big_asset: int = 0
    marker: str | None = None
    generic_names: bool = False
    custom_generate: bool = False
    hidden_size: int = 32
    vocab_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name) or keyword.iskeyword(self.name):
            raise ValueError(f"name must be a lowercase identifier, got {self.name!r}")
        unknown = [kind for kind in self.helpers if kind not in HELPER_KINDS]
        if unknown or len(set(self.helpers)) != len(self.helpers):
            raise ValueError(
                f"helpers must be distinct kinds among {HELPER_KINDS}, got {self.helpers!r}"
            )
        if not (8 <= self.hidden_size <= 64 and self.hidden_size % 2 == 0):
            raise ValueError(f"hidden_size must be even and within 8..64, got {self.hidden_size}")
        top = MAX_TOKENIZER_VOCAB if self.has_tokenizer else 1024
        if not 8 <= self.vocab_size <= top:
            raise ValueError(f"vocab_size must be within 8..{top}, got {self.vocab_size}")
        if not 0 <= self.big_asset <= 2**31:
            raise ValueError(f"big_asset must be within 0..2**31 bytes, got {self.big_asset}")
        if self.marker is not None and not os.path.isabs(self.marker):
            raise ValueError(f"marker must be an absolute path, got {self.marker!r}")
        if self.cross_repo is not None and (not self.cross_repo or "--" in self.cross_repo):
            raise ValueError(f"cross_repo must be a repo id without '--', got {self.cross_repo!r}")

    @property
    def has_tokenizer(self) -> bool:
        """A processor needs a tokenizer, so ``processor=True`` implies one."""
        return self.tokenizer or self.processor

    @property
    def class_prefix(self) -> str:
        """``tiny`` -> ``Tiny``, ``char_lm`` -> ``CharLm``: the ``{Name}`` of class names."""
        return "".join(part[:1].upper() + part[1:] for part in self.name.split("_"))


#: Every switch at once (but ``marker``, ``generic_names`` and ``custom_generate``): the largest shape the
#: tests and ``benchmarks/bench_inspect.py`` resolve.
LARGEST_SPEC = ModelSpec(
    name="big",
    model_keys_first=True,
    helpers=HELPER_KINDS,
    config_helper=True,
    tokenizer=True,
    processor=True,
    nested_subconfig=True,
    asset=True,
    cross_repo="org/big-heads",
)

DEMO_SPEC = ModelSpec(
    name="charlm",
    helpers=("flat", "subpackage"),
    tokenizer=True,
    hidden_size=48,
    vocab_size=MAX_TOKENIZER_VOCAB,
    seed=1234,
)
"""The bundled demo: a char-level causal LM with a custom tokenizer and a helper sub-package."""
