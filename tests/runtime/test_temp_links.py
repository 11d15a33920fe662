"""The temporary folder of private copies passes the rule ``CODEFERRY_HOME`` passes: a link on
its path that another user owns, or that leads to a folder of another user, is refused alike.

Whoever owns a link can point it elsewhere later (in a sticky folder such as /tmp too): the
private copy's files (``vocab.json``, a model's JSON tables), read through the link after they
were checked, would then be theirs. A process runs with ``TMPDIR`` (or ``CODEFERRY_HOME``) at,
or below, such a link, and says what it was refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OTHER = 65534  # nobody: a uid that is neither ours nor root's

#: Makes a private copy (``TMPDIR``) or a store entry (``CODEFERRY_HOME``); says the refusal.
CHILD = r"""
import json, sys
from codeferry._code.digest import unit_digest
from codeferry._runtime import loader, store
from codeferry.errors import CodeferryError
files = {"m.py": b"X = 1\n", "vocab.json": b"{}"}
unit = store.Unit(unit_digest(files), files, ("m",), frozenset(), "links")
try:
    loader.verified_dir(unit) if sys.argv[1] == "TMPDIR" else store.write_unit(unit)
    print(json.dumps(None))
except CodeferryError as exc:
    print(json.dumps({"type": type(exc).__name__, "path": exc.path, "owner": exc.owner}))
"""


def _refusal(variable: str, value: Path, tmp_path: Path) -> object:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "TMPDIR": str(tmp_path / "temp"), "CODEFERRY_HOME": str(tmp_path / "store"),
           variable: str(value)}
    proc = subprocess.run([sys.executable, "-c", CHILD, variable], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give a link to another uid")
@pytest.mark.parametrize("place", ["folder", "above"])
@pytest.mark.parametrize("owned", ["link", "target"])
def test_a_link_of_another_user_is_refused_for_tmpdir_as_for_codeferry_home(
    tmp_path: Path, owned: str, place: str
) -> None:
    (tmp_path / "temp").mkdir(mode=0o700)
    target = tmp_path / "target"
    (target / "inside").mkdir(parents=True, mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    if owned == "link":
        os.lchown(link, OTHER, OTHER)
        offender = link
    else:
        os.chown(target, OTHER, OTHER)
        target.chmod(0o755)
        offender = target
    value = link if place == "folder" else link / "inside"
    tmpdir = _refusal("TMPDIR", value, tmp_path)
    home = _refusal("CODEFERRY_HOME", value, tmp_path)
    expected = {"type": "StorePermissionError", "path": str(offender), "owner": OTHER}
    assert (tmpdir, home) == (expected, expected)
    assert list(target.rglob("codeferry-private-*")) == []  # nothing was written there
