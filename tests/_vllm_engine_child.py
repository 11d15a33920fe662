"""Runs inside the vLLM environment (``CODEFERRY_VLLM_PYTHON``): ``codeferry.Executor`` with
``engine="auto"`` (vLLM generating) against ``engine="transformers"`` on the same model, then
``auto`` and ``vllm`` on a model vLLM refuses (``tests/vllm/test_vllm_engine.py``).

``python _vllm_engine_child.py REMOTE REFUSED OUT``: ``REMOTE`` is a remote-code model vLLM
runs (``_vllm_child.py build``'s ``plain`` layout), ``REFUSED`` one it refuses (codeferry's
bundled demo: an architecture vLLM does not know, whose attention is not transformers'
interface). Writes what each engine gave as JSON to ``OUT``; the test compares them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = ["w1 w2 w3 w4 w5", "w7 w8", "w3 w9 w11 w12 w40 w41 w42", "w60"]
#: vLLM's start-up kept short: no compiled graphs, a small context.
FAST = {"max_model_len": 128, "enforce_eager": True}


def lock_digest(worker: Any) -> str | None:
    """In a worker: the digest of the lock its vLLM processes enforce (``CODEFERRY_LOCK``)."""
    from codeferry._code.lockfile import read_lock

    path = os.environ.get("CODEFERRY_LOCK")
    return read_lock(path).digest if path else None


def threads(worker: Any) -> list[Any]:
    """In a worker: torch's threads and the ``OMP_NUM_THREADS`` its vLLM read."""
    import torch

    return [torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")]


def results(rows: list[Any]) -> list[dict[str, Any]]:
    return [{"prompt_tokens": r.prompt_tokens,
             "completions": [{"text": c.text, "tokens": list(c.token_ids),
                              "finish": c.finish_reason, "stop_reason": c.stop_reason,
                              "logprobs": None if c.logprobs is None else list(c.logprobs)}
                             for c in r.completions]} for r in rows]


def error_of(call: Any) -> dict[str, str] | None:
    try:
        call()
    except Exception as exc:  # the test reads the type and the text
        cause = exc.__cause__
        return {"type": type(exc).__name__, "text": str(exc),
                "cause": type(cause).__name__ if cause is not None else ""}
    return None


def greedy_params(reference: list[dict[str, Any]]) -> list[Any]:
    """Per prompt, parameters that end it in each way a request can end: its length, a stop
    string, a stop token, ``min_tokens``; each taken from the reference's greedy tokens."""
    from codeferry import SamplingParams

    first = reference[0]["completions"][0]
    words = reference[1]["completions"][0]["text"].split()
    third = reference[2]["completions"][0]["tokens"]
    return [SamplingParams(max_tokens=8, temperature=0, logprobs=2),
            SamplingParams(max_tokens=8, temperature=0, stop=[words[2]]),
            SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[third[3]]),
            SamplingParams(max_tokens=6, min_tokens=6, temperature=0,
                           stop_token_ids=[first["tokens"][0]])]


def run_engine(model: str, engine: str, reference: list[dict[str, Any]] | None) -> dict[str, Any]:
    from codeferry import Executor, SamplingParams

    started = time.perf_counter()
    out: dict[str, Any] = {}
    # no dtype: each engine runs the model's saved one (float32), vLLM's too (not its "auto")
    with Executor(model, engine=engine, trust_remote_code=True,
                  engine_options=FAST if engine != "transformers" else None) as ex:
        out.update(startup_s=time.perf_counter() - started, engine=ex.engine,
                   info=ex.worker_info, digest=ex.digest,
                   lock=ex.collective_rpc(lock_digest), threads=ex.collective_rpc(threads))
        plain = [SamplingParams(max_tokens=8, temperature=0)] * len(PROMPTS)
        out["plain"] = results(ex.generate(PROMPTS, plain))
        out["ends"] = results(ex.generate(PROMPTS, greedy_params(reference or out["plain"])))
        out["texts"] = ex.generate(PROMPTS, max_new_tokens=8, do_sample=False)
        out["iter"] = sorted(o.index for o in ex.generate_iter(PROMPTS * 3, max_new_tokens=4))
        seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2)
        out["seeded"] = [results(ex.generate(PROMPTS[:2], seeded)) for _ in range(2)]
        out["bad_option"] = error_of(lambda: ex.generate(PROMPTS[:1], num_beams=2))
        out["embed"] = error_of(lambda: ex.embed(PROMPTS[:1]))
    return out


def run_and_resume(model: str, work: Path) -> dict[str, Any]:
    """``codeferry run`` under ``auto`` (vLLM generating), then a resume by transformers."""
    from codeferry._commands.run import record_path, run

    source, output = work / "in.jsonl", work / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                              for i, p in enumerate(PROMPTS)))
    done = run(model, source, output, max_new_tokens=4, trust_remote_code=True, progress=False,
               workers=1)
    recorded = json.loads(record_path(output).read_text())
    source.write_text(source.read_text() + json.dumps({"id": 99, "prompt": "w5 w6"}) + "\n")
    before = output.read_bytes()
    return {"written": done.written, "options": recorded["options"],
            "lines": len(output.read_text().splitlines()),
            "resumed_by_transformers": error_of(lambda: run(
                model, source, output, max_new_tokens=4, trust_remote_code=True,
                progress=False, engine="transformers")),
            "untouched": output.read_bytes() == before}


def doctor_half(model: str, folder: Path) -> dict[str, Any]:
    """``codeferry doctor``'s engine line for ``model`` saved as bfloat16 (its config says so:
    the doctor builds from the config, and reads the dtype there)."""
    import shutil

    from codeferry._commands.doctor import doctor, render_doctor

    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    report = doctor(str(folder), trust_remote_code=True, workers=1)
    return {"engine": report.workers[0].checks.get("engine"), "text": render_doctor(report)}


def main() -> None:
    remote, refused, target = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from codeferry import Executor
    from codeferry._exec.engines.vllm_engine import choose_engine

    report: dict[str, Any] = {"transformers": run_engine(remote, "transformers", None)}
    # vLLM is installed here: auto keeps it only for local workers that generate
    report["choices"] = [list(choose_engine("auto", "local", ("embed",))),
                         list(choose_engine("auto", "ray")), list(choose_engine("auto", "local"))]
    report["vllm"] = run_engine(remote, "auto", report["transformers"]["plain"])
    report["run"] = run_and_resume(remote, target.parent)
    with Executor(refused, engine="auto", trust_remote_code=True) as ex:
        report["auto_refused"] = {"engine": ex.engine, "info": ex.worker_info,
                                  "texts": ex.generate(["hello"], max_new_tokens=4)}
    # bfloat16 where this CPU has no bfloat16 instructions: auto does not try vLLM
    import torch

    from codeferry._exec.generate.packing import native_dtypes

    # one worker each below: the layout of two is checked above
    with Executor(remote, engine="auto", dtype="bfloat16", trust_remote_code=True,
                  engine_options=FAST, workers=1) as ex:
        report["auto_half"] = {"engine": ex.engine, "info": ex.worker_info,
                               "native": torch.bfloat16 in native_dtypes(),
                               "texts": ex.generate(["w1 w2"], max_new_tokens=4)}
    report["doctor_half"] = doctor_half(remote, target.parent / "half")
    report["vllm_refused"] = error_of(
        lambda: Executor(refused, engine="vllm", trust_remote_code=True, workers=1).close())
    target.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
