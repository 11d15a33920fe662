"""How objects of remote-code classes travel to any process, interpreter or node.

The failure this module exists for (vllm #572, #6607, ray #42731): a config pickles
*by reference* to the module that defined its class, and the receiving process cannot
import that module. cloudpickle's ``register_pickle_by_value`` (vLLM's answer) ships
the class body instead, which drags module globals along (vllm #11055) and makes a new
class object per message in the receiver.

codeferry ships the *code unit* instead, once per pickle stream, ahead of the object:

    instance  -> (_rebuild, (ticket, func, args), state, ...)
                   ticket -> (_arrive, (digest, package, label, order, packages, payload))

where ``(func, args, state)`` is what the class's own ``__reduce_ex__`` returned. On
loading, ``_arrive`` runs first (it comes first in the stream): it verifies the bytes
against the digest, registers the unit, and only then are the classes looked up by name,
so they resolve to the one module of that unit in the receiver. One ticket object per
unit per process means pickle's memo writes the payload once per stream however many
objects refer to it.

Payloads by channel:

* plain ``pickle``, cloudpickle, Ray: the ticket *embeds* the unit's bytes
  (zlib-compressed), because the receiver may be another machine with an empty store;
* multiprocessing's ``ForkingPickler`` (``Pool``, ``ProcessPoolExecutor``, ``Process``
  arguments, ``torch.multiprocessing``): always a process on this machine, so the
  ticket carries only the digest and the receiver reads the store, which the sender
  filled when it loaded the code. Every message stays small.

A class sent alone pickles by name under ``pickle`` (any process on this machine finds
it through the store). Under cloudpickle (and Ray's copy of it), whose by-reference
path has no hook for plain classes, we extend its ``reducer_override`` for codeferry's
classes only, so a class alone carries its ticket too and works on another machine.
The alternative, a custom metaclass on every remote class, reaches every pickler but
changes ``type(cls)`` and breaks multiple inheritance with other metaclasses; see the
README's trade-offs section.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pickle
import re
import sys
import threading
import types
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from .._code.digest import is_digest, is_token, token_of
from ..errors import CodeUnavailableError, TicketPackageError
from . import loader as _loader
from .store import Unit, read_unit

__all__ = ["Ticket", "mark_module", "mark_class", "ticket_for", "is_ferried", "registration_of"]

_MARK = "__codeferry_package__"
_lock = threading.Lock()


class Ticket:
    """The passport of a unit: what a receiver needs before it looks up any class."""

    __slots__ = ("embedded", "registration")

    def __init__(self, registration: _loader.Registration, embedded: bool) -> None:
        self.registration = registration
        self.embedded = embedded

    def __reduce__(self) -> tuple[Any, ...]:
        registration = self.registration
        unit = registration.unit
        if not self.embedded:
            # Same machine: the receiver reads the store, so the package name (which
            # holds the digest's token) is all it takes.
            if registration.package == _loader.default_package(unit):
                return (_arrive_ref, (registration.package,))
            return (_arrive_ref, (registration.package, unit.token))
        return (_arrive, (unit.digest, registration.package, unit.label, unit.order,
                          tuple(sorted(unit.packages)), _payload(registration)))

    # copy/deepcopy go through __reduce_ex__ too: a ticket is immutable, keep it as is.
    def __copy__(self) -> Ticket:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Ticket:
        return self


def _payload(registration: _loader.Registration) -> bytes:
    cached = registration.extras.get("payload")
    if not isinstance(cached, bytes):
        cached = zlib.compress(pickle.dumps(dict(registration.unit.files), protocol=4), 6)
        registration.extras["payload"] = cached
    return cached


def ticket_for(registration: _loader.Registration, *, embedded: bool) -> Ticket:
    key = "ticket.embedded" if embedded else "ticket.ref"
    ticket = registration.extras.get(key)
    if not isinstance(ticket, Ticket):
        ticket = Ticket(registration, embedded)
        registration.extras[key] = ticket
    return ticket


_ALIAS = re.compile(r"transformers_modules(\.[A-Za-z0-9_]+)+")


def _check_package(package: object, digest: object, label: object = None) -> str:
    """The token a ticket's unit may be registered under ``package`` with, or a typed error.

    A ticket names its own package (so a transformers-loaded unit keeps its
    ``transformers_modules.`` name in the receiver), which makes the name sender's data:
    only the unit's own content name, or a ``transformers_modules.`` alias, is accepted.
    ``digest`` is a full digest, a token, or ``None`` (then the package carries it).
    """
    text = package if isinstance(package, str) else repr(package)
    if isinstance(digest, str) and is_digest(digest):
        token: str | None = token_of(digest)
    elif isinstance(digest, str) and is_token(digest):
        token = digest
    elif digest is None and isinstance(package, str) and package.startswith(_loader.PREFIX + ".u"):
        token = package[len(_loader.PREFIX) + 2:]
        token = token if is_token(token) else None
    else:
        token = None
    if token is not None and isinstance(package, str) and (
        package == f"{_loader.PREFIX}.u{token}" or _ALIAS.fullmatch(package)
    ):
        return token
    raise TicketPackageError(
        f"a pickled object asks to register code ({digest}) under package {text!r}, which "
        f"is neither its own name ({_loader.PREFIX}.u<first 32 hex digits of its digest>) "
        "nor a transformers_modules. alias; it was refused before anything ran.",
        package=text, digest=digest if isinstance(digest, str) else None,
        model=label if isinstance(label, str) else None,
        fix="unpickle only messages from processes you trust; a sender running codeferry "
        "never writes such a ticket, so this one was crafted or damaged.",
    )


def _arrive(
    digest: str,
    package: str,
    label: str,
    order: Sequence[str],
    packages: Sequence[str],
    payload: bytes,
) -> Ticket:
    """Receiver side: make the unit importable under ``package`` before anything uses it."""
    _check_package(package, digest, label)
    existing = _loader.registered(package)
    if existing is not None and existing.unit.digest == digest:
        return ticket_for(existing, embedded=True)
    files = pickle.loads(zlib.decompress(payload))
    unit = Unit(digest, files, tuple(order), frozenset(packages), label)
    return ticket_for(_loader.register(unit, package), embedded=True)


def _arrive_ref(package: str, token: str | None = None) -> Ticket:
    """Receiver side of a by-reference ticket: the unit comes from this machine's store."""
    token = _check_package(package, token)
    existing = _loader.registered(package)
    if existing is not None:
        return ticket_for(existing, embedded=False)
    stored = read_unit(token)
    if stored is None:
        raise CodeUnavailableError(
            f"the code {token}... for {package} is not in this process's codeferry store, "
            "and the message carried only its digest.",
            digest=token, model=package,
            fix="use one store for all processes on a machine (same HOME/XDG_CACHE_HOME, "
            "or CODEFERRY_HOME), or send with pickle/cloudpickle, which carry the code.",
        )
    return ticket_for(_loader.register(stored, package, stored=True), embedded=False)


def _rebuild(ticket: Ticket, func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Receiver side: the ticket has arrived (it was unpickled first); build the object."""
    return func(*args)


def _rebuild_packed(
    ticket: Ticket, func: Callable[..., Any], args: tuple[Any, ...], packed: bytes
) -> Any:
    """Like ``_rebuild``, for a config whose state travelled compressed."""
    from multiprocessing.reduction import ForkingPickler

    obj = func(*args)
    state = ForkingPickler.loads(zlib.decompress(packed))
    setstate = getattr(obj, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    else:
        obj.__dict__.update(state)
    return obj


def _load_class(ticket: Ticket, name: str, qualname: str) -> Any:
    obj: Any = _loader.import_module(ticket.registration, name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# -- the sending side -----------------------------------------------------------------


def is_ferried(cls: type) -> bool:
    return isinstance(getattr(cls, _MARK, None), str)


def registration_of(cls: type) -> _loader.Registration:
    registration = _loader.registered(getattr(cls, _MARK))
    assert registration is not None, "a marked class always has a registered unit"
    return registration


def _inner_reduce(obj: Any, protocol: int) -> Any:
    """What the object's class would return without us: the next ``__reduce_ex__`` in the MRO."""
    for klass in type(obj).__mro__:
        method = klass.__dict__.get("__reduce_ex__")
        if method is not None and method is not _reduce_ex:
            return method(obj, protocol)
    raise TypeError(f"cannot reduce {type(obj)!r}")  # unreachable: object defines it


def _wrap(obj: Any, protocol: int, *, embedded: bool) -> Any:
    rv = _inner_reduce(obj, protocol)
    if not isinstance(rv, tuple):
        return rv
    ticket = ticket_for(registration_of(type(obj)), embedded=embedded)
    return (_rebuild, (ticket, rv[0], rv[1]), *rv[2:])


def _reduce_ex(self: Any, protocol: int) -> Any:
    return _wrap(self, protocol, embedded=True)


def _is_config(cls: type) -> bool:
    return any(k.__name__ == "PreTrainedConfig" and k.__module__.startswith("transformers.")
               for k in cls.__mro__)


def _reduce_by_ref(obj: Any) -> Any:
    rv = _wrap(obj, pickle.DEFAULT_PROTOCOL, embedded=False)
    if (
        isinstance(rv, tuple) and len(rv) >= 3 and isinstance(rv[2], dict)
        and all(extra is None for extra in rv[3:]) and _is_config(type(obj))
    ):
        # A config is sent over and over (every request of an engine); its state is a
        # dict of mostly repeated keys, so it compresses to about the size of its JSON.
        from multiprocessing.reduction import ForkingPickler

        (ticket, func, args), state = rv[1], rv[2]
        packed = zlib.compress(bytes(ForkingPickler.dumps(state)), 1)
        return (_rebuild_packed, (ticket, func, args, packed))
    return rv


def _class_reduce(cls: type, *, embedded: bool) -> Any:
    registration = registration_of(cls)
    name = cls.__module__[len(registration.package) + 1:] if cls.__module__ != registration.package else ""
    return (_load_class, (ticket_for(registration, embedded=embedded), name, cls.__qualname__))


def mark_class(cls: type, registration: _loader.Registration) -> None:
    """Make instances of ``cls`` (and ``cls`` itself, under cloudpickle) carry their code."""
    install_cloudpickle_support()
    type.__setattr__(cls, _MARK, registration.package)
    type.__setattr__(cls, "__reduce_ex__", _reduce_ex)
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(cls, _reduce_by_ref)


def mark_module(module: types.ModuleType, registration: _loader.Registration) -> None:
    """Mark every class the module defines (its own, not the ones it imports)."""
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            mark_class(value, registration)


_loader.on_module_executed.append(mark_module)


# -- cloudpickle and Ray's vendored copy ------------------------------------------------

_CLOUDPICKLE_MODULES = ("cloudpickle.cloudpickle", "ray.cloudpickle.cloudpickle")


def _patch_cloudpickle(module: types.ModuleType) -> None:
    pickler = getattr(module, "Pickler", None)
    if pickler is None or getattr(pickler, "_codeferry_patched", False):
        return
    original = pickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if isinstance(obj, type) and _MARK in obj.__dict__:
            return _class_reduce(obj, embedded=True)
        return original(self, obj)

    pickler.reducer_override = reducer_override
    pickler._codeferry_patched = True


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Patch cloudpickle modules when they are imported after us."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _CLOUDPICKLE_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(
                    module: types.ModuleType, original_exec: Any = original_exec
                ) -> None:
                    original_exec(module)
                    _patch_cloudpickle(module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


_cloudpickle_support = False


def install_cloudpickle_support() -> None:
    """Patch cloudpickle and Ray's copy now if imported, else as soon as they are.

    Not at import: the first ``load``/``install()`` and the first class marked (the
    classes of a unit a ticket brought) call it, so importing codeferry leaves
    cloudpickle and ``sys.meta_path`` as they were.
    """
    global _cloudpickle_support
    if _cloudpickle_support:
        return
    with _lock:
        for name in _CLOUDPICKLE_MODULES:
            if name in sys.modules:
                _patch_cloudpickle(sys.modules[name])
        if not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportHook())
        _cloudpickle_support = True
