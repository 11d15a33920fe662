"""Nested trust (CVE-2026-5241's pattern): a ``trust_remote_code`` key in a model's own files
(config.json, a sub-config, tokenizer_config.json, processor_config.json) never stands in for
the caller's. codeferry's decision (``_trust.decide``) takes trust only from the caller's
keyword or a lock, so a model that asks for trust in its files, with a sub-config that names
code of its own (its own ``auto_map``) and a processor that names a remote tokenizer, is
refused without the caller's trust and without a matching lock: in this process and in a
spawned worker, before any of its code runs (each module writes a MARK when executed).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from _doors import edit_json

import codeferry
from codeferry._code.doors import find_doors
from codeferry._install.adopt import install_for_engine

MARK = "\nimport os as _os\nopen(_os.environ['DOORS_MARK'], 'a').write(__name__ + '\\n')\n"


def _mark_modules(folder: Path, *names: str) -> None:
    for name in names:
        with (folder / name).open("a", encoding="utf-8") as f:
            f.write(MARK)


@pytest.fixture(scope="module")
def asking(factory_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """``nest`` (a sub-config with its own auto_map) and ``proc`` (a processor naming a remote
    tokenizer), each asking for trust in every JSON file, with locks of their code."""
    root = tmp_path_factory.mktemp("asking")
    nest = Path(shutil.copytree(factory_models["nested_subconfig"], root / "nest"))
    _mark_modules(nest, "configuration_nest_llm.py", "configuration_nest.py")
    config = nest / "config.json"
    edit_json(config, trust_remote_code=True)
    data = json.loads(config.read_text(encoding="utf-8"))
    data["llm_config"]["trust_remote_code"] = True
    config.write_text(json.dumps(data, indent=2), encoding="utf-8")
    proc = Path(shutil.copytree(factory_models["processor"], root / "proc"))
    _mark_modules(proc, "tokenization_proc.py", "processing_proc.py", "configuration_proc.py")
    edit_json(proc / "processor_config.json", trust_remote_code=True,
              tokenizer={"trust_remote_code": True, "tokenizer_class": "ProcTokenizer"})
    edit_json(proc / "tokenizer_config.json", trust_remote_code=True)
    out = {"nest": nest, "proc": proc}
    for name, folder in list(out.items()):
        lock = root / f"{name}.lock"
        lock.write_text(codeferry.Lock.from_bundle(codeferry.resolve(folder)).dumps(),
                        encoding="utf-8")
        out[f"{name}.lock"] = lock
    return out


def try_load(folder: str, mark: str, how: str, lock: str | None = None,
             trust: bool = False) -> dict[str, Any]:
    """One load of ``folder`` the way ``how`` says; what it raised and what executed."""
    os.environ["DOORS_MARK"] = mark
    try:
        if how == "load":
            codeferry.load(folder, trust_remote_code=trust, lock=lock)
        else:
            if how == "engine":
                install_for_engine(codeferry.read_lock(lock) if lock else None)
            else:
                codeferry.install()
            from transformers import AutoConfig, AutoProcessor

            if Path(folder, "processor_config.json").exists():
                AutoProcessor.from_pretrained(folder, trust_remote_code=trust)
            else:
                AutoConfig.from_pretrained(folder, trust_remote_code=trust)
        out: dict[str, Any] = {"error": None}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        if how != "load":
            codeferry.uninstall()
    out["ran"] = Path(mark).read_text(encoding="utf-8").split() if Path(mark).exists() else []
    return out


@pytest.fixture(scope="module")
def spawned() -> Any:
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        yield pool


def _run(where: str, spawned: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    if where == "parent":
        return try_load(*args, **kwargs)
    return spawned.submit(try_load, *args, **kwargs).result(timeout=240)


def test_the_files_ask_for_trust_and_audit_says_where(asking: dict[str, Path]) -> None:
    kinds = {(d.file, d.key) for name in ("nest", "proc") for d in find_doors(asking[name])
             if d.kind == "trust-in-file"}
    assert kinds == {("config.json", "trust_remote_code"),
                     ("config.json", "llm_config.trust_remote_code"),
                     ("processor_config.json", "trust_remote_code"),
                     ("processor_config.json", "tokenizer.trust_remote_code"),
                     ("tokenizer_config.json", "trust_remote_code")}
    sub = [c for c in codeferry.resolve(asking["nest"]).classes
           if c.declared_in == "config.json:llm_config"]
    assert [c.module for c in sub] == ["configuration_nest_llm"]


@pytest.mark.parametrize("where", ["parent", "spawned"])
@pytest.mark.parametrize("name", ["nest", "proc"])
def test_codeferry_load_refuses_without_the_callers_trust(
        asking: dict[str, Path], spawned: Any, tmp_path: Path, where: str, name: str) -> None:
    got = _run(where, spawned, str(asking[name]), str(tmp_path / "MARK"), "load")
    assert got["error"] == "TrustRequiredError", got
    if name == "nest":
        assert "configuration_nest_llm.py" in got["message"]  # the sub-config's own code
    assert got["ran"] == []


@pytest.mark.parametrize("where", ["parent", "spawned"])
@pytest.mark.parametrize("name", ["nest", "proc"])
def test_installed_transformers_refuses_without_the_callers_trust(
        asking: dict[str, Path], spawned: Any, tmp_path: Path, where: str, name: str) -> None:
    got = _run(where, spawned, str(asking[name]), str(tmp_path / "MARK"), "install")
    assert got["error"] is not None and "trust_remote_code" in got["message"], got
    assert got["ran"] == []


@pytest.mark.parametrize("where", ["parent", "spawned"])
@pytest.mark.parametrize(("name", "changed"), [("nest", "configuration_nest_llm.py"),
                                               ("proc", "tokenization_proc.py")])
def test_a_changed_nested_module_is_refused_under_the_lock(
        asking: dict[str, Path], spawned: Any, tmp_path: Path, where: str, name: str,
        changed: str) -> None:
    folder = Path(shutil.copytree(asking[name], tmp_path / name))
    with (folder / changed).open("a", encoding="utf-8") as f:
        f.write("\nEXTRA = 1\n")
    lock = str(asking[f"{name}.lock"])
    for how in ("load", "engine"):
        mark = tmp_path / f"MARK-{how}"
        got = _run(where, spawned, str(folder), str(mark), how, lock=lock, trust=True)
        assert got["error"] == "LockMismatchError", (how, got)
        assert f"changed  {changed}" in got["message"] and got["ran"] == []


def test_the_locked_nested_code_runs_under_its_lock(asking: dict[str, Path], spawned: Any,
                                                    tmp_path: Path) -> None:
    got = _run("spawned", spawned, str(asking["nest"]), str(tmp_path / "MARK"), "engine",
               lock=str(asking["nest.lock"]), trust=True)
    assert got["error"] is None, got
    assert any(m.endswith(".configuration_nest_llm") for m in got["ran"])
