"""A unit: one repo's worth of needed files, the verified bytes the loader executes.

Pure data (no files, no processes): the store writes and reads units, the loader registers
them, the trust decision names them by digest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import StoreCorruptError
from .digest import token_of, unit_digest

__all__ = ["Unit"]


@dataclass(frozen=True)
class Unit:
    """The verified bytes of a unit, and what the loader needs to execute them.

    The stored layer of a unit: built from a ``Bundle`` (``_runtime.loader.units_of``, from its
    ``bundle.RepoScan``), a ticket or the store; ``_runtime.loader.register`` makes it a
    ``_runtime.loader.Registration`` in a process.

    ``order`` lists dotted module names dependencies first; ``packages`` those that are
    packages (``__init__.py`` or namespace folders); ``label`` is what messages call it.
    """

    digest: str
    files: Mapping[str, bytes]
    order: tuple[str, ...]
    packages: frozenset[str]
    label: str

    @property
    def token(self) -> str:
        return token_of(self.digest)

    def verify(self) -> None:
        actual = unit_digest(self.files)
        if actual != self.digest:
            raise StoreCorruptError(
                f"the code of {self.label} does not match its digest: expected "
                f"{self.digest}, got {actual}.",
                digest=self.digest, model=self.label,
                fix="the bytes were changed after they were hashed; load the model again from its source.",
            )
