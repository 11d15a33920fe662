"""What a worker sends back when a request goes wrong: a request it cannot unpickle, a
``SystemExit`` or ``KeyboardInterrupt`` in ``collective_rpc``, an error of a class from code
the parent's lock does not list. One forked worker per executor, shared where possible."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _store_workers
import pytest

# Workers forked from this process start in about a second with these imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401

import codeferry
from codeferry._runtime import loader as _loader
from codeferry._runtime.loader import units_of
from codeferry._trust import policy as _policy
from codeferry.errors import (
    BatchFailedError,
    RemoteTraceback,
    RequestUnpicklingError,
    WorkerError,
)


@pytest.fixture(scope="module")
def executor(factory_models: dict[str, Path]) -> Iterator[codeferry.Executor]:
    with codeferry.Executor(factory_models["tokenizer"], workers=1, start_method="fork",
                            trust_remote_code=True, max_retries=5) as ex:
        yield ex


def test_request_that_fails_to_unpickle_fails_its_batch_at_once(
    executor: codeferry.Executor,
) -> None:
    pids = executor.pids
    start = time.monotonic()
    with pytest.raises(BatchFailedError) as info:
        executor.complete([codeferry.Request(prompt="hello",
                                             template_kwargs={"bomb": _store_workers.Bomb()})],
                          codeferry.SamplingParams(max_tokens=2))
    assert time.monotonic() - start < 10  # not 6 retries of a dead worker
    cause = info.value.__cause__
    assert isinstance(cause, RequestUnpicklingError)
    assert "ValueError: this object cannot be unpickled here" in str(cause)
    assert isinstance(cause.__cause__, RemoteTraceback)
    assert "explode" in cause.__cause__.tb  # the worker's own traceback
    assert "not retried" in str(info.value) and info.value.indices == (0,)
    assert executor.pids == pids  # the worker lived on
    assert len(executor.generate(["hello"], max_new_tokens=2)) == 1


def test_rpc_that_fails_to_unpickle_raises_typed(executor: codeferry.Executor) -> None:
    with pytest.raises(RequestUnpicklingError):
        executor.collective_rpc(_store_workers.echo, _store_workers.Bomb())
    assert executor.collective_rpc(_store_workers.echo, 7) == [7]


@pytest.mark.parametrize("how, name", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")])
def test_worker_exit_in_rpc_is_a_worker_error(
    executor: codeferry.Executor, how: str, name: str
) -> None:
    pids = executor.pids
    with pytest.raises(WorkerError) as info:
        executor.collective_rpc(_store_workers.leave, how)
    assert name in str(info.value) and info.value.worker == 0
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert name in info.value.__cause__.tb and "leave" in info.value.__cause__.tb
    assert executor.pids == pids
    assert executor.collective_rpc(_store_workers.echo, "still here") == ["still here"]


def _evil_model(root: Path, marker: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(
        {"model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}))
    (root / "configuration_evil.py").write_text(
        "import os\n"
        f"with open({str(marker)!r}, 'a') as _marker:\n"
        "    _marker.write(f'{os.getpid()}\\n')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n\n\n"
        "class EvilError(Exception):\n    pass\n")
    return root


def test_parent_holds_the_lock_policy_of_its_workers(
    factory_models: dict[str, Path], tmp_path: Path
) -> None:
    model = factory_models["tokenizer"]
    lock = codeferry.Lock.from_bundle(codeferry.resolve(model))
    marker = tmp_path / "executed-by.txt"
    evil = _evil_model(tmp_path / "evil", marker)
    evil_digest = next(iter(units_of(codeferry.resolve(evil)).values())).digest
    with codeferry.Executor(model, workers=1, start_method="fork", lock=lock) as ex:
        assert _policy._locked  # before any reply
        worker_pid = ex.pids[0]
        with pytest.raises(WorkerError) as info:
            ex.collective_rpc(_store_workers.raise_foreign, str(evil))
    assert "EvilError" in str(info.value)  # named, from the worker's summary
    assert marker.read_text().split() == [str(worker_pid)]  # never executed in the parent
    assert os.getpid() != worker_pid
    assert _loader.registered(_loader.PREFIX + ".u" + evil_digest[7:39]) is None
    assert not any("configuration_evil" in name for name in sys.modules)
