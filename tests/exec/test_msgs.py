"""Messages that lead somewhere: every mistake below used to end in an exit code, a silent
fallback or a command that would make things worse; each now fails typed, saying what to do.

Real components throughout: real forkserver/spawn/fork workers, real script files run by a
real ``python``, the real CLI, real lock files.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _helpers import run_cli

import codeferry
from codeferry._code.lockfile import Lock
from codeferry.cli import main
from codeferry.errors import DeviceError, LockMismatchError, MainGuardError
from codeferry.testing import ModelSpec, write_model

pytestmark = pytest.mark.usefixtures("no_progress_bars")

DEMO = str(Path(codeferry.__file__).with_name("demo"))


# -- forkserver workers ---------------------------------------------------------------------


def test_run_with_forkserver_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The worker's parent watch took the fork server for a dead executor: exit code 0.
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\nworld\n")
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", DEMO, "--input", str(prompts), "-o", str(output),
                           "--start-method", "forkserver", "--workers", "1")
    assert code == 0, err
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["id"] for row in rows] == [1, 2] and all("output" in row for row in rows)


# -- devices --------------------------------------------------------------------------------


def _unusable_devices() -> list[str]:
    bad = ["gpu", "CUDA", "cuda:x", "cuda:-1", "meta", "opengl",
           f"cuda:{torch.cuda.device_count()}"]  # one past the last GPU; cuda:0 without CUDA
    if not torch.cuda.is_available():
        bad.append("cuda")
    if not torch.backends.mps.is_available():
        bad.append("mps")
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        bad += ["xpu", "xpu:0"]
    return bad


@pytest.mark.parametrize("device", _unusable_devices())
def test_an_unusable_device_is_refused_before_any_worker_starts(device: str) -> None:
    started = time.monotonic()
    before = set(mp.active_children())  # a warm executor's zygote may outlive its test
    with pytest.raises(DeviceError) as info:
        codeferry.Executor(DEMO, workers=1, start_method="spawn", device=device)
    assert time.monotonic() - started < 5  # no worker was started and waited for
    assert set(mp.active_children()) <= before
    err = info.value
    assert err.device == device and repr(device) in str(err) and "cpu" in (err.fix or "")
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.device, str(again)) == (DeviceError, device, str(err))


def test_the_cli_refuses_an_unusable_device_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out.jsonl"
    device = f"cuda:{torch.cuda.device_count()}"
    code, out, err = run_cli(capsys, "run", "-o", str(output), "--device", device)
    assert (code, out) == (2, "")
    assert err.startswith("codeferry: error: device ") and err.count("\n") == 1
    assert "Traceback" not in err and not output.exists()
    code, _, err = run_cli(capsys, "run", "-o", str(output), "--device", "gpu")
    assert code == 2 and "'gpu' is not a device string torch knows" in err


# -- a worker's traceback in the CLI --------------------------------------------------------


def test_the_cli_shows_the_last_frames_of_the_workers_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_model(tmp_path / "noisy", ModelSpec(name="noisy", tokenizer=True))
    modeling = path / "modeling_noisy.py"
    modeling.write_text(modeling.read_text() + textwrap.dedent("""
        import multiprocessing


        def _probe_the_gpu():
            raise AssertionError("Torch not compiled with CUDA enabled (from the test)")


        if multiprocessing.parent_process():
            _probe_the_gpu()
        """))
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\n")
    code, out, err = run_cli(capsys, "run", str(path), "--input", str(prompts), "--trust-remote-code",
                             "--start-method", "fork", "--workers", "1", "-o", str(tmp_path / "o"))
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[0].startswith("codeferry: the worker's traceback")
    assert any("modeling_noisy.py" in line and "_probe_the_gpu" in line for line in lines)
    assert "AssertionError: Torch not compiled with CUDA enabled (from the test)" in lines
    # the error, then (no worker could start: the machine's fault) the command that resumes
    assert lines[-2].startswith("codeferry: error: worker 0 could not start")
    assert lines[-1].startswith("codeferry: to resume, run: codeferry run ")
    assert sum(line.startswith('  File "') for line in lines) <= 3  # the last frames only
    # --debug prints the whole chain instead (the worker's traceback included), once.
    code, _, err = run_cli(capsys, "run", str(path), "--input", str(prompts), "--trust-remote-code",
                           "--start-method", "fork", "--workers", "1", "-o", str(tmp_path / "o"),
                           "--debug")
    assert code == 1 and "the worker's traceback" not in err and "_probe_the_gpu" in err


# -- a lock of another model ----------------------------------------------------------------


def test_a_lock_of_another_model_is_named_and_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = write_model(tmp_path / "one", ModelSpec(name="one"))
    two = write_model(tmp_path / "two", ModelSpec(name="two"))
    lockfile = tmp_path / "locks" / "one.lock"
    assert run_cli(capsys, "lock", str(one), "-o", str(lockfile))[0] == 0
    (tmp_path / "locks" / "two.lock").write_text("taken\n")  # the obvious name is taken

    code, out, _ = run_cli(capsys, "verify", str(two), "--lock", str(lockfile))
    assert code == 1
    advice = out.splitlines()[-1]
    assert "lock of another model (one)" in advice
    suggested = advice.rsplit(" -o ", 1)[1]
    assert suggested == str(tmp_path / "locks" / "two-2.lock")
    assert f"-o {lockfile}" not in out

    with pytest.raises(LockMismatchError) as info:
        codeferry.load(two, lock=lockfile)
    err = info.value
    assert "lock of another model: one" in str(err) and err.diff is not None
    assert f"-o {lockfile}" not in (err.fix or "") and suggested in (err.fix or "")

    # Following the advice works and leaves the first lock alone.
    before = lockfile.read_bytes()
    assert run_cli(capsys, "lock", str(two), "-o", suggested)[0] == 0
    assert run_cli(capsys, "verify", str(two), "--lock", suggested)[0] == 0
    assert lockfile.read_bytes() == before

    # The same model, changed: re-locking into the same file is still the advice.
    (one / "modeling_one.py").write_text((one / "modeling_one.py").read_text() + "\n# changed\n")
    code, out, _ = run_cli(capsys, "verify", str(one), "--lock", str(lockfile))
    assert code == 1 and out.splitlines()[-1].endswith(f"-o {lockfile}")
    assert "another model" not in out
    assert Lock.loads(before.decode()).is_for(codeferry.resolve(one))


# -- MODEL defaults to the demo in every command --------------------------------------------


def test_every_command_defaults_to_the_bundled_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lockfile = tmp_path / "demo.lock"
    assert run_cli(capsys, "lock", "-o", str(lockfile))[0] == 0
    code, out, _ = run_cli(capsys, "verify", "--lock", str(lockfile))
    assert code == 0 and out.startswith(f"ok: {DEMO} matches")
    code, out, _ = run_cli(capsys, "audit", "--json")
    assert code == 0 and json.loads(out)["model"] == DEMO
    code, out, err = run_cli(capsys, "doctor", "--workers", "1", "--start-method", "fork", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and len(report["workers"]) == 1
    for command in ("inspect", "lock", "verify", "audit", "doctor", "run"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "(default: the bundled demo" in " ".join(capsys.readouterr().out.split())


# -- the __main__ guard ---------------------------------------------------------------------


UNGUARDED = """\
import codeferry

{start}
print("started")
"""

STARTS = {
    "spawn": "codeferry.Executor({demo!r}, workers=1, start_method='spawn', trust_remote_code=True)",
    "forkserver": "codeferry.Executor({demo!r}, workers=1, start_method='forkserver', "
                  "trust_remote_code=True)",
    "warm": "codeferry.Executor({demo!r}, workers=1, start_method='fork', warm=True, "
            "trust_remote_code=True)",  # fork workers, but from a spawned zygote
    "doctor": "__import__('codeferry._commands.doctor', fromlist=['doctor']).doctor({demo!r}, trust_remote_code=True, "
              "workers=1, start_method='spawn')",
}

GUARDED = """\
import codeferry


def main():
    with codeferry.Executor({demo!r}, workers=1, start_method={method!r},
                        trust_remote_code=True) as ex:
        print("generated", len(ex.generate(["hi"])))


if __name__ == "__main__":
    main()
"""

# A child of the script's own spawned process imports the script again, and the unguarded
# line starts an executor in that child only: refused there, while bootstrapping.
IN_THE_CHILD = """\
import multiprocessing
import sys

import codeferry

if multiprocessing.current_process().name != "MainProcess":  # set first while bootstrapping
    codeferry.Executor({demo!r}, workers=1, start_method={method!r},
                        trust_remote_code=True)


def nothing():
    pass


if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=nothing)
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


def run_script(tmp_path: Path, template: str, method: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(template.format(demo=DEMO, method=method))
    env = {**os.environ, "PYTHONPATH": str(Path(codeferry.__file__).parents[1])}  # this checkout
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)


@pytest.mark.parametrize("how", list(STARTS))
def test_an_unguarded_script_is_told_to_add_the_main_guard(tmp_path: Path, how: str) -> None:
    done = run_script(tmp_path, UNGUARDED.replace("{start}", STARTS[how]), "spawn")
    assert done.returncode == 1 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("codeferry.errors.MainGuardError: ")
    assert f"{tmp_path / 'job.py'}:3: " in last  # the unguarded line
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping" in last and "died with exit code" not in done.stderr


def test_a_script_read_from_standard_input_is_told_to_be_a_file(tmp_path: Path) -> None:
    """``python - < job.py``: spawned workers import the main script again from its file,
    and ``<stdin>`` is none; said before any worker starts, not as each one's death."""
    env = {**os.environ, "PYTHONPATH": str(Path(codeferry.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-"], input=GUARDED.format(demo=DEMO, method="spawn"),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 1 and "generated" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("codeferry.errors.MainGuardError: the main script was read from "
                           "<stdin>"), done.stderr[-2000:]
    assert "save the script to a file" in last and "died with exit code" not in done.stderr


def test_an_unguarded_import_in_the_child_is_refused_there(tmp_path: Path) -> None:
    done = run_script(tmp_path, IN_THE_CHILD, "spawn")
    assert done.returncode == 1
    assert "codeferry.errors.MainGuardError: this process is a worker importing the main " \
        "script" in done.stderr


def test_a_guarded_script_runs(tmp_path: Path) -> None:
    done = run_script(tmp_path, GUARDED, "spawn")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "generated 1"


def test_main_guard_error_survives_pickling() -> None:
    err = MainGuardError("m", path="job.py", line=3, fix="f")
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.path, again.line, str(again)) == (MainGuardError, "job.py", 3, str(err))
