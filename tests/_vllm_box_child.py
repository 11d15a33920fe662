"""Runs inside the vLLM environment (``CODEFERRY_VLLM_PYTHON``): a hostile remote-code model
(``tests/sandbox/_hostile.py``) through ``codeferry.Executor(engine="vllm")``, in the box and
out of it (``tests/vllm/test_vllm_box.py``).

``python _vllm_box_child.py MODEL PORT OUT``: ``MODEL`` reads its control file (``STAGE
ATTEMPT PORT``), written here before each engine or request; ``PORT`` listens on 127.0.0.1.
Writes JSON to ``OUT``: for each way, the benign outputs, and for each attempt what the
caller got (``["refused", operation, target]``, ``"ok"``, or another error's text).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ATTEMPTS = ("ssh_key", "hub_token", "env_token", "connect_local", "connect_metadata", "udp",
            "write_bashrc", "write_model", "shell", "signal_parent")
PROMPTS = ["w1 w2 w3 w4 w5", "w7 w8"]
#: vLLM's start-up kept short: no compiled graphs, a small context.
FAST = {"max_model_len": 128, "enforce_eager": True}


def outcome(call: Any) -> Any:
    """What ``call`` gave the caller: ``"ok"``, the box's refusal, or another error."""
    from codeferry.errors import SandboxRefusedError

    try:
        call()
    except Exception as exc:  # reported: the test judges
        seen: BaseException | None = exc
        while seen is not None and not isinstance(seen, SandboxRefusedError):
            seen = seen.__cause__
        if isinstance(seen, SandboxRefusedError):
            return ["refused", seen.operation, seen.target]
        return f"{type(exc).__name__}: {exc}"[:2000]
    return "ok"


def main(model: Path, port: int, out: Path) -> None:
    import codeferry

    control = model / "control"

    def executor(box: bool) -> Any:
        return codeferry.Executor(model, workers=1, engine="vllm", trust_remote_code=True,
                                  sandbox=box, max_retries=0, engine_options=FAST)

    from vllm.utils import cpu_resource_utils as cores

    from codeferry._install.vllm import cores_in

    # what the box reads from /sys instead of asking lscpu, against vLLM's own reader (here,
    # outside the box, where lscpu runs)
    report: dict[str, Any] = {"cores": [cores_in(), [[c.id, c.physical_core, c.numa_node]
                                                     for c in cores._get_cpu_list()]]}
    for box in (True, False):
        way: dict[str, Any] = {"forward": {}}
        control.unlink(missing_ok=True)
        with executor(box) as ex:
            way["engine"] = [i["generate_path"] for i in ex.worker_info]
            way["outputs"] = ex.generate(PROMPTS, max_new_tokens=8)
            for attempt in ATTEMPTS:
                control.write_text(f"forward {attempt} {port}")
                way["forward"][attempt] = outcome(lambda: ex.generate(["w1"], max_new_tokens=2))
            control.unlink()
            way["after"] = ex.generate(PROMPTS, max_new_tokens=8)
        if box:  # in vLLM's own construction of the model, and at its import
            control.write_text(f"init connect_local {port}")
            way["init"] = outcome(lambda: executor(True).close())
            control.write_text(f"import ssh_key {port}")
            way["import"] = outcome(lambda: executor(True).close())
            control.unlink()
        way["planted"] = (model / "planted.txt").exists()
        way["bashrc"] = (Path.home() / ".bashrc").read_text()
        report["box" if box else "open"] = way
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
