"""codeferry inside vLLM: a ``vllm.general_plugins`` entry point.

vLLM resolves a remote-code model's classes with transformers'
``get_class_from_dynamic_module`` in the driver, again in its EngineCore and again in
every worker process, which it spawns itself. Code in the driver (``codeferry.load`` or
``codeferry.install``) cannot reach those processes; vLLM's general plugins can: vLLM
loads every entry point of the ``vllm.general_plugins`` group in each of its processes
before it resolves the model there. codeferry ships one (``register`` below), so with
codeferry installed in vLLM's environment every vLLM process loads remote code through
codeferry's resolver and loader (sub-package helpers, ``from . import x``, one config
class, verified bytes) with nothing to change in the user's script.

- It is on whenever codeferry is installed; ``CODEFERRY_VLLM_PLUGIN=0`` switches it off,
  except under ``CODEFERRY_LOCK``: a lock nobody enforces would bind nothing, so with a
  lock ``register()`` logs at error level and raises ``PluginDisabledUnderLockError`` when
  either that switch or ``CODEFERRY_INSTALL=0`` is off (``_settings.lock_switched_off``, the
  exec boot's rule too; vLLM calls its general plugins without catching: the process does
  not start).
- It decides no trust: vLLM passes ``trust_remote_code`` to transformers, which calls the
  hooked function only after its own check passed; models without remote code never
  reach it, and models codeferry cannot locate go on to transformers as before.
- vLLM's wrapper turns any exception of that function into a warning and later says
  "Cannot find model module": codeferry logs its typed error (file:line, fix) at error
  level first, so the cause reaches the user.
- ``CODEFERRY_LOCK=FILE`` (a ``codeferry lock`` file) binds every vLLM process to that
  lock: each class is loaded only if its code is exactly the locked code, remote code
  codeferry cannot check is refused, and code arriving in messages must be locked too.
  The environment reaches every process vLLM starts, so the lock does.
"""

from __future__ import annotations

import logging
import os

from .. import _settings
from ..errors import CodeferryError, PluginDisabledUnderLockError

__all__ = ["register"]


def register() -> None:
    """vLLM's entry point: route transformers' remote-code loading through codeferry.

    Runs in each vLLM process (driver, EngineCore, workers); idempotent. With a lock asked
    for (``CODEFERRY_LOCK``) nothing runs unchecked: a lock file that is missing or cannot be
    read raises ``LockFormatError``, and the plugin switched off raises
    ``PluginDisabledUnderLockError``, each logged at error level first.
    """
    log = logging.getLogger("vllm.codeferry")
    switched = _settings.lock_switched_off(vllm=True)  # the rule the exec boot follows too
    if switched is not None:
        switch = switched.partition("=")[0]
        error = PluginDisabledUnderLockError(
            f"CODEFERRY_LOCK={_settings.lock_file()} asks every vLLM process to run only "
            f"locked code, but {switched} switches off codeferry, which enforces it; this "
            "process refuses to start rather than run unchecked code.",
            path=_settings.lock_file(), switch=switch,
            fix=f"unset {switch} (the lock is then enforced), or unset CODEFERRY_LOCK to run "
            "without a lock.",
        )
        log.error("codeferry: %s", error)
        raise error
    if not _settings.vllm_plugin_enabled():
        return
    if _settings.sandbox_switch():
        pin_cores()
    try:
        import transformers.dynamic_module_utils  # noqa: F401
    except ImportError:  # no transformers here: no remote code to route
        return
    from .._trust.decide import environment_lock
    from .adopt import install_for_engine

    try:
        lock = environment_lock()
    except CodeferryError as exc:
        log.error("codeferry: %s", exc)
        raise
    # a child of vLLM's logger: the error reads like vLLM's own lines, in every process
    install_for_engine(lock, log=log)


def pin_cores() -> None:
    """In a boxed vLLM process: vLLM asks ``lscpu`` (through ``sh -c``) for the cores at
    every start, which the box refuses (it starts no program); the same facts read from
    ``/sys``, which the box lets it read, answer instead. Nothing where vLLM or its reader
    is missing (another vLLM reads the cores some other way)."""
    try:
        from vllm.utils import cpu_resource_utils as cores
    except ImportError:
        return
    info = getattr(cores, "LogicalCPUInfo", None)
    if info is None or not hasattr(cores, "_get_cpu_list"):
        return
    found = [info(id=cpu, physical_core=core, numa_node=node) for cpu, core, node in cores_in()]
    cores._get_cpu_list = lambda: list(found)


def cores_in(root: str = "/sys/devices/system/cpu") -> list[tuple[int, int, int]]:
    """``(cpu, core, node)`` of each online CPU, numbered as ``lscpu --extended=CPU,CORE,NODE
    --online`` numbers them: a core is a distinct package and core id, counted in order of
    first appearance; a CPU outside any NUMA node is on node 0."""
    with open(f"{root}/online", encoding="ascii") as f:
        online = _id_list(f.read())
    numbered: dict[tuple[str, str], int] = {}
    found = []
    for cpu in online:
        topology = f"{root}/cpu{cpu}/topology"
        key = (_read(f"{topology}/physical_package_id"), _read(f"{topology}/core_id"))
        nodes = sorted(int(name[4:]) for name in os.listdir(f"{root}/cpu{cpu}")
                       if name.startswith("node") and name[4:].isdigit())
        found.append((cpu, numbered.setdefault(key, len(numbered)), nodes[0] if nodes else 0))
    return found


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read().strip()


def _id_list(text: str) -> list[int]:
    """``"0-3,8"``: ``[0, 1, 2, 3, 8]``, the kernel's list format."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            ids.extend(range(int(first), int(last or first) + 1))
    return ids
