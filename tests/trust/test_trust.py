"""``_trust.decide``: the one decision ``load``, ``Executor``, ``run`` and ``doctor`` share.

Static: every case resolves a real model folder and decides; nothing executes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import codeferry
from codeferry import cli
from codeferry._trust.decide import DEMO_DIGEST, Decision, decide
from codeferry.errors import LockMismatchError, TrustRequiredError

DEMO = Path(cli._demo())


def test_code_nobody_trusted_is_refused_with_its_files(factory_models: dict[str, Path]) -> None:
    bundle = codeferry.resolve(factory_models["default"])
    with pytest.raises(TrustRequiredError) as caught:
        decide(bundle)
    assert caught.value.files and all(f in str(caught.value) for f in caught.value.files)


def test_trust_remote_code_lets_it_run_without_a_lock(factory_models: dict[str, Path]) -> None:
    bundle = codeferry.resolve(factory_models["default"])
    assert decide(bundle, trust_remote_code=True) == Decision(True, None)


def test_a_lock_file_decides_and_trust_remote_code_changes_nothing(
    factory_models: dict[str, Path], tmp_path: Path
) -> None:
    bundle = codeferry.resolve(factory_models["default"])
    path = tmp_path / "model.lock"
    path.write_text(codeferry.Lock.from_bundle(bundle).dumps(), encoding="utf-8")
    for trust in (False, True):
        decision = decide(bundle, trust_remote_code=trust, lock=path)
        assert decision.trust_remote_code is False
        assert decision.lock is not None and decision.lock.digest == bundle.digest


def test_a_lock_of_other_code_is_refused_even_with_trust_remote_code(
    factory_models: dict[str, Path]
) -> None:
    other = codeferry.Lock.from_bundle(codeferry.resolve(factory_models["tokenizer"]))
    with pytest.raises(LockMismatchError):
        decide(codeferry.resolve(factory_models["default"]), trust_remote_code=True, lock=other)


def test_the_bundled_demo_is_trusted_by_its_digest_only_where_asked() -> None:
    bundle = codeferry.resolve(DEMO)
    assert bundle.digest == DEMO_DIGEST
    decision = decide(bundle, demo=True)
    assert decision.lock is not None and decision.lock.digest == DEMO_DIGEST
    with pytest.raises(TrustRequiredError):
        decide(bundle)  # load and Executor do not make the exception


def test_a_modified_copy_of_the_demo_is_refused(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(DEMO, tmp_path / "demo"))
    code = next(p for p in sorted(copy.glob("*.py")))
    code.write_text(code.read_text(encoding="utf-8") + "\n# changed\n", encoding="utf-8")
    with pytest.raises(TrustRequiredError):
        decide(codeferry.resolve(copy), demo=True)
