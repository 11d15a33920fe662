"""``from_pretrained``'s vocabulary where users pass it: ``load(token=, local_files_only=,
code_revision=)``, ``dtype`` as a ``torch.dtype``, ``--cache-dir`` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Workers forked from this process start in about a second with these imported here.
import torch
import transformers.modeling_utils  # noqa: F401

import codeferry
from codeferry import cli
from codeferry._commands.run import record_path, run
from codeferry.errors import DTypeError, ModelNotFoundError, ResumeMismatchError

DEMO = Path(cli._demo())
PROMPTS = DEMO / "prompts.txt"


def test_code_revision_picks_the_code_and_the_other_keywords_are_accepted(
    two_revisions: tuple[Path, Path, Path],
) -> None:
    cache, first_snapshot, second_snapshot = two_revisions
    first, second = first_snapshot.name, second_snapshot.name
    assert codeferry.resolve("acme/versy", revision=first, cache_dir=cache).digest != \
        codeferry.resolve("acme/versy", revision=second, cache_dir=cache).digest
    options = {"trust_remote_code": True, "cache_dir": cache, "classes": ["AutoConfig"]}
    old = codeferry.load("acme/versy", revision=first, **options)["AutoConfig"]
    new = codeferry.load("acme/versy", **options)["AutoConfig"]  # main: the second commit
    assert old is not new
    # the code of code_revision, whatever revision says (as in transformers)
    assert codeferry.load("acme/versy", revision=second, code_revision=first,
                          **options)["AutoConfig"] is old
    # token and local_files_only: a cached repo is read as it is, with no request either way
    same = codeferry.load("acme/versy", token="hf_not_needed", local_files_only=False, **options)
    assert same["AutoConfig"] is new
    assert codeferry.load("acme/versy", token=True, local_files_only=True,
                          **options)["AutoConfig"] is new
    with pytest.raises(TypeError, match="token must be"):
        codeferry.load("acme/versy", token=3, **options)  # type: ignore[arg-type]
    with pytest.raises(ModelNotFoundError):  # not cached, and the session is offline
        codeferry.load("acme/absent", local_files_only=False, **options)


def test_dtype_takes_a_torch_dtype(tmp_path: Path) -> None:
    """``torch.bfloat16`` and ``"bfloat16"`` are one dtype: the run records its name."""
    output = tmp_path / "out.jsonl"
    result = run(DEMO, PROMPTS, output, workers=1, start_method="fork", dtype=torch.bfloat16,
                 max_new_tokens=2)
    assert result.complete and result.failed == 0
    record = json.loads(record_path(output).read_text())
    assert record["options"]["dtype"] == "bfloat16"
    again = run(DEMO, PROMPTS, output, workers=1, start_method="fork", dtype="torch.bfloat16",
                max_new_tokens=2)
    assert again.skipped == again.total  # the same dtype: resumed (nothing was left)
    with pytest.raises(ResumeMismatchError) as info:
        run(DEMO, PROMPTS, output, workers=1, start_method="fork", dtype=torch.float32,
            max_new_tokens=2)
    assert info.value.differences == {"dtype": ("bfloat16", "float32")}
    for bad in ("float17", "", 16):
        with pytest.raises(DTypeError) as error:
            codeferry.Executor(DEMO, workers=1, start_method="fork", dtype=bad)
        assert error.value.dtype == repr(bad) and error.value.fix


def test_cache_dir_on_the_command_line(
    factory_hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # the default cache lacks it
    assert cli.main(["inspect", "acme/tiny", "--json"]) == 2
    assert "acme/tiny" in capsys.readouterr().err
    assert cli.main(["inspect", "acme/tiny", "--json", "--cache-dir", str(factory_hub_cache)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "models--acme--tiny" in json.dumps(shown)
    for argv in (["audit", "acme/tiny"], ["lock", "acme/tiny", "-o", str(tmp_path / "t.lock")]):
        assert cli.main([*argv, "--cache-dir", str(factory_hub_cache)]) == 0, argv
    assert cli.main(["verify", "acme/tiny", "--lock", str(tmp_path / "t.lock"),
                     "--cache-dir", str(factory_hub_cache)]) == 0
    capsys.readouterr()
