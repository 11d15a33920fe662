"""Tests of the tiny remote-code model factory (``codeferry.testing``).

Static checks run in-process. Every real load with plain transformers runs in ONE subprocess per
session (``loads`` fixture): ``HF_MODULES_CACHE`` is read when transformers is imported, so a
fresh process with a private ``HF_HOME`` is the only clean way, and one process keeps it fast.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from codeferry.testing import (
    DEMO_SPEC,
    HELPER_KINDS,
    ModelSpec,
    demo_model_path,
    write_demo_model,
    write_hub_model,
    write_model,
)
from codeferry.testing._factory import DEMO_PROMPTS, _check_demo

ODD_DIR = "my.model-v1 copy"  # dots, a hyphen and a space: loaders must cope
HUB_REPO = "acme/tiny-hub"
SHARED_REPO = "org/shared-heads"
PINNED_COMMIT = "0123456789abcdef0123456789abcdef01234567"

# Helper files each kind adds (non-generic names).
HELPER_FILES = {
    "flat": ["layers.py"],
    "subpackage": ["utils/__init__.py", "utils/rope.py"],
    "from_dot": ["activations.py"],
    "function_body": ["norms.py"],
    "try_except": ["fast_kernels.py"],
    "star": ["constants.py"],
}
HELPER_IMPORTS = {
    "flat": "from .layers import Block",
    "subpackage": "from .utils.rope import rope",
    "from_dot": "from . import activations",
    "function_body": "        from .norms import rms_norm",
    "try_except": "    from .fast_kernels import fused_add",
    "star": "from .constants import *",
}
BASE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "configuration_tiny.py",
    "modeling_tiny.py",
}


def files_of(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in sorted(files_of(root))}


# ------------------------------------------------------------------------------------------
# Models written once per session
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    marker = root / "marker.txt"
    out: dict[str, Path] = {
        "default": write_model(root / ODD_DIR),
        "combo": write_model(
            root / "combo",
            ModelSpec(
                name="combo",
                helpers=("flat", "function_body", "star"),
                config_helper=True,
                model_keys_first=True,
            ),
        ),
        "tokenizer": write_model(root / "tok", ModelSpec(name="tok", tokenizer=True)),
        "processor": write_model(root / "proc", ModelSpec(name="proc", processor=True)),
        "nested": write_model(root / "nest", ModelSpec(name="nest", nested_subconfig=True)),
        "asset": write_model(root / "asset", ModelSpec(name="asset", asset=True)),
        "marker": write_model(root / "mark", ModelSpec(name="mark", marker=str(marker))),
        "generic_a": write_model(root / "a", ModelSpec(name="alpha", generic_names=True)),
        "generic_b": write_model(
            root / "b", ModelSpec(name="beta", generic_names=True, helpers=("flat",))
        ),
        "marker_file": marker,
    }
    for kind in HELPER_KINDS:
        out[kind] = write_model(root / f"h_{kind}", ModelSpec(name=f"h_{kind}", helpers=(kind,)))
    hub = root / "hub"
    out["hub"] = hub
    out["hub_snapshot"] = write_hub_model(
        hub, HUB_REPO, ModelSpec(name="hubby", tokenizer=True, cross_repo=SHARED_REPO)
    )
    out["hub_pinned"] = write_hub_model(
        hub, "acme/pinned", ModelSpec(name="pinned"), commit=PINNED_COMMIT
    )
    return out


# ------------------------------------------------------------------------------------------
# The one subprocess that loads everything with plain transformers
# ------------------------------------------------------------------------------------------

LOADER = r"""
import importlib, importlib.util, json, shutil, sys, traceback
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM,
                          AutoModelForSequenceClassification, AutoProcessor, AutoTokenizer)
from transformers.dynamic_module_utils import get_class_from_dynamic_module

transformers.logging.set_verbosity_error()
ARGS = json.loads(sys.argv[1])
P = {k: Path(v) for k, v in ARGS["paths"].items()}
HUB, PINNED = ARGS["hub_repo"], ARGS["pinned_commit"]
results = {}

def check(name):
    def wrap(fn):
        try:
            results[name] = {"ok": True, **fn()}
        except Exception as exc:
            results[name] = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500],
                             "trace": traceback.format_exc()[-1500:]}
        return fn
    return wrap

def causal(path, **kw):
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw)
    ids = torch.tensor([[4, 5, 6, 7], [0, 8, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    logits = model(ids, attention_mask=mask).logits
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                         do_sample=False, pad_token_id=0)
    return model, {"cls": type(model).__name__, "module": type(model).__module__,
                   "logits": list(logits.shape), "generated": list(gen.shape),
                   "mro": [c.__name__ for c in type(model).__mro__]}

@check("default")
def _():
    config = AutoConfig.from_pretrained(P["default"], trust_remote_code=True)
    model, out = causal(P["default"])
    saved = load_file(str(P["default"] / "model.safetensors"))
    state = model.state_dict()
    out["weights_equal"] = set(saved) == set(state) and all(
        torch.equal(saved[k], state[k]) for k in saved)
    base = AutoModel.from_pretrained(P["default"], trust_remote_code=True)
    hidden = base(torch.tensor([[1, 2, 3]])).last_hidden_state
    return {**out, "config": type(config).__name__, "base": type(base).__name__,
            "hidden": list(hidden.shape)}

for key in ["combo", "flat", "function_body", "star", "generic_a", "generic_b"]:
    check(key)(lambda key=key: causal(P[key])[1])

@check("tokenizer")
def _():
    tok = AutoTokenizer.from_pretrained(P["tokenizer"], trust_remote_code=True)
    text = "hello world, 42!"
    ids = tok(text)["input_ids"]
    batch = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    return {"cls": type(tok).__name__, "roundtrip": tok.decode(ids), "len": len(ids),
            "batch": list(batch["input_ids"].shape), "pad": batch["input_ids"][0, -1].item()}

@check("processor_classes")
def _():
    path = P["processor"]
    image_cls = get_class_from_dynamic_module("image_processing_proc.ProcImageProcessor", path)
    proc_cls = get_class_from_dynamic_module("processing_proc.ProcProcessor", path)
    pixels = image_cls.from_pretrained(path)([[1.0, 2.0], [3.0, 4.0]])["pixel_values"]
    return {"image": image_cls.__name__, "processor": proc_cls.__name__,
            "pixels": pixels.tolist()}

@check("processor_auto")
def _():
    proc = AutoProcessor.from_pretrained(P["processor"], trust_remote_code=True)
    out = proc(text=["hi", "abc"], images=[[1.0, 2.0], [3.0, 4.0]])
    return {"cls": type(proc).__name__, "keys": sorted(out.keys()),
            "image": type(proc.image_processor).__name__}

@check("nested")
def _():
    config = AutoConfig.from_pretrained(P["nested"], trust_remote_code=True)
    json.loads(config.to_json_string())
    return {"llm": type(config.llm_config).__name__, "llm_hidden": config.llm_config.hidden_size,
            **causal(P["nested"])[1]}

@check("hub")
def _():
    snapshot = P["hub_snapshot"]
    _, out = causal(HUB, cache_dir=P["hub"])
    tok = AutoTokenizer.from_pretrained(HUB, trust_remote_code=True, cache_dir=P["hub"])
    pinned = AutoConfig.from_pretrained("acme/pinned", trust_remote_code=True,
                                        revision=PINNED)  # HF_HUB_CACHE from the env
    return {**out, "tok": type(tok).__name__, "pinned": type(pinned).__name__}

@check("cross_repo")
def _():
    model = AutoModelForSequenceClassification.from_pretrained(
        HUB, trust_remote_code=True, cache_dir=P["hub"])
    logits = model(torch.tensor([[4, 5, 6]])).logits
    return {"cls": type(model).__name__, "module": type(model).__module__,
            "logits": list(logits.shape)}

@check("marker")
def _():
    causal(P["marker"])
    return {"lines": P["marker_file"].read_text().splitlines()}

for key in ["subpackage", "from_dot", "try_except", "asset"]:
    check("plain_" + key)(lambda key=key: causal(P[key])[1])

# The same folders imported as an ordinary Python package (what transformers should do).
pkgs = Path(sys.argv[2])
sys.path.insert(0, str(pkgs))
def as_package(key, pkg, name, folder=None):
    folder = folder or P[key]
    shutil.copytree(folder, pkgs / pkg)
    module = importlib.import_module(f"{pkg}.modeling_{name}")
    prefix = "".join(part.capitalize() for part in name.split("_"))
    model = getattr(module, f"{prefix}ForCausalLM").from_pretrained(pkgs / pkg)
    logits = model(torch.tensor([[4, 5, 6]])).logits
    return module, {"logits": list(logits.shape)}

for key in ["subpackage", "from_dot", "try_except", "star"]:
    check("pkg_" + key)(lambda key=key: as_package(key, "pkg_" + key, "h_" + key)[1])
@check("pkg_asset")
def _():
    module, out = as_package("asset", "pkg_asset", "asset")
    return {**out, "table": len(module.POSITION_TABLE)}
@check("pkg_try_except_names")
def _():
    module = importlib.import_module("pkg_try_except.modeling_h_try_except")
    return {"fused_add": module.fused_add is not None, "cuda": module.fused_rope_cuda is None}
@check("pkg_star_names")
def _():
    module = importlib.import_module("pkg_star.modeling_h_star")
    return {"eps": module.RMS_EPS, "private": hasattr(module, "_NOT_EXPORTED")}
check("pkg_demo")(lambda: as_package("demo", "pkg_demo", "charlm")[1])

print("RESULTS=" + json.dumps(results))
"""


@pytest.fixture(scope="session")
def loads(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("hf_home")
    pkgs = tmp_path_factory.mktemp("pkgs")
    paths = {key: str(path) for key, path in models.items()}
    paths["demo"] = str(demo_model_path())
    args = {"paths": paths, "hub_repo": HUB_REPO, "pinned_commit": PINNED_COMMIT}
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_MODULES_CACHE": str(home / "modules"),
        "HF_HUB_CACHE": str(models["hub"]),
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(args), str(pkgs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS=")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results: dict[str, Any] = json.loads(lines[-1][len("RESULTS=") :])
    return results


def ok(loads: dict[str, Any], key: str) -> dict[str, Any]:
    result: dict[str, Any] = loads[key]
    assert result["ok"], result.get("trace", result)
    return result


# ------------------------------------------------------------------------------------------
# Static checks
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "Tiny"},
        {"name": "class"},
        {"name": "has-hyphen"},
        {"helpers": ("nope",)},
        {"helpers": ("flat", "flat")},
        {"hidden_size": 128},
        {"hidden_size": 33},
        {"vocab_size": 200, "tokenizer": True},
        {"marker": "relative/marker.txt"},
        {"cross_repo": "a--b"},
    ],
)
def test_spec_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ModelSpec(**kwargs)


def test_default_files(models: dict[str, Path]) -> None:
    root = models["default"]
    assert root.name == ODD_DIR
    assert files_of(root) == BASE_FILES
    config = json.loads((root / "config.json").read_text())
    assert list(config["auto_map"]) == ["AutoConfig", "AutoModel", "AutoModelForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tiny.TinyForCausalLM"
    assert config["architectures"] == ["TinyForCausalLM"]
    assert config["model_type"] == "tiny"
    assert (root / "model.safetensors").stat().st_size < 200_000
    for rel in files_of(root):
        if rel.endswith(".py"):
            ast.parse((root / rel).read_text(), rel)


def test_decoy_imports_are_not_files(models: dict[str, Path]) -> None:
    root = models["default"]
    source = (root / "modeling_tiny.py").read_text()
    assert "Example: from .not_a_real_module import Thing" in source
    assert 'NOT_AN_IMPORT = "import .fake"' in source
    assert not (root / "not_a_real_module.py").exists() and not (root / "fake.py").exists()
    bases = {
        node.name: [ast.unparse(base) for base in node.bases]
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef)
    }
    assert bases["TinyForCausalLM"] == ["TinyPreTrainedModel"]  # no GenerationMixin
    assert bases["TinyPreTrainedModel"] == ["PreTrainedModel"]


@pytest.mark.parametrize("kind", HELPER_KINDS)
def test_helper_kind_files(models: dict[str, Path], kind: str) -> None:
    root = models[kind]
    name = f"h_{kind}"
    base = {f.replace("tiny", name) for f in BASE_FILES}
    assert files_of(root) == base | set(HELPER_FILES[kind])
    source = (root / f"modeling_{name}.py").read_text()
    assert HELPER_IMPORTS[kind] in source.splitlines()
    for rel in files_of(root):
        if rel.endswith(".py"):
            ast.parse((root / rel).read_text(), rel)
    if kind == "try_except":
        assert "    from .optional_cuda_kernels import fused_rope_cuda" in source.splitlines()
        assert not (root / "optional_cuda_kernels.py").exists()
    if kind == "star":
        assert '__all__ = ["RMS_EPS", "ROPE_BASE"]' in (root / "constants.py").read_text()


def test_other_variants_files(models: dict[str, Path], tmp_path: Path) -> None:
    combo = models["combo"]
    assert list(json.loads((combo / "config.json").read_text())["auto_map"])[-1] == "AutoConfig"
    assert "from .config_defaults import DEFAULTS" in (combo / "configuration_combo.py").read_text()
    assert "config_defaults.py" in files_of(combo)
    assert {"tokenization_tok.py", "vocab.json", "tokenizer_config.json"} <= files_of(
        models["tokenizer"]
    )
    tok_config = json.loads((models["tokenizer"] / "tokenizer_config.json").read_text())
    assert tok_config["auto_map"] == {"AutoTokenizer": ["tokenization_tok.TokTokenizer", None]}
    assert {
        "image_processing_proc.py",
        "processing_proc.py",
        "preprocessor_config.json",
        "processor_config.json",
        "tokenization_proc.py",
    } <= files_of(models["processor"])
    nested = json.loads((models["nested"] / "config.json").read_text())["llm_config"]
    assert nested["auto_map"] == {"AutoConfig": "configuration_nest_llm.NestLLMConfig"}
    assert "position_table.json" in files_of(models["asset"])
    generic = files_of(models["generic_b"])
    assert {"configuration.py", "modeling.py", "utils.py"} <= generic
    generic_sub = ModelSpec(name="g", generic_names=True, helpers=("flat", "subpackage"))
    generic_root = write_model(tmp_path / "g", generic_sub)
    assert {"ops/__init__.py", "ops/rope.py", "utils.py"} <= files_of(generic_root)
    assert "from .ops.rope import rope" in (generic_root / "modeling.py").read_text()


def test_marker_not_written_by_factory(tmp_path: Path) -> None:
    # Only importing the model code writes the marker: writing the files must not.
    marker = tmp_path / "marker.txt"
    root = write_model(tmp_path / "m", ModelSpec(marker=str(marker)))
    write_hub_model(tmp_path / "hub", "acme/m", ModelSpec(marker=str(marker)))
    assert not marker.exists()
    for module in ("modeling_tiny.py", "configuration_tiny.py"):
        assert f'with open({str(marker)!r}, "a"' in (root / module).read_text()


def test_deterministic(models: dict[str, Path], tmp_path: Path) -> None:
    again = write_model(tmp_path / "again", ModelSpec())
    assert tree_bytes(again) == tree_bytes(models["default"])
    spec = ModelSpec(name="hubby", tokenizer=True, cross_repo=SHARED_REPO)
    snapshot = write_hub_model(tmp_path / "hub", HUB_REPO, spec)
    assert snapshot.name == models["hub_snapshot"].name
    assert tree_bytes(snapshot) == tree_bytes(models["hub_snapshot"])
    other_seed = write_model(tmp_path / "seed", ModelSpec(seed=1))
    assert (other_seed / "model.safetensors").read_bytes() != (
        again / "model.safetensors"
    ).read_bytes()
    assert (other_seed / "modeling_tiny.py").read_bytes() == (
        again / "modeling_tiny.py"
    ).read_bytes()


def test_hub_layout(models: dict[str, Path]) -> None:
    hub, snapshot = models["hub"], models["hub_snapshot"]
    repo = hub / "models--acme--tiny-hub"
    assert snapshot.parent == repo / "snapshots"
    assert len(snapshot.name) == 40 and int(snapshot.name, 16) >= 0
    assert (repo / "refs" / "main").read_text() == snapshot.name
    shared = hub / "models--org--shared-heads"
    commit = (shared / "refs" / "main").read_text()
    assert files_of(shared / "snapshots" / commit) == {"config.json", "modeling_heads.py"}
    ref = json.loads((snapshot / "config.json").read_text())["auto_map"]
    assert ref["AutoModelForSequenceClassification"] == (
        "org/shared-heads--modeling_heads.SharedHeadForSequenceClassification"
    )
    assert models["hub_pinned"].name == PINNED_COMMIT
    # huggingface_hub's layout: every snapshot file is a relative symlink into ../../blobs
    # (one more ../ per folder), blobs named by sha256 (LFS files) or git's blob sha1.
    for rel, data in tree_bytes(snapshot).items():
        link = snapshot / rel
        assert link.is_symlink(), rel
        target = os.readlink(link)
        depth = rel.count("/") + 2
        assert target.startswith("../" * depth + "blobs/") and "../" * (depth + 1) not in target
        assert link.resolve().parent == (repo / "blobs").resolve()
        name = target.rsplit("/", 1)[1]
        if rel.endswith(".safetensors"):
            assert name == hashlib.sha256(data).hexdigest()
        else:
            assert name == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    with pytest.raises(ValueError):
        write_hub_model(hub, "acme/bad", commit="not-a-sha")
    with pytest.raises(ValueError):
        write_hub_model(hub, "a/b/c")


def test_demo_model_is_up_to_date_and_small(tmp_path: Path) -> None:
    demo = demo_model_path()
    assert _check_demo(demo) == [], "regenerate: python -m codeferry.testing._factory --write-demo"
    size = sum((demo / rel).stat().st_size for rel in files_of(demo))
    assert size < 400_000
    assert {"charlm_ops/__init__.py", "charlm_ops/rope.py", "layers.py"} <= files_of(demo)
    assert "from .charlm_ops.rope import rope" in (demo / "modeling_charlm.py").read_text()
    prompts = (demo / "prompts.txt").read_text().splitlines()
    assert prompts == list(DEMO_PROMPTS) and len(prompts) == 8
    vocab = json.loads((demo / "vocab.json").read_text())
    assert len(vocab) == DEMO_SPEC.vocab_size and all(c in vocab for p in prompts for c in p)
    assert tree_bytes(write_demo_model(tmp_path / "demo")) == tree_bytes(demo)


# ------------------------------------------------------------------------------------------
# Real loads with plain transformers (one subprocess, see ``loads``)
# ------------------------------------------------------------------------------------------


def test_load_default(loads: dict[str, Any]) -> None:
    result = ok(loads, "default")
    assert result["config"] == "TinyConfig" and result["cls"] == "TinyForCausalLM"
    assert result["logits"] == [2, 4, 64] and result["generated"] == [2, 7]
    assert "GenerationMixin" in result["mro"]  # added by transformers for remote code
    assert result["weights_equal"], "safetensors names/values must match the model code"
    assert result["base"] == "TinyModel" and result["hidden"] == [1, 3, 32]


@pytest.mark.parametrize(
    "key", ["combo", "flat", "function_body", "star", "generic_a", "generic_b", "nested"]
)
def test_load_variants(loads: dict[str, Any], key: str) -> None:
    result = ok(loads, key)
    assert result["logits"][:2] == [2, 4] and result["generated"] == [2, 7]


def test_generic_names_are_distinct_modules(loads: dict[str, Any]) -> None:
    a, b = ok(loads, "generic_a"), ok(loads, "generic_b")
    assert a["module"].endswith(".modeling") and b["module"].endswith(".modeling")
    assert a["module"] != b["module"] and (a["cls"], b["cls"]) == (
        "AlphaForCausalLM",
        "BetaForCausalLM",
    )


def test_load_tokenizer(loads: dict[str, Any]) -> None:
    result = ok(loads, "tokenizer")
    assert result["cls"] == "TokTokenizer"
    assert result["roundtrip"] == "hello world, 42!" and result["len"] == 16
    assert result["batch"] == [2, 4] and result["pad"] == 0


def test_load_processor(loads: dict[str, Any]) -> None:
    classes = ok(loads, "processor_classes")
    assert (classes["image"], classes["processor"]) == ("ProcImageProcessor", "ProcProcessor")
    assert classes["pixels"] == [[0.5, 1.0], [1.5, 2.0]]
    auto = loads["processor_auto"]
    if not auto["ok"] and "PIL" in auto["message"]:
        pytest.skip("transformers 5 needs Pillow for any image processor: " + auto["message"][:80])
    assert auto["ok"], auto
    assert auto["cls"] == "ProcProcessor" and auto["image"] == "ProcImageProcessor"
    assert auto["keys"] == ["attention_mask", "input_ids", "pixel_values"]


def test_load_nested_subconfig(loads: dict[str, Any]) -> None:
    result = ok(loads, "nested")
    assert result["llm"] == "NestLLMConfig" and result["llm_hidden"] == 32


def test_load_hub_offline(loads: dict[str, Any]) -> None:
    result = ok(loads, "hub")
    assert result["cls"] == "HubbyForCausalLM" and result["generated"] == [2, 7]
    assert ".acme.tiny_hyphen_hub." in result["module"]
    assert result["tok"] == "HubbyTokenizer" and result["pinned"] == "PinnedConfig"


def test_load_cross_repo(loads: dict[str, Any]) -> None:
    result = ok(loads, "cross_repo")
    assert result["cls"] == "SharedHeadForSequenceClassification"
    assert ".org.shared_hyphen_heads." in result["module"] and result["logits"] == [1, 2]


def test_marker_written_on_import(loads: dict[str, Any]) -> None:
    lines = ok(loads, "marker")["lines"]
    modules = {line.split()[0].rsplit(".", 1)[-1] for line in lines}
    assert modules == {"configuration_mark", "modeling_mark"}


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("subpackage", "FileNotFoundError"),  # looks for utils.rope.py
        ("from_dot", "ImportError"),  # activations.py is never copied
        ("try_except", "FileNotFoundError"),  # hashes the absent optional_cuda_kernels.py
        ("asset", "FileNotFoundError"),  # the data file is not copied to the modules cache
    ],
)
def test_plain_transformers_still_fails(loads: dict[str, Any], kind: str, error: str) -> None:
    """These variants reproduce transformers bugs codeferry fixes; plain Python imports them."""
    plain = loads["plain_" + kind]
    if plain["ok"]:
        pytest.skip(f"this transformers version loads the {kind} variant")
    assert plain["error"] == error, plain
    assert ok(loads, "pkg_" + kind)["logits"] == [1, 3, 64]


def test_package_imports(loads: dict[str, Any]) -> None:
    assert ok(loads, "pkg_star")["logits"] == [1, 3, 64]
    assert ok(loads, "pkg_asset")["table"] == 64
    assert ok(loads, "pkg_try_except_names") == {"ok": True, "fused_add": True, "cuda": True}
    assert ok(loads, "pkg_star_names") == {"ok": True, "eps": 1e-6, "private": False}
    assert ok(loads, "pkg_demo")["logits"] == [1, 3, DEMO_SPEC.vocab_size]
