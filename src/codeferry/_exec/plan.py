"""The parent's decisions about a model, made once and carried down: a ``Plan``.

Before any worker starts, the parent resolves the model's code (at the code revision),
finds its config and weights (at the revision), checks that the classes the tasks need can
load, makes the trust decision, checks the device, and that the folder has the weights and
tokenizer files every worker will read (``files``). Two copies of a decision can disagree
(a file changed in between, a trust rule applied in one place only), so ``prepare`` makes
the one ``Plan`` and ``run``, ``doctor``, ``Executor`` and the Ray backend take it. A worker checks the plan (it verifies that the code
it loads has the plan's digest); it never remakes it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from .._code import hub as _hub
from .._code import removed
from .._code.resolve import Bundle
from .._code.source import ModelOrigin
from .._trust.decide import Decision, code_changed
from .._trust.options import ModelOptions
from ..errors import MissingTransformersNameError
from .files import check_model_files, written_for
from .workers.checks import check_device, dtype_name

__all__ = ["Plan", "needed_classes", "prepare", "release_line"]


def needed_classes(tasks: Sequence[str]) -> set[str]:
    """The ``auto_map`` keys workers load for ``tasks``: the config, tokenizer and model heads."""
    return {"AutoConfig", "AutoTokenizer"} | {
        "AutoModel" if task == "embed" else "AutoModelForCausalLM" for task in tasks}


@dataclass(frozen=True)
class Plan:
    """What the parent decided about one model, for every worker it starts."""

    #: The model as the caller named it (a folder or a repo id).
    model: str
    options: ModelOptions
    #: The code, resolved at the code revision; its digest is what every worker verifies.
    bundle: Bundle
    #: The folder of the config, tokenizer and weights (the revision's).
    weights: ModelOrigin
    decision: Decision
    device: str
    #: The dtype's name (``torch.float16`` and ``"float16"`` agree), or ``None``: the model's.
    dtype: str | None
    tasks: tuple[str, ...]
    #: The transformers release line the workers run the code on (``"4.57"``: a release
    #: environment, ``workers.release``), or ``None``: the installed one serves it.
    release: str | None = None

    @property
    def digest(self) -> str:
        return self.bundle.digest

    @property
    def code_folder(self) -> str | None:
        """The code's own folder when it is not the weights' revision (``code_revision``)."""
        return None if self.options.own_code else str(self.bundle.origin.root)

    @property
    def separate_weights(self) -> ModelOrigin | None:
        """The weights' folder when it is another revision's than the code's, else ``None``."""
        return None if self.options.own_code else self.weights

    def for_workers(self) -> ModelOptions:
        """What travels to workers: the decision in place of its inputs, and no token."""
        return self.options.for_workers(self.decision)


def release_line(bundle: Bundle) -> str | None:
    """The transformers release line the workers run ``bundle``'s code on, or ``None``: the
    installed one serves it (``_code.removed.release_for``, told the release config.json
    names). Resolving already found the imports a release would serve: without one of them
    the code is not read again (every model's start pays nothing for this)."""
    if not any(isinstance(p, MissingTransformersNameError) and p.needs for p in bundle.problems):
        return None
    return removed.release_for(removed.uses_in(bundle.contents), removed.installed(),
                               written_for(bundle.origin.root))


def prepare(
    model: str | os.PathLike[str],
    options: ModelOptions,
    *,
    tasks: Sequence[str] = ("generate",),
    device: str = "cpu",
    dtype: object | None = None,
    digest: str | None = None,
    demo: bool = False,
    local_device: bool = True,
    need: _hub.Need = "model",
) -> Plan:
    """Resolve, locate, check and decide once; the ``Plan`` that workers are started with.

    ``digest``: the code the caller checked before (other code found now raises
    ``CodeChangedError``). ``demo``: the bundled demo is trusted without a flag (the command
    line's rule). ``local_device``: the device is this machine's (not a Ray actor's, which
    checks its own node). ``need``: ``"code"`` for a caller that builds configs only (the
    doctor), so a repo's weights are not downloaded for it. With ``need="model"`` the
    folder must hold what every worker will read: weights for ``tasks`` that build a model,
    and the tokenizer's files (``ModelFilesMissingError`` otherwise, before any worker).
    """
    dtype = dtype_name(dtype)  # the cheap checks first, before anything is downloaded
    if local_device:
        check_device(device)
    bundle = options.resolve_code(model, whole=need == "model", requirements=need == "model")
    if digest is not None and bundle.digest != digest:
        raise code_changed(bundle, digest)
    # Names the installed transformers lacks and no shim serves: the workers get the release
    # that has them, and what they would block here blocks nothing.
    release = release_line(bundle)
    if release is not None:
        bundle = bundle.on_release()
    weights = options.locate_model(model, bundle, need=need)
    if need == "model":
        bundle.check_classes(needed_classes(tasks))  # another class's problem is no matter
    decision = options.decide(bundle, demo=demo)
    if need == "model":
        check_model_files(weights.root, tasks, code=bundle.origin.root)
    return Plan(os.fspath(model), options, bundle, weights, decision, device, dtype, tuple(tasks),
                release)
