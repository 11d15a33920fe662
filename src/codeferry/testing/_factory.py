"""A factory of tiny ``trust_remote_code`` models, for tests, benchmarks and docs.

Real remote-code repositories break loaders in many small ways: helper modules in sub-packages,
``from . import x``, imports inside functions or ``try`` blocks, star imports, data files read at
import time, nested remote configs, code living in another repository, generic module names that
two models share... Each :class:`ModelSpec` switch reproduces one of those shapes in a model small
enough (a few hundred KB at most) to be written in milliseconds once torch is imported, so that
every test can build exactly the repository it needs instead of downloading one.

Everything written is deterministic: the same spec gives byte-identical files (JSON with a fixed
key order, weights drawn from a private generator seeded with ``spec.seed``), so hub commits
derived from the bytes are stable and results can be compared across processes and machines.

Run ``python -m codeferry.testing._factory --write-demo src/codeferry/demo`` to regenerate the
bundled demo model, and ``--check-demo`` to verify the committed copy is up to date.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import keyword
import os
import re
import string
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codeferry.testing import _templates as T

__all__ = [
    "DEMO_SPEC",
    "HELPER_KINDS",
    "LARGEST_SPEC",
    "ModelSpec",
    "demo_model_path",
    "write_demo_model",
    "write_hub_model",
    "write_model",
]

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
_ALPHABET = string.ascii_lowercase + " " + string.digits + ".,!?'\"-:;()\n" + string.ascii_uppercase
_ALPHABET += "".join(c for c in string.punctuation if c not in _ALPHABET)
MAX_TOKENIZER_VOCAB = len(SPECIAL_TOKENS) + len(_ALPHABET)  # 100
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
_REPO_ID_RE = re.compile(r"([\w.-]+/)?[\w.-]+\Z")


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


#: Every switch at once (but ``marker`` and ``generic_names``): the largest shape the
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

DEMO_PROMPTS = (
    "Hello, world",
    "The quick brown fox",
    "Once upon a time",
    "def main():",
    "1 + 1 =",
    "Remote code, every process.",
    "To be or not to be",
    "codeferry ships code",
)


@dataclass(frozen=True)
class _Layout:
    """Module names (without ``.py``) of one rendered model, derived from a spec."""

    configuration: str
    modeling: str
    llm_configuration: str
    tokenization: str
    image_processing: str
    processing: str
    flat: str
    package: str

    @classmethod
    def of(cls, spec: ModelSpec, package: str | None = None) -> _Layout:
        if spec.generic_names:
            return cls(
                "configuration", "modeling", "configuration_llm", "tokenization",
                "image_processing", "processing", "utils", package or "ops",
            )  # fmt: skip
        n = spec.name
        return cls(
            f"configuration_{n}", f"modeling_{n}", f"configuration_{n}_llm", f"tokenization_{n}",
            f"image_processing_{n}", f"processing_{n}", "layers", package or "utils",
        )  # fmt: skip


def _render(template: str, **values: str) -> str:
    """Fill a template, then squeeze the runs of blank lines left by empty slots."""
    text = string.Template(template).substitute(values)
    return re.sub(r"\n{4,}", "\n\n\n", text)


def _json_bytes(data: Mapping[str, Any]) -> bytes:
    """JSON in the order given (callers fix it), so the bytes never depend on the run."""
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _vocab(size: int) -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(_ALPHABET[: size - len(SPECIAL_TOKENS)])
    return {token: index for index, token in enumerate(tokens)}


def _configuration_source(spec: ModelSpec, layout: _Layout) -> str:
    names = {"name": spec.name, "Name": spec.class_prefix}
    imports = []
    defaults: dict[str, str] = {
        "vocab_size": str(spec.vocab_size),
        "hidden_size": str(spec.hidden_size),
        "num_layers": str(NUM_LAYERS),
        "max_position_embeddings": str(MAX_POSITIONS),
        "initializer_range": repr(INITIALIZER_RANGE),
    }
    if spec.config_helper:
        imports.append(_render(T.CONFIG_DEFAULTS_IMPORT, module="config_defaults"))
        defaults = {key: f'DEFAULTS["{key}"]' for key in defaults}
    if spec.nested_subconfig:
        imports.append(_render(T.LLM_CONFIG_IMPORT, module=layout.llm_configuration, **names))
    if spec.big_asset:
        imports.append(_render(T.BIG_ASSET_BLOCK, big_asset=BIG_ASSET_FILE))
    return _render(
        T.CONFIGURATION,
        marker_imports=T.MARKER_IMPORTS if spec.marker else "",
        marker_block=_render(T.MARKER_BLOCK, marker=repr(spec.marker)) if spec.marker else "",
        config_imports="\n".join(imports),
        llm_param=T.LLM_PARAM if spec.nested_subconfig else "",
        llm_body=_render(T.LLM_BODY, **names) if spec.nested_subconfig else "",
        **{f"d_{key}": value for key, value in defaults.items()},
        **names,
    )


def _modeling_source(spec: ModelSpec, layout: _Layout) -> str:
    """The modeling module; each helper kind swaps one inline piece for an import of the helper."""
    names = {"name": spec.name, "Name": spec.class_prefix}
    kinds = set(spec.helpers)
    std_imports = ["import math"]
    if spec.asset:
        std_imports += ["import json", "from pathlib import Path"]
    if spec.marker:
        std_imports.append("import os")
    std_imports.sort(key=lambda line: (line.startswith("from "), line))
    helper_imports = []
    slots = {
        "constants": T.CONSTANTS_INLINE,
        "rotate_body": T.ROPE_INLINE,
        "act_body": T.ACT_INLINE,
        "residual_body": T.RESIDUAL_INLINE,
        "norm_body": T.NORM_INLINE,
        "mlp_class": _render(T.MLP_INLINE, **names),
        "mlp_new": f"{spec.class_prefix}MLP(hidden_size, _act)",
    }
    if "flat" in kinds:
        helper_imports.append(f"from .{layout.flat} import Block")
        slots.update(mlp_class="", mlp_new="Block(hidden_size, _act)")
    if "subpackage" in kinds:
        helper_imports.append(f"from .{layout.package}.rope import rope")
        slots["rotate_body"] = T.ROPE_HELPER_CALL
    if "from_dot" in kinds:
        helper_imports.append("from . import activations")
        slots["act_body"] = T.ACT_HELPER_CALL
    if "function_body" in kinds:
        slots["norm_body"] = _render(T.NORM_HELPER_CALL, module="norms")
    if "try_except" in kinds:
        helper_imports.append(_render(T.TRY_EXCEPT_IMPORTS, module="fast_kernels"))
        slots["residual_body"] = T.RESIDUAL_HELPER_CALL
        slots["rotate_body"] = T.ROPE_OPTIONAL_CUDA + slots["rotate_body"]
    if "star" in kinds:
        slots["constants"] = _render(T.CONSTANTS_STAR, module="constants")
    marker = _render(T.MARKER_BLOCK, marker=repr(spec.marker)) if spec.marker else ""
    return _render(
        T.MODELING,
        std_imports="\n".join(std_imports),
        marker_block=marker,
        config_module=layout.configuration,
        helper_imports="\n".join(helper_imports),
        asset=_render(T.ASSET_BLOCK, asset=ASSET_FILE) if spec.asset else T.NO_ASSET_BLOCK,
        **slots,
        **names,
    )


def _helper_files(spec: ModelSpec, layout: _Layout) -> dict[str, str]:
    """Helper modules reached from the modeling/configuration modules, by relative path."""
    name = spec.name
    files: dict[str, str] = {}
    kinds = set(spec.helpers)
    if "flat" in kinds:
        files[f"{layout.flat}.py"] = _render(T.FLAT_HELPER, name=name, module=layout.flat)
    if "subpackage" in kinds:
        files[f"{layout.package}/__init__.py"] = _render(
            T.SUBPACKAGE_INIT, name=name, package=layout.package
        )
        files[f"{layout.package}/rope.py"] = _render(T.SUBPACKAGE_ROPE, name=name)
    if "from_dot" in kinds:
        files["activations.py"] = _render(T.ACTIVATIONS, name=name)
    if "function_body" in kinds:
        files["norms.py"] = _render(T.NORMS, name=name)
    if "try_except" in kinds:
        files["fast_kernels.py"] = _render(T.FAST_KERNELS, name=name)
    if "star" in kinds:
        files["constants.py"] = _render(T.CONSTANTS, name=name, module="constants")
    if spec.config_helper:
        defaults = {
            "hidden_size": spec.hidden_size,
            "initializer_range": INITIALIZER_RANGE,
            "max_position_embeddings": MAX_POSITIONS,
            "num_layers": NUM_LAYERS,
            "vocab_size": spec.vocab_size,
        }
        files["config_defaults.py"] = _render(T.CONFIG_DEFAULTS, name=name, defaults=repr(defaults))
    return files


def _config_json(spec: ModelSpec, layout: _Layout) -> dict[str, Any]:
    prefix = spec.class_prefix
    config_key = {"AutoConfig": f"{layout.configuration}.{prefix}Config"}
    model_keys = {
        "AutoModel": f"{layout.modeling}.{prefix}Model",
        "AutoModelForCausalLM": f"{layout.modeling}.{prefix}ForCausalLM",
    }
    if spec.cross_repo:
        model_keys["AutoModelForSequenceClassification"] = (
            f"{spec.cross_repo}--modeling_heads.SharedHeadForSequenceClassification"
        )
    auto_map = (
        {**model_keys, **config_key} if spec.model_keys_first else {**config_key, **model_keys}
    )
    config: dict[str, Any] = {
        "architectures": [f"{prefix}ForCausalLM"],
        "auto_map": auto_map,
        "dtype": "float32",
        "hidden_size": spec.hidden_size,
        "initializer_range": INITIALIZER_RANGE,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": spec.name,
        "num_layers": NUM_LAYERS,
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab_size,
    }
    if spec.nested_subconfig:
        config["llm_config"] = {
            "auto_map": {"AutoConfig": f"{layout.llm_configuration}.{prefix}LLMConfig"},
            "hidden_size": spec.hidden_size,
            "model_type": f"{spec.name}_llm",
            "num_layers": NUM_LAYERS,
            "vocab_size": spec.vocab_size,
        }
    return dict(sorted(config.items()))


def _tokenizer_files(spec: ModelSpec, layout: _Layout) -> dict[str, bytes]:
    prefix = spec.class_prefix
    names = {"name": spec.name, "Name": prefix}
    tokenizer_config: dict[str, Any] = {
        "auto_map": {"AutoTokenizer": [f"{layout.tokenization}.{prefix}Tokenizer", None]},
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "model_max_length": MAX_POSITIONS,
        "pad_token": "<pad>",
        "tokenizer_class": f"{prefix}Tokenizer",
        "unk_token": "<unk>",
    }
    files = {
        f"{layout.tokenization}.py": _render(
            T.TOKENIZATION, vocab_file="vocab.json", **names
        ).encode(),
        "vocab.json": _json_bytes(_vocab(spec.vocab_size)),
    }
    if spec.processor:
        processor_ref = f"{layout.processing}.{prefix}Processor"
        tokenizer_config["processor_class"] = f"{prefix}Processor"
        files[f"{layout.image_processing}.py"] = _render(T.IMAGE_PROCESSING, **names).encode()
        files[f"{layout.processing}.py"] = _render(T.PROCESSING, **names).encode()
        files["preprocessor_config.json"] = _json_bytes(
            {
                "auto_map": {
                    "AutoImageProcessor": f"{layout.image_processing}.{prefix}ImageProcessor",
                    "AutoProcessor": processor_ref,
                },
                "image_processor_type": f"{prefix}ImageProcessor",
                "processor_class": f"{prefix}Processor",
                "scale": 0.5,
            }
        )
        files["processor_config.json"] = _json_bytes(
            {"auto_map": {"AutoProcessor": processor_ref}, "processor_class": f"{prefix}Processor"}
        )
    files["tokenizer_config.json"] = _json_bytes(dict(sorted(tokenizer_config.items())))
    return files


def _weights(spec: ModelSpec) -> bytes:
    """``model.safetensors`` of ``{Name}ForCausalLM``, from a generator seeded with ``spec.seed``.

    The state dict is built here rather than by instantiating the written code, so that writing a
    model never executes it (a ``marker`` would record that) and stays fast.
    """
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(spec.seed)
    h, v = spec.hidden_size, spec.vocab_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * INITIALIZER_RANGE

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(NUM_LAYERS):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.norm1.weight"] = torch.ones(h)
        tensors[f"{layer}.attn.qkv.weight"] = normal(3 * h, h)
        tensors[f"{layer}.attn.out.weight"] = normal(h, h)
        tensors[f"{layer}.norm2.weight"] = torch.ones(h)
        tensors[f"{layer}.mlp.fc_in.weight"] = normal(2 * h, h)
        tensors[f"{layer}.mlp.fc_out.weight"] = normal(h, 2 * h)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(v, h)
    return bytes(save(tensors, metadata={"format": "pt"}))


def _model_files(spec: ModelSpec, package: str | None = None) -> dict[str, bytes]:
    """Every file of the model repository, by POSIX relative path."""
    layout = _Layout.of(spec, package)
    names = {"name": spec.name, "Name": spec.class_prefix}
    sources = {
        f"{layout.configuration}.py": _configuration_source(spec, layout),
        f"{layout.modeling}.py": _modeling_source(spec, layout),
        **_helper_files(spec, layout),
    }
    if spec.nested_subconfig:
        sources[f"{layout.llm_configuration}.py"] = _render(
            T.LLM_CONFIGURATION,
            vocab_size=str(spec.vocab_size),
            hidden_size=str(spec.hidden_size),
            num_layers=str(NUM_LAYERS),
            **names,
        )
    files = {path: text.encode("utf-8") for path, text in sources.items()}
    files["config.json"] = _json_bytes(_config_json(spec, layout))
    files["generation_config.json"] = _json_bytes(
        {"bos_token_id": 2, "do_sample": False, "eos_token_id": 3, "pad_token_id": 0}
    )
    files["model.safetensors"] = _weights(spec)
    if spec.has_tokenizer:
        files.update(_tokenizer_files(spec, layout))
    if spec.asset:
        table = [round(1.0 - position / 1000, 4) for position in range(64)]
        files[ASSET_FILE] = _json_bytes({"scale": table})
    if spec.big_asset:
        files[BIG_ASSET_FILE] = _big_asset(spec.big_asset, spec.seed)
    return dict(sorted(files.items()))


def _big_asset(size: int, seed: int) -> bytes:
    """``size`` bytes of tokenizer.json-like JSON (a vocabulary of pseudo-random merges).

    It compresses about as well as a real one (3-4x), so message sizes measured with it
    are honest. Deterministic: ``random.Random`` with an int seed is stable across versions.
    """
    import random

    rng = random.Random(seed)
    head = b'{"version": "1.0", "model": {"type": "BPE", "vocab": {\n'
    tail = b'"<end>": 0}}}\n'
    parts = [head]
    total = len(head) + len(tail)
    index = 1
    while True:
        entry = f'"\\u0120{rng.getrandbits(48):012x}": {index},\n'.encode("ascii")
        if total + len(entry) > size:
            break
        parts.append(entry)
        total += len(entry)
        index += 1
    parts.append(b" " * (size - total))  # pad to the exact size (JSON allows whitespace)
    parts.append(tail)
    return b"".join(parts)


def _cross_repo_files(spec: ModelSpec) -> dict[str, bytes]:
    """The other repository of ``spec.cross_repo``: a self-contained head and a minimal config.

    Its code names a stand-in ``{Name}Config`` (transformers 5 compares config class *names* when
    it registers a remote class), so models sharing one head repo must share the ``name``.
    """
    head_ref = "modeling_heads.SharedHeadForSequenceClassification"
    config = {
        "architectures": ["SharedHeadForSequenceClassification"],
        "auto_map": {"AutoModelForSequenceClassification": head_ref},
    }
    head = _render(T.SHARED_HEADS, Name=spec.class_prefix)
    return {"config.json": _json_bytes(config), "modeling_heads.py": head.encode("utf-8")}


def _write_files(root: Path, files: Mapping[str, bytes]) -> None:
    for relative, data in files.items():
        target = root.joinpath(*relative.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _commit_for(repo_id: str, files: Mapping[str, bytes]) -> str:
    """A fake but stable commit sha: sha1 of the repo id and every (path, bytes) pair."""
    digest = hashlib.sha1(repo_id.encode("utf-8"))
    for relative in sorted(files):
        digest.update(b"\0" + relative.encode("utf-8") + b"\0" + files[relative])
    return digest.hexdigest()


#: Files huggingface_hub stores through Git LFS, whose blobs are named by their sha256.
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")


def _blob_name(relative: str, data: bytes) -> str:
    """The blob name huggingface_hub gives a file: sha256 for LFS files, git's sha1 else."""
    if relative.endswith(_LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _write_snapshot(repo_dir: Path, commit: str, files: Mapping[str, bytes]) -> Path:
    """Blobs in ``blobs/``, and ``snapshots/<commit>/<path>`` relative symlinks to them.

    Exactly huggingface_hub's layout: a file ``a/b.py`` of the snapshot links to
    ``../../../blobs/<sha>`` (one ``../`` per folder below ``snapshots``).
    """
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = repo_dir / "snapshots" / commit
    for relative, data in files.items():
        blob = _blob_name(relative, data)
        if not (blobs / blob).is_file():
            (blobs / blob).write_bytes(data)
        parts = relative.split("/")
        link = snapshot.joinpath(*parts)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("../" * (len(parts) + 1) + "blobs/" + blob)
    return snapshot


def _write_hub_repo(
    cache_dir: Path, repo_id: str, files: Mapping[str, bytes], commit: str | None
) -> Path:
    if not _REPO_ID_RE.match(repo_id) or "--" in repo_id:
        raise ValueError(f"repo_id must look like 'org/name' or 'name', got {repo_id!r}")
    commit = commit if commit is not None else _commit_for(repo_id, files)
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"commit must be 40 lowercase hex digits, got {commit!r}")
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = _write_snapshot(repo_dir, commit, files)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit, encoding="utf-8")
    return snapshot


def write_model(dest: str | os.PathLike[str], spec: ModelSpec = ModelSpec()) -> Path:
    """Write a plain local model folder at ``dest`` (created if needed) and return its path.

    Any folder name works, including dots, hyphens and spaces, since loaders must cope with them.
    With ``spec.cross_repo`` the ``auto_map`` still references the other repository, whose code
    then lives only in a hub cache: write it there with :func:`write_hub_model`.
    """
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    _write_files(root, _model_files(spec))
    return root


def write_hub_model(
    cache_dir: str | os.PathLike[str],
    repo_id: str,
    spec: ModelSpec = ModelSpec(),
    *,
    commit: str | None = None,
) -> Path:
    """Write ``repo_id`` into a Hugging Face hub cache (``HF_HUB_CACHE``) and return its snapshot.

    The layout is huggingface_hub's: ``models--{org}--{name}/blobs/{sha}`` files (sha256 of an
    LFS file such as the weights, git's blob sha1 of any other), ``snapshots/{commit}/{path}``
    relative symlinks to them (``../../blobs/{sha}``, one more ``../`` per folder of ``path``)
    and ``refs/main``. Change a file by writing a new blob and relinking, as a download would:
    writing through a link changes the blob every snapshot sharing it sees. huggingface_hub and
    transformers load it offline
    (``HF_HUB_OFFLINE=1``) given ``cache_dir=`` or ``HF_HUB_CACHE``. The default commit is derived
    from the repo id and the file bytes. ``spec.cross_repo`` is written into the same cache too.
    """
    cache = Path(cache_dir)
    if spec.cross_repo:
        _write_hub_repo(cache, spec.cross_repo, _cross_repo_files(spec), None)
    return _write_hub_repo(cache, repo_id, _model_files(spec), commit)


def _demo_files() -> dict[str, bytes]:
    files = _model_files(DEMO_SPEC, package=f"{DEMO_SPEC.name}_ops")
    files["prompts.txt"] = ("\n".join(DEMO_PROMPTS) + "\n").encode("utf-8")
    return files


def write_demo_model(dest: str | os.PathLike[str]) -> Path:
    """Write the bundled ``charlm`` demo model (see :data:`DEMO_SPEC`) and its ``prompts.txt``."""
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    _write_files(root, _demo_files())
    return root


def demo_model_path() -> Path:
    """The demo model folder shipped inside the ``codeferry`` package (``codeferry/demo``)."""
    return Path(__file__).resolve().parent.parent / "demo"


def _check_demo(folder: Path) -> list[str]:
    """Paths whose committed bytes differ from what the factory writes now."""
    expected = _demo_files()
    found = {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    stale = [
        rel
        for rel, data in expected.items()
        if not (folder / rel).is_file() or (folder / rel).read_bytes() != data
    ]
    return sorted(stale + sorted(found - set(expected)))


def main(argv: Sequence[str] | None = None) -> int:
    """``--write-demo DIR`` regenerates the demo model; ``--check-demo DIR`` verifies it."""
    parser = argparse.ArgumentParser(
        prog="python -m codeferry.testing._factory", description=main.__doc__
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-demo", metavar="DIR", type=Path)
    group.add_argument("--check-demo", metavar="DIR", type=Path)
    args = parser.parse_args(argv)
    if args.write_demo is not None:
        print(write_demo_model(args.write_demo))
        return 0
    stale = _check_demo(args.check_demo)
    for rel in stale:
        print(f"out of date: {rel}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
