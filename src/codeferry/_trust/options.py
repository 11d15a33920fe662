"""Which model and whose code, as one value from the command line to the worker.

``load``, ``Executor``, ``run``, ``doctor`` and every command of the CLI take the same
group of arguments, ``from_pretrained``'s vocabulary: where to find the model
(``revision``, ``code_revision``, ``cache_dir``, ``token``, ``local_files_only``) and what
the trust decision is made from (``trust_remote_code``, ``lock``). Each public signature
lists them for its users and its help, ``ModelOptions.of`` takes them from there, and
everything below passes the one value on, never listing them again by hand: a new option
is a field here plus the public signatures.

What the revisions mean is decided here too: the code is read at ``code_revision``
(default: ``revision``), the config and weights at ``revision``, as in transformers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._code import hub as _hub
from .._code.lockfile import Lock
from .._code.resolve import Bundle, resolve
from .._code.source import ModelOrigin
from .decide import Decision, decide

__all__ = ["ModelOptions"]


@dataclass(frozen=True)
class ModelOptions:
    """Where to find a model and its code, and the inputs of the trust decision."""

    revision: str | None = None
    #: The revision whose code runs (``None``: ``revision``'s own).
    code_revision: str | None = None
    cache_dir: str | None = None
    token: str | bool | None = None
    local_files_only: bool | None = None
    trust_remote_code: bool = False
    lock: Lock | str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.token is not None and not isinstance(self.token, (str, bool)):
            raise TypeError(
                f"token must be a string, a bool or None, not {type(self.token).__name__}")
        if self.cache_dir is not None:  # a PathLike from the caller: one type from here on
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> ModelOptions:
        """The options among a public function's ``arguments`` (its ``locals()``): each of
        its keyword arguments of this name, and nothing else (every one must be there)."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})

    def keywords(self) -> dict[str, Any]:
        """The options as the keyword arguments of ``load``, ``Executor``, ``run``, ``doctor``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def own_code(self) -> bool:
        """Whether the code is ``revision``'s own (no other ``code_revision``)."""
        return self.code_revision is None or self.code_revision == self.revision

    def resolve_code(self, model: str | os.PathLike[str], *, whole: bool = False,
                     requirements: bool = True) -> Bundle:
        """``model``'s code at the code revision. ``whole``: a repo id the cache lacks is
        downloaded with its weights when they are the same revision's (what loaders need);
        only its code otherwise."""
        return resolve(model, revision=self.code_revision if not self.own_code else self.revision,
                       cache_dir=self.cache_dir, token=self.token,
                       local_files_only=self.local_files_only, requirements=requirements,
                       fetch="model" if whole and self.own_code else "code")

    def locate_model(self, model: str | os.PathLike[str], code: Bundle, *,
                     need: _hub.Need = "model") -> ModelOrigin:
        """Where ``model``'s config and weights are: ``revision``'s folder (``code``'s own
        when the code is that revision's), downloaded first as ``need`` says."""
        if self.own_code:
            return code.origin
        return _hub.locate(model, revision=self.revision, cache_dir=self.cache_dir,
                           token=self.token, local_files_only=self.local_files_only, need=need)

    def decide(self, bundle: Bundle, *, demo: bool = False) -> Decision:
        """The trust decision (``_trust.decide``) on these options' trust and lock."""
        return decide(bundle, trust_remote_code=self.trust_remote_code, lock=self.lock, demo=demo)

    def for_workers(self, decision: Decision) -> ModelOptions:
        """What travels to workers: the ``decision`` in place of its inputs, and no token.

        A worker reads folders its parent resolved and downloaded already (a Ray actor a
        copy of them), so it never asks the Hub for anything; the token, a secret, would
        only travel in every pickled spec and across the cluster for nothing.
        """
        return dataclasses.replace(self, token=None, trust_remote_code=decision.trust_remote_code,
                                   lock=decision.lock)
