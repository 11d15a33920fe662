"""``code_revision`` past ``load``: the workers of ``Executor``, ``run`` and ``doctor`` (and the
command line's ``--code-revision``) load and verify the code of one revision and build the
model from another revision's config and weights, as transformers does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _workers
import pytest

# Workers forked from this process start in about a second with these imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from _helpers import checksum

import codeferry
from codeferry import cli
from codeferry._commands.run import record_path

FORK: dict[str, Any] = {"workers": 1, "start_method": "fork", "trust_remote_code": True}


def test_executor_workers_run_the_code_of_code_revision_with_the_weights_of_revision(
    two_revisions: tuple[Path, Path, Path],
) -> None:
    cache, first, second = two_revisions
    old_code = codeferry.resolve("acme/versy", revision=first.name, cache_dir=cache).digest
    with codeferry.Executor("acme/versy", revision=second.name, cache_dir=cache,
                            **FORK) as own:
        [mine] = own.collective_rpc(_workers.code_and_weights)
        own_texts = own.generate(["hello", "abc"], max_new_tokens=3)
    assert mine["config_has_defaults"]  # the second commit's own code
    with codeferry.Executor("acme/versy", revision=second.name, code_revision=first.name,
                            cache_dir=cache, **FORK) as ex:
        assert ex.digest == old_code  # what every worker verified before executing anything
        assert ex.model == str(second.resolve())  # built from the revision's folder
        [theirs] = ex.collective_rpc(_workers.code_and_weights)
        texts = ex.generate(["hello", "abc"], max_new_tokens=3)
    assert not theirs["config_has_defaults"]  # the first commit's code built the model...
    assert theirs["config_class"] == mine["config_class"] == "VersyConfig"
    # ... from the second commit's weights (the first's differ)
    assert theirs["checksum"] == pytest.approx(checksum(second))
    assert theirs["checksum"] != pytest.approx(checksum(first))
    assert texts == own_texts  # the same math on the same weights


def test_code_revision_on_the_command_line_reaches_the_workers(
    two_revisions: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    cache, first, second = two_revisions
    old_code = codeferry.resolve("acme/versy", revision=first.name, cache_dir=cache).digest
    new_code = codeferry.resolve("acme/versy", revision=second.name, cache_dir=cache).digest
    where = ["--cache-dir", str(cache), "--revision", second.name, "--code-revision", first.name]
    assert cli.main(["inspect", "acme/versy", "--json", *where]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == old_code
    inputs = tmp_path / "in.txt"
    inputs.write_text("hello\nabc\n")
    output = tmp_path / "out.jsonl"
    workers = ["--trust-remote-code", "--workers", "1", "--start-method", "fork"]
    assert cli.main(["run", "acme/versy", "--input", str(inputs), "-o", str(output),
                     "--max-new-tokens", "2", *workers, *where]) == 0
    # the record names the code the workers ran (pinned: other code would have failed them)
    record = json.loads(record_path(output).read_text())
    assert record["digest"] == old_code
    assert record["model"] == f"acme/versy@{second.name}"  # and the weights they built
    assert len(output.read_text().splitlines()) == 2
    assert cli.main(["doctor", "acme/versy", "--json", *workers, *where]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["digest"] == old_code != new_code
    assert report["ok"] and report["workers"][0]["checks"]["config_class_is_loaded_class"]
    assert cli.main(["doctor", "acme/versy", "--json", *workers, *where[:4]]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == new_code

