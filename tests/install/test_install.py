"""``codeferry.install()``: codeferry under code written for plain transformers.

Everything here calls transformers' own API only (``from_pretrained(..., trust_remote_code=
True)``, ``get_class_from_dynamic_module``), the way inference engines do, in this process
and in spawned children that call transformers themselves.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry.testing import REAL_WORLD_KINDS, ModelSpec, write_model, write_real_world_model

#: Factory variants that transformers' own loader cannot load (its scanner misses them).
TRANSFORMERS_FAILS = ("helper_subpackage", "helper_from_dot")
VARIANTS = ("default", *TRANSFORMERS_FAILS, "model_keys_first", "config_helper", "tokenizer",
            "all_helpers", "acme/tiny", "acme/crossy")


def plain_transformers_load(path: str, revision: str | None = None, tokenizer: bool = False,
                            cache_dir: str | None = None) -> dict[str, Any]:
    """What an engine does: transformers' API only. Runs here and in spawned children."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = {"trust_remote_code": True, "revision": revision, "cache_dir": cache_dir}
    config = AutoConfig.from_pretrained(path, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    out = {
        "config_module": type(config).__module__,
        "model_module": type(model).__module__,
        "config_class_is_type_config": model.config_class is type(config),
        "model_config_is_type_config": type(model.config) is type(config),
    }
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        out["tokenizer_module"] = type(tok).__module__
        out["ids"] = tok("hello")["input_ids"]
    return out


def installed_child(path: str, revision: str | None, cache_dir: str | None) -> dict[str, Any]:
    import codeferry

    codeferry.install()
    return plain_transformers_load(path, revision, cache_dir=cache_dir)


def plain_child(path: str) -> str:
    """Without codeferry: transformers' own error, as text."""
    try:
        plain_transformers_load(path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.fixture
def installed() -> Iterator[None]:
    codeferry.install()
    try:
        yield
    finally:
        codeferry.uninstall()


def _copy(factory_models: dict[str, Path], key: str, tmp_path: Path) -> tuple[str, str | None]:
    """A private copy of a local variant (fresh code: nothing loaded it yet); hub ids as is."""
    if "/" in key:
        return key, None
    return str(shutil.copytree(factory_models[key], tmp_path / key.replace("/", "_"))), None


@pytest.mark.parametrize("key", TRANSFORMERS_FAILS)
def test_plain_transformers_fails_on_these_layouts(
    key: str, factory_models: dict[str, Path], spawned_child: cf.ProcessPoolExecutor, tmp_path: Path
) -> None:
    path, _ = _copy(factory_models, key, tmp_path)
    assert spawned_child.submit(plain_child, path).result(timeout=300) != "ok"  # the test bites


@pytest.mark.parametrize("key", VARIANTS)
def test_transformers_api_after_install_loads_codeferry_classes(
    key: str, factory_models: dict[str, Path], factory_hub_cache: Path, tmp_path: Path,
    installed: None,
) -> None:
    path, revision = _copy(factory_models, key, tmp_path)
    report = plain_transformers_load(path, revision, tokenizer=key == "tokenizer",
                                     cache_dir=str(factory_hub_cache))
    assert report["config_module"].startswith("codeferry._dyn.u")
    assert report["model_module"].startswith("codeferry._dyn.u")
    assert report["config_class_is_type_config"] and report["model_config_is_type_config"]
    if key == "tokenizer":
        assert report["tokenizer_module"].startswith("codeferry._dyn.u") and report["ids"]


@pytest.mark.parametrize("key", ["helper_subpackage", "helper_from_dot", "acme/crossy"])
def test_install_in_a_spawned_child_that_calls_transformers_itself(
    key: str, factory_models: dict[str, Path], factory_hub_cache: Path, tmp_path: Path,
    spawned_child: cf.ProcessPoolExecutor,
) -> None:
    path, revision = _copy(factory_models, key, tmp_path)
    report = spawned_child.submit(installed_child, path, revision,
                                  str(factory_hub_cache)).result(timeout=300)
    assert report["config_module"].startswith("codeferry._dyn.u")
    assert report["config_class_is_type_config"] and report["model_config_is_type_config"]


def test_a_revision_pins_the_hub_snapshot(factory_hub_cache: Path, installed: None) -> None:
    commit = (factory_hub_cache / "models--acme--tiny" / "refs" / "main").read_text().strip()
    report = plain_transformers_load("acme/tiny", revision=commit,
                                     cache_dir=str(factory_hub_cache))
    assert report["config_module"].startswith("codeferry._dyn.u")


def test_transformers_still_decides_trust(
    factory_models: dict[str, Path], tmp_path: Path, installed: None
) -> None:
    from transformers import AutoConfig

    # a model_type nothing registered yet, so only remote code could answer
    path = write_model(tmp_path / "t", ModelSpec(name="trustme", helpers=("subpackage",)))
    before = set(__import__("sys").modules)
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(path, trust_remote_code=False)
    assert not any(name.startswith(("codeferry._dyn.u", "transformers_modules"))
                   for name in set(__import__("sys").modules) - before)


def test_get_class_from_dynamic_module_called_directly(
    factory_models: dict[str, Path], tmp_path: Path, installed: None
) -> None:
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    path, _ = _copy(factory_models, "helper_subpackage", tmp_path)
    cls = get_class_from_dynamic_module("modeling_h_subpackage.HSubpackageForCausalLM", path)
    assert cls.__module__.startswith("codeferry._dyn.u")
    config_cls = get_class_from_dynamic_module("configuration_h_subpackage.HSubpackageConfig", path)
    assert cls.config_class is config_cls


def test_per_class_loading_through_transformers(tmp_path: Path, installed: None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    assert "tokenizer_missing_package" in REAL_WORLD_KINDS
    path = write_real_world_model(tmp_path / "m", "tokenizer_missing_package", name="inst")
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert model.config_class is type(config)
    with pytest.raises(codeferry.errors.MissingPackageError) as info:
        AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    assert "pip install sentencepiece" in (info.value.fix or "")


def test_install_twice_is_safe_and_uninstall_restores_transformers(
    factory_models: dict[str, Path], tmp_path: Path
) -> None:
    import transformers.dynamic_module_utils as dmu
    from transformers.models.auto import configuration_auto

    original = dmu.get_class_from_dynamic_module
    assert configuration_auto.get_class_from_dynamic_module is original
    codeferry.install()
    codeferry.install()
    hooked = dmu.get_class_from_dynamic_module
    assert hooked is not original and configuration_auto.get_class_from_dynamic_module is hooked
    assert hooked.__wrapped__ is original  # type: ignore[attr-defined]
    codeferry.uninstall()
    codeferry.uninstall()
    assert dmu.get_class_from_dynamic_module is original
    assert configuration_auto.get_class_from_dynamic_module is original
    # transformers' own behaviour is back: it executes the code under transformers_modules
    from transformers import AutoConfig

    path = write_model(tmp_path / "u", ModelSpec(name="restored"))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(config).__module__.startswith("transformers_modules.")


def test_after_load_the_flag_by_habit_does_not_execute_the_code_again(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = write_real_world_model(tmp_path / "m", "deferred_helpers", name="habit")
    classes = codeferry.load(path, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(tok) is classes["AutoTokenizer"][0]
    assert type(config) is classes["AutoConfig"]
    assert not any(n.startswith("transformers_modules.") and "habit" in n
                   for n in __import__("sys").modules)


def test_processors_and_image_processors_through_transformers(
    factory_models: dict[str, Path], tmp_path: Path, installed: None
) -> None:
    from transformers import AutoImageProcessor, AutoProcessor

    path = write_model(tmp_path / "p", ModelSpec(name="procinst", processor=True))
    proc = AutoProcessor.from_pretrained(path, trust_remote_code=True)
    image = AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
    assert type(proc).__module__.startswith("codeferry._dyn.u")
    assert type(image).__module__.startswith("codeferry._dyn.u")
    assert type(proc.image_processor) is type(image)
    out = proc(text=["hi", "abc"], images=[[1.0, 2.0], [3.0, 4.0]])
    assert {"input_ids", "pixel_values"} <= set(out.keys())


def test_uninstall_gives_back_every_function_codeferry_patched(tmp_path: Path) -> None:
    """Five places answer transformers (remote classes, adoption, saving, generate() on old
    heads, one model_type per model); one registry records them, and uninstall restores all."""
    import transformers.dynamic_module_utils as dmu
    from transformers import AutoConfig
    from transformers.models.auto import auto_factory

    from codeferry._hf import patches

    places = [(dmu, "get_class_from_dynamic_module"), (dmu, "get_class_in_module"),
              (dmu, "custom_object_save"), (auto_factory, "add_generation_mixin_to_remote_model"),
              (AutoConfig, "from_pretrained")]
    codeferry.uninstall()  # from a clean state, whatever earlier tests did
    originals = [vars(owner)[name] for owner, name in places]
    codeferry.load(write_model(tmp_path / "m", ModelSpec(name="patched")), trust_remote_code=True)
    codeferry.install()
    assert all(patches.patched(owner, name) for owner, name in places)
    assert all(vars(owner)[name] is not o for (owner, name), o in zip(places, originals, strict=True))
    codeferry.uninstall()
    assert [vars(owner)[name] for owner, name in places] == originals
    assert not any(patches.patched(owner, name) for owner, name in places)


LAZY = '''
import json, sys
import codeferry
from codeferry._hf import patches

codeferry.install()
# (not torch: transformers 4.53's dynamic_module_utils imports it itself)
heavy = [m for m in ("transformers.generation.utils", "transformers.modeling_utils",
                     "transformers.models.auto.modeling_auto") if m in sys.modules]
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.utils import GenerationMixin
from transformers.models.auto import auto_factory

tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[2])
    kernel = "loaded"
except Exception as exc:
    kernel = type(exc).__name__
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
places = [(GenerationMixin, "load_custom_generate"),
          (auto_factory, "add_generation_mixin_to_remote_model")]
import transformers
out = {"version": transformers.__version__, "heavy": heavy, "tokenizer": type(tok).__module__, "model": type(model).__module__,
       "kernel": kernel, "patched": [patches.patched(o, n) for o, n in places]}
codeferry.uninstall()
out["after"] = [patches.patched(o, n) for o, n in places]
out["finders"] = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "Watch"]
print(json.dumps(out))
'''


#: ``install()`` called while transformers' ``modeling_utils`` executes: a finder that runs it
#: at the first import that module makes (an import hook, a plugin a library imports...).
INSIDE = '''
import json, sys

class InstallInside:
    half = None
    def find_spec(self, name, path=None, target=None):
        mu = sys.modules.get("transformers.modeling_utils")
        if self.half is None and mu is not None and getattr(mu.__spec__, "_initializing", False):
            self.half = [m for m in ("transformers.modeling_utils",) if m in sys.modules]
            import codeferry
            codeferry.install()
        return None

trigger = InstallInside()
sys.meta_path.insert(0, trigger)
from transformers import AutoModelForCausalLM
import transformers
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
    kernel = "loaded"
except Exception as exc:
    kernel = type(exc).__name__
from codeferry._hf import patches
from transformers.modeling_utils import PreTrainedModel
print(json.dumps({"version": transformers.__version__, "half": trigger.half, "kernel": kernel,
                  "recorded": patches.patched(PreTrainedModel, "from_pretrained")}))
'''


def test_install_inside_an_import_of_transformers_patches_the_half_imported_module(
    tmp_path: Path,
) -> None:
    """``install()`` while ``modeling_utils`` is still executing: no finder sees that module
    start, so it gets its patches at the first import after it finishes, before any model
    loads; a native model whose config names a Hub kernel is refused (it passed the gate when
    only the first remote class patched such a module)."""
    import json
    import os
    import subprocess
    import sys

    from tests._doors import write_native_model

    native = write_native_model(tmp_path / "native", attn_implementation="kernels-community/x")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", INSIDE, str(native)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["half"] == ["transformers.modeling_utils"], got  # install() ran inside it
    # transformers 4.x reads no kernel from config.json's public field: nothing to refuse
    assert got["kernel"] == ("loaded" if got["version"].startswith("4.") else
                             "HubKernelRefusedError"), got
    assert got["recorded"] is True, got


def test_install_imports_nothing_heavy_and_patches_each_module_as_it_is_imported(
    tmp_path: Path,
) -> None:
    """A worker that only tokenizes pays for no torch nor transformers' modeling through
    ``install()``; what codeferry patches in those modules (the Hub kernel gates, the
    ``generate()`` hooks) still goes in, as each one finishes importing, before its first use:
    a native model whose config names a Hub kernel is refused. ``uninstall()`` takes it away."""
    import json
    import os
    import subprocess
    import sys

    from tests._doors import write_native_model

    remote = write_model(tmp_path / "remote", ModelSpec(name="lazyinst", tokenizer=True))
    native = write_native_model(tmp_path / "native", attn_implementation="kernels-community/x")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LAZY, str(remote), str(native)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["heavy"] == []
    assert got["tokenizer"].startswith("codeferry._dyn.") and got["model"].startswith("codeferry._dyn.")
    # transformers 4.x reads no kernel from config.json's public field: nothing to refuse
    assert got["kernel"] == ("loaded" if got["version"].startswith("4.") else
                             "HubKernelRefusedError"), got
    assert got["patched"] == [True, True] and got["after"] == [False, False]
    assert got["finders"] == []
