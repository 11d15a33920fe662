"""What a failed outcome of ``codeferry run`` is: an answer for its input, or a fault of the machine.

An answer is written as the input's error line, as a result is: the model (or its code) raised
on that input. A fault of the machine is what the run did, not what the input caused: the
executor broke (no worker can start: a full ``TMPDIR``, a missing dependency, memory), the
model's code changed on disk, a worker could not start, a batch ran past ``--batch-timeout``, a
worker died on every attempt (killed, out of memory), the store failed, memory or disk ran out.
A fault stops the run (``RunStoppedError``) and never becomes an output line, so the same
command resumes and runs those inputs again.
"""

from __future__ import annotations

import errno

from ..errors import (
    BatchFailedError,
    BatchTimeoutError,
    BrokenExecutorError,
    ChatTemplateMissingError,
    ClusterError,
    CodeChangedError,
    CodeUnavailableError,
    RemoteTraceback,
    RequestRefusedError,
    RequestUnpicklingError,
    SamplingParamsError,
    StoreCorruptError,
    StorePermissionError,
    StoreUnavailableError,
    WorkerError,
    WorkerStartupError,
)

__all__ = ["is_machine_fault", "machine_fault"]

#: Errors that say what the machine did, whatever the input.
_MACHINE: tuple[type[BaseException], ...] = (
    BrokenExecutorError, WorkerStartupError, BatchTimeoutError, ClusterError,
    RequestUnpicklingError, CodeChangedError, CodeUnavailableError, StoreUnavailableError,
    StoreCorruptError, StorePermissionError, MemoryError,
    # Not the machine's, but no answer for an input either: how the run was started (no
    # chat template for chat inputs). Stopping lets the fixed command resume.
    ChatTemplateMissingError,
)
#: An ``OSError`` with one of these is the machine's (space, memory, descriptors), not the input's.
_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EMFILE, errno.ENFILE,
                     errno.EROFS})


def machine_fault(error: BaseException) -> BaseException | None:
    """The fault of the machine behind a failed outcome's ``error``; ``None`` when the error is
    the answer for that input (its batch failed, the worker's own error as the cause)."""
    if isinstance(error, (SamplingParamsError, RequestRefusedError)):
        return None  # the line asks what the run does not do (a field, more than the context)
    if not isinstance(error, BatchFailedError):
        return error  # the executor broke, the code changed: no batch answered anything
    cause = error.__cause__
    if cause is None:
        return None
    return cause if _is_machine(cause) else None


def is_machine_fault(error: BaseException) -> bool:
    """Whether ``error``, raised by a run before or while it wrote, is the machine's doing (a
    worker that cannot start, changed code, the store): the same command resumes it. A
    missing chat template stops a run too, but only its fix (``--chat-template``) resumes."""
    return _is_machine(error) and not isinstance(error, ChatTemplateMissingError)


def _is_machine(cause: BaseException) -> bool:
    if isinstance(cause, _MACHINE):
        return True
    if type(cause).__name__ == "OutOfMemoryError":  # torch's, a RuntimeError
        return True
    if isinstance(cause, OSError) and cause.errno in _ERRNOS:
        return True
    # A plain WorkerError without the worker's traceback: the worker died (a signal, the OOM
    # killer) while running the batch, on every attempt. With it: the worker's own error that
    # could not travel as itself, an answer.
    return type(cause) is WorkerError and not isinstance(cause.__cause__, RemoteTraceback)
