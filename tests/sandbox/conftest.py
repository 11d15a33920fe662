"""The hostile model's world, one per test module: a home with planted secrets, the model
(``_hostile.py``), and a listening 127.0.0.1 port its code tries to reach."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _hostile import listener, plant_home, write_hostile


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return plant_home(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, home: Path) -> Path:
    return write_hostile(tmp_path_factory.mktemp("models"), home)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with listener() as found:
        yield found
