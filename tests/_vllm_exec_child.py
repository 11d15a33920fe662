"""Run by ``codeferry exec [--sandbox] --`` in the vLLM environment: vLLM's own ``LLM`` (the
plugin routing its remote code) on a hostile model (``tests/sandbox/_hostile.py``), one
request per attempt in its ``forward`` (``tests/vllm/test_vllm_box.py``).

``python _vllm_exec_child.py MODEL PORT``: prints one JSON object: the benign text, and for
each attempt ``"ok"``, or the last line of what the boot tells of its error uncaught (the box
names what it refused there: ``SandboxRefusedError``).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ATTEMPTS = ("ssh_key", "hub_token", "env_token", "connect_local", "connect_metadata", "udp",
            "write_bashrc", "write_model", "shell", "signal_parent")


def main(model: Path, port: int) -> None:
    from vllm import LLM, SamplingParams

    control = model / "control"  # the box lets this one file be written (the test says so)
    control.write_text("")
    llm = LLM(model=str(model), trust_remote_code=True, model_impl="transformers",
              dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    found: dict[str, object] = {
        "text": llm.generate(["w1 w2 w3 w4 w5"], params, use_tqdm=False)[0].outputs[0].text}
    for attempt in ATTEMPTS:
        control.write_text(f"forward {attempt} {port}")
        try:
            llm.generate(["w1"], SamplingParams(max_tokens=2), use_tqdm=False)
            found[attempt] = "ok"
        except Exception as exc:  # told as the boot tells it uncaught (sys.excepthook)
            text = io.StringIO()
            with contextlib.redirect_stderr(text):
                sys.excepthook(type(exc), exc, exc.__traceback__)
            found[attempt] = text.getvalue().strip().splitlines()[-1]
    control.write_text("")
    print(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
