"""The public API is a short explicit list; every error is typed, catchable and picklable."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from _helpers import ROOT

import codeferry
from codeferry import errors


def test_public_api_is_pinned() -> None:
    assert sorted(codeferry.__all__) == sorted([
        "Bundle", "Completion", "Executor", "GenerateResult", "LoadResult", "Lock", "Outcome",
        "Request", "RunResult", "SamplingParams", "errors", "install", "load", "read_lock", "resolve",
        "run", "uninstall", "__version__",
    ])
    for name in codeferry.__all__:
        assert hasattr(codeferry, name)


@pytest.mark.parametrize("name", [n for n in errors.__all__ if n != "RemoteTraceback"])
def test_every_error_is_typed_and_survives_pickling(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.CodeferryError)
    # each error also is the builtin a caller would already catch
    builtins = [b for b in cls.__mro__
                if b.__module__ == "builtins" and b not in (object, BaseException, Exception)]
    assert cls is errors.CodeferryError or builtins
    err = cls("what went wrong.", path="/m/config.json", line=3, fix="do this.")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is cls and str(again) == str(err) == (
        "/m/config.json:3: what went wrong. Fix: do this.")


def test_mypy_strict_and_ruff_are_clean() -> None:
    mypy = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert mypy.returncode == 0, mypy.stdout[-3000:]
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"],
                          cwd=ROOT, capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout[-3000:]
