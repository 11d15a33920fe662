"""codeferry follows the conventions of the libraries around it: loggers named after their
modules, degraded modes as ``warnings``, ``HF_DEBUG``/``CODEFERRY_DEBUG``, ``python -m
codeferry``, and one version, written in ``pyproject.toml`` only."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, SRC

import codeferry
from codeferry import _settings, _version, cli
from codeferry._exec import scheduler as _scheduler
from codeferry.testing import ModelSpec, write_model

# the [project] table's version (the first table of the file; no tomllib on Python 3.10)
PYPROJECT_VERSION = re.findall(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(),
                               re.MULTILINE)[0]


# -- logging and warnings ---------------------------------------------------------------


def test_every_logger_is_named_after_its_module() -> None:
    """``logging.getLogger(__name__)`` everywhere: ``codeferry`` is the parent of them all."""
    calls = []
    for path in sorted(SRC.rglob("*.py")):
        if "demo" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger":
                calls.append((path.name, ast.unparse(node.args[0]) if node.args else ""))
    # One deliberate exception: inside vLLM, codeferry's errors go to a child of vLLM's own
    # logger, so they show in vLLM's output format, where vLLM says "Cannot find model module".
    calls = [(name, arg) for name, arg in calls if (name, arg) != ("vllm.py", "'vllm.codeferry'")]
    assert calls and all(arg == "__name__" for _, arg in calls), calls
    assert _scheduler.logger.name == "codeferry._exec.scheduler"
    parent = logging.getLogger("codeferry")  # configuring it configures every module's logger
    assert _scheduler.logger.parent is parent


def test_a_class_transformers_refuses_to_register_is_a_warning(tmp_path: Path) -> None:
    """A head whose ``config_class`` is another config: load returns it, Auto classes cannot."""
    path = write_model(tmp_path / "refusy", ModelSpec(name="refusy"))
    modeling = path / "modeling_refusy.py"
    modeling.write_text(modeling.read_text() + (
        "\n\nclass OtherConfig(RefusyConfig):\n    model_type = 'other'\n\n\n"
        "RefusyModel.config_class = OtherConfig\n"))
    with pytest.warns(RuntimeWarning, match="transformers refused to register") as caught:
        result = codeferry.load(path, trust_remote_code=True)
    assert "AutoModel" in result and result["AutoModel"].__name__ == "RefusyModel"
    assert any("AutoModel.from_pretrained will load its code through transformers"
               in str(w.message) for w in caught)


def test_no_flock_is_a_warning(tmp_path: Path) -> None:
    """Where fcntl is missing (Windows), the private copies cannot be swept: said, not silent."""
    code = (
        "import sys, warnings\n"
        "sys.modules['fcntl'] = None  # this interpreter has no fcntl, as on Windows\n"
        "from pathlib import Path\n"
        "from codeferry._runtime import private as _private\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    _private._hold_alive(Path({str(tmp_path)!r}))\n"
        "print([(w.category.__name__, str(w.message)) for w in caught])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" in proc.stdout and "no fcntl.flock" in proc.stdout
    assert "not removed" in proc.stdout


# -- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("setting", [None, "CODEFERRY_DEBUG=1", "HF_DEBUG=1", "HF_DEBUG=true",
                                     "HF_DEBUG=0", "--debug"])
def test_debug_variables_show_tracebacks_like_debug(
    setting: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in _settings.DEBUG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    argv = ["inspect", str(tmp_path / "missing")]
    if setting == "--debug":
        argv.append("--debug")
    elif setting is not None:
        name, value = setting.split("=")
        monkeypatch.setenv(name, value)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    shown = setting not in (None, "HF_DEBUG=0")
    assert ("Traceback (most recent call last)" in err) is shown
    assert err.rstrip("\n").splitlines()[-1].startswith("codeferry: error: ")
    assert "ModelNotFoundError" in err if shown else err.count("\n") == 1


def test_python_dash_m_codeferry_and_the_version() -> None:
    """One version: pyproject's, through the metadata, in ``__version__`` and ``--version``."""
    assert codeferry.__version__ == importlib.metadata.version("codeferry") == PYPROJECT_VERSION
    proc = subprocess.run([sys.executable, "-m", "codeferry", "--version"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert (proc.returncode, proc.stdout) == (0, f"codeferry {PYPROJECT_VERSION}\n")
    assert cli.main.__module__ == "codeferry.cli"
    proc = subprocess.run([sys.executable, "-m", "codeferry", "inspect"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and f"model    {SRC / 'demo'}\n" in proc.stdout  # the demo
    init = (SRC / "__init__.py").read_text()
    assert not re.search(r"__version__\s*=\s*['\"]", init)  # not written a second time


def test_an_uninstalled_source_tree_reads_its_pyproject(tmp_path: Path) -> None:
    """No metadata (a source tree on ``sys.path``, nothing installed): pyproject.toml it is."""
    tree = tmp_path / "tree"
    (tree / "src" / "codeferry").mkdir(parents=True)
    (tree / "src" / "codeferry" / "_version.py").write_bytes((SRC / "_version.py").read_bytes())
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "codeferry"\n'
        'version = "9.8.7"\n\n[tool.other]\nversion = "1.0"\n')
    # -S: no site-packages, so no installed codeferry whose metadata would answer first
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('v', {str(tree / 'src' / 'codeferry' / '_version.py')!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "print(module.package_version())\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (proc.returncode, proc.stdout) == (0, "9.8.7\n"), proc.stderr
    assert _version.from_pyproject(tree / "pyproject.toml") == "9.8.7"
    assert _version.from_pyproject(tmp_path / "absent.toml") is None
    (tree / "pyproject.toml").write_text('[tool.other]\nversion = "1.0"\n')
    assert _version.from_pyproject(tree / "pyproject.toml") is None


def test_test_files_have_unique_names() -> None:
    """The test folders are not packages: pytest imports each file by its base name, so two
    ``test_x.py`` in different folders collide ("import file mismatch") and one never runs."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_benchmarks_name_modules_and_files_the_package_has() -> None:
    """A benchmark is run by hand, long after the code it imports has moved: every
    ``codeferry`` module it imports and every ``src/codeferry/...py`` it reads must exist."""
    import importlib.util

    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and not node.level else [])
            for name in names:
                if name.split(".")[0] == "codeferry" and importlib.util.find_spec(name) is None:
                    missing.append(f"{path.name}: import {name}")
        for file in re.findall(r"src/codeferry/[\w/]+\.py", text):
            if not (ROOT / file).is_file():
                missing.append(f"{path.name}: {file}")
    assert missing == []
