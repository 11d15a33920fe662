"""Tiny ``trust_remote_code`` models for tests, benchmarks and docs.

Use :func:`write_model` (plain folder) or :func:`write_hub_model` (hub cache layout) with a
:class:`ModelSpec` to build a model repository that reproduces one real-world remote-code shape,
and :func:`demo_model_path` for the small ``charlm`` demo model shipped with codeferry.

The names are loaded lazily so that ``python -m codeferry.testing._factory`` (which regenerates
the demo model) does not import the factory twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from codeferry.testing._factory import (
        demo_model_path,
        write_demo_model,
        write_hub_model,
        write_model,
    )
    from codeferry.testing._realworld import (
        MISSING_PACKAGES,
        REAL_WORLD_KINDS,
        write_real_world_model,
    )
    from codeferry.testing._spec import DEMO_SPEC, HELPER_KINDS, LARGEST_SPEC, ModelSpec

__all__ = [
    "DEMO_SPEC",
    "HELPER_KINDS",
    "LARGEST_SPEC",
    "MISSING_PACKAGES",
    "REAL_WORLD_KINDS",
    "ModelSpec",
    "demo_model_path",
    "write_demo_model",
    "write_hub_model",
    "write_model",
    "write_real_world_model",
]

_REAL_WORLD = {"MISSING_PACKAGES", "REAL_WORLD_KINDS", "write_real_world_model"}
_SPEC = {"DEMO_SPEC", "HELPER_KINDS", "LARGEST_SPEC", "ModelSpec"}


def __getattr__(name: str) -> Any:
    if name in _REAL_WORLD:
        return getattr(importlib.import_module("codeferry.testing._realworld"), name)
    if name in _SPEC:
        return getattr(importlib.import_module("codeferry.testing._spec"), name)
    if name in __all__:
        return getattr(importlib.import_module("codeferry.testing._factory"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
