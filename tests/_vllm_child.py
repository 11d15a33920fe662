"""Runs inside the vLLM environment (``CODEFERRY_VLLM_PYTHON``), one vLLM start per process.

``build ROOT``: tiny Llama models, one plain-architecture reference and remote-code copies
of it (same weights and tokenizer, own ``model_type``) in the helper layouts plain vLLM
cannot load:

- ``plain``: ``modeling_xllama.py`` imports ``configuration_xllama.py``;
- ``subpkg``: the modeling file also does ``from .ops.rope import apply_rotary``;
- ``fromdot``: the modeling file also does ``from . import layers``;
- ``broken``: the ``fromdot`` layout whose ``layers.py`` imports a package that is not installed.

The remote classes append one JSON line per config/model they build to
``$CODEFERRY_VLLM_PROBE`` (pid, the module of the config class, whether the model's
``config_class`` is the config's type, the process's lock state), so the test sees every
vLLM process, not only the driver.

``run MODEL OUT [--tp N]``: ``LLM(model=MODEL, trust_remote_code=True, model_impl=
"transformers", ...)``, greedy tokens of one prompt into ``OUT`` as JSON, or the error's
type and text when vLLM refuses the model. Also used by ``benchmarks/bench_vllm.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any


def run_in_group(args, *, env, stdout, timeout, cwd=None):
    """Run a vLLM driver in its own process group; end the whole group when it is done.

    The driver leaves without vLLM's shutdown (``os._exit``), so its EngineCore and
    workers are ended here, by the group id. Give ``stdout`` a file or ``DEVNULL``: those
    processes inherit it, and a pipe would stay open until they end. Shared by the
    integration test and ``benchmarks/bench_vllm.py``; imports nothing of vLLM.
    """
    import signal
    import subprocess

    child = subprocess.Popen(args, stdout=stdout, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, cwd=cwd)
    try:
        return child.wait(timeout=timeout)
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()


def child_env(root: Path, src: Path, **extra: str) -> dict[str, str]:
    """A vLLM child's environment: ``src``'s codeferry, offline, every vLLM cache and
    temporary file under ``root``, none of the parent's vLLM or codeferry lock settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CODEFERRY_VLLM_PLUGIN", "CODEFERRY_LOCK", "VLLM_"))
           and k not in {"OMP_NUM_THREADS", "HF_MODULES_CACHE"}}
    for name in ("tmp", "vllm-cache", "hf"):
        (root / name).mkdir(parents=True, exist_ok=True)
    env.update(PYTHONPATH=str(src), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_WORKER_MULTIPROC_METHOD="spawn", TOKENIZERS_PARALLELISM="false",
               TMPDIR=str(root / "tmp"), VLLM_CACHE_ROOT=str(root / "vllm-cache"),
               HF_HOME=str(root / "hf"), **extra)
    return env


PROMPT = "w1 w2 w3 w4 w5"
MAX_TOKENS = 8
WORDS = 120  # vocabulary: 3 special tokens and w0..w119

PROBE = '''
def _probe(what, obj, config):
    import json as _json
    import os as _os
    import sys as _sys
    path = _os.environ.get("CODEFERRY_VLLM_PROBE")
    if not path:
        return
    policy = _sys.modules.get("codeferry._trust.policy")
    record = {
        "what": what, "pid": _os.getpid(),
        "config_module": type(config).__module__,
        "self_module": type(obj).__module__,
        "config_class_is_type": getattr(obj, "config_class", type(config)) is type(config),
        "transformers_modules": sorted(
            n for n, m in _sys.modules.items()
            if n.startswith("transformers_modules.") and getattr(m, "__file__", None)),
        "locked": getattr(policy, "_locked", None),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(_json.dumps(record) + "\\n")
'''

CONFIGURATION = '''from transformers import LlamaConfig
''' + PROBE + '''

class XLlamaConfig(LlamaConfig):
    model_type = "xllama"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _probe("config", self, self)
'''

MODELING = '''from transformers import LlamaForCausalLM, LlamaModel

from .configuration_xllama import XLlamaConfig
{helper_import}
''' + PROBE + '''

class XLlamaModel(LlamaModel):
    config_class = XLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        {helper_use}
        _probe("model", self, config)


class XLlamaForCausalLM(LlamaForCausalLM):
    config_class = XLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        {helper_use}
        _probe("model", self, config)
'''

LAYOUTS: dict[str, dict[str, Any]] = {
    "plain": {"helper_import": "", "helper_use": "pass", "files": {}},
    "subpkg": {
        "helper_import": "from .ops.rope import apply_rotary",
        "helper_use": "assert apply_rotary(1.0) == 1.0",
        "files": {"ops/__init__.py": "", "ops/rope.py": "def apply_rotary(x):\n    return x\n"},
    },
    "fromdot": {
        "helper_import": "from . import layers",
        "helper_use": "assert layers.SCALE == 1.0",
        "files": {"layers.py": "SCALE = 1.0\n"},
    },
    "broken": {
        "helper_import": "from . import layers",
        "helper_use": "assert layers.SCALE == 1.0",
        "files": {"layers.py": "import codeferry_missing_package_x\n\nSCALE = 1.0\n"},
    },
}

AUTO_MAP = {
    "AutoConfig": "configuration_xllama.XLlamaConfig",
    "AutoModel": "modeling_xllama.XLlamaModel",
    "AutoModelForCausalLM": "modeling_xllama.XLlamaForCausalLM",
}


def build(root: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    reference = root / "reference"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=128, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random weights large enough that greedy tokens vary
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(reference)
    fast.save_pretrained(reference)
    for name, layout in LAYOUTS.items():
        folder = root / name
        shutil.copytree(reference, folder)
        data = json.loads((folder / "config.json").read_text())
        data.update(model_type="xllama", architectures=["XLlamaForCausalLM"], auto_map=AUTO_MAP)
        (folder / "config.json").write_text(json.dumps(data, indent=2))
        (folder / "configuration_xllama.py").write_text(CONFIGURATION)
        (folder / "modeling_xllama.py").write_text(
            MODELING.replace("{helper_import}", layout["helper_import"])
            .replace("{helper_use}", layout["helper_use"]))
        for rel, text in layout["files"].items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)


def run(model: str, out: Path, tp: int) -> None:
    started = time.perf_counter()
    result: dict[str, Any] = {"model": model, "tp": tp, "driver_pid": os.getpid()}
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, trust_remote_code=True, model_impl="transformers",
                  dtype="float32", max_model_len=128, enforce_eager=True,
                  tensor_parallel_size=tp, seed=0,
                  distributed_executor_backend="mp" if tp > 1 else None)
        result["startup_s"] = time.perf_counter() - started
        config = llm.llm_engine.model_config.hf_config
        result["driver_config_module"] = type(config).__module__
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        first = time.perf_counter()
        outputs = llm.generate([PROMPT], params, use_tqdm=False)
        result["first_request_s"] = time.perf_counter() - first
        result["tokens"] = list(outputs[0].outputs[0].token_ids)
    except Exception as exc:  # the test compares what vLLM says with what codeferry says
        result["error_type"] = type(exc).__name__
        result["error"] = str(exc)
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown of its processes is not what is measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("root", type=Path)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("out", type=Path)
    r.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build(args.root)
    else:
        run(args.model, args.out, args.tp)


if __name__ == "__main__":
    main()
