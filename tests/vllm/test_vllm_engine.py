"""vLLM as the executor's engine: ``Executor(engine="vllm" | "auto")`` in real vLLM.

One child process in the vLLM environment (``tests/_vllm_engine_child.py``) runs the same
calls through ``engine="transformers"`` and ``engine="auto"`` (vLLM generating) on a
remote-code model (the ``plain`` layout of
``_vllm_child.py build``), then ``engine="auto"`` and ``engine="vllm"`` on codeferry's bundled
demo model, whose architecture vLLM does not know. Greedy outputs,
cut every way a request can end, must be the same on both engines: tokens, texts, finish and
stop reasons, logprobs within float tolerance. The code vLLM runs is bound to the digest the
parent checked (the lock in ``CODEFERRY_LOCK``, and the probe lines of every class built).
``codeferry run`` under ``auto`` records the engine, and a resume by transformers is refused.
A bfloat16 model on a CPU without bfloat16 instructions gets transformers under ``auto``.

vLLM runs in its own environment (``CODEFERRY_VLLM_PYTHON``), as in ``test_vllm.py``: without
it the module skips, except under CI, where it fails.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import _vllm_child  # noqa: E402 - stdlib only at import

import codeferry  # noqa: E402
from codeferry._exec.engines.vllm_engine import choose_engine, vllm_version  # noqa: E402
from codeferry.errors import ExtraMissingError  # noqa: E402

CHILD = TESTS / "_vllm_engine_child.py"
DEMO = Path(codeferry.__file__).resolve().parent / "demo"
TIMEOUT = 900


def _env(root: Path, **extra: str) -> dict[str, str]:
    return _vllm_child.child_env(root, TESTS.parent / "src", **extra)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory,
           vllm_built: Callable[[str, dict[str, str]], Path],
           vllm_python: str) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm_engine")
    model = vllm_built(vllm_python, _env(work)) / "plain"
    out, probe, log = work / "report.json", work / "probe.jsonl", work / "child.log"
    with log.open("wb") as sink:
        _vllm_child.run_in_group([vllm_python, str(CHILD), str(model), str(DEMO), str(out)],
                                 env=_env(work, CODEFERRY_VLLM_PROBE=str(probe)), stdout=sink,
                                 timeout=TIMEOUT)
    assert out.exists(), log.read_text(errors="replace")[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["probe"] = [json.loads(line) for line in probe.read_text().splitlines()]
    return result


def _same_logprobs(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    assert [e["token_id"] for e in ours] == [e["token_id"] for e in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert math.isclose(a["logprob"], b["logprob"], abs_tol=1e-3), (a, b)
        assert [t["token_id"] for t in a["top"]] == [t["token_id"] for t in b["top"]]


def test_vllm_gives_the_transformers_engines_greedy_results(report: dict[str, Any]) -> None:
    ours, theirs = report["transformers"], report["vllm"]
    assert theirs["engine"] == "auto" and ours["engine"] == "transformers"
    # both engines laid out alike: workers of one thread each (two on 2 cores)
    assert [i["generate_path"] for i in theirs["info"]] == ["vllm"] * len(ours["info"])
    # each vLLM keeps its worker's share of the cores (vLLM alone would cut torch to one)
    assert [t for t, _ in theirs["threads"]] == [t for t, _ in ours["threads"]]
    assert [omp for _, omp in theirs["threads"]] == [str(t) for t, _ in ours["threads"]]
    for call in ("plain", "ends"):
        for mine, vllm in zip(ours[call], theirs[call], strict=True):
            a, b = mine["completions"][0], vllm["completions"][0]
            assert (a["tokens"], a["text"], a["finish"], a["stop_reason"]) == (
                b["tokens"], b["text"], b["finish"], b["stop_reason"]), call
            assert mine["prompt_tokens"] == vllm["prompt_tokens"]
            if a["logprobs"] is not None:
                _same_logprobs(a["logprobs"], b["logprobs"])
    # every way a request ends, each ended that way (the parameters are built to)
    assert [(r["completions"][0]["finish"], r["completions"][0]["stop_reason"] is not None)
            for r in theirs["ends"]] == [("length", False), ("stop", True), ("stop", True),
                                         ("length", False)]
    assert theirs["ends"][0]["completions"][0]["logprobs"] is not None
    assert theirs["texts"] == ours["texts"]  # generate() without params: plain strings
    assert theirs["iter"] == list(range(12))  # generate_iter: every index once


def test_vllm_samples_n_per_request_and_a_seed_repeats(report: dict[str, Any]) -> None:
    first, again = report["vllm"]["seeded"]
    assert [len(r["completions"]) for r in first] == [2, 2]
    assert first == again


def test_vllm_runs_exactly_the_code_the_parent_checked(report: dict[str, Any]) -> None:
    theirs = report["vllm"]
    # the worker binds vLLM to a lock of the digest the parent decided on...
    assert theirs["lock"] == [theirs["digest"]] * len(theirs["info"])
    assert set(report["transformers"]["lock"]) == {None}
    # ...and every class vLLM built came through codeferry, under that lock
    built = [r for r in report["probe"] if r["locked"]]
    assert built, report["probe"]
    assert all(r["config_module"].startswith("codeferry") and not r["transformers_modules"]
               for r in built), built


def test_errors_are_typed_and_not_retried(report: dict[str, Any]) -> None:
    theirs = report["vllm"]
    # refused in the parent, before any batch is sent: one mapping for both engines
    assert theirs["bad_option"]["type"] == "SamplingParamsError"
    assert "num_beams" in theirs["bad_option"]["text"]
    assert theirs["embed"]["cause"] == "EngineRefusedError"
    assert "failed once (not retried)" in theirs["embed"]["text"]
    refused = report["vllm_refused"]
    assert refused["type"] == "WorkerStartupError"
    assert "EngineRefusedError" in refused["text"] and "CharlmForCausalLM" in refused["text"]


def test_auto_keeps_vllm_only_for_local_workers_that_generate(report: dict[str, Any]) -> None:
    embed, ray, local = report["choices"]
    assert embed == ["transformers", "engine='auto': vLLM only generates, and these workers do not"]
    assert ray == ["transformers", "engine='auto': vLLM runs in local workers only"]
    assert local[0] == "auto" and "vLLM 0.32" in local[1]


def test_codeferry_run_records_the_vllm_engine_and_refuses_a_resume_by_another(
    report: dict[str, Any],
) -> None:
    run = report["run"]
    assert run["written"] == run["lines"] == 4
    assert run["options"]["engine"] == "vllm", run  # auto's engine, known once started
    refused = run["resumed_by_transformers"]
    assert refused and refused["type"] == "ResumeMismatchError", refused
    assert '"vllm"' in refused["text"] and '"transformers"' in refused["text"], refused
    assert run["untouched"]


def alike(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Two workers' ``worker_info`` alike but for the cores each is bound to."""
    return {**one, "cores": None} == {**other, "cores": None}


def test_auto_falls_back_to_transformers_with_vllms_reason(report: dict[str, Any]) -> None:
    auto = report["auto_refused"]
    assert auto["engine"] == "auto"
    info = auto["info"][0]
    assert all(alike(i, info) for i in auto["info"]), auto["info"]
    assert info["generate_path"] != "vllm"
    assert "vLLM 0.32" in info["generate_reason"]
    assert "CharlmForCausalLM" in info["generate_reason"]
    assert "transformers generates instead" in info["generate_reason"]
    assert len(auto["texts"]) == 1


def test_auto_keeps_half_precision_off_vllm_on_a_cpu_without_its_instructions(
        report: dict[str, Any]) -> None:
    half = report["auto_half"]
    info = half["info"][0]
    assert all(alike(i, info) for i in half["info"]), half["info"]
    assert len(half["texts"]) == 1
    if half["native"]:  # a CPU with bfloat16 instructions: vLLM's kernels take it
        assert info["generate_path"] == "vllm", info
        return
    assert info["engine"] == "transformers" and info["generate_path"] != "vllm", info
    assert info["generate_reason"].startswith(
        "engine='auto': bfloat16 on a CPU without bfloat16 instructions"), info
    assert info["packed_linears"] > 0, info  # multiplied upcast


def test_the_doctor_says_which_engine_a_half_precision_model_gets_and_why(
        report: dict[str, Any]) -> None:
    doctor, native = report["doctor_half"], report["auto_half"]["native"]
    if native:  # a CPU with bfloat16 instructions: vLLM takes it, as auto's worker does
        assert doctor["engine"]["auto"] == "vllm", doctor
        return
    assert doctor["engine"] == {"auto": "transformers", "reason": (
        "bfloat16 on a CPU without bfloat16 instructions: vLLM falls back to PyTorch's slow "
        "bfloat16 matmul there, transformers' engine multiplies in float32")}, doctor
    assert "engine: transformers" in doctor["text"] and "bfloat16" in doctor["text"], doctor


def test_without_vllm_auto_is_transformers_and_vllm_is_refused_typed() -> None:
    """This environment has no vLLM (the dev venv): the parent decides, before any worker."""
    if vllm_version() is not None:  # (not find_spec: this folder, tests/vllm, is on sys.path)
        pytest.skip("vLLM is installed here: the child's cases above cover it")
    assert choose_engine("auto", "local") == ("transformers",
                                              "engine='auto': vLLM is not installed here")
    assert choose_engine("transformers", "local")[0] == "transformers"
    with pytest.raises(ExtraMissingError) as info:
        codeferry.Executor(DEMO, engine="vllm", trust_remote_code=True)
    assert info.value.extra == "vllm"
    with pytest.raises(ValueError, match="engine must be"):
        codeferry.Executor(DEMO, engine="tensorrt")  # type: ignore[arg-type]
