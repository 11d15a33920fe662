"""``codeferry.resolve`` / ``codeferry inspect`` on every factory variant, and on broken models.

Expectations are derived from the ``ModelSpec`` (which files each switch adds, which module
imports which) and from the written bytes themselves (import lines, ``auto_map`` JSON), never
from the resolver. Models are written once per session (``factory_models`` in conftest);
tests that change a model work on a copy.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from codeferry import errors
from codeferry._code.resolve import Bundle, resolve
from codeferry.cli import main
from codeferry.errors import OptionalModuleMissing
from codeferry.testing import HELPER_KINDS, ModelSpec, write_hub_model, write_model

pytestmark = pytest.mark.usefixtures("offline_hub")

HEX40 = re.compile(r"[0-9a-f]{40}\Z")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
LFS_POINTER = (
    b"version https://git-lfs.github.com/spec/v1\n"
    b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    b"size 12345\n"
)


# ------------------------------------------------------------------------------------------
# Fixtures and oracles
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def inspected(
    factory_models: dict[str, Path], factory_hub_cache: Path
) -> Callable[[str], Bundle]:
    """``resolve`` of a factory variant, once per session (repo ids go through the hub cache)."""
    cache: dict[str, Bundle] = {}

    def get(key: str) -> Bundle:
        if key not in cache:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("HF_HUB_OFFLINE", "1")
                mp.setenv("HF_HUB_CACHE", str(factory_hub_cache))
                if "/" in key:
                    cache[key] = resolve(key, cache_dir=factory_hub_cache)
                else:
                    cache[key] = resolve(factory_models[key])
        return cache[key]

    return get


def layout(spec: ModelSpec) -> dict[str, str]:
    """Module names the factory uses for ``spec`` (documented in ``ModelSpec``)."""
    n, g = spec.name, spec.generic_names
    return {
        "cfg": "configuration" if g else f"configuration_{n}",
        "mdl": "modeling" if g else f"modeling_{n}",
        "llm": "configuration_llm" if g else f"configuration_{n}_llm",
        "tok": "tokenization" if g else f"tokenization_{n}",
        "img": "image_processing" if g else f"image_processing_{n}",
        "proc": "processing" if g else f"processing_{n}",
        "flat": "utils" if g else "layers",
        "pkg": "ops" if g else "utils",
    }


def expected_files(spec: ModelSpec) -> set[tuple[str | None, str, str]]:
    """(repo, path, kind) of every file the code of ``spec`` needs, and nothing else."""
    lay = layout(spec)
    mods = {lay["cfg"], lay["mdl"]}
    files: set[tuple[str | None, str, str]] = set()
    kinds = set(spec.helpers)
    if "flat" in kinds:
        mods.add(lay["flat"])
    if "subpackage" in kinds:
        files.add((None, f"{lay['pkg']}/__init__.py", "package"))
        files.add((None, f"{lay['pkg']}/rope.py", "module"))
    extra = {"from_dot": "activations", "function_body": "norms", "try_except": "fast_kernels",
             "star": "constants"}
    mods |= {extra[k] for k in kinds if k in extra}
    if spec.config_helper:
        mods.add("config_defaults")
    if spec.nested_subconfig:
        mods.add(lay["llm"])
    if spec.tokenizer or spec.processor:
        mods.add(lay["tok"])
        # The tokenizer module names it (VOCAB_FILES_NAMES): the resolver ships named data files.
        files.add((None, "vocab.json", "asset"))
    if spec.processor:
        mods |= {lay["img"], lay["proc"]}
    if spec.asset:
        files.add((None, "position_table.json", "asset"))
    if spec.cross_repo:
        files.add((spec.cross_repo, "modeling_heads.py", "module"))
    return files | {(None, f"{m}.py", "module") for m in mods}


def expected_edges(spec: ModelSpec) -> set[tuple[str, str, bool]]:
    """(importer, imported, deferred) between the modules of ``spec``."""
    lay = layout(spec)
    cfg, mdl, pkg = lay["cfg"], lay["mdl"], lay["pkg"]
    edges = {(mdl, cfg, False)}
    kinds = set(spec.helpers)
    if "flat" in kinds:
        edges.add((mdl, lay["flat"], False))
    if "subpackage" in kinds:
        edges |= {
            (mdl, pkg, False), (mdl, f"{pkg}.rope", False),
            (pkg, f"{pkg}.rope", False),  # __init__: from .rope import rope
        }  # fmt: skip
    if "from_dot" in kinds:
        edges.add((mdl, "activations", False))
    if "function_body" in kinds:
        edges.add((mdl, "norms", True))
    if "try_except" in kinds:
        edges.add((mdl, "fast_kernels", False))
    if "star" in kinds:
        edges.add((mdl, "constants", False))
    if spec.config_helper:
        edges.add((cfg, "config_defaults", False))
    if spec.nested_subconfig:
        edges.add((cfg, lay["llm"], False))
    return edges


def expected_classes(spec: ModelSpec) -> set[tuple[str, str, int | None, str | None, str, str]]:
    """(source, key, slot, repo, module, class) of every ``auto_map`` entry of ``spec``."""
    lay, p = layout(spec), spec.class_prefix
    out: set[tuple[str, str, int | None, str | None, str, str]] = {
        ("config.json", "AutoConfig", None, None, lay["cfg"], f"{p}Config"),
        ("config.json", "AutoModel", None, None, lay["mdl"], f"{p}Model"),
        ("config.json", "AutoModelForCausalLM", None, None, lay["mdl"], f"{p}ForCausalLM"),
    }
    if spec.cross_repo:
        out.add(("config.json", "AutoModelForSequenceClassification", None, spec.cross_repo,
                 "modeling_heads", "SharedHeadForSequenceClassification"))
    if spec.nested_subconfig:
        out.add(("config.json:llm_config", "AutoConfig", None, None, lay["llm"], f"{p}LLMConfig"))
    if spec.tokenizer or spec.processor:
        out.add(("tokenizer_config.json", "AutoTokenizer", 0, None, lay["tok"], f"{p}Tokenizer"))
    if spec.processor:
        out |= {
            ("processor_config.json", "AutoProcessor", None, None, lay["proc"], f"{p}Processor"),
            ("preprocessor_config.json", "AutoProcessor", None, None, lay["proc"], f"{p}Processor"),
            ("preprocessor_config.json", "AutoImageProcessor", None, None, lay["img"],
             f"{p}ImageProcessor"),
        }  # fmt: skip
    return out


def qualified(repo: str | None, path: str) -> str:
    """Dotted module name of a ``.py`` path, prefixed ``org/repo--`` for cross-repo code."""
    stem = path[: -len("/__init__.py")] if path.endswith("/__init__.py") else path[: -len(".py")]
    return (f"{repo}--" if repo else "") + stem.replace("/", ".")


_IMPORT_LINE = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)")


def third_party_uses(bundle: Bundle) -> dict[str, set[tuple[str, int]]]:
    """Package -> {(shown path, line)} read from the import lines of the needed files."""
    uses: dict[str, set[tuple[str, int]]] = {}
    for (repo, path), data in bundle.contents.items():
        if not path.endswith(".py"):
            continue
        for number, text in enumerate(data.decode("utf-8").splitlines(), start=1):
            found = _IMPORT_LINE.match(text)
            if found and found.group(1) not in sys.stdlib_module_names | {"__future__"}:
                shown = (f"{repo}--" if repo else "") + path
                uses.setdefault(found.group(1), set()).add((shown, number))
    return uses


def assert_topological(bundle: Bundle) -> None:
    """Every module once; each imported module before its importer (edges as given)."""
    order = list(bundle.load_order)
    assert len(order) == len(set(order))
    assert set(order) == {m.qualified for m in bundle.modules}
    position = {name: index for index, name in enumerate(order)}
    pairs = {(a, b) for a, b, _ in bundle.edges}
    for importer, imported, _ in bundle.edges:
        if (imported, importer) in pairs:
            # Only a package and its own submodule may point at each other (its __init__
            # imports the submodule, which needs the package): Python runs both at once.
            short = sorted([importer, imported], key=len)
            assert short[1].startswith(short[0] + "."), (importer, imported)
            continue
        assert position[imported] < position[importer], (imported, "after", importer, order)


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def replace_in(path: Path, old: str, new: str) -> int:
    """Replace ``old`` (exactly once) in ``path``; return the 1-based line where it was."""
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new), encoding="utf-8")
    return text[: text.index(old)].count("\n") + 1


def problem_types(bundle: Bundle) -> list[str]:
    return [type(p).__name__ for p in bundle.problems]


VARIANTS = [
    "default",
    *(f"helper_{kind}" for kind in HELPER_KINDS),
    "all_helpers",
    "model_keys_first",
    "config_helper",
    "tokenizer",
    "processor",
    "nested_subconfig",
    "asset",
    "generic_a",
    "generic_b",
    "cross_repo",
    "largest",
    "acme/tiny",
    "acme/crossy",
    "acme/largest",
]


# ------------------------------------------------------------------------------------------
# Every variant: files, load order, classes, requirements, problems
# ------------------------------------------------------------------------------------------


def test_variant_list_covers_every_factory_model(factory_specs: dict[str, ModelSpec]) -> None:
    assert set(VARIANTS) == set(factory_specs)


@pytest.mark.parametrize("key", VARIANTS)
def test_files_are_exactly_what_the_code_needs(
    key: str, inspected: Callable[[str], Bundle], factory_specs: dict[str, ModelSpec]
) -> None:
    bundle = inspected(key)
    spec = factory_specs[key]
    got = {(f.repo, f.path, f.kind) for f in bundle.files}
    assert got == expected_files(spec)
    paths = {f.path for f in bundle.files}
    # never the absent optional import, never the docstring / string-constant decoys
    assert not any("optional_cuda_kernels" in p or "not_a_real_module" in p or "fake" in p
                   for p in paths)
    # never configs, weights or tokenizer configs
    assert not paths & {"config.json", "model.safetensors", "generation_config.json",
                        "tokenizer_config.json", "preprocessor_config.json"}
    for entry in bundle.files:
        data = bundle.contents[(entry.repo, entry.path)]
        assert entry.size == len(data)
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert "\\" not in entry.path and not entry.path.startswith("/")
    assert set(bundle.contents) == {(f.repo, f.path) for f in bundle.files}
    # every module is a file of the bundle
    assert {qualified(m.repo, m.path) for m in bundle.modules} == {
        qualified(r, p) for r, p, k in got if k != "asset"
    }


@pytest.mark.parametrize("key", VARIANTS)
def test_load_order_is_topological_with_the_expected_edges(
    key: str, inspected: Callable[[str], Bundle], factory_specs: dict[str, ModelSpec]
) -> None:
    bundle = inspected(key)
    spec = factory_specs[key]
    assert set(bundle.edges) == expected_edges(spec)
    # A submodule needs its package first: an order constraint, not an import edge
    # (an edge would draw a cycle in --graph that the report says is not there).
    if "subpackage" in spec.helpers:
        pkg = layout(spec)["pkg"]
        assert (f"{pkg}.rope", pkg) in bundle.parents
        assert (f"{pkg}.rope", pkg, False) not in bundle.edges
    assert_topological(bundle)
    lay = layout(spec)
    order = list(bundle.load_order)
    # the config module before the modeling module, even when auto_map lists models first
    assert order.index(lay["cfg"]) < order.index(lay["mdl"])
    for helper in ("config_defaults", lay["llm"]):
        if helper in order:
            assert order.index(helper) < order.index(lay["cfg"])
    for importer, imported, _ in bundle.edges:
        if importer == lay["mdl"]:
            assert order.index(imported) < order.index(lay["mdl"])


@pytest.mark.parametrize("key", VARIANTS)
def test_classes_are_every_auto_map_entry(
    key: str,
    inspected: Callable[[str], Bundle],
    factory_specs: dict[str, ModelSpec],
    factory_models: dict[str, Path],
) -> None:
    bundle = inspected(key)
    spec = factory_specs[key]
    got = {(c.declared_in, c.key, c.slot, c.repo, c.module, c.name) for c in bundle.classes}
    assert got == expected_classes(spec)
    assert len(bundle.classes) == len(got)
    # config.json entries in the order the file lists them (model keys first or not)
    auto_map = json.loads((factory_models[key] / "config.json").read_text())["auto_map"]
    assert [c.key for c in bundle.classes if c.declared_in == "config.json"] == list(auto_map)
    assert [c.reference for c in bundle.classes if c.declared_in == "config.json"] == list(
        auto_map.values()
    )


@pytest.mark.parametrize("key", VARIANTS)
def test_requirements_name_installed_packages_with_every_use(
    key: str, inspected: Callable[[str], Bundle], factory_specs: dict[str, ModelSpec]
) -> None:
    bundle = inspected(key)
    expected = third_party_uses(bundle)
    names = {"torch", "transformers"} | ({"numpy"} if factory_specs[key].processor else set())
    assert set(expected) == names  # the oracle itself sees what the templates import
    assert {r.name for r in bundle.requirements} == names
    for req in bundle.requirements:
        assert req.installed
        assert req.version == importlib.metadata.version(req.distribution or req.name)
        assert not req.guarded
        assert {(u.path, u.line) for u in req.uses} == expected[req.name]
        assert all(not u.guarded for u in req.uses)
        assert all(str(u) == f"{u.path}:{u.line}" for u in req.uses)


@pytest.mark.parametrize("key", VARIANTS)
def test_good_variants_have_no_problems(key: str, inspected: Callable[[str], Bundle]) -> None:
    bundle = inspected(key)
    assert bundle.blocking == ()
    # The only notes: a guarded import of a file the model does not ship.
    assert {type(p) for p in bundle.problems} <= {OptionalModuleMissing}
    assert all(bundle.problems_for(ref) == () for ref in bundle.classes)
    bundle.check()  # raises nothing
    assert DIGEST.match(bundle.digest)


def test_requirement_use_lines_point_at_the_import(inspected: Callable[[str], Bundle]) -> None:
    bundle = inspected("largest")
    for req in bundle.requirements:
        for use in req.uses:
            repo, _, path = use.path.rpartition("--")
            text = bundle.contents[(repo or None, path)].decode().splitlines()[use.line - 1]
            assert re.match(rf"\s*(import|from) {req.name}\b", text), (use, text)


def test_helper_kinds_each_add_their_own_files(inspected: Callable[[str], Bundle]) -> None:
    base = {f.path for f in inspected("default").files}
    assert base == {"configuration_tiny.py", "modeling_tiny.py"}
    added = {kind: {f.path for f in inspected(f"helper_{kind}").files} - {
        f"configuration_h_{kind}.py", f"modeling_h_{kind}.py"} for kind in HELPER_KINDS}
    assert added == {
        "flat": {"layers.py"},
        "subpackage": {"utils/__init__.py", "utils/rope.py"},
        "from_dot": {"activations.py"},
        "function_body": {"norms.py"},
        "try_except": {"fast_kernels.py"},  # and not the absent optional_cuda_kernels.py
        "star": {"constants.py"},
    }
    every = {f.path for f in inspected("all_helpers").files}
    assert every == {"configuration_allh.py", "modeling_allh.py"}.union(*added.values())


def test_generic_names_two_models_same_module_names_different_code(
    inspected: Callable[[str], Bundle],
) -> None:
    a, b = inspected("generic_a"), inspected("generic_b")
    assert {"configuration", "modeling"} <= set(a.load_order) & set(b.load_order)
    assert {f.path for f in b.files} == {
        "configuration.py", "modeling.py", "utils.py", "ops/__init__.py", "ops/rope.py"
    }
    shared = {f.path: f.sha256 for f in a.files}
    assert any(shared[f.path] != f.sha256 for f in b.files if f.path in shared)
    assert a.digest != b.digest


def test_odd_folder_name(inspected: Callable[[str], Bundle], factory_models: dict[str, Path]) -> None:
    folder = factory_models["default"]
    assert folder.name == "my.model-v1 copy"
    bundle = inspected("default")
    assert bundle.origin.root == folder.resolve()
    assert bundle.load_order == ("configuration_tiny", "modeling_tiny")


# ------------------------------------------------------------------------------------------
# Hub layout, revisions, cross-repo pins
# ------------------------------------------------------------------------------------------


def test_hub_repo_id_resolves_to_its_pinned_snapshot(
    inspected: Callable[[str], Bundle], factory_models: dict[str, Path]
) -> None:
    bundle = inspected("acme/tiny")
    snapshot = factory_models["acme/tiny"]
    assert bundle.origin.repo_id == "acme/tiny"
    assert bundle.origin.root == snapshot
    assert bundle.origin.commit == snapshot.name and HEX40.match(snapshot.name)
    assert bundle.to_json()["commit"] == snapshot.name
    assert bundle.pins == {}


@pytest.mark.parametrize("key", ["cross_repo", "acme/crossy", "acme/largest"])
def test_cross_repo_code_is_pinned_to_a_commit(
    key: str,
    inspected: Callable[[str], Bundle],
    factory_specs: dict[str, ModelSpec],
    factory_hub_cache: Path,
) -> None:
    bundle = inspected(key)
    other = factory_specs[key].cross_repo
    assert other is not None
    main_ref = factory_hub_cache / f"models--{other.replace('/', '--')}" / "refs" / "main"
    commit = main_ref.read_text().strip()
    assert bundle.pins == {other: commit} and HEX40.match(commit)
    assert bundle.to_json()["pins"] == {other: commit}
    heads = [f for f in bundle.files if f.repo == other]
    assert [(f.path, f.kind) for f in heads] == [("modeling_heads.py", "module")]
    assert f"{other}--modeling_heads" in bundle.load_order
    ref = next(c for c in bundle.classes if c.repo == other)
    assert ref.reference == f"{other}--modeling_heads.SharedHeadForSequenceClassification"
    # its own requirements are listed under its repo prefix
    uses = {u.path for r in bundle.requirements for u in r.uses}
    assert f"{other}--modeling_heads.py" in uses


def test_cross_repo_follows_main_to_a_new_commit_and_records_it(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    spec = ModelSpec(name="moved", cross_repo="org/moving-heads")
    write_hub_model(cache, "acme/moved", spec)
    first = resolve("acme/moved", cache_dir=cache)
    old = first.pins["org/moving-heads"]
    # a new commit of the other repo: refs/main moves, the old snapshot stays
    repo_dir = cache / "models--org--moving-heads"
    new = "f" * 40
    shutil.copytree(repo_dir / "snapshots" / old, repo_dir / "snapshots" / new)
    with (repo_dir / "snapshots" / new / "modeling_heads.py").open("a") as handle:
        handle.write("\n# changed upstream\n")
    (repo_dir / "refs" / "main").write_text(new)
    second = resolve("acme/moved", cache_dir=cache)
    assert second.pins == {"org/moving-heads": new}
    assert second.digest != first.digest  # the other repo's new bytes are hashed
    # asking for the model at its commit still pins the other repo to a commit, never "main"
    pinned = resolve("acme/moved", revision=first.origin.commit, cache_dir=cache)
    assert all(HEX40.match(c) for c in pinned.pins.values())


def test_cross_repo_absent_from_the_cache_is_a_blocking_problem(
    tmp_path: Path, factory_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    bundle = resolve(factory_models["cross_repo"])
    assert problem_types(bundle) == ["MissingModuleError"]
    problem = bundle.problems[0]
    assert problem.blocking and "org/shared-heads" in str(problem)
    assert problem.path is not None and problem.path.endswith("config.json")
    assert bundle.pins == {}


def test_cross_repo_is_found_in_the_cache_dir_given_to_resolve(
    factory_hub_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``cache_dir=`` is where the model AND the code it references are looked up."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    bundle = resolve("acme/crossy", cache_dir=factory_hub_cache)
    assert bundle.problems == () and set(bundle.pins) == {"org/shared-heads"}


@pytest.fixture()
def tagged_revisions(tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    """``acme/rev`` with commit ``old`` (tag ``v1``: one helper) and ``new`` (main: another)."""
    cache = tmp_path / "hub"
    old, new = "a" * 40, "b" * 40
    write_hub_model(cache, "acme/rev", ModelSpec(name="rev", helpers=("flat",)), commit=old)
    write_hub_model(cache, "acme/rev", ModelSpec(name="rev", helpers=("star",)), commit=new)
    (cache / "models--acme--rev" / "refs" / "v1").write_text(old)
    yield cache, old, new


def test_revision_selects_the_snapshot(tagged_revisions: tuple[Path, str, str]) -> None:
    cache, old, new = tagged_revisions
    latest = resolve("acme/rev", cache_dir=cache)
    assert latest.origin.commit == new and "constants.py" in {f.path for f in latest.files}
    for revision in ("v1", old):
        earlier = resolve("acme/rev", revision=revision, cache_dir=cache)
        assert earlier.origin.commit == old
        assert {f.path for f in earlier.files} == {"configuration_rev.py", "modeling_rev.py",
                                                    "layers.py"}
        assert earlier.digest != latest.digest


def test_cli_revision_in_the_hub_cache(
    tagged_revisions: tuple[Path, str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache, old, _ = tagged_revisions
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert main(["inspect", "acme/rev", "--revision", "v1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["repo_id"] == "acme/rev" and data["commit"] == old
    assert "layers" in data["load_order"] and "constants" not in data["load_order"]
    assert main(["inspect", "acme/rev", "--revision", "v9"]) == 2
    assert "v9" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Problems: each a typed error with file, line and a fix
# ------------------------------------------------------------------------------------------


def test_absolute_sibling_import(factory_models: dict[str, Path], tmp_path: Path) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    line = replace_in(root / "modeling_tiny.py", "from .configuration_tiny import",
                      "from configuration_tiny import")
    bundle = resolve(root)
    assert problem_types(bundle) == ["AbsoluteSiblingImportError"]
    problem = bundle.problems[0]
    assert isinstance(problem, errors.AbsoluteSiblingImportError) and problem.blocking
    assert problem.path == str(root.resolve() / "modeling_tiny.py") and problem.line == line
    assert problem.fix is not None and "from .configuration_tiny import" in problem.fix
    # the sibling is still found and ordered first, and is not a pip requirement
    assert bundle.load_order == ("configuration_tiny", "modeling_tiny")
    assert "configuration_tiny" not in {r.name for r in bundle.requirements}
    with pytest.raises(errors.AbsoluteSiblingImportError):
        bundle.check()


def test_missing_relative_import_outside_try(factory_models: dict[str, Path], tmp_path: Path) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    anchor = "from .configuration_tiny import TinyConfig\n"
    line = replace_in(root / "modeling_tiny.py", anchor, anchor + "from .gone import helper\n") + 1
    bundle = resolve(root)
    assert problem_types(bundle) == ["MissingModuleError"]
    problem = bundle.problems[0]
    assert problem.blocking and problem.line == line
    assert problem.path == str(root.resolve() / "modeling_tiny.py")
    assert "gone.py" in problem.message and problem.fix and "try/except" in problem.fix
    assert "gone.py" not in {f.path for f in bundle.files}


def test_missing_relative_import_inside_try_is_fine(inspected: Callable[[str], Bundle]) -> None:
    bundle = inspected("helper_try_except")
    source = bundle.contents[(None, "modeling_h_try_except.py")].decode()
    assert "from .optional_cuda_kernels import fused_rope_cuda" in source
    assert bundle.blocking == ()
    # ... but it is listed, as a note with its place, not silently dropped.
    (note,) = bundle.problems
    assert isinstance(note, OptionalModuleMissing) and not note.blocking
    line = source.splitlines().index(
        next(x for x in source.splitlines() if "optional_cuda_kernels" in x)) + 1
    assert note.path is not None and note.path.endswith("modeling_h_try_except.py")
    assert note.line == line and "optional_cuda_kernels.py" in note.message


def test_auto_map_naming_a_missing_module(factory_models: dict[str, Path], tmp_path: Path) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    replace_in(root / "config.json", '"modeling_tiny.TinyModel"', '"modeling_nope.TinyModel"')
    bundle = resolve(root)
    assert problem_types(bundle) == ["MissingModuleError"]
    problem = bundle.problems[0]
    assert problem.blocking and problem.path == str(root.resolve() / "config.json")
    assert "modeling_nope" in problem.message and problem.fix


def test_missing_class(factory_models: dict[str, Path], tmp_path: Path) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    replace_in(root / "config.json", '"modeling_tiny.TinyModel"', '"modeling_tiny.NopeModel"')
    bundle = resolve(root)
    assert problem_types(bundle) == ["MissingClassError"]
    problem = bundle.problems[0]
    assert isinstance(problem, errors.MissingClassError) and problem.blocking
    assert problem.path == str(root.resolve() / "config.json")
    assert "NopeModel" in problem.message and "modeling_tiny.py" in problem.message


def test_class_from_a_star_import_is_found(factory_models: dict[str, Path], tmp_path: Path) -> None:
    """A class defined in a helper and star-imported by the auto_map module exists."""
    root = copy_model(factory_models["helper_star"], tmp_path / "m")
    with (root / "constants.py").open("a") as handle:
        handle.write("\n\nclass Extra:\n    pass\n")
    replace_in(root / "constants.py", '__all__ = ["RMS_EPS", "ROPE_BASE"]',
               '__all__ = ["RMS_EPS", "ROPE_BASE", "Extra"]')
    replace_in(root / "config.json", '"modeling_h_star.HStarModel"', '"modeling_h_star.Extra"')
    assert resolve(root).problems == ()


def test_syntax_error(factory_models: dict[str, Path], tmp_path: Path) -> None:
    root = copy_model(factory_models["helper_flat"], tmp_path / "m")
    text = (root / "layers.py").read_text()
    line = text.count("\n") + 1
    (root / "layers.py").write_text(text + "def broken(:\n    pass\n")
    bundle = resolve(root)
    assert problem_types(bundle) == ["SourceSyntaxError"]
    problem = bundle.problems[0]
    assert isinstance(problem, errors.SourceSyntaxError) and problem.blocking
    assert problem.path == str(root.resolve() / "layers.py")
    assert problem.line == line and problem.col == len("def broken(") + 1
    assert f"layers.py:{line}:{problem.col}" in str(problem)
    assert "layers.py" in {f.path for f in bundle.files}  # still hashed: it is needed


def test_lfs_pointer_where_code_should_be(
    factory_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_model(factory_models["helper_flat"], tmp_path / "m")
    (root / "layers.py").write_bytes(LFS_POINTER)
    bundle = resolve(root)
    assert problem_types(bundle) == ["LFSPointerError"]
    problem = bundle.problems[0]
    assert problem.blocking and problem.line == 1
    assert problem.path == str(root.resolve() / "layers.py")
    assert problem.fix and "lfs" in problem.fix.lower()
    assert main(["inspect", str(root)]) == 1
    out = capsys.readouterr().out
    assert "error:" in out and "Git LFS pointer" in out


def test_name_missing_from_transformers(factory_models: dict[str, Path], tmp_path: Path) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    line = replace_in(root / "configuration_tiny.py", "from transformers import PretrainedConfig\n",
                      "from transformers import PretrainedConfig, NoSuchThingInTransformers\n")
    # a guarded one is not a problem
    replace_in(root / "modeling_tiny.py", "import torch\n",
               "import torch\ntry:\n    from transformers import AlsoNotThere\n"
               "except ImportError:\n    AlsoNotThere = None\n")
    bundle = resolve(root)
    assert problem_types(bundle) == ["MissingTransformersNameError"]
    problem = bundle.problems[0]
    assert problem.blocking and problem.line == line
    assert problem.path == str(root.resolve() / "configuration_tiny.py")
    assert "NoSuchThingInTransformers" in problem.message
    assert importlib.metadata.version("transformers") in problem.message


def test_missing_pip_package_in_a_guarded_import(
    factory_models: dict[str, Path], tmp_path: Path
) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    anchor = "import torch\n"
    line = replace_in(root / "modeling_tiny.py", anchor, anchor + (
        "try:\n    import codeferry_no_such_package_xyz\nexcept ImportError:\n"
        "    codeferry_no_such_package_xyz = None\n")) + 2
    bundle = resolve(root)
    req = next(r for r in bundle.requirements if r.name == "codeferry_no_such_package_xyz")
    assert not req.installed and req.version is None and req.guarded
    assert [(u.path, u.line, u.guarded) for u in req.uses] == [("modeling_tiny.py", line, True)]
    assert bundle.blocking == ()
    bundle.check()


# ------------------------------------------------------------------------------------------
# Digest
# ------------------------------------------------------------------------------------------


def test_digest_is_stable_across_folders_layouts_and_mtimes(
    inspected: Callable[[str], Bundle], factory_models: dict[str, Path], tmp_path: Path
) -> None:
    default = inspected("default")
    # the same spec written into a folder of another name
    other = write_model(tmp_path / "another name", ModelSpec())
    assert resolve(other).digest == default.digest
    # hub layout of the same code (also for the largest variant, with its cross repo)
    assert inspected("acme/tiny").digest == default.digest
    assert inspected("acme/largest").digest == inspected("largest").digest
    # file times do not matter
    copy = copy_model(factory_models["largest"], tmp_path / "copy")
    for path in copy.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    assert resolve(copy).digest == inspected("largest").digest


@pytest.mark.parametrize(
    ("rel", "needed"),
    [
        ("layers.py", True),
        ("utils/rope.py", True),
        ("utils/__init__.py", True),
        ("config_defaults.py", True),
        ("position_table.json", True),
        ("configuration_big.py", True),
        ("README.md", False),
        ("model.safetensors", False),
        ("generation_config.json", False),
    ],
)
def test_digest_changes_with_any_needed_byte_only(
    rel: str, needed: bool, inspected: Callable[[str], Bundle], factory_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    root = copy_model(factory_models["largest"], tmp_path / "m")
    path = root / rel
    if path.exists():
        path.write_bytes(path.read_bytes() + b"\n")  # one more byte; still parses
    else:
        path.write_text("# an unrelated new file\n")
    before = inspected("largest").digest
    after = resolve(root)
    assert (after.digest != before) is needed
    if rel.endswith(".py"):
        assert after.blocking == ()


# ------------------------------------------------------------------------------------------
# Static analysis executes nothing
# ------------------------------------------------------------------------------------------


def test_inspect_executes_no_model_code(tmp_path: Path) -> None:
    marker = tmp_path / "executed.log"
    spec = ModelSpec(name="sentinel", marker=str(marker), helpers=HELPER_KINDS, tokenizer=True,
                     config_helper=True)
    root = write_model(tmp_path / "sentinel model", spec)
    # the marker mechanism is there: both modules append to the file at import time
    for module in ("configuration_sentinel.py", "modeling_sentinel.py"):
        assert repr(str(marker)) in (root / module).read_text()
    bundle = resolve(root)
    assert bundle.blocking == () and len(bundle.files) > 5
    assert main(["inspect", str(root), "--json"]) == 0
    assert main(["inspect", str(root), "--graph", str(tmp_path / "g.dot")]) == 0
    assert not any("sentinel" in name for name in sys.modules)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "codeferry.cli", "inspect", str(root)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "modeling_sentinel.py" in proc.stdout and bundle.digest in proc.stdout
    assert not marker.exists()


# ------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------


def test_cli_human_report_has_every_section(
    factory_models: dict[str, Path], inspected: Callable[[str], Bundle],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["inspect", str(factory_models["largest"])]) == 0
    out = capsys.readouterr().out
    bundle = inspected("largest")
    lines = out.splitlines()
    for section in ("classes", "load order (dependencies first)", "requirements", "problems"):
        assert section in lines, section
    assert f"files ({len(bundle.files)}, " in out
    assert f"digest   {bundle.digest}" in out
    assert f"pinned   org/big-heads@{bundle.pins['org/big-heads']}" in out
    assert "config.json:llm_config" in out and "utils/__init__.py" in out
    assert "position_table.json" in out and "(asset)" in out
    assert "norms (in a function)" in out
    after = lines[lines.index("problems") + 1:]
    assert after and all(line.startswith("  note: ") for line in after)  # notes, no errors
    class_lines = lines[lines.index("classes") + 1:lines.index(next(x for x in lines if x.startswith("files (")))]
    assert all(line.endswith("  ok") for line in class_lines if line.startswith("    "))
    # load order listed in the bundle's order
    numbered = [line.split(". ", 1)[1] for line in lines if re.match(r"\s+\d+\. ", line)]
    assert numbered == list(bundle.load_order)


def test_cli_json(
    factory_models: dict[str, Path], inspected: Callable[[str], Bundle],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["inspect", str(factory_models["largest"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"digest", "classes", "files", "load_order", "requirements", "problems"} <= set(data)
    assert DIGEST.match(data["digest"]) and data["digest"] == inspected("largest").digest
    paths = {f["path"] for f in data["files"]}
    assert "utils/rope.py" in paths and "position_table.json" in paths
    assert all("\\" not in p and not os.path.isabs(p) for p in paths)
    assert "utils.rope" in data["load_order"] and "modeling_big" in data["load_order"]
    assert [p for p in data["problems"] if p["blocking"]] == []
    assert all(c["loadable"] and c["blocked_by"] == [] for c in data["classes"])
    assert all(((c["repo"] + "--") if c["repo"] else "") + c["module"] in c["closure"]
               for c in data["classes"])
    torch_req = next(r for r in data["requirements"] if r["name"] == "torch")
    assert torch_req["installed"] and torch_req["version"] == importlib.metadata.version("torch")
    assert all({"path", "line", "guarded"} <= set(u) for u in torch_req["uses"])
    sub = [c for c in data["classes"] if c["source"] == "config.json:llm_config"]
    assert [c["key"] for c in sub] == ["AutoConfig"]
    assert json.loads(json.dumps({**inspected("largest").to_json(), "doors": [],
                                  "removed_names": [], "release": None,
                                  "sandbox": []})) == data


def test_cli_json_lists_problems_and_exits_1(
    factory_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_model(factory_models["default"], tmp_path / "m")
    replace_in(root / "config.json", '"modeling_tiny.TinyModel"', '"modeling_tiny.NopeModel"')
    assert main(["inspect", str(root), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [p["type"] for p in data["problems"]] == ["MissingClassError"]
    assert data["problems"][0]["blocking"] is True


def test_cli_graph_dot(
    factory_models: dict[str, Path], inspected: Callable[[str], Bundle], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "graphs" / "out.dot"
    assert main(["inspect", str(factory_models["largest"]), "--graph", str(out)]) == 0
    dot = out.read_text()
    assert dot.startswith("digraph ") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}") == 1
    for module in inspected("largest").modules:
        assert f'"{module.qualified}" [label=' in dot
    assert '"modeling_big" -> "configuration_big";' in dot
    assert '"modeling_big" -> "norms" [style=dashed];' in dot
    assert '"org/big-heads--modeling_heads"' in dot
    # every line between the braces is a node, an edge or an attribute statement
    body = dot.strip().splitlines()[1:-1]
    statement = re.compile(r'\s+("[^"]+"( -> "[^"]+")?( \[[^\]]*\])?|\w+( \[[^\]]*\]|=\w+));')
    assert all(statement.fullmatch(line) for line in body), body
    capsys.readouterr()


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_cli_graph_rendered_needs_graphviz(
    suffix: str, factory_models: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / f"out{suffix}"
    code = main(["inspect", str(factory_models["default"]), "--graph", str(out)])
    if shutil.which("dot") is None:
        assert code == 2
        assert "Graphviz" in capsys.readouterr().err
        assert not out.exists() and list(tmp_path.iterdir()) == []
    else:
        assert code == 0 and out.stat().st_size > 0
        head = out.read_bytes()[:64]
        assert (b"<svg" in out.read_bytes()) if suffix == ".svg" else head.startswith(b"\x89PNG")


def test_cli_graph_unknown_suffix_is_a_usage_error(
    factory_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.pdf"
    assert main(["inspect", str(factory_models["default"]), "--graph", str(out)]) == 2
    assert not out.exists()
    assert "codeferry: error:" in capsys.readouterr().err


def test_cli_exit_codes(
    factory_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(factory_models["processor"])]) == 0
    assert main(["inspect", "acme/crossy"]) == 0  # from HF_HUB_CACHE, offline
    assert main(["inspect", str(tmp_path / "no such model")]) == 2
    assert main(["inspect", "acme/not-in-the-cache"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["inspect", "--no-such-option"])
    assert info.value.code == 2
    assert main(["inspect"]) == 0  # no MODEL: the bundled demo model
    root = copy_model(factory_models["default"], tmp_path / "m")
    (root / "modeling_tiny.py").write_bytes(LFS_POINTER)
    assert main(["inspect", str(root)]) == 1
    capsys.readouterr()
