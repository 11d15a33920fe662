"""``save_pretrained`` of codeferry-loaded objects writes the code they need, as it was.

transformers saves remote code only for classes that carry an ``_auto_class`` (set on its own
remote path by ``register_for_auto_class``), and then copies the class's module file plus
what its regular expressions find (so ``from .utils.rope import rope`` is lost). A model
loaded by ``codeferry.load`` would be saved with its ``auto_map`` but no code at all, and
fine-tune -> save -> reload would break.

Here every codeferry class gets the ``_auto_class`` of its ``auto_map`` key, and
``custom_object_save`` (which every ``save_pretrained`` calls for such classes) writes the
class's whole unit: every module, package and asset file, under its original relative
path, from the verified bytes. The saved folder is the model's code exactly, so
``codeferry inspect`` of it gives the same digest, and plain transformers loads it where it
could load the original. A cross-repo class keeps its ``org/repo--module.Class`` reference
and its code stays in that repo.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._runtime import pickling as _pickling
from . import patches

__all__ = ["install_save_hook", "save_as", "save_code"]



def save_as(cls: type, key: str) -> None:
    """Make ``cls`` save its code under ``auto_map`` key ``key`` (what transformers does)."""
    if "_auto_class" in cls.__dict__ and cls.__dict__["_auto_class"] is not None:
        return  # the first key wins: one class, one auto_map entry
    type.__setattr__(cls, "_auto_class", key)


def _reference(cls: type) -> str:
    registration = _pickling.registration_of(cls)
    return f"{cls.__module__[len(registration.package) + 1:]}.{cls.__name__}"


def _auto_map(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        found = config.setdefault("auto_map", {})
    else:
        found = getattr(config, "auto_map", None)
        if found is None:
            found = {}
            config.auto_map = found
    return found  # type: ignore[no-any-return]


def _entry(obj: Any, cls: type, key: str) -> Any:
    """The ``auto_map`` value transformers would write for ``obj``."""
    entry: Any = _reference(cls)
    if "Tokenizer" in key:
        if cls.__name__.endswith("Fast"):
            slow = getattr(obj, "slow_tokenizer_class", None)
            slow_ref = _reference(slow) if isinstance(slow, type) and _pickling.is_ferried(slow) else None
            return [slow_ref, entry]
        return [entry, None]
    return entry


def save_code(obj: Any, folder: str | os.PathLike[str]) -> list[str]:
    """Write the unit of ``obj``'s class into ``folder``; the paths written."""
    cls = obj if isinstance(obj, type) else type(obj)
    written = []
    for rel, data in sorted(_pickling.registration_of(cls).unit.files.items()):
        dest = Path(folder) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.codeferry-tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        written.append(str(dest))
    return written


def _custom_object_save(obj: Any, folder: str | os.PathLike[str], config: Any = None) -> Any:
    cls = obj if isinstance(obj, type) else type(obj)
    if not _pickling.is_ferried(cls):
        import transformers.dynamic_module_utils as dmu

        return patches.original(dmu, "custom_object_save")(obj, folder, config=config)
    key = getattr(cls, "_auto_class", None)
    configs = [c for c in (config if isinstance(config, (list, tuple)) else [config])
               if c is not None]
    cross_repo = False
    for cfg in configs:
        auto_map = _auto_map(cfg)
        if key:
            current = auto_map.get(key)
            cross_repo |= "--" in str(current)
            if current is None:  # a loaded model's own entries are already right
                auto_map[key] = _entry(obj, cls, key)
    if cross_repo:
        return []  # the reference names the repo that holds that code: nothing to copy
    return save_code(obj, folder)


def install_save_hook() -> None:
    """Answer ``custom_object_save`` for codeferry classes (idempotent; others unchanged)."""
    import transformers.dynamic_module_utils as dmu

    patches.patch(dmu, "custom_object_save", _custom_object_save, everywhere=True)
