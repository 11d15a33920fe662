"""``codeferry audit`` names, before anything runs, every attempt of the hostile model that the
box refuses at run time (``ATTEMPTS``, which the other tests of this folder try in the box),
at its file and line, marked as refused under ``--sandbox``; the model's benign reads (its
control file, which the box lets it read, and its tokenizer's vocabulary) are not findings.
Static: no kernel feature is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import run_cli
from _hostile import ATTEMPTS

from codeferry._code.audit.report import audit

#: Attempt -> (category, the code that makes it, as written in ``_hostile.ATTEMPT``).
STATIC = {
    "ssh_key": ("file-read", 'open(_HOME + "/.ssh/id_rsa")'),
    "hub_token": ("file-read", 'open(_HOME + "/.cache/huggingface/token")'),
    "env_token": ("environment", '_os.environ["HF_TOKEN"]'),
    "connect_local": ("network", '_socket.create_connection(("127.0.0.1", port), timeout=5)'),
    "connect_metadata": ("network", "_socket.socket()"),
    "udp": ("network", "_socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)"),
    "write_bashrc": ("file-write", 'open(_HOME + "/.bashrc", "a")'),
    "write_model": ("file-write", 'open(_MODEL + "/planted.txt", "w")'),
    "shell": ("process", '_subprocess.run(["sh", "-c", "true"], check=True)'),
    "signal_parent": ("process", "_os.kill(_os.getppid(), 0)"),
}


def _place(text: str, code: str) -> tuple[int, int]:
    """(line, column) of the one place ``code`` is written in ``text``, 1-based."""
    places = [
        (n, line.index(code) + 1) for n, line in enumerate(text.splitlines(), 1) if code in line
    ]
    assert len(places) == 1, (code, places)
    return places[0]


@pytest.fixture(scope="module")
def expected(hostile: Path) -> set[tuple[str, int, int, str]]:
    text = (hostile / "modeling_hostile.py").read_text(encoding="utf-8")
    return {
        ("modeling_hostile.py", *_place(text, code), category) for category, code in STATIC.values()
    }


def test_every_attempt_the_box_refuses_is_named_statically(
    hostile: Path, home: Path, expected: set[tuple[str, int, int, str]]
) -> None:
    assert set(STATIC) == set(ATTEMPTS)  # a new attempt needs its static finding here
    report = audit(hostile)
    found = {(f.path, f.line, f.col, f.category) for f in report.findings}
    assert found == expected  # and nothing else: not the control file, not the vocabulary
    assert all(f.refused for f in report.findings)
    reads = {f.reason for f in report.findings if f.category == "file-read"}
    assert reads == {
        f"reads {home}/.ssh/id_rsa, outside the model's folder (builtins.open)",
        f"reads {home}/.cache/huggingface/token, outside the model's folder (builtins.open)",
    }


def test_the_command_marks_each_refusal(
    hostile: Path, expected: set[tuple[str, int, int, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "audit", str(hostile))
    assert code == 0
    lines = out.splitlines()
    assert f"sandbox  {len(expected)} refused under --sandbox" in out
    for path, line, col, _category in expected:
        at = lines.index(next(s for s in lines if s.startswith(f"  {path}:{line}:{col}: ")))
        assert lines[at + 2].startswith("      under --sandbox: refused"), lines[at : at + 3]
    code, out, _ = run_cli(capsys, "audit", str(hostile), "--json", "--fail-on", "file-read")
    assert code == 1
    data = json.loads(out)
    assert {(f["file"], f["line"], f["col"], f["category"]) for f in data["findings"]} == expected
    assert all(f["sandbox"].startswith("refused") for f in data["findings"])
