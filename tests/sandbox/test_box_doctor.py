"""``codeferry doctor --sandbox``: each worker loads the model's code in the box, and says what
the box refused; the doctor's own process loads it outside (as without the box)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _hostile import plant_home, write_hostile


def _doctor(model: Path, home: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "codeferry", "doctor", str(model),
                           "--trust-remote-code", "--workers", "1", "--json", *flags],
                          capture_output=True, text=True, timeout=300, cwd=home,
                          env={**os.environ, "HOME": str(home)})


def test_a_worker_in_the_box_reports_the_refusal(tmp_path: Path) -> None:
    """The model reads the planted key at import: the boxed worker's report is the box's
    typed error naming the file; unboxed, the same doctor passes."""
    home = plant_home(tmp_path / "home")
    model = write_hostile(tmp_path / "models", home)
    (model / "control").write_text("import ssh_key 0")
    boxed = _doctor(model, home, "--sandbox")
    assert boxed.returncode == 1, boxed.stderr
    assert "SandboxRefusedError" in boxed.stdout and ".ssh/id_rsa" in boxed.stdout
    plain = _doctor(model, home)
    assert plain.returncode == 0, plain.stdout + plain.stderr
