"""Every door transformers opens to a repo's Python passes one gate.

transformers runs a repo's code through ``auto_map`` and through ``custom_generate/``
(``from_pretrained`` and ``generate(custom_generate=...)``). Each case runs in a new process
of its own (a lock binds a process for good), forked from a process started with spawn,
forkserver or fork (``_forker``: one per start method, no interpreter started per case), and
the model's ``marker`` file says which of its modules executed there:

- without a lock, trust decides at every door, on every transformers release (4.x ran a
  local ``custom_generate/`` untrusted), and trusted code runs from codeferry's verified bytes;
- under a lock (``CODEFERRY_LOCK``, ``load(..., lock=...)``) nothing the lock does not list
  executes, whoever passed ``trust_remote_code=True`` (CVE-2026-27893's pattern), through
  codeferry or straight through transformers' ``get_class_in_module``;
- ``inspect``, ``audit`` and ``lock`` list the door's files, with file:line.

vLLM never reaches ``custom_generate`` (its Transformers backend builds the model with
``from_config`` and generates itself): the vLLM side of the gate is in ``tests/vllm``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import _door_child as child
import pytest
from _forker import Forker
from _helpers import run_cli

from codeferry import Lock, read_lock, resolve
from codeferry.testing import ModelSpec, write_hub_model, write_model

METHODS = ["spawn", "forkserver", "fork"]
DOOR_FILES = ("custom_generate/generate.py", "custom_generate/requirements.txt",
              "custom_generate/sampling.py")




def _plain_with_custom_generate(dest: Path, source: Path) -> Path:
    """A transformers model without ``auto_map`` whose only remote code is ``custom_generate/``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(dest)
    shutil.copytree(source / "custom_generate", dest / "custom_generate")
    return dest


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Models with a ``custom_generate/`` door, their locks, and a hub cache, written once."""
    root = tmp_path_factory.mktemp("doors")
    marker = root / "marker.txt"
    model = write_model(root / "gen", ModelSpec(name="doorgen", custom_generate=True,
                                                 marker=str(marker)))
    other = write_model(root / "other", ModelSpec(name="doorother", custom_generate=True,
                                                   marker=str(marker)))
    # locked by a codeferry that did not see the door, or the door added after locking:
    # the exploit
    stale = write_model(root / "stale", ModelSpec(name="doorstale", marker=str(marker)))
    stale_lock = root / "stale.lock"
    stale_lock.write_text(Lock.from_bundle(resolve(stale)).dumps())
    shutil.copytree(write_model(root / "src", ModelSpec(
        name="doorstale", custom_generate=True, marker=str(marker))) / "custom_generate",
        stale / "custom_generate")
    lock = root / "gen.lock"
    lock.write_text(Lock.from_bundle(resolve(model)).dumps())
    cache = root / "hub"
    hub = write_hub_model(cache, "acme/doorhub", ModelSpec(name="doorhub", custom_generate=True,
                                                            marker=str(marker)))
    return {"root": root, "marker": marker, "model": model, "other": other, "stale": stale,
            "stale_lock": stale_lock, "lock": lock, "cache": cache, "hub": hub,
            "plain": _plain_with_custom_generate(root / "plain", model)}


# -- the static side: inspect, audit, lock, verify --------------------------------------


def test_the_door_is_resolved_hashed_and_locked_with_file_and_line(
    doors: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = resolve(doors["model"])
    assert [(d.name, d.path) for d in bundle.doors] == [
        ("custom_generate", "custom_generate/generate.py")]
    line = bundle.doors[0].line
    source = (doors["model"] / "custom_generate/generate.py").read_text().splitlines()
    assert source[line - 1].startswith("def generate(")
    by_path = {f.path: f for f in bundle.files}
    assert set(DOOR_FILES) <= set(by_path)
    assert by_path["custom_generate/requirements.txt"].kind == "asset"
    assert "custom_generate.sampling" in {m.name for m in bundle.modules}
    # the door is no class's closure: loading the auto_map classes does not execute it
    assert all("custom_generate" not in " ".join(c) for c in bundle.closures.values())
    lock = read_lock(doors["lock"])
    assert {f.path for f in lock.files} >= set(DOOR_FILES)
    assert "codeferry-lock 1" in doors["lock"].read_text()  # the format did not change
    code, out, _ = run_cli(capsys, "inspect", str(doors["model"]))
    assert code == 0
    assert f"custom_generate  {doors['model'] / 'custom_generate/generate.py'}:{line}" in out
    code, out, _ = run_cli(capsys, "inspect", "--json", str(doors["model"]))
    assert json.loads(out)["doors"] == [
        {"door": "custom_generate", "path": "custom_generate/generate.py", "line": line}]
    code, out, _ = run_cli(capsys, "audit", str(doors["model"]))
    assert "custom_generate/generate.py:" in out  # its open(..., "a") of the marker
    code, out, _ = run_cli(capsys, "verify", str(doors["stale"]), "--lock",
                          str(doors["stale_lock"]))
    assert code != 0 and "added    custom_generate/generate.py" in out + _


def test_a_model_without_a_door_keeps_its_digest(factory_models: dict[str, Path]) -> None:
    bundle = resolve(factory_models["default"])
    assert bundle.doors == () and not any(f.path.startswith("custom_generate/")
                                          for f in bundle.files)


# -- the runtime gate, in fresh processes --------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_without_a_lock_trust_decides_at_the_custom_generate_door(
    doors: dict[str, Path], forkers: Callable[[str], Forker], method: str
) -> None:
    out = forkers(method).run(child.without_lock, str(doors["model"]), str(doors["plain"]),
                 str(doors["other"]), str(doors["marker"]))
    # untrusted: from_pretrained keeps transformers' generate, generate() refuses, nothing ran
    assert out["plain_untrusted_generate"] == "GenerationMixin.generate"
    assert out["plain_untrusted_ran"] == []
    assert out["generate_untrusted"] == "TrustRequiredError"
    assert out["generate_untrusted_ran"] == []
    # trusted: the custom generate is codeferry's, executed from verified bytes
    assert out["from_pretrained_trusted"].startswith("ok codeferry._dyn.u")
    assert out["from_pretrained_trusted"].endswith(".custom_generate.generate")
    assert out["generate_other_trusted"].startswith("ok codeferry._dyn.u")
    assert len(out["ran"]) == 2 and all(n.startswith("codeferry._dyn.u") for n in out["ran"])


@pytest.mark.parametrize("method", METHODS)
def test_a_lock_that_does_not_list_the_door_refuses_it(
    doors: dict[str, Path], forkers: Callable[[str], Forker], method: str
) -> None:
    """The issue's exploit: locked without custom_generate/, loaded with the vLLM plugin."""
    out = forkers(method).run(child.engine_lock, str(doors["stale_lock"]), str(doors["stale"]),
                 str(doors["other"]), str(doors["marker"]))
    assert out["from_pretrained"] == "LockMismatchError"
    assert out["get_class_in_module"] == "UnlockedCodeError"  # straight through transformers
    assert out["ran"] == []


@pytest.mark.parametrize("method", METHODS)
def test_a_lock_that_lists_the_door_runs_exactly_it_and_nothing_else(
    doors: dict[str, Path], forkers: Callable[[str], Forker], method: str
) -> None:
    out = forkers(method).run(child.engine_lock, str(doors["lock"]), str(doors["model"]),
                 str(doors["other"]), str(doors["marker"]))
    assert out["from_pretrained"].startswith("ok codeferry._dyn.u")
    # the locked bytes may run through transformers' own path too
    assert out["get_class_in_module"].startswith("ok transformers_modules.")
    # another repo's custom_generate, though the caller trusts it: not in the lock
    assert out["generate_other"] == "UnlockedCodeError"
    assert out["other_ran"] == []


@pytest.mark.parametrize("method", METHODS)
def test_a_library_that_hard_codes_trust_runs_only_locked_code(
    doors: dict[str, Path], forkers: Callable[[str], Forker], method: str
) -> None:
    """CVE-2026-27893's pattern under ``load(..., lock=...)``."""
    out = forkers(method).run(child.load_lock, str(doors["lock"]), str(doors["model"]),
                 str(doors["other"]), str(doors["marker"]))
    assert out["other_transformers"] == "UnlockedCodeError"
    assert out["other_installed"] == "UnlockedCodeError"
    assert out["locked_model"].startswith("ok codeferry._dyn.u")
    assert [n for n in out["ran"] if "doorother" in n] == []


def test_code_does_not_run_at_start_up_without_trust(
    doors: dict[str, Path], forkers: Callable[[str], Forker]
) -> None:
    """CVE-2026-22807's pattern: AutoConfig/AutoModel without trust_remote_code run nothing."""
    out = forkers("spawn").run(child.untrusted_startup, str(doors["model"]), str(doors["marker"]))
    assert out["config"] == "ValueError" and out["model"] == "ValueError"
    assert out["ran"] == []


def test_a_repo_in_the_hub_cache_passes_the_same_gate(
    doors: dict[str, Path], forkers: Callable[[str], Forker]
) -> None:
    args = (str(doors["cache"]), str(doors["model"]), "acme/doorhub", str(doors["marker"]))
    out = forkers("spawn").run(child.hub_repo, args[0], None, *args[1:])
    assert out["repo_untrusted"] == "TrustRequiredError"
    assert out["repo_trusted"].startswith("ok codeferry._dyn.u")
    assert len(out["repo_ran"]) == 1 and out["repo_ran"][0].startswith("codeferry._dyn.u")
    out = forkers("spawn").run(child.hub_repo, args[0], str(doors["lock"]), *args[1:])
    assert out["repo_trusted"] == "UnlockedCodeError"  # not in the model's lock
    assert out["repo_ran"] == []


def test_an_executor_refuses_a_lock_that_does_not_list_the_door(doors: dict[str, Path]) -> None:
    """codeferry's own workers get only what the parent decided: it decides on the door too."""
    import codeferry
    from codeferry.errors import LockMismatchError

    with pytest.raises(LockMismatchError) as caught:
        codeferry.Executor(doors["stale"], workers=1, lock=doors["stale_lock"])
    assert "added    custom_generate/generate.py" in str(caught.value)
