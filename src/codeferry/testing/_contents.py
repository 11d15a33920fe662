"""The bytes of every file of a factory model: sources, JSON, weights and assets.

Rendering is kept apart from writing (``_factory``: plain folder, hub cache layout, demo)
and from the spec (``_spec``): this module turns a :class:`ModelSpec` into a
``{path: bytes}`` mapping and touches no disk. Each file's text comes from the templates
(``_templates`` for the model's own code, ``_extra_templates`` for the tokenizer,
processors and the cross-repository head).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from codeferry.testing import _extra_templates as X
from codeferry.testing import _templates as T
from codeferry.testing._spec import (
    ALPHABET,
    ASSET_FILE,
    BIG_ASSET_FILE,
    INITIALIZER_RANGE,
    MAX_POSITIONS,
    NUM_LAYERS,
    SPECIAL_TOKENS,
    ModelSpec,
)

__all__ = ["cross_repo_files", "model_files"]


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
    tokens = list(SPECIAL_TOKENS) + list(ALPHABET[: size - len(SPECIAL_TOKENS)])
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
            X.TOKENIZATION, vocab_file="vocab.json", **names
        ).encode(),
        "vocab.json": _json_bytes(_vocab(spec.vocab_size)),
    }
    if spec.processor:
        processor_ref = f"{layout.processing}.{prefix}Processor"
        tokenizer_config["processor_class"] = f"{prefix}Processor"
        files[f"{layout.image_processing}.py"] = _render(X.IMAGE_PROCESSING, **names).encode()
        files[f"{layout.processing}.py"] = _render(X.PROCESSING, **names).encode()
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


def model_files(spec: ModelSpec, package: str | None = None) -> dict[str, bytes]:
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
    if spec.custom_generate:
        files["custom_generate/generate.py"] = _render(
            T.CUSTOM_GENERATE, name=spec.name,
            marker_imports=T.MARKER_IMPORTS if spec.marker else "",
            marker_block=_render(T.MARKER_BLOCK, marker=repr(spec.marker)) if spec.marker else "",
        ).encode("utf-8")
        files["custom_generate/sampling.py"] = T.CUSTOM_GENERATE_SAMPLING.encode("utf-8")
        files["custom_generate/requirements.txt"] = b"numpy\n"
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


def cross_repo_files(spec: ModelSpec) -> dict[str, bytes]:
    """The other repository of ``spec.cross_repo``: a self-contained head and a minimal config.

    Its code names a stand-in ``{Name}Config`` (transformers 5 compares config class *names* when
    it registers a remote class), so models sharing one head repo must share the ``name``.
    """
    head_ref = "modeling_heads.SharedHeadForSequenceClassification"
    config = {
        "architectures": ["SharedHeadForSequenceClassification"],
        "auto_map": {"AutoModelForSequenceClassification": head_ref},
    }
    head = _render(X.SHARED_HEADS, Name=spec.class_prefix)
    return {"config.json": _json_bytes(config), "modeling_heads.py": head.encode("utf-8")}
