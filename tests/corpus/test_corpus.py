"""Remote code written for transformers 4 generates through codeferry on the installed
transformers, token for token as that code does on the release it was written for.

codeferry's side is the ``Executor`` with a real worker, on this process's transformers (the
newest, the dev pin, and the floors in CI). The other side is ``golden.json``: plain
transformers' tokens on the family's own release, which CI's floors stage computes again
(``floors_reference.py``), so the file cannot drift from what that code does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _corpus import FAMILIES, NEW_TOKENS, PROMPTS, build, golden

import codeferry
from codeferry import Request, SamplingParams
from codeferry._code.removed import installed
from codeferry._code.resolve import resolve
from codeferry._exec.plan import release_line


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "codeferry", *args], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build(request.param, tmp_path_factory.mktemp("corpus"))


def test_every_family_has_its_reference() -> None:
    tokens = golden()
    assert sorted(tokens) == FAMILIES
    assert all(len(rows) == len(PROMPTS) and all(rows) for rows in tokens.values())


def test_generates_as_on_its_own_release(family: tuple[str, Path]) -> None:
    name, folder = family
    expected = golden()[name]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with codeferry.Executor(folder, workers=1, trust_remote_code=True) as ex:
        results = ex.complete([Request(p) for p in PROMPTS], params)
        ran_on = ex.worker_info[0]["transformers"]
        reason = ex.worker_info[0]["generate_reason"]
    got = [list(r.completions[0].token_ids) for r in results]
    assert got == expected, name  # an end-of-sequence token ends both, and is in both
    # the prompts differ in length: only code that drops the attention mask gets no padding
    assert ("left padding changes" in reason) == (name == "chatglm6b"), reason
    # the installed transformers, or the release environment the code needs (hybridcache on 5.x)
    line = release_line(resolve(folder))
    assert ran_on == installed() if line is None else ran_on.startswith(f"{line}."), ran_on


def test_a_release_environment_is_made_once_and_named_by_inspect(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = build("hybridcache", tmp_path_factory.mktemp("corpus"))
    line = release_line(resolve(folder))
    inspected = json.loads(_cli("inspect", str(folder), "--json"))
    assert inspected["release"] == line
    locked = subprocess.run([sys.executable, "-m", "codeferry", "lock", str(folder)],
                            capture_output=True, text=True, timeout=120, check=True)
    said = f"the executor's workers run this code on transformers {line}"
    assert (said in locked.stderr) == (line is not None), locked.stderr
    assert "cannot load" not in locked.stderr, locked.stderr  # nothing the release serves
    made = json.loads(_cli("release", str(folder), "--json"))
    if line is None:  # the floors: the installed transformers still has HybridCache
        assert made == {"model": str(folder), "installed": installed(), "line": None}
    else:  # the set-up made it (CI's, or `codeferry release` by hand): nothing made again
        assert made["line"] == line and made["made"] is False
        assert made["transformers"].startswith(f"{line}.")


def test_run_and_doctor_from_the_command_line(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``codeferry run`` writes the golden tokens' texts and ``doctor`` passes, for the family
    a release serves on transformers 5 (and the installed transformers serves on the floors)."""
    from transformers import AutoTokenizer

    folder = build("hybridcache", tmp_path_factory.mktemp("corpus"))
    inputs, output = folder / "in.jsonl", folder / "out.jsonl"
    inputs.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                              for i, p in enumerate(PROMPTS)))
    _cli("run", str(folder), "--trust-remote-code", "--input", str(inputs), "-o", str(output),
         "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--no-progress")
    codeferry.load(folder, trust_remote_code=True, classes=["AutoConfig", "AutoTokenizer"])
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    texts = [json.loads(line)["output"] for line in output.read_text().splitlines()]
    assert texts == [tokenizer.decode(row, skip_special_tokens=True)
                     for row in golden()["hybridcache"]]
    doctor = _cli("doctor", str(folder), "--trust-remote-code", "--workers", "1")
    assert doctor.rstrip().endswith("ok")
    line = release_line(resolve(folder))
    assert (f"run this code on transformers {line}" in doctor) == (line is not None)


def test_a_hub_repo_whose_code_needs_a_release_generates_offline(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same family as a repo id in a hub cache (huggingface_hub's layout: blobs and
    snapshot symlinks), offline: the workers, on the release where one is needed (whose own
    huggingface_hub reads the cache), generate the golden tokens."""
    from codeferry.testing._factory import _write_hub_repo

    folder = build("hybridcache", tmp_path_factory.mktemp("corpus"))
    cache = tmp_path_factory.mktemp("hub")
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    _write_hub_repo(cache, "corpus/hybridcache", files, None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with codeferry.Executor("corpus/hybridcache", workers=1, trust_remote_code=True) as ex:
        results = ex.complete([Request(p) for p in PROMPTS], params)
        ran_on = ex.worker_info[0]["transformers"]
    assert [list(r.completions[0].token_ids) for r in results] == golden()["hybridcache"]
    line = release_line(resolve(folder))
    assert ran_on == installed() if line is None else ran_on.startswith(f"{line}."), ran_on


def test_chatglm6b_generates_as_its_users_call_it(tmp_path: Path) -> None:
    """``AutoModel.from_pretrained(...).generate`` after ``codeferry.load``, one prompt at a
    time, in this process: its map has no causal-LM key, and on transformers 5 its own
    ``prepare_inputs_for_generation`` gets no 1-D position ids from ``generate``."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = build("chatglm6b", tmp_path)
    codeferry.load(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    got = []
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        got.append(out[0, ids["input_ids"].shape[1]:].tolist())
    assert got == golden()["chatglm6b"][:3]


def test_generate_makes_positions_only_for_code_written_for_transformers_5(
        tmp_path: Path) -> None:
    """transformers 5's ``generate`` makes every position before the first step and hands them
    to ``prepare_inputs_for_generation``; 4's made none. A class with its own (StableLM's
    reads ``kwargs.get("position_ids")``) gets none when transformers 4 wrote its config, and
    what the installed ``generate`` makes when transformers 5 did."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = build("stablelm", tmp_path)
    codeferry.load(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    if not installed().startswith("5."):  # 4's generate makes none: nothing to serve
        assert not hasattr(model, "_prepare_position_ids_for_generation")
        return
    ids, mask = torch.tensor([[0, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1]])
    assert model.config.transformers_version == "4.34.0"
    assert model._prepare_position_ids_for_generation(ids, {"attention_mask": mask}) is None
    model.config.transformers_version = "5.2.0"
    made = model._prepare_position_ids_for_generation(ids, {"attention_mask": mask})
    assert made.tolist() == [[0, 0, 1, 2]]
