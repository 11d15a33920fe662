"""``codeferry audit``: what a model's code can do beyond computing, found without running it.

The sneaky model is a clean factory model plus ``sneaky.py``, imported by its modeling
module. Every line of ``sneaky.py`` that must be reported says so in a trailing
``# expect: category[, category]`` comment: expectations come from the bytes written,
and every other line must stay silent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import run_cli

from codeferry._code.audit.report import CATEGORIES, audit, audit_bundle, audit_source, render_audit
from codeferry._code.resolve import resolve
from codeferry.testing import ModelSpec, demo_model_path, write_hub_model, write_model

pytestmark = pytest.mark.usefixtures("offline_hub")

SNEAKY = '''\
"""Never imported by the tests: audit only reads it."""
import builtins
import ctypes
import importlib
import importlib.util as iu
import os
import pickle
import runpy
import shutil
import signal
import socket
import subprocess as sp
import sys
import urllib.request
from multiprocessing import Process
from os import *
from os import system
from pathlib import Path
from subprocess import Popen as P

import numpy as np
import requests
import torch
import yaml
from huggingface_hub import hf_hub_download, snapshot_download
from torch.utils.cpp_extension import load_inline
from transformers import AutoModel
from transformers.utils import cached_file

HERE = Path(__file__).parent
CACHE = HERE / "cache.json"
RUN = sp.run  # expect: process


def processes(cmd):
    sp.run(cmd)  # expect: process
    system("id")  # expect: process
    P(["nvcc", "-O2", "kernel.cu"])  # expect: process, native-code
    getattr(os, "system")("id")  # expect: process
    __import__("subprocess").check_output(["id"])  # expect: process, dynamic-code
    sys.modules["os"].system("id")  # expect: process
    popen("id")  # expect: process
    os.execv("/bin/sh", ["sh"])  # expect: process
    os.fork()  # expect: process
    Process(target=print).start()  # expect: process
    local = sp.Popen
    local(["id"])  # expect: process
    RUN(["id"])  # expect: process


def network():
    socket.create_connection(("example.com", 80))  # expect: network
    requests.get("https://example.com")  # expect: network
    urllib.request.urlopen("https://example.com")  # expect: network
    hf_hub_download("org/repo", "file.bin")  # expect: network
    snapshot_download("org/repo")  # expect: network
    cached_file("org/repo", "config.json")  # expect: network
    AutoModel.from_pretrained("org/other")  # expect: network


def dynamic(src):
    eval(src)  # expect: dynamic-code
    exec(src)  # expect: dynamic-code
    compile(src, "<x>", "exec")  # expect: dynamic-code
    importlib.import_module(src)  # expect: dynamic-code
    spec = iu.spec_from_file_location("m", "/tmp/m.py")  # expect: dynamic-code
    spec.loader.exec_module(iu.module_from_spec(spec))  # expect: dynamic-code
    runpy.run_path("/tmp/m.py")  # expect: dynamic-code
    importlib.import_module("subprocess").call(["id"])  # expect: dynamic-code, process


def native():
    ctypes.CDLL("libc.so.6")  # expect: native-code
    load_inline("ext", "int f() { return 1; }")  # expect: native-code
    torch.ops.load_library("ops.so")  # expect: native-code


def files(path):
    open(path, "w")  # expect: file-write
    open(path, mode="a+")  # expect: file-write
    open(path)
    open("/etc/shadow")  # expect: file-read
    (Path.home() / ".netrc").read_text()  # expect: file-read
    open("/proc/self/status")
    open(CACHE, "w")
    (HERE / "sub" / "x.txt").write_text("x")
    os.makedirs(os.path.join(os.path.dirname(__file__), "cache"), exist_ok=True)
    (HERE / ".." / "x.txt").write_text("x")  # expect: file-write
    Path("/etc/x").write_bytes(b"")  # expect: file-write
    shutil.rmtree(path)  # expect: file-write
    shutil.copy(CACHE, "/tmp/out")  # expect: file-write
    os.remove(path)  # expect: file-write


def loads(path, blob):
    import marshal

    pickle.loads(blob)  # expect: unpickle
    torch.load(path)  # expect: unpickle
    torch.load(path, weights_only=True)
    np.load(path, allow_pickle=True)  # expect: unpickle
    np.load(path)
    yaml.load(blob, Loader=yaml.Loader)  # expect: unpickle
    yaml.load(blob, Loader=yaml.SafeLoader)
    yaml.safe_load(blob)
    marshal.loads(blob)  # expect: unpickle


def environment():
    os.environ["HF_HUB_OFFLINE"] = "0"  # expect: environment
    os.environ.update({"A": "1"})  # expect: environment
    os.environ.get("A")
    os.environ.get("HF_TOKEN")  # expect: environment
    dict(os.environ)  # expect: environment
    os.putenv("A", "1")  # expect: environment
    sys.path.insert(0, "/tmp")  # expect: environment
    sys.modules["transformers"] = None  # expect: environment
    os.chdir("/")  # expect: environment
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # expect: environment
    builtins.print = len  # expect: environment
    setattr(builtins, "open", None)  # expect: environment
'''


def expected(source: str) -> set[tuple[int, str]]:
    """(line, category) of every ``# expect:`` comment."""
    out = set()
    for number, line in enumerate(source.splitlines(), start=1):
        if "# expect:" in line:
            for category in line.split("# expect:", 1)[1].split(","):
                out.add((number, category.strip()))
    return out


@pytest.fixture(scope="module")
def sneaky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean factory model whose modeling module star-imports ``sneaky.py``."""
    root = write_model(tmp_path_factory.mktemp("sneaky") / "model", ModelSpec(name="sneaky"))
    modeling = root / "modeling_sneaky.py"
    modeling.write_text(modeling.read_text(encoding="utf-8") + "\nfrom .sneaky import *\n",
                        encoding="utf-8")
    (root / "sneaky.py").write_text(SNEAKY, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("clean") / "model", ModelSpec(name="clean"))


# ------------------------------------------------------------------------------------------
# Findings
# ------------------------------------------------------------------------------------------


def test_every_category_is_found_at_its_line(sneaky: Path) -> None:
    report = audit(sneaky)
    found = {(f.line, f.category) for f in report.findings if f.path == "sneaky.py"}
    assert found == expected(SNEAKY)
    assert {c for _, c in found} == set(CATEGORIES)
    assert all(f.path == "sneaky.py" and f.repo is None for f in report.findings)
    assert report.counts == {c: sum(1 for f in report.findings if f.category == c) for c in CATEGORIES}


def test_a_finding_names_place_code_and_the_resolved_name(sneaky: Path) -> None:
    report = audit(sneaky)
    line = SNEAKY.splitlines().index('    P(["nvcc", "-O2", "kernel.cu"])  # expect: process, native-code') + 1
    by_category = {f.category: f for f in report.findings if f.line == line}
    process = by_category["process"]
    assert (process.file, process.col) == ("sneaky.py", 5)
    assert process.code == 'P(["nvcc", "-O2", "kernel.cu"])'
    assert "subprocess.Popen" in process.reason  # the alias, resolved
    assert "nvcc" in by_category["native-code"].reason
    assert process.location == f"sneaky.py:{line}:5"
    assert all(len(f.code) <= 80 for f in report.findings)


def test_a_clean_factory_model_has_no_findings(clean: Path, factory_models: dict[str, Path]) -> None:
    assert audit(clean).findings == ()
    for key in ("default", "all_helpers", "largest", "processor", "generic_b", "acme/crossy"):
        report = audit(factory_models[key])
        assert report.findings == (), (key, report.findings)


def test_the_demo_model_has_no_findings(capsys: pytest.CaptureFixture[str]) -> None:
    assert audit(demo_model_path()).findings == ()
    code, out, _ = run_cli(capsys, "audit", str(demo_model_path()))
    assert code == 0
    assert "findings none found" in out
    assert all(f"{category}: none found" in out for category in CATEGORIES)


def test_cross_repo_findings_name_the_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    write_hub_model(cache, "acme/uses-heads", ModelSpec(name="heads", cross_repo="org/heads"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    (heads,) = (cache / "models--org--heads" / "snapshots").iterdir()
    module = heads / "modeling_heads.py"
    module.write_text(module.read_text(encoding="utf-8") + "\nimport os\nos.system('id')\n",
                      encoding="utf-8")
    report = audit("acme/uses-heads", revision="main")
    (finding,) = report.findings
    assert (finding.repo, finding.path, finding.category) == ("org/heads", "modeling_heads.py", "process")
    assert finding.file == "org/heads--modeling_heads.py"
    assert finding.to_json()["repo"] == "org/heads"


def test_audit_reads_the_bytes_resolve_hashed(clean: Path, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(clean, model)
    bundle = resolve(model)
    (model / "modeling_clean.py").write_text("import os\nos.system('id')\n", encoding="utf-8")
    assert audit_bundle(bundle).findings == ()  # what was checked is what runs
    assert audit(model).counts["process"] == 1


def test_files_that_are_not_python_are_listed_not_fatal(clean: Path, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(clean, model)
    modeling = model / "modeling_clean.py"
    modeling.write_text(modeling.read_text(encoding="utf-8") + "\nfrom . import broken\n",
                        encoding="utf-8")
    (model / "broken.py").write_text("def (:\n", encoding="utf-8")
    report = audit(model)
    assert report.findings == ()
    assert [file for file, _ in report.skipped] == ["broken.py"]
    assert "broken.py" in render_audit(report)


# Snippets: what each must (or must not) report. False positives matter as much as misses.
SAVE_HOOK = """\
import os
class T:
    def save_vocabulary(self, save_directory, filename_prefix=None):
        if os.path.isdir(save_directory):
            vocab = os.path.join(save_directory, 'vocab.json')
        else:
            vocab = {other}
        with open(vocab, 'w') as handle:
            handle.write('{{}}')
"""
SNIPPETS: list[tuple[str, set[str]]] = [
    ("import torch\ndef f(m):\n    return torch.compile(m)\n", set()),
    ("import re\nPAT = re.compile('x')\n", set()),
    ("class M:\n    def go(self):\n        return self.compile()\n", set()),
    ("def train(eval=False):\n    if eval:\n        return eval\n", set()),
    ("def f(open):\n    open('x', 'w')\n", set()),
    ("import os\nx = os.environ.get('A', '1')\ny = os.path.join('a', 'b')\n", set()),
    ("import subprocess\ntry:\n    pass\nexcept subprocess.CalledProcessError:\n    pass\n", set()),
    ("import torch\ntorch.backends.cudnn.benchmark = True\n", set()),
    ("import json\nd = json.load(open('config.json'))\n", set()),
    (SAVE_HOOK.format(other="save_directory"), set()),
    (SAVE_HOOK.format(other="'/tmp/vocab.json'"), {"file-write"}),
    (("from multiprocessing import Pool\ndef f(p: Pool = None) -> Pool:\n    x: Pool = p\n"
      "    return x\n"), set()),
    (("import os\ndef dump(save_directory):\n    path = os.path.join(save_directory, 'v.json')\n"
      "    open(path, 'w')\n"), {"file-write"}),
    (("from pathlib import Path\nP = Path(__file__).resolve().parent\n"
      "def f():\n    (P / 'a' / 'b.json').write_text('x')\n    P.joinpath('c').mkdir()\n"), set()),
    ("from pathlib import Path\ndef f():\n    Path(__file__).parent.parent.joinpath('x').touch()\n",
     {"file-write"}),
    ("import tempfile\nd = tempfile.mkdtemp()\n", {"file-write"}),
    ("import subprocess\nsubprocess.run('make -j4', shell=True)\n", {"process", "native-code"}),
    ("import subprocess, sys\nsubprocess.check_call([sys.executable, '-m', 'pip', 'install', 'x'])\n",
     {"process", "network"}),
    ("from subprocess import *\nPopen(['id'])\n", {"process"}),
    ("import importlib\nos_ = importlib.import_module('os')\nos_.system('id')\n",
     {"process", "dynamic-code"}),
    ("import yaml\nyaml.load(open('x'))\n", {"unpickle"}),
    ("import torch\nf = torch.load\n", {"unpickle"}),
    ("import os\nos.environ.setdefault('A', '1')\n", {"environment"}),
    ("import os\ndel os.environ['A']\n", {"environment"}),
    ("import sys\nsys.path += ['/x']\n", {"environment"}),
    ("import transformers\ntransformers.dynamic_module_utils.check_imports = lambda f: []\n",
     {"environment"}),
    ("import ctypes\nlib = ctypes.cdll.LoadLibrary('x.so')\n", {"native-code"}),
    ("import torch\ntorch.hub.load('org/repo', 'model')\n", {"network", "dynamic-code"}),
    ("import os\nfd = os.open('/tmp/x', os.O_WRONLY | os.O_CREAT)\n", {"file-write"}),
    ("import os\nfd = os.open('/tmp/x', os.O_RDONLY)\n", {"file-read"}),
    ("import os\nfd = os.open('/dev/null', os.O_RDONLY)\n", set()),
]


@pytest.mark.parametrize(("source", "categories"), SNIPPETS, ids=[s[:40] for s, _ in SNIPPETS])
def test_snippets(source: str, categories: set[str]) -> None:
    assert {f.category for f in audit_source(source, path="m.py")} == categories


def test_a_function_alias_is_reported_where_it_is_used() -> None:
    findings = audit_source("import subprocess as sp\ndef f():\n    r = sp.run\n    r('id')\n", path="m.py")
    assert [(f.line, f.category, f.code) for f in findings] == [(4, "process", "r('id')")]


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------


def test_json_output(sneaky: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "audit", str(sneaky), "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) >= {"model", "digest", "findings", "counts"}
    assert data["digest"] == resolve(sneaky).digest
    assert list(data["counts"]) == list(CATEGORIES)
    assert sum(data["counts"].values()) == len(data["findings"])
    first = data["findings"][0]
    assert set(first) == {"category", "file", "repo", "line", "col", "code", "reason", "sandbox"}
    assert {(f["line"], f["category"]) for f in data["findings"]} == expected(SNEAKY)


def test_human_output_groups_by_category(sneaky: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "audit", str(sneaky))
    assert code == 0
    counts = audit(sneaky).counts
    for category in CATEGORIES:
        assert f"\n{category} ({counts[category]})\n" in out
    assert "sneaky.py:" in out and "nothing was executed" in out


@pytest.mark.parametrize(
    ("model", "fail_on", "code"),
    [
        ("sneaky", [], 0),
        ("sneaky", ["--fail-on", "process"], 1),
        ("sneaky", ["--fail-on", "process,network"], 1),
        ("sneaky", ["--fail-on", "unpickle", "--fail-on", "environment"], 1),
        ("clean", ["--fail-on", ",".join(CATEGORIES)], 0),
    ],
)
def test_fail_on_exit_codes(
    model: str, fail_on: list[str], code: int, sneaky: Path, clean: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = {"sneaky": sneaky, "clean": clean}[model]
    assert run_cli(capsys, "audit", str(folder), *fail_on)[0] == code


def test_fail_on_only_counts_its_categories(tmp_path: Path, clean: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(clean, model)
    modeling = model / "modeling_clean.py"
    modeling.write_text(modeling.read_text(encoding="utf-8") + "\nimport pickle\npickle.loads(b'')\n",
                        encoding="utf-8")
    assert run_cli(capsys, "audit", str(model), "--fail-on", "process,network")[0] == 0
    assert run_cli(capsys, "audit", str(model), "--fail-on", "network,unpickle")[0] == 1


def test_unknown_fail_on_category_is_a_usage_error(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "audit", str(clean), "--fail-on", "process,telepathy")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "telepathy" in err
    assert all(category in err for category in CATEGORIES)


def test_missing_model_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "audit", str(tmp_path / "nope"))
    assert code == 2 and err.startswith("codeferry: error:") and err.count("\n") == 1


def test_audit_executes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker.txt"
    model = write_model(tmp_path / "model", ModelSpec(name="marked", marker=str(marker)))
    report = audit(model)
    # The marker's own write is what audit reports, and it never happened.
    assert {(f.path, f.category) for f in report.findings} == {
        ("configuration_marked.py", "file-write"), ("modeling_marked.py", "file-write")}
    assert run_cli(capsys, "audit", str(model), "--json")[0] == 0
    assert not marker.exists()
    done = subprocess.run(
        [sys.executable, "-m", "codeferry.cli", "audit", str(model), "--fail-on", "file-write"],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(), check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "file-write (2)" in done.stdout
    assert not marker.exists()
