"""``codeferry run`` into outputs that are not regular files: a pipe, ``/dev/stdout``, a
named pipe, a character device. They are written straight through (nothing to resume,
and reading one would wait forever)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

# Workers forked from this process start in about a second with these imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401

from codeferry import cli
from codeferry._commands.run import run

DEMO = Path(cli._demo())
PROMPTS = DEMO / "prompts.txt"
N_PROMPTS = 8


def _cli(output: str) -> list[str]:
    return [sys.executable, "-m", "codeferry.cli", "run", str(DEMO), "--input", str(PROMPTS),
            "--output", output, "--workers", "1", "--start-method", "fork"]


def _rows(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_output_dev_stdout_into_a_pipe_is_written_through() -> None:
    """``codeferry run ... --output /dev/stdout | cat`` used to wait forever."""
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    # capture_output: stdout (and so /dev/stdout) is a real pipe, as in `| cat`.
    proc = subprocess.run(_cli("/dev/stdout"), capture_output=True, stdin=subprocess.DEVNULL,
                          text=True, timeout=90, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    assert [row["id"] for row in rows] == list(range(1, N_PROMPTS + 1))
    assert all(isinstance(row["output"], str) for row in rows)


def test_named_pipe_is_written_through(tmp_path: Path) -> None:
    """In a child with a time limit: the old code waited forever on the pipe."""
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as handle:
            got.append(handle.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    try:
        proc = subprocess.run(_cli(str(fifo)), capture_output=True, text=True, timeout=90,
                              env=env, check=False, stdin=subprocess.DEVNULL)
    finally:
        if reader.is_alive():  # unblock the reader whatever happened
            with open(fifo, "wb"):
                pass
    reader.join(30)
    assert proc.returncode == 0, proc.stderr
    assert [row["id"] for row in _rows(got[0].decode("utf-8"))] == list(range(1, N_PROMPTS + 1))
    assert fifo.is_fifo()  # left as it was


def test_character_device_is_written_through() -> None:
    """/dev/null: written, never read back, truncated, fsync'd (EINVAL) or removed."""
    result = run(DEMO, PROMPTS, "/dev/null", workers=1, start_method="fork")
    assert result.written == N_PROMPTS and result.complete
    assert Path("/dev/null").is_char_device()
