"""``codeferry.load``: resolve, decide trust, register, execute in order, tell transformers."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from . import _loader, _pickling, _policy, _transformers
from ._lockfile import Lock, read_lock
from ._resolve import Bundle, resolve
from ._store import UnitData, unit_digest
from .errors import RemoteCodeExecutionError, TrustRequiredError

__all__ = ["load", "units_of", "class_key"]

_lock = threading.Lock()


def class_key(source: str, key: str) -> str:
    """The key of ``load``'s mapping: ``auto_map`` key, prefixed for nested sub-configs."""
    if ":" in source:
        return f"{source.split(':', 1)[1]}:{key}"
    return key


def units_of(bundle: Bundle) -> dict[str | None, UnitData]:
    """The bundle's code split by repo (``None``: the model's own), ready to register."""
    units: dict[str | None, UnitData] = {}
    repos = {f.repo for f in bundle.files} | {c.repo for c in bundle.classes}
    for repo in sorted(repos, key=lambda r: r or ""):
        files = {path: data for (r, path), data in bundle.sources.items() if r == repo}
        prefix = f"{repo}--" if repo else ""
        order = tuple(
            name[len(prefix):] for name in bundle.load_order
            if (name.startswith(prefix) if repo else "--" not in name)
        )
        packages = frozenset(m.name for m in bundle.modules if m.repo == repo and m.is_package)
        label = f"{repo}@{bundle.pins[repo]}" if repo else bundle.source.name
        units[repo] = UnitData(unit_digest(files), files, order, packages, label)
    return units


def trust_error(bundle: Bundle) -> TrustRequiredError:
    files = tuple(
        (f"{f.repo}--" if f.repo else "") + f.path for f in bundle.files if f.kind != "asset"
    )
    listing = ", ".join(files)
    return TrustRequiredError(
        f"the model ships code that would run in this process and in every worker: "
        f"{listing} (digest {bundle.digest}).",
        files=files,
        path=str(bundle.source.root),
        fix="read it (`codeferry inspect MODEL`, `codeferry audit MODEL`), then pass "
        "trust_remote_code=True or lock=FILE (on the command line --trust-remote-code or "
        "--lock FILE; `codeferry lock MODEL -o FILE` writes one).",
    )


def load(
    model: str | os.PathLike[str],
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    lock: Lock | str | os.PathLike[str] | None = None,
) -> Mapping[str, Any]:
    """Load every ``auto_map`` class of ``model`` in dependency order, once per process.

    Returns ``auto_map`` key -> class (a ``[slow, fast]`` pair maps to a tuple; a nested
    sub-config's entries are keyed ``"llm_config:AutoConfig"``). The classes are
    registered with transformers' Auto classes, so ``AutoConfig/AutoModel*/AutoTokenizer
    .from_pretrained(model)`` return instances of exactly these classes afterwards, and
    objects of them pickle with their code, so any process can receive them.

    Code runs only with ``trust_remote_code=True`` or a ``lock`` (a ``Lock`` or the path
    of a lock file) that lists exactly this code; once a lock was used in a process, that
    process runs (and accepts from other processes) only code some lock of it lists.
    """
    bundle = resolve(model, revision=revision, requirements=False)
    bundle.check()
    if lock is not None:
        locked = lock if isinstance(lock, Lock) else read_lock(lock)
        locked.check(bundle)
    elif not trust_remote_code and bundle.files:
        raise trust_error(bundle)
    units = units_of(bundle)
    _policy.allow({u.digest for u in units.values()}, from_lock=lock is not None)
    with _lock:
        runtimes = {repo: _loader.register(unit) for repo, unit in units.items()}
        for repo, runtime in runtimes.items():
            for name in runtime.unit.order:
                try:
                    _loader.import_module(runtime, name)
                except Exception as exc:
                    path = runtime.locate(name)
                    where = (path[0] if path else None) or name
                    raise RemoteCodeExecutionError(
                        f"executing {where} of {runtime.unit.label} raised "
                        f"{type(exc).__name__}: {exc}",
                        digest=runtime.unit.digest, model=runtime.unit.label,
                        path=str(bundle.source.root / where) if repo is None else where,
                        fix="see the cause above; a missing package is listed by "
                        f"`codeferry inspect {bundle.source.root}` under requirements.",
                    ) from exc
        classes: dict[str, Any] = {}
        owners: dict[type, _loader.Runtime] = {}
        pairs: dict[str, list[Any]] = {}
        for ref in bundle.classes:
            runtime = runtimes[ref.repo]
            cls = getattr(_loader.import_module(runtime, ref.module), ref.name)
            owners[cls] = runtime
            key = class_key(ref.source, ref.key)
            if ref.slot is None:
                classes[key] = cls
            else:
                slots = pairs.setdefault(key, [])
                slots.extend([None] * (ref.slot + 1 - len(slots)))
                slots[ref.slot] = cls
        for key, slots in pairs.items():
            classes[key] = tuple(slots + [None] * (2 - len(slots)))
        try:
            import transformers  # noqa: F401
        except ImportError:
            return classes
        registered = _transformers.register_with_transformers(classes, owners)
        if None in runtimes:
            _transformers.serve_verified_files(registered, bundle.source.root, runtimes[None])
        return registered


_pickling.install_cloudpickle_support()
