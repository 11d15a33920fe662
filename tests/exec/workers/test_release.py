"""Release environments: which release a model's code gets, what is hidden beside it, and
what a user sees when one cannot be made.

The corpus (``tests/corpus``) runs a model on a made release end to end; here the decision
is checked on its own (pure), the hiding in a fresh interpreter over real distribution
metadata, and the failure with the real installer pointed at an index that refuses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from codeferry._code import removed
from codeferry.errors import ReleaseUnavailableError

HYBRID = "from transformers.cache_utils import Cache, HybridCache\n"
SUMMARY = "from transformers.modeling_utils import SequenceSummary\n"
SHIMMED = "from transformers.utils import is_torch_fx_available\n"


def _found(*sources: str) -> list[tuple[str, removed.Use]]:
    return removed.uses_in({(None, f"m{i}.py"): s.encode() for i, s in enumerate(sources)})


@pytest.mark.parametrize(("sources", "installed", "written_for", "line"), [
    ((HYBRID,), "5.25.0", None, "4.57"),  # the names' last release
    ((HYBRID,), "5.25.0", "4.47.0", "4.53"),  # the code's own, raised to the floor
    ((HYBRID,), "5.25.0", "4.55.2", "4.55"),  # the code's own
    ((HYBRID,), "5.25.0", "4.60.0", "4.57"),  # never newer than the names' last release
    ((HYBRID,), "4.57.6", None, None),  # the installed one has it
    ((SHIMMED,), "5.25.0", None, None),  # a shim serves it
    ((HYBRID, SUMMARY), "5.25.0", None, None),  # no release codeferry runs on has both
])
def test_the_release_a_model_gets(sources: tuple[str, ...], installed: str,
                                  written_for: str | None, line: str | None) -> None:
    assert removed.release_for(_found(*sources), installed, written_for) == line


def _dist(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "top_level.txt").write_text(name + "\n")
    (site / name).mkdir()
    (site / name / "__init__.py").write_text("")


def test_packages_that_need_what_the_release_replaced_are_hidden_beside_it(
        tmp_path: Path) -> None:
    release, site = tmp_path / "release", tmp_path / "site"
    _dist(release, "hubby", "0.36.2")
    _dist(site, "hubby", "2.4.0")  # the user's own: shadowed by the release's, never hidden
    _dist(site, "needsnew", "1.0", "hubby>=1.32")  # kernels and huggingface_hub, in small
    _dist(site, "needsold", "1.0", "hubby>=0.30")
    _dist(site, "onlyextra", "1.0", 'hubby>=9; extra == "hub"')
    script = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path[:0] = [{str(release)!r}, {str(site)!r}]
        from codeferry._exec.workers.release import hide_conflicts
        print(sorted(hide_conflicts({str(release)!r})))
        print([importlib.util.find_spec(n) is not None
               for n in ("needsnew", "needsold", "onlyextra")])
        print(importlib.util.find_spec("hubby").origin)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, timeout=60)
    hidden, found, hubby = done.stdout.splitlines()
    assert hidden == "['needsnew']"
    assert found == "[False, True, True]"
    assert hubby.startswith(str(release))


def test_a_release_that_cannot_be_made_says_what_to_run_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from codeferry._exec.workers import release

    monkeypatch.setenv("CODEFERRY_RELEASES", str(tmp_path))
    # the real installer, with no cache and an index on a port nothing listens on
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # pip, not a uv elsewhere
    with pytest.raises(ReleaseUnavailableError) as err:
        release.ensure("4.53", say=False)
    assert "transformers 4.53" in str(err.value)
    assert "codeferry release" in (err.value.fix or "")
    assert release.made("4.53") is None
    assert [p.name for p in tmp_path.iterdir()] == [f".{release.folder('4.53').name}.lock"]


def test_ray_actors_make_their_nodes_own_release(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver makes no release for Ray actors (nodes do not share its disk): each actor
    makes or finds its node's own at its start; one that already imported another
    transformers is refused, named, before anything is made."""
    import transformers  # noqa: F401 - as a process that imported its own first

    from codeferry._exec.workers.release import enter, for_workers

    monkeypatch.setenv("CODEFERRY_RELEASES", str(tmp_path))
    assert for_workers(None, "ray") is None
    assert for_workers("4.53", "ray") == "4.53"
    assert list(tmp_path.iterdir()) == []  # nothing made here
    with pytest.raises(ReleaseUnavailableError, match=r"imported transformers \S+ before"):
        enter("4.0")
    assert list(tmp_path.iterdir()) == []
