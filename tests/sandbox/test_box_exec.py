"""``codeferry exec --sandbox -- python script.py``: the box holds the command and all it
starts, the user's own code and the model's alike; without ``--sandbox`` the same script
does everything it tries (so the test bites). Real processes, the real kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _hostile import ATTEMPTS, names, write_script, write_uncaught


def _exec(flags: list[str], command: list[str], cwd: Path, home: Path,
          **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "HOME": str(home), "HF_TOKEN": "hf_parent_secret", **env}
    return subprocess.run([sys.executable, "-m", "codeferry", "exec", *flags,
                           "--trust-remote-code", "--", *command], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def test_every_attempt_of_the_command_is_refused(tmp_path: Path, home: Path, hostile: Path,
                                                 port: int) -> None:
    """Each attempt of the script fails with the kernel's refusal (``EACCES``/``EPERM``);
    the credential is gone from the environment; the home is as it was."""
    script = write_script(tmp_path, home, hostile)
    done = _exec(["--sandbox"], [sys.executable, str(script), str(port), *ATTEMPTS], tmp_path,
                 home)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found.pop("env_token") == ["KeyError", None]
    assert found == {a: ["PermissionError", 1 if a == "signal_parent" else 13]
                     for a in ATTEMPTS if a != "env_token"}
    assert (home / ".bashrc").read_text() == "# the user's\n"
    assert not (hostile / "planted.txt").exists()


def test_without_the_box_the_command_does_it_all(tmp_path: Path, home: Path, hostile: Path,
                                                 port: int) -> None:
    script = write_script(tmp_path, home, hostile)
    try:
        done = _exec([], [sys.executable, str(script), str(port), *ATTEMPTS], tmp_path, home)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1]) == dict.fromkeys(ATTEMPTS, "ok")
        assert "echo owned" in (home / ".bashrc").read_text()
    finally:
        (home / ".bashrc").write_text("# the user's\n")
        (hostile / "planted.txt").unlink(missing_ok=True)


LOADS = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
tokens = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)("abc", return_tensors="pt")
try:
    model(**tokens)
except PermissionError as exc:
    print("refused", exc.filename)
"""


def test_the_models_code_under_exec_is_boxed(tmp_path: Path, home: Path, hostile: Path,
                                              port: int) -> None:
    """A model loaded by the command (its folder allowed by ``CODEFERRY_SANDBOX_READ``) runs
    boxed: its forward cannot read the planted key."""
    script = tmp_path / "loads.py"
    script.write_text(LOADS)
    (hostile / "control").write_text(f"forward ssh_key {port}")
    try:
        done = _exec(["--sandbox"], [sys.executable, str(script), str(hostile)], tmp_path, home,
                     CODEFERRY_SANDBOX_READ=str(hostile))
    finally:
        (hostile / "control").unlink()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"refused {home}/.ssh/id_rsa"


def test_a_kernel_without_landlock_runs_nothing(tmp_path: Path, home: Path) -> None:
    """``CODEFERRY_SANDBOX_LANDLOCK=0``: the typed refusal, the kernel's facts and the fix,
    and the command never ran."""
    ran = tmp_path / "ran"
    done = _exec(["--sandbox"], [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], tmp_path,
                 home, CODEFERRY_SANDBOX_LANDLOCK="0")
    assert done.returncode != 0
    assert "SandboxUnavailableError" in done.stderr or "sandbox cannot be built" in done.stderr
    assert os.uname().release in done.stderr and "Fix:" in done.stderr
    assert not ran.exists()


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_an_uncaught_refusal_is_told_typed(tmp_path: Path, home: Path, hostile: Path,
                                           port: int, attempt: str) -> None:
    """The boot of each boxed process tells a refusal nobody caught as
    ``SandboxRefusedError``, naming the operation and the path or address."""
    script = write_uncaught(tmp_path, home, hostile)
    done = _exec(["--sandbox"], [sys.executable, str(script), str(port), attempt], tmp_path,
                 home)
    assert done.returncode == 1
    told = done.stderr.strip().splitlines()[-1]
    assert told.startswith("codeferry.errors.SandboxRefusedError: "), told
    assert names(told, attempt), told


def test_print_env_refuses_the_box(tmp_path: Path, home: Path) -> None:
    """Variables cannot carry the box: ``--print-env --sandbox`` is refused, not printed as if
    it boxed what runs them."""
    done = _exec(["--sandbox", "--print-env"], [], tmp_path, home)
    assert done.returncode == 2 and "--sandbox" in done.stderr and not done.stdout


def test_a_child_reading_its_own_proc_files_is_told_why(tmp_path: Path, home: Path) -> None:
    """The command reads its own ``/proc`` files (the box named them when it was made); a
    process it starts cannot, and the refusal says why and what boxes such programs."""
    child = "open('/proc/self/status').read()"
    parent = (f"import subprocess, sys; open('/proc/self/status').read(); "
              f"sys.exit(subprocess.run([sys.executable, '-c', {child!r}]).returncode)")
    done = _exec(["--sandbox"], [sys.executable, "-c", parent], tmp_path, home)
    assert done.returncode == 1
    told = done.stderr.strip().splitlines()[-1]
    assert told.startswith("codeferry.errors.SandboxRefusedError: "), told
    assert "/status" in told and "cannot read its own /proc files" in told, told
    assert "Executor(sandbox=True)" in told
