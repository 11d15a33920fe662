"""Every error codeferry raises, in one place.

Each error names *what* went wrong and *where* (file, and line/column where there is
one), says *why*, and ends with how to fix it. Each also inherits the builtin a caller
would already catch (``FileNotFoundError``, ``ValueError``, ``ImportError``, ...), keeps
its data as attributes, and survives pickling, so a worker's error reaches its parent
intact (loky and huggingface_hub do the same). Never branch on message text: branch on
the type and the attributes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CodeferryError",
    "ModelNotFoundError",
    "ConfigNotFoundError",
    "InvalidConfigError",
    "InvalidAutoMapError",
    "UnsafePathError",
    "ShadowingModuleError",
    "UnreadableFileError",
    "SourceDecodeError",
    "SourceTooLargeError",
    "SourceSyntaxError",
    "SourceTooDeepError",
    "MissingModuleError",
    "MissingClassError",
    "LFSPointerError",
    "AbsoluteSiblingImportError",
    "ImportCycleError",
    "MissingTransformersNameError",
    "ProblemsFound",
    "TrustRequiredError",
    "StoreUnavailableError",
    "StoreCorruptError",
    "CodeUnavailableError",
    "RemoteCodeExecutionError",
    "WorkerError",
    "RemoteTraceback",
    "LockFormatError",
    "LockMismatchError",
    "WorkerStartupError",
    "BatchFailedError",
    "InputNotFoundError",
    "InputFormatError",
    "OutputError",
    "AssetTooLargeError",
]


class CodeferryError(Exception):
    """Base of every codeferry error.

    ``path``/``line``/``col`` locate the fault (``None`` where not applicable) and
    ``fix`` says how to recover. ``str(err)`` is one line: ``path:line:col: message Fix: ...``.
    """

    #: Problems of this kind stop a model from loading (``False``: only worth a look).
    blocking: bool = True

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        col: int | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.col = col
        self.fix = fix

    @property
    def location(self) -> str:
        """``path:line:col`` with the parts that are known."""
        if self.path is None:
            return ""
        parts = [self.path]
        if self.line is not None:
            parts.append(str(self.line))
            if self.col is not None:
                parts.append(str(self.col))
        return ":".join(parts)

    def __str__(self) -> str:
        text = self.message
        if self.location:
            text = f"{self.location}: {text}"
        if self.fix:
            text = f"{text} Fix: {self.fix}"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError and friends have their own __reduce__ that drops our keyword-only
        # data; rebuild from the message and restore the attributes as state.
        # ImportError keeps ``path`` in a C slot, not in __dict__: name it explicitly.
        state = {**self.__dict__, "path": self.path}
        return (_rebuild_error, (type(self), self.message), state)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view, used by ``--json`` output."""
        return {
            "type": type(self).__name__,
            "message": self.message,
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "fix": self.fix,
            "blocking": self.blocking,
        }


def _rebuild_error(cls: type[CodeferryError], message: str) -> CodeferryError:
    err = cls.__new__(cls, message)
    Exception.__init__(err, message)
    return err


# -- locating the model ---------------------------------------------------------------


class ModelNotFoundError(CodeferryError, FileNotFoundError):
    """The model is neither a folder nor a repo id present in the local hub cache."""


class ConfigNotFoundError(CodeferryError, FileNotFoundError):
    """The model folder has no ``config.json``."""


class InvalidConfigError(CodeferryError, ValueError):
    """A JSON file of the model does not parse."""


class InvalidAutoMapError(CodeferryError, ValueError):
    """An ``auto_map`` has the wrong shape, or an entry is not ``module.Class``."""


class UnsafePathError(CodeferryError, PermissionError):
    """A path named by the model escapes the model folder (``..``, absolute, symlink)."""


class ShadowingModuleError(CodeferryError, ValueError):
    """A remote module would shadow the standard library or a core package."""


class UnreadableFileError(CodeferryError, OSError):
    """A file the code needs cannot be read: a broken or looping symlink, a pipe, no permission."""


# -- reading the code -----------------------------------------------------------------


class SourceDecodeError(CodeferryError, UnicodeError):
    """A source file is not UTF-8."""


class SourceTooLargeError(CodeferryError, ValueError):
    """A source file is larger than any real model file; refused before reading it."""


class SourceSyntaxError(CodeferryError, SyntaxError):
    """A source file is not valid Python."""


class SourceTooDeepError(CodeferryError, ValueError):
    """A source file nests code too deeply for Python to compile, or for codeferry to analyse."""


class MissingModuleError(CodeferryError, ImportError):
    """A module named by ``auto_map`` or imported relatively does not exist."""


class MissingClassError(CodeferryError, ImportError):
    """An ``auto_map`` entry names a class its module does not define."""


class LFSPointerError(CodeferryError, ValueError):
    """A Git LFS pointer file stands where code should be."""


class AbsoluteSiblingImportError(CodeferryError, ImportError):
    """A module imports a sibling file absolutely (``from configuration_x import X``).

    That only works when the model folder happens to be on ``sys.path``; transformers
    then reports it as a missing pip package.
    """


class ImportCycleError(CodeferryError, ImportError):
    """Modules import each other at module level; no load order exists."""

    def __init__(self, message: str, *, cycle: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.cycle = cycle


class MissingTransformersNameError(CodeferryError, ImportError):
    """The code imports a name the installed transformers does not have."""


class ProblemsFound(CodeferryError, ImportError):
    """Static analysis found blocking problems; ``problems`` lists each one."""

    def __init__(
        self, message: str, *, problems: tuple[CodeferryError, ...] = (), **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.problems = problems


# -- loading and carrying the code ----------------------------------------------------


class TrustRequiredError(CodeferryError, PermissionError):
    """Model code would run, but the caller did not decide to trust it."""

    def __init__(self, message: str, *, files: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.files = files


class _CodeError(CodeferryError):
    """An error about one unit of code: ``model`` names it, ``digest`` pins it."""

    def __init__(
        self, message: str, *, digest: str | None = None, model: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.digest = digest
        self.model = model


class StoreUnavailableError(_CodeError, OSError):
    """The codeferry store cannot be written (read-only, disk full)."""


class StoreCorruptError(_CodeError, ValueError):
    """Bytes do not match the digest they were sent or stored with."""


class CodeUnavailableError(_CodeError, ImportError):
    """A process got a digest it has no bytes for, neither in memory nor in its store."""


class RemoteCodeExecutionError(_CodeError, ImportError):
    """Executing a module of the model raised; the original exception is the cause."""


class WorkerError(CodeferryError, RuntimeError):
    """A worker process failed; its traceback is the ``__cause__``."""

    def __init__(self, message: str, *, worker: int | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.worker = worker


class RemoteTraceback(Exception):
    """A worker's formatted traceback, attached as ``__cause__`` of the error it raised.

    Python prints the cause above the error, so the parent's traceback shows where the
    worker failed (loky does the same).
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb}\"\"\""


# -- locks ----------------------------------------------------------------------------


class LockFormatError(CodeferryError, ValueError):
    """A lock file is truncated, malformed, of an unknown version, or inconsistent."""


class LockMismatchError(CodeferryError, PermissionError):
    """Code differs from what a lock allows; ``diff`` (when known) says how."""

    def __init__(
        self, message: str, *, diff: Any = None, digest: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.diff = diff
        self.digest = digest


# -- the executor ---------------------------------------------------------------------


class WorkerStartupError(WorkerError):
    """A worker failed its start-up handshake; the worker's traceback is the cause."""


class BatchFailedError(CodeferryError, RuntimeError):
    """A batch failed on every attempt; ``indices``/``inputs`` name what it held."""

    def __init__(
        self, message: str, *, indices: tuple[int, ...] = (), inputs: tuple[Any, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.indices = indices
        self.inputs = inputs


# -- codeferry run --------------------------------------------------------------------


class InputNotFoundError(CodeferryError, FileNotFoundError):
    """The ``--input`` file of ``codeferry run`` does not exist."""


class InputFormatError(CodeferryError, ValueError):
    """A line of an input (or an existing output) file of ``codeferry run`` is unusable.

    ``path`` and ``line`` locate it; nothing has been written when this is raised.
    """


class OutputError(CodeferryError, OSError):
    """The ``--output`` file of ``codeferry run`` cannot be opened, locked or written."""


# -- assets ---------------------------------------------------------------------------


class AssetTooLargeError(CodeferryError, ValueError):
    """A data file the code names (an asset) is above the asset limit (``limit``, bytes)."""

    def __init__(
        self, message: str, *, size: int | None = None, limit: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.size = size
        self.limit = limit
