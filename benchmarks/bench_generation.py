"""Generation that looks like a real batch job: codeferry's ways against vLLM CPU, one run.

The model: a random-weight Llama (``--size``: ``70m`` is hidden 512, 12 layers, 8 heads,
70M parameters; ``200m`` hidden 1024, 12 layers, 16 heads, 217M; saved in ``--dtype``,
float32 or bfloat16, the dtype real checkpoints of this size ship in) over a word-level
tokenizer of 32,000 words (``tokenizers``' ``WordLevel``: one token a word, so a text's
token count is its word count, the same for every way) with a chat template
(``<|user|> ... <|end|> <|assistant|>``). Its output head is scaled (x``HEAD_SCALE``) so
that its next-token distributions are peaked, as a trained model's are: sampling then
follows paths near the greedy ones instead of drawing uniformly from 32,000 words.
``--remote``: the same weights as remote code (``auto_map``, a ``model_type`` neither
transformers nor vLLM implements), so every way runs the model's own files.

Its end-of-sequence ids are chosen so that outputs stop at their own, data-dependent,
widely different lengths: one greedy pass over the prompts, without any end-of-sequence,
``--max-new-tokens`` long; then, among the tokens no prompt contains, up to ``MAX_EOS``
tokens are taken one at a time, each the one that brings the outputs' ends (the position
after the first of them, or the full length) closest to evenly spread over the limit
(Kolmogorov-Smirnov distance to uniform). A random model's greedy outputs fall into loops of
one or two tokens, so no single token ends them at spread lengths; several ids, as Llama 3
has, do. They go into the config and generation config (``eos_token_id``, a list) and the
tokenizer (the first as ``eos_token`` and pad token, the others as special tokens, so every
way drops them from texts). The "model" line prints the ends.

Workloads (``--prompts`` prompts each, chat-formatted, 3 to 48 words of user text, most
short):

- ``greedy``: up to ``--max-new-tokens`` new tokens, greedy, stops at end-of-sequence;
- ``sampled``: the same with temperature 0.8, top-k 40, top-p 0.95 (each way draws its own
  numbers: token counts differ a little between ways, the table counts each way's own);
- ``forced16``: ``bench_vs_vllm.py``'s old workload on this model: 16 new tokens, greedy,
  every output exactly 16 (``min_new_tokens``; ``min_tokens`` and ``ignore_eos`` for vLLM);
- ``capped``: greedy, every output ``--max-new-tokens`` long, as in a job whose outputs
  reach their cap (``min_new_tokens`` as above).

Neighbours (``--neighbour``, one or more): the machine's other work, started before each
round's calls under it and stopped after: ``none``; ``one-core``, one process spinning (a
core's worth of work, placed by the kernel); ``half-both``, two processes each busy half
the time (5 ms on, 5 ms off), so both cores are half taken. Every round runs every way under
every neighbour in turn (A B C under each, then the next round), and the table gives each
way's median tok/s per neighbour with the range over rounds, its ratio to vLLM CPU under
the same neighbour, and the share of its quiet speed it kept.

Ways: vLLM CPU (``LLM`` defaults but the dtype: it is given the model's, where its own
default would run a float32 model in bfloat16; ``VLLM_CPU_KVCACHE_SPACE=1``), vLLM's
Transformers backend (``model_impl="transformers"``), both in ``--vllm-python``
(``_vllm_generation.py``: one served engine each, started alone so that its start-up is
timed alone, then kept for every workload, and stopped with SIGSTOP between its own calls,
since an idle engine still polls for work); ``codeferry.Executor`` at its defaults and
other settings (its default engine, ``auto``, drives vLLM inside its worker where this
script runs with a Python that has vLLM, e.g. ``--vllm-python``'s own, and transformers
otherwise: run it both ways; ``--setting '{"engine": "transformers"}'`` names the
transformers path); a plain transformers loop (``generate`` on batches of 8 in input order, 2
threads). Every way: a warm-up call, then ``--reps`` rounds in which every way makes one
timed call (medians): all ways, vLLM's included, are interleaved, so a ratio compares calls
made under the same load. "tok/s": generated tokens (end-of-sequence included)
per second; "first s": time to the first output within a timed call (``generate_iter``'s
first outcome; the plain loop's first batch; vLLM's ``LLM.generate`` hands back nothing
before the call ends); "peak RSS": the largest VmHWM among the way's processes, and their count. Greedy
texts are compared with the plain loop's. Run::

    HF_HUB_OFFLINE=1 nice -n 5 python benchmarks/bench_generation.py \\
        --vllm-python /work/vllm-venv/bin/python [--prompts 32 --max-new-tokens 128]
"""

from __future__ import annotations

# Only the standard library at module level: spawned workers import this file as __mp_main__.
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import bench_executor as be  # noqa: E402 - stdlib only at import
from bench_vs_vllm import skewed_prompts  # noqa: E402 - stdlib only at import

HEAD_SCALE = 8.0
MAX_EOS = 8
VOCAB = 32000
SIZES = {"70m": (512, 12), "200m": (1024, 12)}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.95}
SETTINGS = ('{"generate_path": "batched"}', '{"workers": 1}')


def _peak(worker: Any = None) -> int:
    """VmHWM of this process, bytes (runs in workers through collective_rpc too)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _gpu_peak(worker: Any = None) -> int:
    """The most accelerator memory this process's tensors held, bytes (0 without CUDA)."""
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_initialized() else 0


def user_texts(n: int) -> list[str]:
    """``n`` user messages of 3 to 48 words, most short: ``bench_vs_vllm``'s skewed prompts."""
    return skewed_prompts(n, stride=7)


def make_model(root: Path, size: str, prompts_user: list[str], new: int,
               dtype: str = "float32", device: str = "cpu",
               remote: bool = False) -> tuple[Path, dict[str, Any]]:
    """The model folder, and how its end-of-sequence was chosen (the greedy pass that
    chooses it runs on ``device``); ``remote``: the same weights as remote code
    (``as_remote``)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from codeferry._exec.generate.decode import RowOptions, decode

    marks = ["<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
    words = marks + sorted(set(be.WORDS))
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, chat_template=TEMPLATE,
                                        model_input_names=["input_ids", "attention_mask"])
    hidden, layers = SIZES[size]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model = model.to(getattr(torch, dtype))  # saved so: every way reads this dtype
    prompts = chat(tokenizer, prompts_user)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    torch.set_num_threads(os.cpu_count() or 1)
    rows = decode(model.to(device), ids, [RowOptions(new) for _ in ids], pad_token_id=0)
    model = model.to("cpu")
    # Not a token of any prompt, nor one an output starts with (every output at least 2 long).
    used = {t for row in ids for t in row} | set(range(len(marks))) | {row[0] for row in rows}
    eos, ends = choose_ends(rows, new, used)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.config.pad_token_id = model.generation_config.pad_token_id = eos[0]
    tokenizer.eos_token = tokenizer.pad_token = words[eos[0]]
    tokenizer.add_special_tokens({"additional_special_tokens": [words[t] for t in eos[1:]]})
    spread = statistics.pstdev(ends)
    path = root / f"llama-{size}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if remote:
        as_remote(path)
    params = sum(p.numel() for p in model.parameters())
    return path, {"eos": eos, "word": " ".join(words[t] for t in eos), "params": params,
                  "ends": sorted(ends), "spread": spread}


#: The remote code of ``--remote``: Llama's classes under a ``model_type`` no library
#: implements, so every way runs the model's own files (vLLM through its Transformers
#: backend, which takes code whose attention goes through ``AttentionInterface``).
REMOTE_FILES = {
    "configuration_benchllama.py": (
        "from transformers import LlamaConfig\n\n\n"
        "class BenchLlamaConfig(LlamaConfig):\n    model_type = \"benchllama\"\n"),
    "modeling_benchllama.py": (
        "from transformers import LlamaForCausalLM, LlamaModel\n\n"
        "from .configuration_benchllama import BenchLlamaConfig\n\n\n"
        "class BenchLlamaModel(LlamaModel):\n    config_class = BenchLlamaConfig\n\n\n"
        "class BenchLlamaForCausalLM(LlamaForCausalLM):\n"
        "    config_class = BenchLlamaConfig\n"),
}


def as_remote(path: Path) -> None:
    """The saved Llama in ``path`` made a remote-code model: its classes in its own files,
    named by ``auto_map``."""
    for name, text in REMOTE_FILES.items():
        (path / name).write_text(text)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="benchllama", architectures=["BenchLlamaForCausalLM"], auto_map={
        "AutoConfig": "configuration_benchllama.BenchLlamaConfig",
        "AutoModel": "modeling_benchllama.BenchLlamaModel",
        "AutoModelForCausalLM": "modeling_benchllama.BenchLlamaForCausalLM"})
    (path / "config.json").write_text(json.dumps(config, indent=2))


def choose_ends(rows: list[list[int]], new: int, used: set[int]) -> tuple[list[int], list[int]]:
    """End-of-sequence ids (at most ``MAX_EOS``) under which the outputs ``rows`` end as
    evenly spread over ``1..new`` as they can: added one at a time, each the token that
    brings the ends' distribution closest to uniform (Kolmogorov-Smirnov distance).

    Each row's first position of each token is found once: a candidate's ends are then
    the current ends cut by those positions (a pass over the rows, not over every token)."""
    firsts: list[dict[int, int]] = []
    for row in rows:
        first: dict[int, int] = {}
        for at, token in enumerate(row):
            first.setdefault(token, at + 1)
        firsts.append(first)

    def with_token(ends: list[int], token: int) -> list[int]:
        return [min(end, first.get(token, new)) for end, first in zip(ends, firsts, strict=True)]

    def distance(ends: list[int]) -> float:
        ordered = sorted(ends)
        return max(abs((i + 1) / len(ordered) - e / new) for i, e in enumerate(ordered))

    chosen: list[int] = []
    ends = [new] * len(rows)
    best = distance(ends)
    candidates = sorted({t for row in rows for t in row} - used)
    while len(chosen) < MAX_EOS:
        scored = min(((distance(with_token(ends, t)), t) for t in candidates), default=None)
        if scored is None or scored[0] >= best:
            break
        best = scored[0]
        chosen.append(scored[1])
        ends = with_token(ends, scored[1])
    return chosen or candidates[:1], ends


def chat(tokenizer: Any, users: list[str]) -> list[str]:
    return [str(tokenizer.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                              add_generation_prompt=True)) for u in users]


def count(text: str, new: int) -> int:
    """Generated tokens of an output: its words, and its end-of-sequence when it stopped early."""
    words = len(text.split())
    return words + (1 if words < new else 0)


@dataclass
class Way:
    label: str
    #: One call of every prompt: the texts, and the seconds to the first of them.
    call: Callable[[], tuple[list[str], float]]
    startup_s: float | None
    peak: Callable[[], list[int]] = lambda: [_peak()]
    #: Accelerator memory per process (``--device cuda``), like ``peak``.
    gpu_peak: Callable[[], list[int]] = lambda: [_gpu_peak()]
    times: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
    #: The warm-up call, when it is not ``call`` (the plain loop warms up on one batch).
    warm: Callable[[], tuple[list[str], float]] | None = None
    note: str = ""
    peaks: list[int] = field(default_factory=list)
    gpu_peaks: list[int] = field(default_factory=list)
    #: Seconds of each timed call, by neighbour (``run_ways``).
    runs: dict[str, list[float]] = field(default_factory=dict)


def executor_way(label: str, path: str, prompts: list[str], options: dict[str, Any],
                 **settings: Any) -> Way:
    import codeferry

    env = settings.pop("env", {})  # e.g. {"CODEFERRY_CPU_BIND": "0"}: set while it starts
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        start = time.perf_counter()
        ex = codeferry.Executor(path, preload=("generate",), **settings)
        startup = time.perf_counter() - start
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def call() -> tuple[list[str], float]:
        begin, first, texts = time.perf_counter(), 0.0, [""] * len(prompts)
        for outcome in ex.generate_iter(prompts, **options):
            first = first or time.perf_counter() - begin
            texts[outcome.index] = outcome.value
        return texts, first

    info = ex.worker_info[0]
    return Way(label, call, startup,
               peak=lambda: list(ex.collective_rpc(_peak)),
               gpu_peak=lambda: list(ex.collective_rpc(_gpu_peak)), close=ex.close,
               note=f"{len(ex.worker_info)} workers, {info['generate_path']}"
               + ("" if info["generate_path"] == "decode"
                  else f" ({str(info.get('generate_reason', ''))[:90]})"))


def started_way(label: str, *args: Any, **settings: Any) -> Way | None:
    """``executor_way``, or ``None`` with the error printed: one way that cannot start (a
    setting this device does not take) leaves the others to be measured."""
    try:
        return executor_way(label, *args, **settings)
    except Exception as exc:  # printed, and the run goes on
        print(f"{label}: did not start: {type(exc).__name__}: {exc}"[:600])
        return None


def plain_way(path: str, prompts: list[str], options: dict[str, Any], device: str = "cpu",
              size: int = 0, remote: bool = False) -> Way:
    """``generate`` on batches of ``size`` (``be.BATCH``, 8, by default) in input order,
    left-padded, 2 threads, this process, the model on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = size or be.BATCH
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left",
                                              trust_remote_code=remote)
    model = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=remote).to(device).eval()

    def batch(texts: list[str]) -> list[str]:
        enc = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(**enc, pad_token_id=tokenizer.pad_token_id,
                                 **{"do_sample": False, **options})
        return [str(tokenizer.decode(row, skip_special_tokens=True))
                for row in out[:, enc["input_ids"].shape[1]:]]

    gpu = device.startswith("cuda")
    seen: list[int] = []

    def run() -> tuple[list[str], float]:
        torch.set_num_threads(2)
        if gpu:  # this process's peak, over this way's own calls only
            torch.cuda.reset_peak_memory_stats()
        begin, texts, first = time.perf_counter(), [], 0.0
        for start in range(0, len(prompts), size):
            texts += batch(prompts[start:start + size])
            first = first or time.perf_counter() - begin
        if gpu:
            seen.append(int(torch.cuda.max_memory_allocated()))
        return texts, first

    def warm() -> tuple[list[str], float]:
        return batch(prompts[:size]), 0.0

    where = "2 threads" if device == "cpu" else device
    return Way(f"plain transformers loop (generate, batches of {size}, {where})", run, None,
               warm=warm, gpu_peak=lambda: [max(seen, default=0)])


class VllmEngine:
    """One served vLLM engine (``_vllm_generation.py``) in ``--vllm-python``, in its own
    process group: started alone (its start-up is timed with nothing else running), then
    called between codeferry's calls, so every rep runs every way under the same load; its
    processes are stopped between its own calls (``pause``)."""

    LABELS: ClassVar[dict[str, str]] = {
        "auto": "vLLM CPU (LLM defaults)", "transformers": 'vLLM CPU, model_impl="transformers"'}

    def __init__(self, python: str, path: str, impl: str, dtype: str, root: Path,
                 remote: bool = False) -> None:
        import secrets
        import subprocess
        from multiprocessing.connection import Listener

        self.impl, self.root, self.error = impl, root, ""
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        spec = {"model": path, "model_impl": impl, "dtype": dtype, "max_model_len": 1024,
                "trust_remote_code": remote,
                "address": list(listener.address), "authkey": key.hex()}
        (root / f"vllm-{impl}.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if not k.startswith("CODEFERRY_")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_WORKER_MULTIPROC_METHOD="spawn", CODEFERRY_VLLM_PLUGIN="0",
                   VLLM_CACHE_ROOT=str(root / "vllm-cache"))
        self.log = root / f"vllm-{impl}.log"
        with open(self.log, "wb") as log:
            self.child = subprocess.Popen(
                [python, str(HERE / "_vllm_generation.py"), str(root / f"vllm-{impl}.json")],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.conn = listener.accept()
        listener.close()
        hello = self.conn.recv() if self.conn.poll(3600) else {"error": "no answer in an hour"}
        self.startup_s = hello.get("startup_s")
        if "error" in hello:
            self.fail(hello["error"])
        self.pause()

    def pause(self) -> None:
        """Stop the engine's processes (SIGSTOP) between its own calls. Idle, its processes
        still poll for work for seconds after a call (about 10% of a core measured later,
        more just after one); a way timed next would share the cores with them, and threads
        that meet at a barrier per op lose most."""
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGSTOP)

    def resume(self) -> None:
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGCONT)

    def fail(self, error: str) -> None:
        self.error = error
        tail = self.log.read_text(errors="replace")[-1500:]
        print(f"vLLM ({self.impl}) failed: {error[:300]}\n{tail}")

    def way(self, prompts: list[str], params: dict[str, Any]) -> Way | None:
        if self.error:
            return None

        def call() -> tuple[list[str], float]:
            self.resume()
            begin = time.perf_counter()
            self.conn.send({"prompts": prompts, "params": params})
            reply = self.conn.recv()
            elapsed = time.perf_counter() - begin
            self.pause()
            if "error" in reply:
                raise RuntimeError(f"vLLM ({self.impl}): {reply['error']}")
            return reply["texts"], elapsed  # nothing comes back before the call ends

        def peak() -> list[int]:
            self.resume()
            self.conn.send({"peak": True})
            peaks = list(self.conn.recv()["peak_rss"].values())
            self.pause()
            return peaks

        return Way(self.LABELS[self.impl], call, self.startup_s, peak=peak,
                   gpu_peak=lambda: [], note="one engine, every prompt in one generate call")

    def close(self) -> None:
        import signal

        try:
            self.resume()
            self.conn.send({"stop": True})
        except OSError:
            pass
        try:
            os.killpg(self.child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.child.wait()


def vllm_params(options: dict[str, Any], eos: list[int]) -> dict[str, Any]:
    new = options["max_new_tokens"]
    if options.get("min_new_tokens"):
        return {"temperature": 0.0, "max_tokens": new, "min_tokens": new, "ignore_eos": True}
    if options.get("do_sample"):
        return {"temperature": options["temperature"], "top_k": options["top_k"],
                "top_p": options["top_p"], "max_tokens": new, "stop_token_ids": eos, "seed": 0}
    return {"temperature": 0.0, "max_tokens": new, "stop_token_ids": eos}


#: The neighbours' programs (``--neighbour``): how many processes, and what each runs.
NEIGHBOURS: dict[str, tuple[int, str]] = {
    "none": (0, ""),
    "one-core": (1, "while True:\n    pass\n"),
    "half-both": (2, "import time\nwhile True:\n    end = time.perf_counter() + 0.005\n"
                     "    while time.perf_counter() < end:\n        pass\n"
                     "    time.sleep(0.005)\n"),
}


@contextlib.contextmanager
def neighbour(name: str) -> Any:
    """The machine's other work (``NEIGHBOURS[name]``) while the block runs."""
    import subprocess

    count, program = NEIGHBOURS[name]
    procs = [subprocess.Popen([sys.executable, "-c", program]) for _ in range(count)]
    try:
        time.sleep(0.5 if procs else 0)  # running before the first call starts
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_ways(ways: list[Way], reps: int, neighbours: tuple[str, ...] = ("none",)) -> None:
    """A warm-up call of every way, then ``reps`` rounds: in each, every neighbour in turn,
    and under it one call of every way."""
    for way in ways:
        way.texts = (way.warm or way.call)()[0]
    for _ in range(reps):
        for name in neighbours:
            with neighbour(name):
                for way in ways:
                    start = time.perf_counter()
                    texts, first = way.call()
                    way.runs.setdefault(name, []).append(time.perf_counter() - start)
                    if name == neighbours[0]:
                        way.texts = texts
                        way.times.append(way.runs[name][-1])
                        way.firsts.append(first)
    for way in ways:
        way.peaks = way.peak()
        way.gpu_peaks = way.gpu_peak()


def table(name: str, new: int, prompts: list[str], ways: list[Way],
          reference: list[str] | None) -> None:
    rows = []
    for way in ways:
        median = statistics.median(way.times)
        tokens = sum(count(t, new) for t in way.texts)
        rows.append((way, median, tokens / median))
    base = next((rate for way, _, rate in rows if way.label == VllmEngine.LABELS["auto"]), None)
    print(f"\n### {name}: {len(prompts)} prompts, up to {new} new tokens\n")
    gpu = any(any(way.gpu_peaks) for way in ways)
    print("| way | tok/s | vs vLLM CPU | items/s | first s | start-up s | peak RSS "
          + ("| peak GPU " if gpu else "") + "| tokens | same greedy text | note |")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else "") + "---:|---:|---|")
    for way, median, rate in rows:
        first = statistics.median(way.firsts)
        ratio = f"{rate / base:.2f}x" if base else "-"
        same = ("-" if reference is None or name == "sampled"
                else f"{sum(a.strip() == b.strip() for a, b in zip(way.texts, reference, strict=True))}"
                f"/{len(way.texts)}")
        peak = f"{max(way.peaks) / 2**30:.2f} GiB x{len(way.peaks)}" if way.peaks else "-"
        if gpu:
            peak += f" | {max(way.gpu_peaks) / 2**30:.2f} GiB" if way.gpu_peaks else " | -"
        startup = "-" if way.startup_s is None else f"{way.startup_s:.1f}"
        print(f"| {way.label} | {rate:.1f} | {ratio} | {len(prompts) / median:.2f} | {first:.2f} "
              f"| {startup} | {peak} | {sum(count(t, new) for t in way.texts)} | {same} "
              f"| {way.note} |")
    neighbours = list(ways[0].runs) if ways else []
    if len(neighbours) > 1:
        neighbour_table(name, new, ways, neighbours)


def neighbour_table(name: str, new: int, ways: list[Way], neighbours: list[str]) -> None:
    """Each way's tok/s under each neighbour: median [min-max] over rounds, the ratio of
    medians to vLLM CPU's under the same neighbour, and the share of its quiet median kept."""
    def rates(way: Way, where: str) -> list[float]:
        tokens = sum(count(t, new) for t in way.texts)  # greedy: the same texts every round
        return sorted(tokens / s for s in way.runs[where])

    base = next((w for w in ways if w.label == VllmEngine.LABELS["auto"]), None)
    print(f"\n### {name} beside neighbours: tok/s median [min-max] of {len(ways[0].runs[neighbours[0]])}"
          " rounds, vs vLLM CPU under the same neighbour, share of its quiet speed kept\n")
    print("| way | " + " | ".join(neighbours) + " |")
    print("|---|" + "---:|" * len(neighbours))
    for way in ways:
        cells = []
        quiet = statistics.median(rates(way, neighbours[0]))
        for where in neighbours:
            got = rates(way, where)
            cell = f"{statistics.median(got):.0f} [{got[0]:.0f}-{got[-1]:.0f}]"
            if base is not None:
                cell += f", {statistics.median(got) / statistics.median(rates(base, where)):.2f}x"
            if where != neighbours[0]:
                cell += f", kept {statistics.median(got) / quiet:.0%}"
            cells.append(cell)
        print(f"| {way.label} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--vllm-python", help="a Python with vllm installed")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--size", choices=sorted(SIZES), default="70m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the dtype the model is saved in; every way runs it (vLLM is "
                        "given it: its own default would run a float32 model in bfloat16)")
    parser.add_argument("--workload", action="append",
                        choices=["greedy", "sampled", "forced16", "capped"])
    parser.add_argument("--neighbour", action="append", choices=sorted(NEIGHBOURS),
                        help="the machine's other work during the timed calls, one or more "
                        "(default: none); each round runs every way under each in turn")
    parser.add_argument("--vllm-impl", action="append", choices=["auto", "transformers"],
                        help="vLLM's ways (default: both)")
    parser.add_argument("--setting", action="append", default=None,
                        help="Executor settings (JSON) besides the defaults ('none': the defaults alone; "
                        "'env': variables set while it starts); default: "
                        + " ".join(SETTINGS))
    parser.add_argument("--device", default="cpu",
                        help="where codeferry's ways and the plain loop run (cpu, cuda); "
                        "vLLM's ways are vLLM CPU's wherever this is")
    parser.add_argument("--plain-batch", type=int, action="append", default=None,
                        help=f"the plain loop's batch size, one way each (default {be.BATCH}; "
                        "0: no plain loop)")
    parser.add_argument("--remote", action="store_true",
                        help="the same model as remote code (auto_map, a model_type no "
                        "library implements): every way runs its own files")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no workload after this many seconds (a leased machine)")
    args = parser.parse_args()
    settings = [s for s in args.setting or SETTINGS if s != "none"]
    chosen = args.workload or ["greedy", "sampled", "forced16"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-generation-") as name:
        root = Path(name)
        be.isolate(root)
        be.preamble()
        if args.device != "cpu":
            import torch

            print(f"device: {args.device}, {torch.cuda.get_device_name()}")
        users = user_texts(args.prompts)
        path, made = make_model(root, args.size, users, args.max_new_tokens, args.dtype,
                                args.device, args.remote)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.remote)
        prompts = chat(tokenizer, users)
        lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
        print(f"model: {made['params'] / 1e6:.0f}M parameters, {args.dtype}"
              f"{', remote code' if args.remote else ''}; prompts {min(lengths)}-"
              f"{max(lengths)} tokens (median {statistics.median(lengths):.0f}); end-of-sequence "
              f"{made['word']!r} (ids {made['eos']}): greedy ends {made['ends'][0]}-"
              f"{made['ends'][-1]} (median {statistics.median(made['ends']):.0f}, "
              f"stdev {made['spread']:.1f}) of {args.max_new_tokens}")
        new = args.max_new_tokens
        options = {"greedy": {"max_new_tokens": new}, "sampled": {"max_new_tokens": new, **SAMPLED},
                   "forced16": {"max_new_tokens": 16, "min_new_tokens": 16},
                   "capped": {"max_new_tokens": new, "min_new_tokens": new}}
        engines = [VllmEngine(args.vllm_python, str(path), impl, args.dtype, root, args.remote)
                   for impl in args.vllm_impl or ("auto", "transformers")
                   ] if args.vllm_python else []
        neighbours = tuple(dict.fromkeys(args.neighbour or ["none"]))
        where = {} if args.device == "cpu" else {"device": args.device}
        trust = {"trust_remote_code": True} if args.remote else {}
        for workload in chosen:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                print(f"\n### {workload}: not run (past --budget-s {args.budget_s:.0f})")
                continue
            opts = options[workload]
            ways = [w for e in engines
                    if (w := e.way(prompts, vllm_params(opts, made["eos"]))) is not None]
            tried: list[Way | None] = [started_way(
                f"codeferry Executor({json.dumps(where)[1:-1]}), defaults" if where
                else "codeferry Executor, defaults", str(path), prompts, opts, **where,
                **trust)]
            for setting in settings:
                tried.append(started_way(f"codeferry Executor({setting})", str(path), prompts,
                                         opts, **where, **trust, **json.loads(setting)))
            plains = [plain_way(str(path), prompts, opts, args.device, size, args.remote)
                      for size in args.plain_batch or [be.BATCH] if size > 0]
            ways += [w for w in tried if w is not None] + plains
            run_ways(ways, args.reps, neighbours)
            for way in ways:
                way.close()
            limit = opts["max_new_tokens"]
            table(workload, limit, prompts, ways, plains[0].texts if plains else
                  (ways[0].texts if workload != "sampled" and ways else None))
            sys.stdout.flush()
        for engine in engines:
            engine.close()
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
