"""A callback right after chosen modules execute: a finder at the front of ``sys.meta_path``.

codeferry patches a few transformers modules by their own attributes (the ``generate()`` hook,
the Hub kernel gates). Importing them to patch them costs a process that never loads a model
seconds and a hundred MB (``transformers.generation.utils`` imports torch), so ``install()``
patches those already imported and lets this finder hand it the others as each one finishes
executing, before any code can use it. ``codeferry exec``'s boot uses the same finder from the
start of every process.

Standard library only, and no import of the package: the boot loads this file by its path
(importing codeferry would cost every process under ``exec``). A module whose execution had
already begun when the finder went in (``install()`` called inside an import of transformers)
is handed over at the first import after it finishes: a watched module that executed without
the finder seeing it start waits in ``Watch.pending`` until then.
"""

from __future__ import annotations

import importlib.machinery
import sys

TYPE_CHECKING = False  # not typing's: every process under exec loads this file
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType
    from typing import Any

__all__ = ["Watch", "executing", "watching"]


class Watch:
    """A finder for the modules ``names`` only: the spec the other finders give, whose loader
    calls ``callback(module)`` once the module has executed (not when it raised)."""

    def __init__(self, names: frozenset[str], callback: Callable[[ModuleType], None]) -> None:
        self.names = names
        self.callback = callback
        #: The names not handed over yet. A module whose execution began before this finder
        #: went in, or that the finders after it found while it went in, never passes through
        #: ``exec_module`` here: every import checks whether one of these has finished since
        #: (a few dictionary lookups, and none once all are handed over).
        self.pending = set(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if self.pending:
            self._hand_over_finished()
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            loader: Any = spec.loader
            if loader is not None and hasattr(loader, "exec_module"):
                original = loader.exec_module

                def exec_module(module: ModuleType, original: Any = original) -> None:
                    original(module)
                    self._hand_over(module)

                loader.exec_module = exec_module
            return spec
        return None

    def _hand_over(self, module: ModuleType) -> None:
        self.pending.discard(module.__name__)
        self.callback(module)

    def _hand_over_finished(self) -> None:
        """``callback`` for each pending module that has executed (once each: the set shrinks
        before the call, which may import)."""
        for name in tuple(self.pending):
            module = sys.modules.get(name)
            if module is not None and not executing(module):
                self._hand_over(module)


def watching(names: frozenset[str]) -> bool:
    """Whether a ``Watch`` on ``sys.meta_path`` (this file's, or the boot's copy of it) already
    covers every module of ``names``."""
    return any(type(f).__name__ == "Watch" and names <= getattr(f, "names", frozenset())
               for f in sys.meta_path)


def executing(module: ModuleType) -> bool:
    """Whether ``module`` is still executing (imported half: a circle through it, or a caller
    inside its import), which importlib marks on its spec until it finishes."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
