"""``codeferry exec --sandbox -- torchrun``: the ranks meet through gloo in the box's private
network, and each rank's every hostile attempt is refused and told typed; without
``--sandbox`` the same ranks do everything they try (so the test bites). One torchrun of
2 ranks per run, each rank importing torch once; real processes, the real kernel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _hostile import ATTEMPT, ATTEMPTS, names

from codeferry._sandbox.box import is_launcher

TORCHRUN = Path(sys.executable).parent / "torchrun"
RANKS = 2

#: Each rank: gloo's init and an all_reduce, then every attempt (``argv``: the host's listening
#: port, the process outside the box to signal); one line ``RANK<n> {json}``, each attempt
#: "ok" or the last line ``sys.excepthook`` prints for its error (what an uncaught one shows).
RANK = ATTEMPT + '''

import contextlib as _contextlib
import io as _io
import json as _json
import sys as _sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
_sum = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(_sum)
_os.getppid = lambda: int(_sys.argv[2])  # the parent to signal: the launcher's, outside
_found = {{"sum": _sum.item()}}
for _name in _sys.argv[3:]:
    try:
        _attempt(_name, int(_sys.argv[1]))
        _found[_name] = "ok"
    except Exception as _exc:
        with _contextlib.redirect_stderr(_io.StringIO()) as _told:
            _sys.excepthook(type(_exc), _exc, None)
        _found[_name] = _told.getvalue().strip().splitlines()[-1]
for _rank in range(dist.get_world_size()):  # one rank's line at a time
    if _rank == dist.get_rank():
        print(f"RANK{{_rank}} " + _json.dumps(_found), flush=True)
    dist.barrier()
dist.destroy_process_group()
'''


def _torchrun(flags: list[str], cwd: Path, home: Path, hostile: Path, port: int,
              *, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    script = cwd / "rank.py"
    script.write_text(RANK.format(home=str(home), control="", model=str(hostile)))
    environment = {**os.environ, "HOME": str(home), "HF_TOKEN": "hf_parent_secret",
                   "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "codeferry", "exec", *flags, "--trust-remote-code", "--",
               str(TORCHRUN), "--standalone", f"--nproc_per_node={RANKS}", str(script),
               str(port), str(os.getpid()), *ATTEMPTS]
    return subprocess.run([*(prefix or []), *command], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def _ranks(done: subprocess.CompletedProcess[str]) -> dict[int, dict[str, object]]:
    found = {int(line[4:].split(" ", 1)[0]): json.loads(line.split(" ", 1)[1])
             for line in done.stdout.splitlines() if line.startswith("RANK")}
    assert sorted(found) == list(range(RANKS)), done.stdout + done.stderr
    return found


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torch's torchrun is not installed")
def test_each_ranks_every_attempt_is_refused_typed(tmp_path: Path, home: Path, hostile: Path,
                                                   port: int) -> None:
    """gloo's init and an all_reduce work across the ranks; each rank's attempts fail, told
    as ``SandboxRefusedError`` naming the operation and target (the host's loopback port:
    outside the box's network); the home and the model are as they were."""
    done = _torchrun(["--sandbox"], tmp_path, home, hostile, port)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank, found in _ranks(done).items():
        assert found.pop("sum") == 3.0, rank
        for attempt in ATTEMPTS:
            told = str(found[attempt]).removeprefix(f"[rank{rank}]: ")  # torch's own hook
            assert told.startswith("codeferry.errors.SandboxRefusedError: "), (rank, told)
            assert names(told, attempt), (rank, attempt, told)
    assert (home / ".bashrc").read_text() == "# the user's\n"
    assert not (hostile / "planted.txt").exists()


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torch's torchrun is not installed")
def test_without_the_box_each_rank_does_it_all(tmp_path: Path, home: Path, hostile: Path,
                                               port: int) -> None:
    try:
        done = _torchrun([], tmp_path, home, hostile, port)
        assert done.returncode == 0, done.stderr[-4000:]
        for found in _ranks(done).values():
            assert found == {"sum": 3.0, **dict.fromkeys(ATTEMPTS, "ok")}
    finally:
        (home / ".bashrc").write_text("# the user's\n")
        (hostile / "planted.txt").unlink(missing_ok=True)


UNSHARE = shutil.which("unshare")


@pytest.mark.skipif(UNSHARE is None, reason="no unshare(1) to take user namespaces away")
def test_without_user_namespaces_nothing_runs(tmp_path: Path, home: Path, hostile: Path,
                                              port: int) -> None:
    """Where the kernel refuses a new user namespace (here: none may be made below the one
    the test enters), the launcher's box fails closed, typed, with the fix; no rank ran."""
    assert UNSHARE is not None
    probe = subprocess.run([UNSHARE, "-Ur", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("this machine makes no user namespace to take them away in")
    done = _torchrun(["--sandbox"], tmp_path, home, hostile, port, prefix=[
        UNSHARE, "-Ur", "sh", "-c", 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
        "sh"])
    assert done.returncode != 0 and "RANK" not in done.stdout
    assert "sandbox cannot give the command a private network" in done.stderr, done.stderr
    assert "user namespaces" in done.stderr and "Fix:" in done.stderr


def test_only_a_distributed_launcher_gets_a_private_network() -> None:
    """Every other command keeps the box's port rules."""
    assert is_launcher(["/venv/bin/torchrun", "--standalone", "x.py"])
    assert is_launcher(["python", "-u", "-m", "torch.distributed.run", "x.py"])
    assert not is_launcher(["python", "x.py", "-m", "torch.distributed.run"])
    assert not is_launcher(["python", "-m", "http.server"])
    assert not is_launcher(["sh", "-c", "torchrun x.py"])
