"""codeferry: load Hugging Face remote code correctly in every process and on every node.

The public API is this short list (pinned by ``tests/house/test_api.py``); everything in a
module whose name starts with ``_`` is private.
"""

from __future__ import annotations

from . import errors
from ._code.lockfile import Lock, read_lock
from ._code.resolve import Bundle, resolve
from ._commands.run import RunResult, run
from ._exec.executor import Executor, Outcome
from ._exec.generate.params import Completion, GenerateResult, Request, SamplingParams
from ._install.adopt import install, uninstall
from ._load import LoadResult, load
from ._version import package_version

#: From the package metadata (``pyproject.toml``'s ``version``, the one place it is written).
__version__ = package_version()

__all__ = [
    "Bundle",
    "Completion",
    "Executor",
    "GenerateResult",
    "LoadResult",
    "Lock",
    "Outcome",
    "Request",
    "RunResult",
    "SamplingParams",
    "errors",
    "install",
    "load",
    "read_lock",
    "resolve",
    "run",
    "uninstall",
    "__version__",
]
