"""Ray stays optional: imported only by backend="ray", and missing, it is named."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import codeferry
from codeferry.errors import ExtraMissingError
from codeferry.testing import ModelSpec, write_model


def test_without_ray_the_ray_backend_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_model(tmp_path / "m", ModelSpec(name="noray", tokenizer=True))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ExtraMissingError) as info:
        codeferry.Executor(path, backend="ray", trust_remote_code=True)
    assert info.value.extra == "ray" and "codeferry[ray]" in str(info.value)


def test_without_cloudpickle_the_ray_backend_names_the_extra_before_starting_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install of ray alone (the `ray` extra once lacked cloudpickle): said at once, not
    when the first request is pickled."""
    pytest.importorskip("ray")
    path = write_model(tmp_path / "m", ModelSpec(name="nocp", tokenizer=True))
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # `import cloudpickle` raises
    with pytest.raises(ExtraMissingError) as info:
        codeferry.Executor(path, backend="ray", trust_remote_code=True)
    assert info.value.extra == "ray" and "cloudpickle" in str(info.value)
    import ray

    assert not ray.is_initialized()


def test_the_ray_extra_lists_every_package_the_backend_imports() -> None:
    """What `pip install codeferry[ray]` brings: ray, and cloudpickle for the requests."""
    import tomllib
    from _helpers import ROOT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {r.split(">")[0].split("=")[0] for r in extras["ray"]} >= {"ray", "cloudpickle"}


def test_the_local_executor_never_imports_ray() -> None:
    code = ("import sys, codeferry, codeferry._exec.executor, codeferry._exec.scheduler, "
            "codeferry._exec.workers.transport; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- a cluster address where nothing listens ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def test_a_wrong_ray_address_is_a_cluster_error_within_seconds_without_ray_logs() -> None:
    """`codeferry run --backend ray --address` where nothing listens: one typed error that
    names the address and the fix, in seconds (Ray alone retries for minutes, logging each
    try, then raises a bare ConnectionError)."""
    address = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "codeferry", "run", "--backend", "ray", "--address", address,
             "--workers", "1"], capture_output=True, text=True, env=_env(), timeout=90)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"still waiting after 90 s; it printed {len(err.splitlines())} lines "
                    f"to stderr, the last: {err[-1500:]}")
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("codeferry: error: "), done.stderr[-3000:]
    assert address in lines[0] and "ray start --head" in lines[0] and "RAY_ADDRESS" in lines[0]
    assert done.stdout == ""
    assert took < 45, f"took {took:.0f} s"


def test_a_wrong_ray_address_error_is_typed_and_carries_the_address(tmp_path: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"
    path = write_model(tmp_path / "m", ModelSpec(name="farray", tokenizer=True))
    code = (
        "import json, pickle, sys\n"
        "import codeferry\n"
        "from codeferry import errors\n"
        "try:\n"
        f"    codeferry.Executor({str(path)!r}, backend='ray', address={address!r},\n"
        "                       trust_remote_code=True, workers=1)\n"
        "except errors.ClusterError as exc:\n"
        "    again = pickle.loads(pickle.dumps(exc))\n"
        "    print(json.dumps({'type': type(exc).__name__, 'address': exc.address,\n"
        "                      'again': [type(again).__name__, again.address, str(again)],\n"
        "                      'text': str(exc), 'cause': type(exc.__cause__).__name__,\n"
        "                      'is_worker_error': isinstance(exc, errors.WorkerError)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["type"] == "ClusterUnreachableError" and seen["address"] == address
    assert seen["again"] == [seen["type"], address, seen["text"]]
    assert seen["cause"] == "ConnectionRefusedError" and seen["is_worker_error"]
    assert done.stderr.strip() == "", done.stderr[-3000:]  # no Ray log lines
