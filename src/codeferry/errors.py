"""Every error codeferry raises, in one place.

Each error names *what* went wrong and *where* (file, and line/column where there is
one), says *why*, and ends with how to fix it. Each also inherits the builtin a caller
would already catch (``FileNotFoundError``, ``ValueError``, ``ImportError``, ...), keeps
its data as attributes, and survives pickling, so a worker's error reaches its parent
intact (loky and huggingface_hub do the same). Never branch on message text: branch on
the type and the attributes.
"""

from __future__ import annotations

from concurrent.futures import BrokenExecutor
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
    "RequestRefusedError",
    "WeightsUnreadableError",
    "OutputError",
    "CodeChangedError",
    "ResumeMismatchError",
    "DeviceError",
    "MainGuardError",
    "MissingPackageError",
    "OptionalModuleMissing",
    "OptionalPackageMissing",
    "ConfigUnavailableError",
    "ModelTypeConflictError",
    "ClassNotLoadedError",
    "StorePermissionError",
    "TicketPackageError",
    "RequestUnpicklingError",
    "AssetTooLargeError",
    "OutputLockError",
    "DTypeError",
    "BrokenExecutorError",
    "BatchTimeoutError",
    "ClusterError",
    "WeightsTooLargeError",
    "ExtraMissingError",
    "ModelNotCachedError",
    "HubRepoNotFoundError",
    "HubRevisionNotFoundError",
    "GatedRepoError",
    "HubDownloadError",
    "ForeignOutputError",
    "RunStoppedError",
    "InputChangedError",
    "ResumeUncheckedError",
    "OutputHeldError",
    "ClusterUnreachableError",
    "ModelFilesMissingError",
    "DoctorCheckError",
    "CommandNotRunError",
    "UnlockedCodeError",
    "PluginDisabledUnderLockError",
    "HubMismatchError",
    "HubUncheckedError",
    "ModelSignatureError",
    "HubKernelRefusedError",
    "SamplingParamsError",
    "ChatTemplateMissingError",
    "EngineRefusedError",
    "ReleaseUnavailableError",
    "SandboxError",
    "SandboxUnavailableError",
    "SandboxRefusedError",
    "SandboxUnsupportedError",
]


# -- errors every layer uses --------------------------------------------------------------

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


class _CodeError(CodeferryError):
    """An error about one unit of code: ``model`` names it, ``digest`` pins it."""

    def __init__(
        self, message: str, *, digest: str | None = None, model: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.digest = digest
        self.model = model


class ExtraMissingError(CodeferryError, ImportError):
    """A feature needs an optional dependency that is not installed; ``extra`` names the
    ``pip install 'codeferry[...]'`` extra that brings it."""

    def __init__(self, message: str, *, extra: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.extra = extra


# -- _sandbox: the box around the processes that run model code ---------------------------

class SandboxError(CodeferryError, PermissionError):
    """Base of the box's errors: one ``except`` for every way the box stops something."""


class SandboxUnavailableError(SandboxError):
    """The box cannot be built here, so nothing ran (never a silent run without it):
    ``kernel`` is ``uname -r``, ``abi`` the Landlock ABI it offers (``0``: none), ``needed``
    the ABI the box needs, ``reason`` what is missing."""

    def __init__(self, message: str, *, kernel: str = "", abi: int = 0, needed: int = 0,
                 reason: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.kernel = kernel
        self.abi = abi
        self.needed = needed
        self.reason = reason


class SandboxRefusedError(SandboxError):
    """The box refused what the model's code tried: ``operation`` (``open``, ``connect``,
    ``socket``, ``exec``, ``kill``...) on ``target`` (a path, an address, a program, a pid);
    the model's own error is the cause."""

    def __init__(self, message: str, *, operation: str = "", target: str = "",
                 **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.operation = operation
        self.target = target


class SandboxUnsupportedError(SandboxError, ValueError):
    """The box was asked for where it cannot be put yet (``where``: the vLLM engine, the Ray
    backend): refused rather than run unboxed."""

    def __init__(self, message: str, *, where: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.where = where


# -- _code: reading the model's code ------------------------------------------------------

class ModelNotFoundError(CodeferryError, FileNotFoundError):
    """The model is neither a folder nor a repo id found in the hub cache (or on the Hub)."""


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
    """The code imports a name the installed transformers does not have.

    ``needs``: the last transformers release checked that has it (``"4.57"``), where known:
    the executor's workers can run the code there (``ReleaseUnavailableError`` when that
    release cannot be made); ``""`` where no release is known to have it.
    """

    def __init__(self, message: str, *, needs: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.needs = needs


class MissingPackageError(CodeferryError, ImportError):
    """A module imports a third-party package, unguarded at module level, that is not installed.

    ``package`` is the import name; ``distribution`` the name ``pip install`` takes (a
    best guess where the two differ and nothing is installed to ask).
    """

    def __init__(
        self, message: str, *, package: str = "", distribution: str = "", **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.package = package
        self.distribution = distribution


class OptionalPackageMissing(MissingPackageError):
    """A module reached only through imports inside functions needs a package that is missing.

    A note: nothing imports that module at load, so only the code path that uses it fails.
    """

    blocking = False


class OptionalModuleMissing(MissingModuleError):
    """An optional relative import (guarded, or inside a function) names a file that is absent.

    A note, not a problem: the import only fails on the code path that needs it.
    """

    blocking = False


class AssetTooLargeError(CodeferryError, ValueError):
    """A data file the code names (an asset) is above the asset limit (``limit``, bytes)."""

    def __init__(
        self, message: str, *, size: int | None = None, limit: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.size = size
        self.limit = limit


class StoreCorruptError(_CodeError, ValueError):
    """Bytes do not match the digest they were sent or stored with."""


class ProblemsFound(CodeferryError, ImportError):
    """Static analysis found blocking problems; ``problems`` lists each one."""

    def __init__(
        self, message: str, *, problems: tuple[CodeferryError, ...] = (), **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.problems = problems


# -- _code: the Hugging Face Hub, and the Hub's check of a lock (--verify-hub) ------------

class _HubError(CodeferryError):
    """An error about a repo of the Hub: ``repo_id`` names it, ``revision`` what was asked for."""

    def __init__(
        self, message: str, *, repo_id: str | None = None, revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.repo_id = repo_id
        self.revision = revision


class ModelNotCachedError(_HubError, ModelNotFoundError):
    """A repo id the local cache lacks (or holds in part), and downloading is off.

    Off: ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``), or ``local_files_only=True``.
    ``missing`` lists the files a partly cached snapshot lacks (empty: none of it is cached).
    """

    def __init__(self, message: str, *, missing: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.missing = missing


class HubRepoNotFoundError(_HubError, ModelNotFoundError):
    """The Hub has no such repo, or it is private and no token with access to it was sent."""


class HubRevisionNotFoundError(_HubError, ModelNotFoundError):
    """The repo is on the Hub, but has no such branch, tag or commit."""


class GatedRepoError(_HubError, PermissionError):
    """The repo is gated, or the token sent was refused: its files need a token with access."""


class HubDownloadError(_HubError, ConnectionError):
    """The Hub could not be reached, or answered with an error, or a download was cut short.

    huggingface_hub writes each file to a temporary file and renames it into place, so
    nothing half-written is in the cache: running the same call again downloads what is
    missing.
    """


class HubMismatchError(_HubError, PermissionError):
    """Locked files (or the files about to be locked) are not what the Hub holds at the
    locked commit: a tampered cache or mirror, or a lock made from one. Nothing ran.

    ``mismatches`` lists each file as ``(name, expected, actual)``: ``name`` as the lock
    names it (``org/other--path`` for a cross-repo file), ``expected`` the Hub's hash
    (``sha256:<hex>`` of an LFS file, ``git-sha1:<hex>`` of any other, ``"absent"`` when the
    Hub's commit lacks the file), ``actual`` the local file's. A commit the Hub never had is
    one row whose name is the repo (``expected`` ``"absent"``, ``actual`` the commit).
    """

    def __init__(self, message: str, *,
                 mismatches: tuple[tuple[str, str, str], ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.mismatches = mismatches


class HubUncheckedError(_HubError, ConnectionError):
    """``--verify-hub`` could not ask the Hub, so nothing was vouched for (and ``codeferry
    lock --verify-hub`` wrote nothing): offline (``HF_HUB_OFFLINE=1``), no connection, the
    Hub answered an error, or the lock is of a local folder, which no Hub holds. ``reason``
    says which. The command line exits 3: neither success nor a mismatch."""

    def __init__(self, message: str, *, reason: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.reason = reason


# -- _code: locks and model signatures ----------------------------------------------------

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


class ModelSignatureError(CodeferryError, PermissionError):
    """A model's OpenSSF signature (``model.sig``, the ``model-signing`` package's format) is
    missing, does not verify with the public key given, or was made with another key than
    the one the lock requires. ``signature`` is the signature file, ``key`` the public key's
    id (``sha256:<hex>`` of its DER form) where one was read. Nothing ran."""

    def __init__(self, message: str, *, signature: str | None = None, key: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.signature = signature
        self.key = key


# -- _trust: the trust decision -----------------------------------------------------------

class TrustRequiredError(CodeferryError, PermissionError):
    """Model code would run, but the caller did not decide to trust it."""

    def __init__(self, message: str, *, files: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.files = files


class CodeChangedError(_CodeError, PermissionError):
    """A worker found other code than the parent checked: the model changed on disk since.

    ``expected`` is the digest the parent decided on, ``actual`` the digest the worker
    resolved; nothing of ``actual`` was executed. Not a crash: retrying finds the same.
    """

    def __init__(
        self, message: str, *, expected: str | None = None, actual: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.expected = expected
        self.actual = actual


# -- _runtime: the store and the units processes send each other --------------------------

class StoreUnavailableError(_CodeError, OSError):
    """The codeferry store cannot be written (read-only, disk full)."""


class StorePermissionError(CodeferryError, PermissionError):
    """A folder or entry of the codeferry store is owned, or writable, by another user.

    Whoever can write there can replace code this process would run. ``owner`` (uid) and
    ``mode`` (permission bits) are what was found at ``path``; ``digest`` names the unit
    when an entry of one is at fault.
    """

    def __init__(
        self, message: str, *, owner: int | None = None, mode: int | None = None,
        digest: str | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.owner = owner
        self.mode = mode
        self.digest = digest


class CodeUnavailableError(_CodeError, ImportError):
    """A process got a digest it has no bytes for, neither in memory nor in its store."""


class TicketPackageError(_CodeError, ImportError):
    """A pickled unit asks to be registered under a package name that is not its own.

    Only ``codeferry._dyn.u<token>`` of its own digest, or a ``transformers_modules.``
    alias, may be: anything else (``requests``, ``codeferry._dyn``) would put the sender's
    code in the place of a module the receiver imports. ``package`` is the name asked for.
    """

    def __init__(self, message: str, *, package: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.package = package


# -- _hf, _load, _install: loading, and the gates of transformers' doors ------------------

class RemoteCodeExecutionError(_CodeError, ImportError):
    """Executing a module of the model raised; the original exception is the cause."""


class ConfigUnavailableError(CodeferryError, ImportError):
    """A model class cannot load because the model's ``AutoConfig`` class cannot.

    ``key`` is the model class's ``auto_map`` key; the config's own error is the cause
    and ``config_error``.
    """

    def __init__(
        self, message: str, *, key: str = "", config_error: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.key = key
        self.config_error = config_error


class ModelTypeConflictError(CodeferryError, ValueError):
    """Another model's class holds this ``model_type`` in transformers' registry.

    transformers keeps one config class per ``model_type``; answering this model with the
    other model's class would run the wrong code. ``model_type`` names the contested type.
    """

    def __init__(self, message: str, *, model_type: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.model_type = model_type


class ClassNotLoadedError(CodeferryError, KeyError):
    """``load()``'s result has no class for this key: its import failed (the cause is that
    failure, as ``LoadResult.failed`` holds it), or the model's ``auto_map`` names none.
    ``key`` is the ``auto_map`` key asked for."""

    def __init__(self, message: str, *, key: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.key = key


class UnlockedCodeError(CodeferryError, RuntimeError):
    """A lock binds this process, and transformers was about to execute a module whose bytes
    are not locked bytes (``path``: the file; ``door``: the way in, such as
    ``custom_generate``). Nothing of it ran. Deliberately not an ``OSError``: transformers
    reads an ``OSError`` at some doors (``custom_generate`` in ``from_pretrained``) as "no
    such file" and goes on silently, and a refusal under a lock must be heard."""

    def __init__(self, message: str, *, door: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.door = door


class PluginDisabledUnderLockError(CodeferryError, RuntimeError):
    """``CODEFERRY_LOCK`` is set, but a switch turns codeferry off in this process
    (``CODEFERRY_VLLM_PLUGIN=0`` in vLLM's, ``CODEFERRY_INSTALL=0`` in any): the lock would
    bind nothing, so the process refuses (vLLM's to start, any other to import transformers'
    remote-code loader) instead of running unchecked code. ``switch`` names the variable."""

    def __init__(self, message: str, *, switch: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.switch = switch


class HubKernelRefusedError(CodeferryError, PermissionError):
    """transformers was about to fetch and import a Hub kernel (the ``kernels`` package) that
    nobody decided may run here: under a lock (no kernel repo is in a lock), or named only by
    the model's own config without the caller's ``trust_remote_code``. ``repo`` is the kernel
    repo; ``path``/``line`` name the config field when the model's files name it. Nothing was
    downloaded or imported."""

    def __init__(self, message: str, *, repo: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.repo = repo


# -- _exec: workers, the executor, Ray ----------------------------------------------------

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


class WorkerStartupError(WorkerError):
    """A worker failed its start-up handshake; the worker's traceback is the cause."""


class BrokenExecutorError(WorkerError, BrokenExecutor):
    """No worker is left and none can be started (every replacement failed, or no Ray node
    can host one): every input not done yet fails with this, and so does every later call.
    The last start-up error is the cause."""


class BatchTimeoutError(WorkerError):
    """A batch ran past ``batch_timeout``: its worker was killed and replaced."""


class BatchFailedError(CodeferryError, RuntimeError):
    """A batch failed on every attempt; ``indices``/``inputs`` name what it held."""

    def __init__(
        self, message: str, *, indices: tuple[int, ...] = (), inputs: tuple[Any, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.indices = indices
        self.inputs = inputs


class RequestUnpicklingError(WorkerError):
    """A worker could not unpickle a request it was sent; the unpickling error is the cause.

    Sending it again would fail the same way, so its batch fails at once, not retried.
    """


class ClusterError(WorkerError):
    """Ray reported a failure (an actor or node died, a task raised in Ray itself); Ray's
    own exception is the cause."""


class ClusterUnreachableError(ClusterError):
    """Nothing answers at the Ray cluster address given (``address=``, ``--address`` or
    ``RAY_ADDRESS``) within a few seconds; ``address`` is the address tried, and the socket
    error of the last try is the cause."""

    def __init__(self, message: str, *, address: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.address = address


class WeightsTooLargeError(CodeferryError, ValueError):
    """A Ray node lacks the model's weights and they are too large to ship from the driver."""


class ModelFilesMissingError(CodeferryError, FileNotFoundError):
    """The model's folder lacks files every worker would need: raised in the parent, before
    any worker starts.

    ``path`` is the folder; ``missing`` names what it lacks (``"weights"``, ``"tokenizer"``);
    ``files`` the files that would do (one of them is enough).
    """

    def __init__(
        self, message: str, *, missing: tuple[str, ...] = (), files: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.missing = missing
        self.files = files


class DeviceError(CodeferryError, ValueError):
    """``device`` is not a device string torch knows, or names a device this machine lacks.

    Raised in the parent before any worker starts; ``device`` is what was asked for.
    """

    def __init__(self, message: str, *, device: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.device = device


class DTypeError(CodeferryError, ValueError):
    """A ``dtype`` that is neither a ``torch.dtype`` nor the name of one; ``dtype`` is its repr.

    Raised in the parent before any worker starts.
    """

    def __init__(self, message: str, *, dtype: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.dtype = dtype


class MainGuardError(CodeferryError, RuntimeError):
    """Workers would be started while the main script is being imported.

    Spawn and forkserver workers import the main script again; without an
    ``if __name__ == "__main__":`` guard the script starts an executor in every worker,
    which multiprocessing refuses. ``path``/``line`` name the unguarded statement.
    """


# -- _exec: engines -----------------------------------------------------------------------

class ReleaseUnavailableError(CodeferryError, RuntimeError):
    """The transformers release a model's code needs is not made here and cannot be made now
    (offline, or the installer failed); what to run to make it is in ``fix``."""


class EngineRefusedError(CodeferryError, RuntimeError):
    """The engine a worker was asked for (``engine="vllm"``) cannot serve this model or this
    kind of request; ``engine`` names it. ``engine="auto"`` falls back to transformers on it."""

    def __init__(self, message: str, *, engine: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.engine = engine


# -- _exec: generation: sampling parameters and chat --------------------------------------

class SamplingParamsError(CodeferryError, ValueError):
    """A sampling parameter is out of range or of the wrong type (``SamplingParams``, a
    request's body, a command-line flag): ``field`` names it; an input line's file and line
    are the error's ``path`` and ``line``."""

    def __init__(self, message: str, *, field: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.field = field


class ChatTemplateMissingError(CodeferryError, ValueError):
    """A chat request (``messages``) for a model whose tokenizer has no chat template, and
    none was given (``--chat-template FILE``, ``chat_template=``)."""


# -- _commands: codeferry run's inputs and outputs, doctor, exec --------------------------

class InputNotFoundError(CodeferryError, FileNotFoundError):
    """The ``--input`` file of ``codeferry run`` does not exist."""


class InputFormatError(CodeferryError, ValueError):
    """A line of an input (or an existing output) file of ``codeferry run`` is unusable.

    ``path`` and ``line`` locate it; nothing has been written when this is raised.
    """


class RequestRefusedError(InputFormatError):
    """One input line asks for what codeferry does not do: a request field it does not
    implement, a model other than the one run, a content part that is not text. ``field``
    names it. That line alone is answered by this error (status 400 in the OpenAI output, as
    vLLM answers a bad request) and the others run: a 200 that ignored the field would be a
    silent wrong answer."""

    def __init__(self, message: str, *, field: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.field = field


class WeightsUnreadableError(CodeferryError, ValueError):
    """A weights file of the model folder cannot be read whole: a safetensors file cut short
    (a download or copy that stopped), or a shard its index names that is not there.
    ``path`` names the file; ``codeferry run`` says so before any worker starts."""


class OutputError(CodeferryError, OSError):
    """The ``--output`` file of ``codeferry run`` cannot be opened, locked or written."""


class ForeignOutputError(OutputError):
    """The ``--output`` file holds a line ``codeferry run`` does not write (``path``/``line``
    name it): the file is someone else's, so it is left exactly as it is."""


class OutputLockError(OutputError):
    """``codeferry run`` cannot lock its ``--output`` file, so it writes nothing to it.

    ``held`` is ``True`` when another run holds the lock (wait for it, or choose another
    output), ``False`` when the lock file ``lock_path`` cannot be created or locked at all
    (a read-only folder, a filesystem without locks).
    """

    def __init__(
        self, message: str, *, lock_path: str | None = None, held: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.lock_path = lock_path
        self.held = held


class OutputHeldError(OutputLockError):
    """Another run holds the lock of the ``--output`` file (of the file itself: any name of
    it, a hard link or a bind mount included). ``holder`` says which run: its ``pid``,
    ``host``, ``command`` and ``started`` (seconds since the epoch), as it recorded them."""

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("held", True)
        super().__init__(message, **kwargs)
        self.holder = holder or {}


class ResumeMismatchError(CodeferryError, ValueError):
    """``codeferry run`` would resume an output that another model, code or option set wrote.

    ``differences`` maps each field that differs (``model``, ``digest``, ``task``, an
    option) to ``(recorded, now)``.
    """

    def __init__(
        self, message: str, *, differences: dict[str, tuple[Any, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.differences = differences or {}


class InputChangedError(ResumeMismatchError):
    """A resume whose input holds another request, under an id the output already answers,
    than the run that wrote that line had: the line would be a stale answer. ``ids`` are
    those ids, ``lines`` their lines in the input now."""

    def __init__(
        self, message: str, *, ids: tuple[Any, ...] = (), lines: tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.ids = ids
        self.lines = lines


class ResumeUncheckedError(ResumeMismatchError):
    """A resume that cannot be checked: the output holds lines but no record of what
    produced them is beside it (or the record predates what is checked now)."""


class RunStoppedError(CodeferryError, RuntimeError):
    """``codeferry run`` stopped on a fault of the machine, not of an input: the executor
    broke, the model's code changed, a worker could not start, a batch timed out, the store
    failed. The fault is the ``__cause__``; nothing of it was written as an output line, so
    the same command resumes. ``written`` lines of ``total`` are in ``output`` (``None``:
    stdout); ``stopped_at`` is the first input id not written; ``resume`` the command that
    resumes (the CLI fills it in).
    """

    def __init__(
        self, message: str, *, written: int = 0, total: int = 0, output: str | None = None,
        stopped_at: Any = None, resume: str | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.written = written
        self.total = total
        self.output = output
        self.stopped_at = stopped_at
        self.resume = resume


class DoctorCheckError(CodeferryError, RuntimeError):
    """A check of ``codeferry doctor`` failed in a worker: ``check`` names it (``"generate"``:
    one token generated the way ``codeferry run`` generates). The worker's own error is the
    cause (its traceback)."""

    def __init__(self, message: str, *, check: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.check = check


class CommandNotRunError(CodeferryError, OSError):
    """``codeferry exec`` could not start COMMAND (not found, not executable): ``command`` is
    its first word, and ``status`` the exit code a shell gives for it (127 not found, 126
    found but not runnable)."""

    def __init__(
        self, message: str, *, command: str = "", status: int = 126, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.command = command
        self.status = status
