"""What runs inside an executor worker: load the code, build the model, serve batches.

A worker is started with everything it needs in one ``WorkerSpec`` (the model's folder,
its ``ModelOptions`` with the parent's trust decision, the digest the parent checked,
device, dtype, threads). It loads the remote code itself,
through ``codeferry.load``: nothing it inherited (from a fork, a preloaded zygote) is
trusted to mean the code is there, and it executes only the digest the parent checked
(``CodeChangedError`` otherwise), so a worker started after the folder changed cannot
run code nobody decided on. It then answers one message per request on its pipe::

    parent -> worker   (request_id, kind, pickled payload)   kind: generate|complete|embed|score|rpc|stop
    worker -> parent   (request_id, "ok", pickled result) | (request_id, "error", (blob, tb, text))

The payload travels pickled on its own, inside the message: the worker unpickles it
inside its error handling, so an input whose unpickling raises (or exits) becomes a
typed error reply for that request (``RequestUnpicklingError``) instead of killing the
worker, which the parent would retry until it gave up without the cause.

and a first ``("ready", pid, info)`` or ``("failed", ...)``: the start-up handshake. A
thread watches the parent (its pid, and a lifeline pipe for forkserver children, whose
parent is the fork server): if it dies, the worker exits at once, busy or not, so a
killed parent leaves no orphan behind.

A worker's stdout is its stderr (``stdout.route_stdout``): ``codeferry run`` writes its
output to the stdout the workers inherited, and a model that prints must not write into it
(nor tear its lines). Python-level lines arrive whole, named: ``[codeferry worker 0] ...``.
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._trust.options import ModelOptions

from .. import _settings
from .stdout import finish_stdout, route_stdout

__all__ = ["WorkerSpec", "error_payload", "handle", "pack", "remote_error", "unpack_reply",
           "worker_main"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker starts from; it travels pickled (to a Ray actor too)."""

    #: The folder the model is built from: config, tokenizer, weights.
    model: str
    #: Where the code is and whether it may run: the parent's ``ModelOptions.for_workers``,
    #: its trust decision made and no token.
    options: ModelOptions
    device: str
    dtype: str | None
    threads: int
    preload: tuple[str, ...]
    #: The digest the parent checked: the worker runs exactly this code or fails with
    #: ``CodeChangedError`` (``None``: whatever the trust or lock allows).
    digest: str | None = None
    #: ``auto``, ``continuous`` or ``batched``: see ``_generation.choose_path``.
    generate_path: str = "auto"
    #: ``False``: load and verify every class strictly, build nothing (``codeferry doctor``).
    serve: bool = True
    #: The folder of the code when it is another revision's than ``model``'s
    #: (``code_revision``, as in transformers): the classes are loaded and verified from
    #: here, the config, tokenizer and weights read from ``model`` with them.
    #: ``None``: ``model``'s own code.
    code: str | None = None



def _watch_parent(parent_pid: int, lifeline: Connection | None) -> None:
    """Exit the moment the executor's process is gone.

    ``os.getppid()`` names the executor only when it started us itself (spawn, fork, a
    zygote that passes its own pid). A forkserver child's parent is the fork server,
    so a change of parent means nothing there: the ``lifeline`` does. It is the read
    end of a pipe whose only write end the executor holds, so it reads EOF (``poll``
    returns) when the executor dies, however it dies; nothing is ever written to it.
    A process forked from the executor for other reasons would hold a copy of that write
    end, so the executor's pid is checked too.
    """
    ours = os.getppid() == parent_pid  # False under forkserver
    while True:
        if lifeline is not None:
            try:
                if lifeline.poll(0.2):
                    os._exit(0)  # EOF: the executor is gone
            except (EOFError, OSError):
                os._exit(0)
        else:
            time.sleep(0.2)
        if ours and os.getppid() != parent_pid:
            os._exit(0)  # orphaned: leave now, whatever we were doing
        if not ours:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass  # the pid is someone else's now, or not ours to signal: rely on the pipe


ErrorPayload = tuple[bytes | None, str, str]


def error_payload(exc: BaseException) -> ErrorPayload:
    """A worker's error as it travels: (pickled error or None, traceback, summary)."""
    text = traceback.format_exc()
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an unpicklable error still travels as text
        blob = None
    return blob, text, f"{type(exc).__name__}: {exc}"


def pack(payload: Any) -> bytes:
    """A request's payload as the worker receives it (pickled by the sender's pickler, so
    objects of remote-code classes carry their tickets, as on any multiprocessing pipe)."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(payload))


def remote_error(payload: ErrorPayload, worker: int) -> BaseException:
    """The parent's side of ``error_payload``: the worker's own error when it unpickles
    (a ``WorkerError`` with its summary when not), the worker's traceback as its cause.

    A ``SystemExit``, ``KeyboardInterrupt`` or other ``BaseException`` that is not an
    ``Exception`` is never handed back as is: raised in the parent it would exit the
    parent, or look like its own Ctrl-C. It becomes a ``WorkerError`` naming it.
    """
    from ..errors import RemoteTraceback, WorkerError

    blob, tb, text = payload
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - fall back to the text
            exc = None
    if exc is not None and not isinstance(exc, Exception):
        exc = WorkerError(f"worker {worker} raised {text} (a {type(exc).__name__} in a "
                          "worker ends that call, not the parent)", worker=worker,
                          fix="the cause above is the worker's own traceback.")
    if exc is None:
        exc = WorkerError(f"worker {worker} raised {text}", worker=worker)
    exc.__cause__ = RemoteTraceback(tb)
    return exc


class _Engine:
    """The models of one worker, built on first use of each kind of request."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from .._load import load_pinned, load_with

        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # load reports of heads a task does not use
        torch.set_num_threads(max(1, spec.threads))
        self.spec = spec
        self.models: dict[str, Any] = {}
        #: Linear layers packed for oneDNN, per model (``packing.py``; CPU only).
        self.packed: dict[str, int] = {}
        self._accepted: dict[int, tuple[set[str], bool]] = {}
        #: (path, why) once the generate model is built: see ``_generation.choose_path``.
        self.generate_path: tuple[str, str] | None = None
        #: ``config=`` for ``from_pretrained`` when the code is another revision's: ``model``'s
        #: config built by the loaded config class, so that transformers neither reads the
        #: code of ``model``'s own revision nor asks which config class owns its model_type.
        self._with_config: dict[str, Any] = {}
        code, options = spec.code or spec.model, spec.options
        if not spec.serve:
            # ``codeferry doctor``: the code arrives with the config, by ticket, first; a
            # lock binds this process before anything arrives.
            self.classes = (load_pinned(code, str(spec.digest), options)
                            if options.lock is not None else {})
            return
        if spec.digest is None:
            self.classes = load_with(code, options)
        else:
            self.classes = load_pinned(code, spec.digest, options)
        config_class: Any = self.classes.get("AutoConfig")
        if spec.code not in (None, spec.model) and config_class is not None:
            self._with_config["config"] = config_class.from_pretrained(spec.model)
        self.load_tokenizer()
        for kind in spec.preload:
            self.model_for(kind)

    def load_tokenizer(self, config: Any = None) -> None:
        """``AutoTokenizer`` of the model's folder, with a pad token (batches are padded).
        ``config``: the model's config, built by the loaded code (the doctor has it)."""
        from transformers import AutoTokenizer

        if config is not None and self.spec.code not in (None, self.spec.model):
            self._with_config["config"] = config
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.spec.model, revision=self.spec.options.revision, **self._with_config)
        if self.tokenizer.pad_token is None:
            fallback = self.tokenizer.eos_token or self.tokenizer.unk_token
            if fallback is not None:
                self.tokenizer.pad_token = fallback

    def model_for(self, kind: str) -> Any:
        import torch
        from transformers import AutoModel, AutoModelForCausalLM

        auto = AutoModel if kind == "embed" else AutoModelForCausalLM
        key = auto.__name__
        failed = getattr(self.classes, "failed", {})
        if key in failed:  # the model's own class could not load: say why, not "not found"
            raise failed[key]
        if key not in self.models:
            dtype = getattr(torch, self.spec.dtype) if self.spec.dtype else None
            self.adopt(kind, auto.from_pretrained(self.spec.model,
                                                  revision=self.spec.options.revision,
                                                  dtype=dtype, **self._with_config))
        return self.models[key]

    def adopt(self, kind: str, model: Any) -> None:
        """Serve ``kind`` with ``model`` (built by ``model_for``, or by the doctor from the
        config): on the device, in eval mode; for ``generate`` the path it takes
        (``generation.choose_path``, which needs the tokenizer's pad token)."""
        key = "AutoModel" if kind == "embed" else "AutoModelForCausalLM"
        self.models[key] = model.to(self.spec.device).eval()
        if self.spec.device.split(":")[0] == "cpu" and _settings.cpu_pack_enabled():
            from .packing import pack_linears

            self.packed[key] = pack_linears(self.models[key])
        if kind == "generate":
            from .generation import choose_path
            from .stream import choose

            # engine (issue 20): the decode loop first, where it is taken (stream.choose).
            requested = self.spec.generate_path
            self.generate_path = choose(self.models[key], requested, self.spec.device,
                                        self.tokenizer.pad_token_id) or choose_path(
                self.models[key], "auto" if requested == "decode" else requested,
                self.spec.device, self.tokenizer.pad_token_id)

    def info(self) -> dict[str, Any]:
        """What the ready message tells the parent: classes, and how ``generate`` runs."""
        path, why = self.generate_path or (None, "generate is not preloaded")
        return {"classes": sorted(self.classes), "generate_path": path, "generate_reason": why,
                "packed_linears": sum(self.packed.values())}

    def _encode(self, texts: list[str], *, left: bool, model: Any) -> tuple[Any, Any]:
        """Model inputs (only those ``forward`` takes), and the attention mask."""
        self.tokenizer.padding_side = "left" if left else "right"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        # Tokenizers of BERT lineage also return token_type_ids, which a causal LM's
        # forward (and generate's kwarg check) refuses: pass only what forward takes.
        if id(model) not in self._accepted:  # inspect.signature costs ~0.1 ms a call
            parameters = inspect.signature(model.forward).parameters
            self._accepted[id(model)] = (set(parameters), any(
                p.kind is p.VAR_KEYWORD for p in parameters.values()))
        accepted, takes_any = self._accepted[id(model)]
        inputs = {k: v.to(self.spec.device) for k, v in enc.items()
                  if k in accepted or (takes_any and k != "token_type_ids")}
        inputs.setdefault("input_ids", enc["input_ids"].to(self.spec.device))
        return inputs, enc["attention_mask"].to(self.spec.device)

    def generate_options(self, model: Any, options: dict[str, Any]) -> dict[str, Any]:
        """A request's ``generate`` options with the worker's defaults: sampling or not as
        the model's generation_config says (transformers' default: greedy), unless the caller
        says (the continuous path asks which), the new-token limit, the pad token."""
        options = {"do_sample": bool(model.generation_config.do_sample),
                   "max_new_tokens": _settings.DEFAULT_MAX_NEW_TOKENS, **options}
        if self.tokenizer.pad_token_id is not None:
            options.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        return options

    def stream(self) -> Any:
        """A ``stream.Stream`` when this worker generates with the decode loop, else ``None``."""
        if self.generate_path is None or self.generate_path[0] != "decode":
            return None
        from .stream import Stream

        return Stream(self.model_for("generate"), self.tokenizer)

    def generate(self, texts: list[str], options: dict[str, Any]) -> list[str]:
        import torch

        from .generation import continuous_supports, generate_continuous, lighter_min_new_tokens

        model = self.model_for("generate")
        options = self.generate_options(model, options)
        assert self.generate_path is not None  # set when the model was built
        if self.generate_path[0] == "decode":  # engine (issue 20): decode.py's loop
            from .stream import generate as decode_generate

            texts_out = decode_generate(model, self.tokenizer, texts, options)
            if texts_out is not None:
                return texts_out
        if self.generate_path[0] == "continuous" and continuous_supports(options):
            ids = self.tokenizer(texts)["input_ids"]  # unpadded: it pages, it does not pad
            rows = generate_continuous(model, ids, options, model.generation_config.eos_token_id)
            return [str(self.tokenizer.decode(row, skip_special_tokens=True)) for row in rows]
        enc, _ = self._encode(texts, left=True, model=model)
        options = lighter_min_new_tokens(options, enc["input_ids"].shape[1],
                                         model.generation_config)
        with torch.inference_mode():
            out = model.generate(**enc, **options)
        new = out[:, enc["input_ids"].shape[1]:]
        return [str(self.tokenizer.decode(row, skip_special_tokens=True)) for row in new]

    def complete(self, requests: list[Any], defaults: Any, chat_template: str | None,
                 planned: Any = None) -> list[Any]:
        """``Request`` values -> ``GenerateResult`` values: see ``complete``."""
        from .complete import complete

        return complete(self, requests, defaults, chat_template, planned)

    def embed(self, texts: list[str], pooling: str) -> list[list[float]]:
        import torch

        model = self.model_for("embed")
        enc, attention = self._encode(texts, left=False, model=model)
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = attention.unsqueeze(-1).to(hidden.dtype)
        if pooling == "mean":
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        elif pooling == "cls":
            pooled = hidden[:, 0]
        elif pooling == "last":
            last = attention.sum(1) - 1
            pooled = hidden[torch.arange(hidden.shape[0]), last]
        else:
            raise ValueError(f"unknown pooling {pooling!r}: use 'mean', 'cls' or 'last'")
        return [row.float().tolist() for row in pooled]

    def score(self, texts: list[str]) -> list[dict[str, Any]]:
        import torch

        model = self.model_for("score")
        enc, attention = self._encode(texts, left=False, model=model)
        with torch.inference_mode():
            logits = model(**enc).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = enc["input_ids"][:, 1:]
        picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        mask = attention[:, 1:].bool()
        results = []
        for row in range(len(texts)):
            ids = targets[row][mask[row]].tolist()
            values = picked[row][mask[row]].tolist()
            results.append({
                "tokens": self.tokenizer.convert_ids_to_tokens(ids),
                "token_logprobs": values,
                "logprob": float(sum(values)),
            })
        return results


def _unpack(blob: Any) -> Any:
    from ..errors import RequestUnpicklingError

    if not isinstance(blob, bytes):
        raise RequestUnpicklingError(f"a request's payload is {type(blob).__name__}, not bytes.",
                                     fix="send requests through codeferry.Executor only.")
    try:
        return pickle.loads(blob)
    except BaseException as exc:  # a SystemExit from __reduce__ included
        raise RequestUnpicklingError(
            f"a worker could not unpickle a request: {type(exc).__name__}: {exc}",
            fix="an input object fails to unpickle in a fresh process; make it picklable "
            "(or send plain data), then retry.",
        ) from exc


def worker_main(spec: WorkerSpec, conn: Connection, parent_pid: int,
                lifeline: Connection | None = None,
                inherited: Connection | None = None, slot: int | None = None) -> None:
    """Entry point of a worker process.

    ``lifeline``: see ``_watch_parent``. ``inherited``: the executor's write end of it,
    which a forked worker holds a copy of and must close, or EOF would never come.
    ``slot``: the worker's number, which names its stdout lines on stderr.
    """
    route_stdout("codeferry worker" if slot is None else f"codeferry worker {slot}")
    # Ctrl-C reaches the whole process group: the parent decides what stops, and how.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if inherited is not None:
        inherited.close()
    threading.Thread(target=_watch_parent, args=(parent_pid, lifeline), daemon=True).start()
    try:
        _serve(spec, conn)
    finally:
        finish_stdout()


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    try:
        engine = _Engine(spec)
    except BaseException as exc:  # noqa: BLE001 - the handshake carries it to the parent
        conn.send(("failed", os.getpid(), error_payload(exc)))
        return
    stream = engine.stream()  # engine (issue 20): batches merged into one decode loop
    # "streams": the scheduler may keep more batches in this worker's pipe (STREAM_DEPTH)
    conn.send(("ready", os.getpid(), {**engine.info(), "streams": stream is not None}))

    def step() -> None:
        for request_id, ok, value in stream.step():
            conn.send((request_id, *(("ok", pack(value)) if ok else ("error", error_payload(value)))))

    while True:
        if stream is not None and stream.busy and not conn.poll(0):
            step()
            continue
        try:
            request_id, kind, payload = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed our pipe: shut down
        planned = None  # a complete batch the stream planned and did not take
        if stream is not None and kind in ("generate", "complete"):
            try:
                request = _unpack(payload)
                if kind == "complete":
                    planned = stream.take_complete(request_id, engine, request["texts"],
                                                   request["defaults"], request["chat_template"])
                    taken = planned is None
                else:
                    taken = stream.take(request_id, request["texts"], engine.generate_options(
                        engine.model_for("generate"), request["options"]))
                if taken:
                    continue
            except BaseException as exc:  # noqa: BLE001 - reported, the worker lives on
                conn.send((request_id, "error", error_payload(exc)))
                continue
        while stream is not None and stream.busy:  # anything else runs with no decode in flight
            step()
        if kind == "stop":
            return
        conn.send((request_id, *handle(engine, kind, payload, planned)))


def handle(engine: _Engine, kind: str, payload: Any, planned: Any = None) -> tuple[str, Any]:
    """One request: ``("ok", pickled result)`` or ``("error", error payload)``; ``planned``:
    a ``complete`` batch already planned (``Stream.take_complete``).

    The result travels pickled on its own, like the request: the parent unpickles it
    knowing which request it answers, so a result it refuses (code its lock does not
    list) fails that request, typed, instead of the connection.
    """
    try:
        payload = _unpack(payload)
        if kind == "generate":
            result: Any = engine.generate(payload["texts"], payload["options"])
        elif kind == "complete":
            result = engine.complete(payload["texts"], payload["defaults"],
                                     payload["chat_template"], planned)
        elif kind == "embed":
            result = engine.embed(payload["texts"], payload["pooling"])
        elif kind == "score":
            result = engine.score(payload["texts"])
        elif kind == "rpc":
            func, args, kwargs = payload
            result = func(engine, *args, **kwargs)
        else:
            raise ValueError(f"unknown request {kind!r}")
        return "ok", pack(result)
    except BaseException as exc:  # noqa: BLE001 - reported, the worker lives on
        return "error", error_payload(exc)


def unpack_reply(status: str, body: Any, worker: int) -> tuple[bool, Any]:
    """The parent's side of ``handle``: ``(True, result)`` or ``(False, error)``."""
    if status != "ok":
        return False, remote_error(body, worker)
    try:
        return True, pickle.loads(body)
    except Exception as exc:  # noqa: BLE001 - typed errors (a refused ticket) pass as they are
        from ..errors import CodeferryError, WorkerError

        if isinstance(exc, CodeferryError):
            return False, exc
        error = WorkerError(f"worker {worker}'s reply could not be unpickled here: "
                            f"{type(exc).__name__}: {exc}", worker=worker,
                            fix="return plain data (or objects importable here) from the worker.")
        error.__cause__ = exc
        return False, error
