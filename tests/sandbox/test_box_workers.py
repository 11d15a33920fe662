"""Executor workers in the box: a hostile model's every attempt is refused by the kernel and
reaches the caller as a ``SandboxRefusedError`` naming what was tried, in spawn, forkserver
and fork workers; without the box the same model does all of it (so the test bites).

Real processes and the real kernel (Landlock, seccomp): nothing is mocked.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _hostile import ATTEMPTS, REFUSED

import codeferry
from codeferry.errors import (
    BatchFailedError,
    SandboxRefusedError,
    SandboxUnavailableError,
    SandboxUnsupportedError,
    WorkerStartupError,
)


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """The parent's credentials, as a user's shell would hold them."""
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", "hf_parent_secret")


def _control(model: Path, stage: str | None, attempt: str = "", port: int = 0) -> None:
    control = model / "control"
    if stage is None:
        control.unlink(missing_ok=True)
    else:
        control.write_text(f"{stage} {attempt} {port}")


def _refusal(error: BaseException) -> SandboxRefusedError:
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, SandboxRefusedError):
        seen = seen.__cause__
    assert isinstance(seen, SandboxRefusedError), f"not refused by the box: {error!r}"
    return seen


@pytest.mark.usefixtures("environment")
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_every_attempt_in_forward_is_refused_and_named(hostile: Path, home: Path, port: int,
                                                       method: str) -> None:
    """Each attempt fails its request with the box's typed error naming operation and
    target; the worker lives on, and a benign request after still answers."""
    _control(hostile, None)
    with codeferry.Executor(hostile, workers=1, start_method=method, trust_remote_code=True,
                            sandbox=True, max_retries=0) as ex:
        for attempt in ATTEMPTS:
            _control(hostile, "forward", attempt, port)
            with pytest.raises(BatchFailedError) as info:
                ex.generate(["abc"], max_new_tokens=2)
            refused = _refusal(info.value)
            operation, target = REFUSED[attempt]
            assert refused.operation == operation, (attempt, str(refused))
            assert target in refused.target, (attempt, str(refused))
        _control(hostile, None)
        assert len(ex.generate(["abc"], max_new_tokens=2)) == 1
    assert (home / ".bashrc").read_text() == "# the user's\n"
    assert not (hostile / "planted.txt").exists()


@pytest.mark.usefixtures("environment")
def test_without_the_box_every_attempt_succeeds(hostile: Path, home: Path, port: int) -> None:
    """The same model, unboxed, reads the key, reaches the ports, writes the home: the
    refusals above are the box's doing."""
    _control(hostile, None)
    try:
        with codeferry.Executor(hostile, workers=1, trust_remote_code=True, sandbox=False,
                                max_retries=0) as ex:
            for attempt in ATTEMPTS:
                _control(hostile, "forward", attempt, port)
                assert len(ex.generate(["abc"], max_new_tokens=2)) == 1, attempt
        assert "echo owned" in (home / ".bashrc").read_text()
        assert (hostile / "planted.txt").read_text() == "owned"
    finally:
        _control(hostile, None)
        (home / ".bashrc").write_text("# the user's\n")
        (hostile / "planted.txt").unlink(missing_ok=True)


@pytest.mark.usefixtures("environment")
@pytest.mark.parametrize(("stage", "attempt", "method"), [
    ("import", "ssh_key", "spawn"), ("init", "connect_local", "spawn"),
    ("import", "udp", "forkserver"), ("init", "shell", "forkserver"),
    ("import", "write_bashrc", "fork"), ("init", "signal_parent", "fork"),
    ("import", "env_token", "fork"), ("init", "hub_token", "fork"),
    ("init", "write_model", "warm"), ("import", "connect_metadata", "warm"),
])
def test_attempts_at_import_and_init_stop_the_worker_named(hostile: Path, port: int,
                                                           stage: str, attempt: str,
                                                           method: str) -> None:
    """At import or in ``__init__`` (spawn, forkserver, fork and warm workers: forked from the
    zygote) the refusal stops the worker's start: the caller gets
    ``WorkerStartupError`` whose cause is the box's error naming the attempt."""
    _control(hostile, stage, attempt, port)
    try:
        with pytest.raises(WorkerStartupError) as info:
            how = {"warm": True} if method == "warm" else {"start_method": method}
            with codeferry.Executor(hostile, workers=1, sandbox=True, trust_remote_code=True,
                                    max_retries=0, **how) as ex:  # type: ignore[arg-type]
                ex.generate(["abc"], max_new_tokens=2)
    finally:
        _control(hostile, None)
    refused = _refusal(info.value)
    operation, target = REFUSED[attempt]
    assert (refused.operation, target in refused.target) == (operation, True), str(refused)


def test_a_kernel_without_landlock_is_refused_before_any_worker(
        hostile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CODEFERRY_SANDBOX_LANDLOCK=0`` acts as a kernel without Landlock: the box is asked
    for, so the executor refuses, typed, with the kernel's facts and the fix; no model code
    ran (the control file would have the import stage write the home)."""
    monkeypatch.setenv("CODEFERRY_SANDBOX_LANDLOCK", "0")
    monkeypatch.setenv("CODEFERRY_SANDBOX", "1")
    with pytest.raises(SandboxUnavailableError) as info:
        codeferry.Executor(hostile, workers=1, trust_remote_code=True)
    assert info.value.abi == 0 and info.value.kernel == os.uname().release
    assert "Landlock" in str(info.value) and info.value.fix


def test_the_ray_backend_is_refused(hostile: Path) -> None:
    """Never silently unboxed: Ray's actors run on its own daemons' processes, outside any box
    codeferry can draw, so the Ray backend is refused, typed."""
    with pytest.raises(SandboxUnsupportedError) as info:
        codeferry.Executor(hostile, workers=1, trust_remote_code=True, sandbox=True,
                           backend="ray")
    assert info.value.where == "the Ray backend"


@pytest.mark.parametrize(("engine", "groups"), [
    ("transformers", False), ("vllm", True), ("auto", True)])
def test_only_an_engine_that_may_be_vllm_gets_its_groups(engine: str, groups: bool) -> None:
    """vLLM's gloo groups listen on a port the kernel picks (``Request.groups``); workers
    whose engine is transformers' keep the stricter box."""
    from codeferry._exec.options import WorkerOptions, sandbox_request

    request = sandbox_request(WorkerOptions(sandbox=True), engine)
    assert request is not None and request.groups is groups
