"""Cold-start failures of N torchrun ranks over M launches: plain transformers vs `codeferry exec`.

Every launch starts ``torchrun --standalone --nproc_per_node=N`` (gloo, CPU) with an empty
transformers module cache and codeferry store; after a barrier every rank calls
``AutoConfig.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`` on the same repo id (a tiny factory model in an offline hub cache)
at the same moment. That is the shape of the reports in failure-modes F5 (NeMo-Automodel
#1840, openvla-oft #155, xtuner #1313, TensorRT-LLM #17708): partial file writes,
``PermissionError``, ``AttributeError: module ... has no attribute`` at 4+ ranks. The rank
script is plain transformers; the second column runs it unchanged under ``codeferry exec``.
Prints a table and the command that produced it. Short form by default; the long form::

    nice -n 10 python benchmarks/bench_cold_ranks.py --ranks 8 --launches 1000
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from codeferry.testing import ModelSpec, write_hub_model

REPO = "acme/cold-ranks"

RANK = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()  # every rank loads at the same moment
    try:
        AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
        AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        result = "ok"
    except Exception as exc:
        result = f"{type(exc).__name__}: {str(exc)[:200]}"
    with open(f"{sys.argv[2]}/rank{rank}.json", "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()
""")


def launch(root: Path, hub: Path, ranks: int, routed: bool) -> list[str]:
    """One cold launch: each rank's outcome (``"ok"``, the error, or ``"no report"``)."""
    fresh = Path(tempfile.mkdtemp(dir=root))
    out = fresh / "out"
    out.mkdir()
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(fresh / "modules"), "CODEFERRY_HOME": str(fresh / "store"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, "--standalone", f"--nproc_per_node={ranks}", str(root / "rank.py"),
            REPO, str(out)]
    if routed:
        argv = [sys.executable, "-m", "codeferry", "exec", "--trust-remote-code", "--", *argv]
    subprocess.run(argv, env=env, cwd=fresh, capture_output=True, timeout=900, check=False)
    outcomes = []
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        outcomes.append(json.loads(path.read_text()) if path.exists() else "no report")
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cold-ranks-") as tmp:
        root = Path(tmp)
        hub = root / "hub"
        write_hub_model(hub, REPO, ModelSpec(name="coldranks", helpers=("flat",)))
        (root / "rank.py").write_text(RANK, encoding="utf-8")
        print(f"{args.ranks} ranks x {args.launches} cold launches (torchrun, gloo, CPU)\n")
        print("| | launches with a failed rank | failed ranks | seconds per launch | errors |")
        print("|---|---:|---:|---:|---|")
        for label, routed in (("plain transformers", False), ("under `codeferry exec`", True)):
            errors: collections.Counter[str] = collections.Counter()
            failed_launches = failed_ranks = 0
            start = time.perf_counter()
            for _ in range(args.launches):
                bad = [o for o in launch(root, hub, args.ranks, routed) if o != "ok"]
                failed_launches += bool(bad)
                failed_ranks += len(bad)
                errors.update(o.split(":")[0] for o in bad)
            per = (time.perf_counter() - start) / args.launches
            seen = ", ".join(f"{name} x{n}" for name, n in errors.most_common()) or "none"
            print(f"| {label} | {failed_launches}/{args.launches} | "
                  f"{failed_ranks}/{args.launches * args.ranks} | {per:.1f} | {seen} |")
    print("\ncommand: " + shlex.join(["python", "benchmarks/bench_cold_ranks.py",
                                      f"--ranks={args.ranks}", f"--launches={args.launches}"]))


if __name__ == "__main__":
    main()
