"""Workers' stdout never reaches the output: it goes to stderr, each line named by its worker.

``codeferry run`` writes its JSONL to stdout by default, and workers used to inherit that
stdout: a model that prints in ``forward`` wrote into the output, and two workers tore one
line between them. Every start method, and the warm (zygote) path, in a process of its own
with real pipes, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import GENERATED, unique_model

PRINTING_FORWARD = '''

import os as _os

_original_forward = {cls}.forward


def _forward(self, *args, **kwargs):
    print("debug from forward")  # Python-level, block-buffered on a pipe
    _os.write(1, b"fd-level debug\\n")  # what a C extension's printf does
    return _original_forward(self, *args, **kwargs)


{cls}.forward = _forward
'''

PROMPTS = ["abc", "hello there", "zzz", "tiny model", "one more", "last one"]

WARM_SCRIPT = '''
import json
import sys

import codeferry

if __name__ == "__main__":
    with codeferry.Executor(sys.argv[1], workers=2, warm=True, trust_remote_code=True,
                            batch_size=1) as ex:
        for index, text in enumerate(ex.generate(sys.argv[2:], max_new_tokens=2)):
            print(json.dumps({"id": index, "output": text}), flush=True)
'''


def printing_model(root: Path) -> Path:
    path = unique_model(root, "pr", tokenizer=True)
    modeling = next(path.glob("modeling_*.py"))
    name = path.name[:1].upper() + path.name[1:]
    modeling.write_text(modeling.read_text() + PRINTING_FORWARD.format(cls=f"{name}ForCausalLM"))
    return path


def check_streams(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == len(PROMPTS), proc.stdout
    for line in lines:  # every stdout line is codeferry's JSON, whole
        row = json.loads(line)
        assert {"id", "output"} <= set(row) <= GENERATED and isinstance(row["output"], str)
    assert "debug" not in proc.stdout
    for worker in (0, 1):  # both workers ran batches, and each is named
        assert f"[codeferry worker {worker}] debug from forward\n" in proc.stderr, proc.stderr
    assert "fd-level debug\n" in proc.stderr


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_run_output_on_stdout_holds_only_json_when_the_model_prints(
        method: str, tmp_path: Path) -> None:
    model = printing_model(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "codeferry", "run", str(model), "--input", str(prompts),
         "--trust-remote-code", "--workers", "2", "--start-method", method,
         "--batch-size", "1", "--max-new-tokens", "2"],
        capture_output=True, text=True, timeout=600, env=env(), check=False)
    check_streams(proc)


def test_warm_workers_print_to_stderr_too(tmp_path: Path) -> None:
    model = printing_model(tmp_path)
    script = tmp_path / "warm.py"
    script.write_text(WARM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(model), *PROMPTS],
                          capture_output=True, text=True, timeout=600, env=env(), check=False)
    check_streams(proc)
