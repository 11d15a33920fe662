"""The keyword arguments of ``run`` and ``doctor``, and the option values they become.

``run`` and ``doctor`` take their options as ``**options``; the ``TypedDict``s here list
each one with its type, which type checkers read as the functions' own keywords.
``options_of`` refuses a keyword not listed (``TypeError``, as Python would) and builds the
values once: ``ModelOptions`` (which model, whose code), ``WorkerOptions`` (how the workers
run it); ``RunOptions`` holds the rest of ``run``'s (what it writes, and how).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, TextIO, TypedDict

from .._code.lockfile import Lock
from .._exec.options import Backend, EngineName, StartMethod, WorkerOptions
from .._trust.options import ModelOptions

__all__ = ["DOCTOR_KEYWORDS", "RUN_KEYWORDS", "DoctorKeywords", "ModelKeywords", "RunKeywords",
           "RunOptions", "options_of", "too_small"]


class ModelKeywords(TypedDict, total=False):
    """Which model and whose code: ``ModelOptions``'s fields."""

    trust_remote_code: bool
    lock: Lock | str | os.PathLike[str] | None
    revision: str | None
    code_revision: str | None
    cache_dir: str | os.PathLike[str] | None
    token: str | bool | None
    local_files_only: bool | None


class DoctorKeywords(ModelKeywords, total=False):
    """``doctor``'s keywords besides ``timeout``."""

    workers: int
    start_method: StartMethod
    backend: Backend
    address: str | None
    sandbox: bool | None


class RunKeywords(ModelKeywords, total=False):
    """``run``'s keywords besides ``task`` and ``params``."""

    workers: int | None
    start_method: StartMethod
    batch_size: int | None
    max_batch_tokens: int | None
    device: str
    dtype: str | Any | None
    batch_timeout: float | None
    backend: Backend
    address: str | None
    engine: EngineName
    engine_options: Mapping[str, Any] | None
    sandbox: bool | None
    max_new_tokens: int | None
    max_model_len: int | None
    served_model_name: str | None
    pooling: str | None
    chat_template: str | os.PathLike[str] | None
    force_resume: bool
    retry_errors: bool
    progress: bool | None
    stdout: TextIO | None
    stderr: TextIO | None


#: The names of each function's keywords, as the ``TypedDict`` lists them.
DOCTOR_KEYWORDS: frozenset[str] = DoctorKeywords.__optional_keys__
RUN_KEYWORDS: frozenset[str] = RunKeywords.__optional_keys__


@dataclass(frozen=True)
class RunOptions:
    """``run``'s options that are neither the model's nor the workers': the task's, the
    output's, and where the run shows what it does."""

    max_new_tokens: int | None = None
    #: The context lines are checked against (``None``: the model's config.json).
    max_model_len: int | None = None
    #: The name an OpenAI line's ``"model"`` may give besides the model's path or folder name.
    served_model_name: str | None = None
    pooling: str | None = None
    chat_template: str | os.PathLike[str] | None = None
    force_resume: bool = False
    retry_errors: bool = False
    progress: bool | None = None
    stdout: TextIO | None = None
    stderr: TextIO | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> RunOptions:
        """The options among ``arguments``: each field present there, the rest at their
        defaults."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)
                      if f.name in arguments})


def options_of(function: str, given: Mapping[str, Any], accepted: Collection[str],
               ) -> tuple[ModelOptions, WorkerOptions]:
    """The ``ModelOptions`` and ``WorkerOptions`` of ``function``'s keywords ``given``
    (those absent at their defaults); a keyword not ``accepted`` raises ``TypeError``
    naming it, as Python does."""
    for name in given:
        if name not in accepted:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    model = ModelOptions(**{f.name: given[f.name] for f in dataclasses.fields(ModelOptions)
                            if f.name in given})
    return model, WorkerOptions.of(given)


def too_small(**counts: int | None) -> tuple[str, int] | None:
    """The first of ``counts`` given and below 1, as ``(name, value)``: the check of
    ``run``'s counts (``workers``, ``batch_size``...) for the function and the command line
    alike, each saying it its own way."""
    for name, value in counts.items():
        if value is not None and value < 1:
            return name, value
    return None
