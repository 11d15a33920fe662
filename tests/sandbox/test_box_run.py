"""``codeferry run --sandbox`` on a hostile model: the refusal is that input's answer (an error
line naming what was refused), not a fault that stops the run; the other inputs answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _hostile import plant_home, write_hostile


def test_a_refusal_in_forward_is_the_inputs_error_line(tmp_path: Path) -> None:
    home = plant_home(tmp_path / "home")
    model = write_hostile(tmp_path / "models", home)
    (model / "control").write_text("forward ssh_key 0")
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("abc\nhello\n")
    done = subprocess.run(
        [sys.executable, "-m", "codeferry", "run", str(model), "--trust-remote-code",
         "--sandbox", "--workers", "1", "--max-new-tokens", "2", "--input", str(inputs)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HOME": str(home)})
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 1, done.stderr  # inputs failed; the run itself did not stop
    assert [line["id"] for line in lines] == [1, 2]
    for line in lines:
        text = json.dumps(line)
        assert "SandboxRefusedError" in text and ".ssh/id_rsa" in text, text
