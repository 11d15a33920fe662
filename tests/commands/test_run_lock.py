"""The output lock of ``codeferry run``: an ``flock`` of the output file itself (its inode),
so every name of the file shares it, whatever each run's ``CODEFERRY_HOME``; typed errors
that name the run holding it.

The holder is a real second process running codeferry's own output sink; the runs that
are refused never start a worker (the lock is taken before), so these tests stay fast.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from codeferry import cli, errors
from codeferry._commands import outlock
from codeferry._commands.run import lock_path, run
from codeferry.errors import OutputError, OutputLockError

DEMO = Path(cli._demo())
PROMPTS = DEMO / "prompts.txt"

# A second process that opens OUTPUT the way a run does (lock, read, resume state), says
# "held", and keeps it until its stdin closes; with "fork-and-die" it first forks a child
# that sleeps on, then dies without releasing anything, as a killed run would.
HOLDER = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from pathlib import Path
    from codeferry._commands.inputs import read_inputs
    from codeferry._commands.output import Sink as _Sink

    sink = _Sink(Path(sys.argv[1]), sys.stdout)
    sink.open(read_inputs(sys.argv[2]), "generate")
    if sys.argv[3] == "fork-and-die":
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        print(child.pid, flush=True)
        os._exit(0)
    print("held", flush=True)
    sys.stdin.read()
""")


def _holder(output: Path, mode: str = "hold") -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(output), str(PROMPTS), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    return proc


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The process writing ``out.jsonl`` (holding its lock)."""
    output = tmp_path / "out.jsonl"
    proc = _holder(output)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


@pytest.fixture
def held(tmp_path: Path, holder: subprocess.Popen[str]) -> Path:
    """An output file another process is writing (holding its lock)."""
    return tmp_path / "out.jsonl"


def test_an_output_another_run_writes_is_refused(
    held: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(OutputLockError) as info:
        run(DEMO, PROMPTS, held, workers=1, start_method="fork")
    assert info.value.held and info.value.lock_path == str(held)
    assert isinstance(info.value, OutputError) and info.value.fix
    assert info.value.path == str(held) and "another codeferry run" in str(info.value)
    # on the command line: one line, exit 1, the output left as the other run has it
    code = cli.main(["run", str(DEMO), "--input", str(PROMPTS), "--output", str(held)])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.startswith("codeferry: error: ") and err.count("\n") == 1
    assert "being written by another codeferry run" in err
    assert held.read_bytes() == b""


def test_a_link_to_an_output_another_run_writes_is_refused(held: Path) -> None:
    """One file under two names is one output: the lock follows links."""
    link = held.with_name("link.jsonl")
    link.symlink_to(held.name)
    with pytest.raises(OutputLockError) as info:
        run(DEMO, PROMPTS, link, workers=1, start_method="fork")
    assert info.value.held and info.value.lock_path == str(link)


def test_a_hard_link_to_an_output_another_run_writes_is_refused(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    """A hard link is the same file under a name no link resolution finds: the lock of a
    path let two runs write one output (every id twice). The error names the holder."""
    held = tmp_path / "out.jsonl"
    hard = tmp_path / "elsewhere" / "hard.jsonl"
    hard.parent.mkdir()
    os.link(held, hard)
    with pytest.raises(OutputLockError) as info:
        run(DEMO, PROMPTS, hard, workers=1, start_method="fork")
    assert held.read_bytes() == b""  # nothing written through the second name
    assert isinstance(info.value, errors.OutputHeldError) and info.value.held
    assert lock_path(held) == lock_path(hard)  # where the holder's note is: one for both
    assert info.value.holder["pid"] == holder.pid
    assert info.value.holder["output"] == str(held)
    assert f"pid {holder.pid} " in info.value.message and str(held) in info.value.message
    # nothing of the lock lives in the user's folders
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["elsewhere", "hard.jsonl", "out.jsonl"]


def test_an_output_on_a_file_system_without_locks_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is the file's own: a file system that takes no ``flock`` (some network ones)
    refuses the run, typed, before anything is read or written."""
    output = tmp_path / "out.jsonl"
    output.touch()

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(outlock.fcntl, "flock", no_locks)
    with pytest.raises(OutputLockError) as info:
        run(DEMO, PROMPTS, output, workers=1, start_method="fork")
    assert not info.value.held and info.value.lock_path == str(output)
    assert "file locks" in info.value.message and info.value.fix
    assert output.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_run_with_another_home_is_refused(
        tmp_path: Path, holder: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs on one output with different homes (two shells, cron, sudo with another
    HOME): the lock under the home let both write. The lock is the file's: the second is
    refused, and still names the holder (from the kernel's table of locks)."""
    held = tmp_path / "out.jsonl"
    monkeypatch.setenv("CODEFERRY_HOME", str(tmp_path / "another-home"))
    with pytest.raises(errors.OutputHeldError) as info:
        run(DEMO, PROMPTS, held, workers=1, start_method="fork")
    assert held.read_bytes() == b""
    assert info.value.holder["pid"] == holder.pid
    assert f"pid {holder.pid} " in info.value.message and " since " in info.value.message
    assert str(held) in info.value.message and "-c" in info.value.message  # its command


def test_two_runs_with_different_homes_write_each_id_once(tmp_path: Path) -> None:
    """Two real ``codeferry run`` processes on one output, each with its own home: the second
    is refused (exit 1, the typed error), the first writes every id once."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"prompt number {n}\n" for n in range(50)))
    output = tmp_path / "out.jsonl"

    def start(home: str) -> subprocess.Popen[str]:
        env = {**os.environ, "CODEFERRY_HOME": str(tmp_path / home)}
        return subprocess.Popen(
            [sys.executable, "-m", "codeferry", "run", str(DEMO), "--input", str(source),
             "--output", str(output), "--workers", "1", "--start-method", "fork",
             "--max-new-tokens", "24"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)

    first = start("home-a")
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "home-a" / "run-locks").glob("*.json")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = start("home-b")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1, err
        assert "being written by another codeferry run" in err and f"pid {first.pid} " in err
        assert first.wait(300) == 0, first.communicate()
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert ids == list(range(1, 51))


def test_a_forked_child_does_not_keep_the_lock_of_a_dead_run(tmp_path: Path) -> None:
    """A run killed while a forked worker lives on: the next run gets the lock at once."""
    output = tmp_path / "out.jsonl"
    proc = _holder(output, "fork-and-die")
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.wait(30)
    proc.stdout.close()
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        os.kill(child, 0)  # the forked child still lives
        again = _holder(output)
        assert again.stdout is not None and again.stdout.readline() == "held\n"
        assert again.stdin is not None
        again.stdin.close()
        again.wait(30)
        again.stdout.close()
    finally:
        os.kill(child, signal.SIGKILL)
