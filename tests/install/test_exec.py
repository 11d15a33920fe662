"""``codeferry exec``: code written for plain transformers, every process routed through codeferry.

Real processes only: each script below is plain transformers (no import of codeferry) and is
run under ``python -m codeferry exec`` and, side by side, without it. Every run gets a fresh
transformers module cache and codeferry store, so every process loads from nothing.
Pools, torchrun ranks and the other ways users start processes under ``codeferry exec`` are
``tests/contexts`` (every start method, layout and mode).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from _helpers import unique_model

import codeferry
from codeferry._install.switch import BOOT

#: AutoConfig here and in a spawned child: what each got ("loaded" or the error's type).
LOCK_SCRIPT = textwrap.dedent("""
    import concurrent.futures as cf
    import json
    import multiprocessing as mp
    import sys


    def attempt(folder):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        except Exception as exc:
            return type(exc).__name__
        return "loaded " + type(config).__module__


    if __name__ == "__main__":
        here = attempt(sys.argv[1])
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            child = pool.submit(attempt, sys.argv[1]).result(timeout=300)
        print(json.dumps({"here": here, "child": child}))
""")

#: What a process looks like at start: its finders, whether codeferry was imported, which
#: sitecustomize stands in sys.modules; with an argument, also whether transformers' entry
#: point is codeferry's after importing it.
PROBE = textwrap.dedent("""
    import json, sys
    seen = {
        "meta_path": [type(f).__module__ + "." + type(f).__qualname__ for f in sys.meta_path],
        "codeferry_imported": any(m.split(".")[0] == "codeferry" for m in sys.modules),
        "modules_left": sorted(m for m in sys.modules if "codeferry" in m),
        "user_sitecustomize": getattr(sys.modules.get("sitecustomize"), "MARK", None),
        "heavy": sorted(set(sys.modules) & {"typing", "pathlib", "dataclasses", "inspect"}),
    }
    if sys.argv[1:] == ["transformers"]:
        import transformers.dynamic_module_utils as dmu
        seen["routed"] = bool(getattr(dmu.get_class_from_dynamic_module, "__codeferry__", False))
    print(json.dumps(seen))
""")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This session's environment with a fresh module cache and store (nothing loaded yet)."""
    fresh = Path(tempfile.mkdtemp(prefix="caches", dir=tmp_path))
    env = {**os.environ, "HF_MODULES_CACHE": str(fresh / "modules"),
           "CODEFERRY_HOME": str(fresh / "codeferry"), "OMP_NUM_THREADS": "1"}
    env.update(extra)
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
                          check=False)


def _exec(*flags: str) -> list[str]:
    return [sys.executable, "-m", "codeferry", "exec", *flags, "--"]


def _report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_lock_for_other_code_is_refused_in_every_process(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    model = unique_model(tmp_path, "exlock", helpers=("subpackage",), marker=str(marker))
    other = unique_model(tmp_path, "exother")
    lock = tmp_path / "other.lock"
    lock.write_text(codeferry.Lock.from_bundle(codeferry.resolve(other)).dumps())
    script = _script(tmp_path, "lock.py", LOCK_SCRIPT)

    refused = _report(_run([*_exec("--lock", str(lock)), sys.executable, script, str(model)],
                           _env(tmp_path), tmp_path))
    assert refused == {"here": "LockMismatchError", "child": "LockMismatchError"}
    assert not marker.exists()  # none of the model's code ran, in either process

    own = tmp_path / "own.lock"
    own.write_text(codeferry.Lock.from_bundle(codeferry.resolve(model)).dumps())
    loaded = _report(_run([*_exec("--lock", str(own)), sys.executable, script, str(model)],
                          _env(tmp_path), tmp_path))
    assert loaded["here"].startswith("loaded codeferry._dyn"), loaded
    assert loaded["child"].startswith("loaded codeferry._dyn"), loaded
    assert marker.exists()


def test_an_unreadable_lock_stops_before_the_command(tmp_path: Path) -> None:
    proc = _run([*_exec("--lock", str(tmp_path / "missing.lock")), sys.executable, "-c",
                 "open('started', 'w')"], _env(tmp_path), tmp_path)
    assert proc.returncode == 1 and "does not exist" in proc.stderr
    assert not (tmp_path / "started").exists()


def test_the_exit_code_is_the_commands(tmp_path: Path) -> None:
    proc = _run([*_exec("--trust-remote-code"), sys.executable, "-c", "raise SystemExit(7)"],
                _env(tmp_path), tmp_path)
    assert proc.returncode == 7, proc.stderr
    missing = _run([*_exec("--trust-remote-code"), str(tmp_path / "no-such-command")],
                   _env(tmp_path), tmp_path)
    assert missing.returncode == 127 and "cannot run" in missing.stderr


def _with_user_sitecustomize(tmp_path: Path) -> Path:
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("MARK = 'user'\n")
    return user


def test_without_the_switch_the_boot_folder_changes_nothing(tmp_path: Path) -> None:
    user = _with_user_sitecustomize(tmp_path)
    inherited = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(user), inherited) if p)
    probe = _script(tmp_path, "probe.py", PROBE)
    env = _env(tmp_path)
    env.pop("CODEFERRY_INSTALL", None)
    without = _report(_run([sys.executable, probe], {**env, "PYTHONPATH": path}, tmp_path))
    for off in ({}, {"CODEFERRY_INSTALL": "0"}):
        booted = {**env, **off, "PYTHONPATH": str(BOOT) + os.pathsep + path}
        assert _report(_run([sys.executable, probe], booted, tmp_path)) == without
        routed = _report(_run([sys.executable, probe, "transformers"], booted, tmp_path))
        assert routed["routed"] is False
    assert without["user_sitecustomize"] == "user" and not without["codeferry_imported"]


def test_the_printed_variables_switch_it_on_and_chain_to_a_user_sitecustomize(
    tmp_path: Path,
) -> None:
    user = _with_user_sitecustomize(tmp_path)
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(user), env.get("PYTHONPATH", "")) if p)
    printed = _run([sys.executable, "-m", "codeferry", "exec", "--trust-remote-code",
                    "--print-env", "--json"], env, tmp_path)
    variables = json.loads(printed.stdout)
    assert variables["CODEFERRY_INSTALL"] == "1"
    assert variables["PYTHONPATH"].split(os.pathsep)[:2] == [str(BOOT), str(user)]
    probe = _script(tmp_path, "probe.py", PROBE)

    started = _report(_run([sys.executable, probe], {**env, **variables}, tmp_path))
    assert started["user_sitecustomize"] == "user"  # the user's ran, and stands as sitecustomize
    assert not started["codeferry_imported"] and started["modules_left"] == []
    # reading the switch costs a process no import beyond its own start
    assert started["heavy"] == _report(_run([sys.executable, probe], env, tmp_path))["heavy"]
    assert started["meta_path"][0] == "_codeferry_boot_watch.Watch"  # waiting for transformers
    routed = _report(_run([sys.executable, probe, "transformers"], {**env, **variables},
                          tmp_path))
    assert routed["routed"] is True
    shell = _run([sys.executable, "-m", "codeferry", "exec", "--trust-remote-code",
                  "--print-env"], env, tmp_path)
    assert shell.stdout.startswith("export PYTHONPATH=") and "CODEFERRY_INSTALL=1" in shell.stdout


def test_an_interpreter_that_cannot_import_codeferry_fails_loudly(tmp_path: Path) -> None:
    """Switched on where codeferry cannot be imported: importing transformers fails and says
    why, rather than loading remote code unrouted (a user sitecustomize hides codeferry)."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import sys\nsys.modules['codeferry'] = None\n")
    env = _env(tmp_path, CODEFERRY_INSTALL="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BOOT), str(user), env.get("PYTHONPATH", "")) if p)
    proc = _run([sys.executable, "-c", "import transformers.dynamic_module_utils"], env, tmp_path)
    assert proc.returncode == 1
    assert "cannot import codeferry" in proc.stderr and str(BOOT) in proc.stderr


def test_the_boot_watches_what_codeferry_patches() -> None:
    """The boot names its watched modules itself (importing codeferry there would cost every
    process): they are exactly the module that routes and those ``switch.completed`` patches."""
    import ast

    from codeferry._install import switch

    tree = ast.parse((BOOT / "sitecustomize.py").read_text(encoding="utf-8"))
    values = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    route = ast.literal_eval(values["_ROUTE"])
    watched = values["_WATCHED"]
    assert isinstance(watched, ast.Call) and isinstance(watched.args[0], ast.Set)
    names = {route if isinstance(e, ast.Name) else ast.literal_eval(e) for e in watched.args[0].elts}
    assert route == "transformers.dynamic_module_utils"
    assert names == {route, *switch.WATCHED}
