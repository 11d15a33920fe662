"""A ticket may register its unit only under the unit's own name, or a
``transformers_modules.`` alias: crafted pickles asking for ``requests`` or
``codeferry._dyn`` are refused, typed, before anything is registered or run."""

from __future__ import annotations

import pickle
import sys
import zlib
from typing import Any

import pytest

from codeferry._code.digest import unit_digest
from codeferry._runtime import loader as _loader
from codeferry._runtime import pickling as _pickling
from codeferry._runtime.store import Unit, write_unit
from codeferry.errors import TicketPackageError

FILES = {"__init__.py": b"", "evil.py": b"HIJACKED = True\n"}
UNIT = Unit(unit_digest(FILES), FILES, ("", "evil"), frozenset({""}), "crafted")
OTHER = "0" * 32


class Crafted:
    """Pickles as a call of ``func(*args)``, the way a hostile sender would write it."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def embedded(package: str) -> bytes:
    payload = zlib.compress(pickle.dumps(dict(FILES), protocol=4))
    return pickle.dumps(Crafted(_pickling._arrive, UNIT.digest, package, UNIT.label,
                                UNIT.order, ("",), payload))


def by_reference(*args: str) -> bytes:
    return pickle.dumps(Crafted(_pickling._arrive_ref, *args))


HOSTILE = ["requests", "json", "codeferry", "codeferry._dyn", f"codeferry._dyn.u{OTHER}",
           "codeferry._dyn.u" + UNIT.token + ".x", "transformers_modules", "transformers_modules..x",
           "transformers_modules.a/../b"]


@pytest.mark.parametrize("package", HOSTILE)
def test_embedded_ticket_under_a_foreign_name_is_refused(package: str) -> None:
    before = set(sys.modules)
    with pytest.raises(TicketPackageError) as info:
        pickle.loads(embedded(package))
    err = info.value
    assert err.package == package and err.digest == UNIT.digest
    assert repr(package) in str(err) and err.fix
    assert _loader.registered(package) is None
    assert set(sys.modules) - before == set()  # nothing imported, nothing shadowed
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.package, again.digest) == (TicketPackageError, package, UNIT.digest)


@pytest.mark.parametrize("args", [
    ("requests",), ("requests", None), ("requests", UNIT.token), ("codeferry._dyn",),
    ("codeferry._dyn.u../../../../etc",), (f"codeferry._dyn.u{OTHER}", UNIT.token),
    ("transformers_modules.x", "../../../../tmp/evil0000000000000000000000000000"),
    ("transformers_modules.x",),
])
def test_by_reference_ticket_under_a_foreign_name_is_refused(args: tuple[str, ...]) -> None:
    write_unit(UNIT)  # the store has the bytes: only the name is wrong
    with pytest.raises(TicketPackageError):
        pickle.loads(by_reference(*args))
    assert _loader.registered(args[0]) is None


def test_own_name_and_transformers_alias_are_accepted() -> None:
    own = _loader.default_package(UNIT)
    ticket = pickle.loads(embedded(own))
    assert ticket.registration.package == own
    alias = "transformers_modules.crafted.abc123_hyphen_x"
    assert pickle.loads(embedded(alias)).registration.package == alias
    write_unit(UNIT)
    assert pickle.loads(by_reference(own)).registration.unit.digest == UNIT.digest
    assert pickle.loads(by_reference(alias, UNIT.token)).registration.package == alias
