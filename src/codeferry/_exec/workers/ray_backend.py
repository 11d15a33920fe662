"""The Ray transport: executor workers as Ray actors, on nodes that never saw the model.

What a node gets, and from where::

    driver                                   each node (once, whatever its actor count)
    ──────                                   ──────────────────────────────────────────
    Ferry: manifest {path: sha256, size}     ferry/<manifest token>/  written whole, under a
      code, configs, tokenizer:      ──────▶   file lock: code and configs from the object
        one object                             store, each checked against its sha256;
      weights: one object each,                weights from the node's own hub cache when it
        when under SHIP_LIMIT in all           holds the repo at the same commit (checked
                                               too), else from the object store

Ray's object store moves an object to a node once; the second actor there finds the
folder written and fetches nothing. The actor then runs ``worker``'s engine on that
folder: it loads the code through ``load_pinned`` with the driver's digest and the
caller's trust or lock, so a node executes only the verified bytes it was sent, and
refuses code its lock does not list. Nothing is read from the driver's disk, a shared
filesystem or the Hub. Requests and replies are the local transport's messages, carried
by actor calls; every Ray failure becomes a codeferry error with Ray's as the cause.

Weights above ``CODEFERRY_RAY_SHIP_LIMIT`` bytes (default 2 GiB) are not shipped: a node
without them in its own cache fails to start with ``WeightsTooLargeError``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ... import _settings
from ..._code.digest import file_sha256, manifest_token, path_sha256
from ..._code.source import WEIGHT_SUFFIXES, ModelOrigin, list_files
from ..._runtime.store import store_root
from ...errors import ClusterError, ClusterUnreachableError, ExtraMissingError, WeightsTooLargeError
from .transport import Event, Post
from .worker import WorkerSpec, error_payload, remote_error, unpack_reply

__all__ = ["Ferry", "RayTransport", "build_ferry", "connect", "is_weight", "materialize"]

#: Seconds a driver keeps trying to reach the cluster at an explicit address before it
#: gives up (Ray's own connect retries take minutes, and log every attempt).
CONNECT_WAIT_S = 5.0

def is_weight(rel: str) -> bool:
    """Weights travel one object each and may come from a node's own cache instead; every
    other file (code, configs, tokenizer) travels in one object with the rest."""
    return rel.endswith(WEIGHT_SUFFIXES)


def ray_module() -> Any:
    """``ray``, or a typed error naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ExtraMissingError(
            "backend='ray' needs Ray, which is not installed.", extra="ray",
            fix="pip install 'codeferry[ray]'") from exc
    return ray


@dataclass(frozen=True)
class Ferry:
    """What a node needs to build the model folder; plain data and object refs."""

    token: str
    manifest: dict[str, tuple[str, int]]
    small: Any  # ObjectRef of {path: bytes}
    large: dict[str, Any]  # path -> ObjectRef (absent: not shipped, too large)
    repo_id: str | None
    commit: str | None

    @property
    def code_bytes(self) -> int:
        """Bytes every node receives from the driver, at most once."""
        return sum(size for rel, (_, size) in self.manifest.items() if not is_weight(rel))


def build_ferry(bundle: Any, model: ModelOrigin | None = None) -> Ferry:
    """Put the model folder of ``bundle`` into the object store (the driver's side).

    ``model``: the folder of another revision than the code's (``code_revision``), whose
    config and weights the actors build the model from; the code's folder (all but its
    weights) then travels inside it, under ``CODE_FOLDER``.
    """
    ray = ray_module()
    origin = model or bundle.origin
    files = list_files(origin)
    if model is not None:
        files |= {f"{CODE_FOLDER}/{rel}": path for rel, path in list_files(bundle.origin).items()
                  if not is_weight(rel)}
    manifest = {rel: (path_sha256(path), path.stat().st_size) for rel, path in files.items()}
    small = {rel: files[rel].read_bytes() for rel in manifest if not is_weight(rel)}
    for rel, data in cross_repo_files(bundle).items():
        manifest[rel] = (file_sha256(data), len(data))
        small[rel] = data
    token = manifest_token(manifest)
    big = {rel: size for rel, (_, size) in manifest.items() if is_weight(rel)}
    shipped = sum(big.values()) <= _settings.ray_ship_limit()
    large = {rel: ray.put(files[rel].read_bytes()) for rel in big} if shipped else {}
    return Ferry(token, manifest, ray.put(small), large, origin.repo_id, origin.commit)


#: Inside a node's copy of the folder: a hub cache of the cross-repo code the model names
#: (hidden, so that it is no file of the model's own).
CROSS_REPO_CACHE = ".codeferry-hub"
#: Inside a node's copy of the folder: the code's own folder, when it is another revision's.
CODE_FOLDER = ".codeferry-code"


def cross_repo_files(bundle: Any) -> dict[str, bytes]:
    """The code of every other repo the model's ``auto_map`` names, laid out as a hub cache
    (``refs/main`` at the commit the driver pinned), under ``CROSS_REPO_CACHE``."""
    out: dict[str, bytes] = {}
    for (repo, path), data in bundle.contents.items():
        if repo is None:
            continue
        base = f"{CROSS_REPO_CACHE}/models--{repo.replace('/', '--')}"
        commit = bundle.pins[repo]
        out[f"{base}/snapshots/{commit}/{path}"] = data
        out[f"{base}/refs/main"] = commit.encode()
    return out


def _cached_copy(ferry: Ferry, rel: str) -> Path | None:
    """The file in this node's own hub cache, at the same commit and the same bytes."""
    if not (ferry.repo_id and ferry.commit):
        return None
    path = (_settings.hub_cache() / ("models--" + ferry.repo_id.replace("/", "--")) / "snapshots"
            / ferry.commit / rel)
    try:
        real = path.resolve(strict=True)
    except OSError:
        return None
    return real if path_sha256(real) == ferry.manifest[rel][0] else None


def materialize(ferry: Ferry) -> tuple[Path, dict[str, Any]]:
    """This node's copy of the model folder, written once (the node's side).

    Returns the folder and what it took: bytes fetched from the driver, files found in
    the node's own cache (both zero when another actor on this node wrote it already).
    """
    from filelock import FileLock

    ray = ray_module()
    root = store_root().parent / "ferry"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = root / ferry.token
    stats = {"fetched_bytes": 0, "from_node_cache": 0, "written": False}
    with FileLock(str(folder) + ".lock"):
        if folder.is_dir():
            return folder, stats
        tmp = Path(tempfile.mkdtemp(prefix=f".{ferry.token}.", dir=root))
        try:
            small: dict[str, bytes] = ray.get(ferry.small)
            stats["fetched_bytes"] += sum(len(b) for b in small.values())
            for rel, (sha, size) in sorted(ferry.manifest.items()):
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                if not is_weight(rel):
                    data = small[rel]
                elif (cached := _cached_copy(ferry, rel)) is not None:
                    target.symlink_to(cached)
                    stats["from_node_cache"] += 1
                    continue
                elif rel in ferry.large:
                    data = ray.get(ferry.large[rel])
                    stats["fetched_bytes"] += len(data)
                else:
                    raise WeightsTooLargeError(
                        f"this node has no copy of {rel} ({size} bytes) at commit "
                        f"{ferry.commit}, and the driver ships large files only up to "
                        f"CODEFERRY_RAY_SHIP_LIMIT={_settings.ray_ship_limit()} bytes in all.",
                        path=rel, fix="download the model into each node's Hugging Face cache "
                        "at the same commit (`hf download REPO --revision COMMIT`), or raise "
                        "CODEFERRY_RAY_SHIP_LIMIT.")
                if file_sha256(data) != sha:
                    raise ClusterError(f"{rel} arrived with other bytes than the driver sent.",
                                       path=rel, fix="run again; report it if it persists.")
                target.write_bytes(data)
            os.rename(tmp, folder)  # whole or not at all
            stats["written"] = True
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder, stats


class RayWorker:
    """The actor: one executor worker on whichever node Ray placed it."""

    def __init__(self) -> None:
        self.engine: Any = None

    def start(self, spec: WorkerSpec, ferry: Ferry) -> tuple[Any, ...]:
        ray = ray_module()
        node = {"node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}
        try:
            if spec.engine.release:  # this node's own, before anything imports transformers
                from .release import enter

                enter(spec.engine.release)
            from .checks import check_device
            from .worker import build_engine

            check_device(spec.device)
            folder, stats = materialize(ferry)
            cross = folder / CROSS_REPO_CACHE
            code = folder / CODE_FOLDER
            options = replace(spec.options, cache_dir=str(cross) if cross.is_dir() else None)
            self.engine = build_engine(replace(spec, model=str(folder), options=options,
                                               code=str(code) if code.is_dir() else None))
        except BaseException as exc:  # noqa: BLE001 - the handshake carries it to the driver
            return ("failed", os.getpid(), error_payload(exc), node)
        info = {**self.engine.info(), **node, "ferry": stats, "folder": str(folder),
                "transformers": sys.modules["transformers"].__version__}
        return ("ready", os.getpid(), info)

    def handle(self, payload: bytes) -> tuple[str, Any]:
        from .worker import handle

        return handle(self.engine, payload)


def _cluster_error(exc: BaseException, what: str) -> ClusterError:
    error = ClusterError(f"{what}: Ray raised {type(exc).__name__}: {str(exc)[:500]}",
                         fix="the cause is Ray's own error.")
    error.__cause__ = exc
    return error


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of an explicit cluster address (``host:port``, ``ray://host:port``);
    ``None`` for ``auto``, ``local`` and anything else Ray reads its own way."""
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme != "ray":
            return None
        text = rest
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def _first_answer(hosts: list[str], port: int, wait: float) -> OSError | None:
    """Try a TCP connection to ``port`` of each of ``hosts`` until one succeeds or ``wait``
    seconds have passed; the last error, or ``None`` when something answered."""
    deadline = time.monotonic() + wait
    while True:
        for host in hosts:
            try:
                with socket.create_connection((host, port), timeout=min(1.0, wait)):
                    return None
            except OSError as exc:
                failure = exc
        if time.monotonic() >= deadline:
            return failure
        time.sleep(0.25)


def connect(address: str | None) -> None:
    """``ray.init`` for ``address`` (else ``RAY_ADDRESS``; else a new local cluster), typed.

    An explicit address where nothing answers within ``CONNECT_WAIT_S`` seconds is a
    ``ClusterUnreachableError`` before Ray is asked at all (Ray would retry for minutes and
    log each try); anything Ray raises while joining is a ``ClusterError`` with Ray's
    exception as the cause.
    """
    ray = ray_module()
    given = address or _settings.ray_address() or None
    source = "address= / --address" if address else "RAY_ADDRESS"
    fix = ("start the cluster there (`ray start --head --port PORT` on its head node), or "
           "pass the address `ray start --head` printed (--address / address=, or "
           "RAY_ADDRESS); without one, codeferry starts a local Ray on this machine.")
    target = _host_port(given) if given else None
    if given is not None and target is not None:
        host, port = target
        hosts = [host]
        if host == "localhost" or host.startswith("127."):
            # Ray joins this node's own address in place of a loopback one
            with contextlib.suppress(Exception):
                hosts.append(ray.util.get_node_ip_address())
        failure = _first_answer(hosts, port, CONNECT_WAIT_S)
        if failure is not None:
            error = ClusterUnreachableError(
                f"no Ray cluster answers at {given} ({source}): "
                f"{failure.strerror or failure} after {CONNECT_WAIT_S:g} s of tries.",
                address=given, fix=fix)
            raise error from failure
    try:
        ray.init(address=given, log_to_driver=False)
    except Exception as exc:
        where = f"the Ray cluster at {given} ({source})" if given else "a local Ray cluster"
        raise ClusterError(
            f"cannot join {where}: Ray raised {type(exc).__name__}: {str(exc)[:500]}",
            fix=fix if given else "see Ray's error (the cause); `ray stop` ends a stale "
            "local cluster.") from exc


class _RayChannel:
    def __init__(self, slot: int, actor: Any, start_ref: Any, post: Post) -> None:
        self.slot = slot
        self.actor = actor
        self._pid: int | None = None
        self._node = "?"
        self._post = post
        self._closing = False
        self._lock = threading.Lock()  # the reader's _end against stop
        self._refs: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._refs.put((-1, start_ref))
        threading.Thread(target=self._read, name=f"codeferry-ray-{slot}", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def where(self) -> str:
        return f"actor pid {self._pid} on node {self._node}"

    def _read(self) -> None:
        ray = ray_module()
        task_errors = (ray.exceptions.RayTaskError,)
        while True:
            item = self._refs.get()
            if item is None or self._closing:
                return
            request, ref = item
            try:
                reply = ray.get(ref)
            except task_errors as exc:  # Ray itself failed the call: not a dead actor
                if request < 0:
                    self._end()
                    self._post(Event(self, "failed", _cluster_error(exc, "the actor's start")))
                    return
                self._post(Event(self, "reply", (request, False,
                                                 _cluster_error(exc, "an actor call"))))
                continue
            except Exception as exc:  # noqa: BLE001 - ActorDiedError, NodeDiedError, ...
                if not self._closing:
                    self._post(Event(self, "died", (f"died ({type(exc).__name__})",
                                                    _cluster_error(exc, "the actor died"))))
                return
            if request < 0:
                self._pid = reply[1]
                if reply[0] == "ready":
                    self._node = reply[2]["node_ip"]
                    self._post(Event(self, "ready", reply[2]))
                else:
                    self._node = reply[3]["node_ip"]
                    self._end()
                    self._post(Event(self, "failed", remote_error(reply[2], self.slot)))
                    return
            else:
                status, body = reply
                self._post(Event(self, "reply", (request, *unpack_reply(status, body, self.slot))))

    def send(self, request: int, payload: bytes) -> None:
        self._refs.put((request, self.actor.handle.remote(payload)))

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray_module().kill(self.actor, no_restart=True)

    def _end(self) -> None:
        """Kill the actor that failed to start, as a local worker exits: its CPUs free for
        the next try. Called before ``failed`` is posted, and not once ``stop`` has run: the
        post may end the executor, whose close shuts down a Ray it started, and Ray exits
        the whole process (no exception) when a thread calls it after its shutdown."""
        with self._lock:
            if not self._closing:
                self.kill()

    def stop(self, timeout: float) -> None:
        with self._lock:
            self._closing = True
        self._refs.put(None)
        self.kill()


class RayTransport:
    """Workers as Ray actors: ``address`` (or ``RAY_ADDRESS``) names the cluster."""

    name = "ray"
    depth = 3  # an actor call costs more than a pipe message: keep one more in flight

    @staticmethod
    def pack(payload: Any) -> bytes:
        """By cloudpickle, as Ray itself would: functions of ``__main__`` travel by value,
        objects of remote-code classes with their code embedded (another machine)."""
        import cloudpickle

        from ..._runtime.pickling import install_cloudpickle_support

        install_cloudpickle_support()
        return bytes(cloudpickle.dumps(payload))

    def __init__(self, code: Any, *, weights: ModelOrigin | None = None,
                 address: str | None = None, resources: dict[str, Any] | None = None) -> None:
        ray = ray_module()
        try:
            import cloudpickle  # noqa: F401 - ``pack`` needs it: said now, not mid-run
        except ImportError as exc:
            raise ExtraMissingError(
                "backend='ray' pickles requests with cloudpickle, which is not installed.",
                extra="ray", fix="pip install 'codeferry[ray]' (it brings cloudpickle).",
            ) from exc
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            connect(address)
        options = {"num_cpus": 1, **(resources or {})}
        self._actor = ray.remote(RayWorker).options(
            max_restarts=0, max_task_retries=0, max_concurrency=1,
            scheduling_strategy="SPREAD", **options)
        # ``code``: the model's resolved ``Bundle``; ``weights``: the weights' own folder when
        # they are another revision's (``Plan.separate_weights``).
        self.ferry = build_ferry(code, weights)

    def start(self, slot: int, spec: WorkerSpec, post: Post) -> _RayChannel:
        actor = self._actor.remote()
        return _RayChannel(slot, actor, actor.start.remote(spec, self.ferry), post)

    def close(self) -> None:
        if self._owns_ray:
            with contextlib.suppress(Exception):
                ray_module().shutdown()
