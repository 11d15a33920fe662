"""``codeferry audit`` says, before anything runs, what a model's code would try that the box
(``--sandbox``) refuses: reads of the home's secrets and of absolute paths the box does not
grant (``file-read``), credential variables and the whole environment (``environment``),
each at its file and line and marked as the box's refusal.

The thief model is a factory model whose modeling module, at import, in ``__init__`` and in
``forward``, reads a planted ``~/.ssh/id_rsa``, the hub token, ``HF_TOKEN`` and the whole
environment, every way the audit follows. It also reads what the box allows and what the
audit cannot place (its own vocabulary next to ``__file__``, a path passed in, a variable
that is not a credential, a kernel fact): none of those is a finding. Each line that must be
reported says so in a trailing ``# expect: category`` comment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _helpers import run_cli

from codeferry._code.audit.report import audit, audit_source
from codeferry._sandbox.policy import is_credential
from codeferry.testing import ModelSpec, write_model

pytestmark = pytest.mark.usefixtures("offline_hub")

THIEF = """

import os as _os
import pathlib as _pathlib
from pathlib import Path as _Path

_HERE = _os.path.dirname(__file__)
_KEY = open(_os.path.expanduser("~/.ssh/id_rsa")).read()  # expect: file-read
_VOCAB = open(_os.path.join(_HERE, "vocab.txt")).read()
_NETRC = _pathlib.Path("~/.netrc").expanduser().read_bytes()  # expect: file-read
_ENVIRON = _os.environ.copy()  # expect: environment
_SHADOW = open("/etc/shadow").read()  # expect: file-read
_STATUS = open("/proc/self/status").read()
_plain_init = ThiefForCausalLM.__init__
_plain_forward = ThiefForCausalLM.forward


def _read_vocab(vocab_file):
    with open(vocab_file, encoding="utf-8") as handle:
        return handle.read()


def _init(self, *args, **kwargs):
    token = _Path.home() / ".cache" / "huggingface" / "token"
    self._token = token.read_text()  # expect: file-read
    self._aws = open(_os.path.join(_os.environ["HOME"], ".aws", "credentials")).read()  # expect: file-read
    self._hf = _os.environ["HF_TOKEN"]  # expect: environment
    self._secret = _os.getenv("AWS_SECRET_ACCESS_KEY")  # expect: environment
    self._table = (_Path(__file__).parent / "vocab.txt").read_text()
    self._vocab = _read_vocab(_os.path.join(_HERE, "vocab.txt"))
    _plain_init(self, *args, **kwargs)


def _forward(self, *args, **kwargs):
    threads = _os.environ.get("OMP_NUM_THREADS", "1")
    everything = dict(_os.environ)  # expect: environment
    names = [name for name in _os.environ]  # expect: environment
    if "HUGGING_FACE_HUB_TOKEN" in _os.environ:  # expect: environment
        pass
    return _plain_forward(self, *args, **kwargs)


ThiefForCausalLM.__init__ = _init
ThiefForCausalLM.forward = _forward
"""


def _expected(text: str) -> set[tuple[int, str]]:
    """(line, category) of every ``# expect:`` comment of ``text``."""
    return {
        (n, line.split("# expect:", 1)[1].strip())
        for n, line in enumerate(text.splitlines(), 1)
        if "# expect:" in line
    }


@pytest.fixture(scope="module")
def thief(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_model(tmp_path_factory.mktemp("thief") / "model", ModelSpec(name="thief"))
    modeling = root / "modeling_thief.py"
    modeling.write_text(modeling.read_text(encoding="utf-8") + THIEF, encoding="utf-8")
    (root / "vocab.txt").write_text("a\nb\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home with the secrets the thief reaches for, as a user's."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_planted_token\n")
    return home


def test_each_read_the_box_refuses_is_found_at_its_line(thief: Path) -> None:
    text = (thief / "modeling_thief.py").read_text(encoding="utf-8")
    report = audit(thief)
    assert {(f.line, f.category) for f in report.findings} == _expected(text)
    assert {f.path for f in report.findings} == {"modeling_thief.py"}
    first = (
        text.splitlines().index(
            '_KEY = open(_os.path.expanduser("~/.ssh/id_rsa")).read()  # expect: file-read'
        )
        + 1
    )
    by_line = {f.line: f for f in report.findings}
    assert by_line[first].location == f"modeling_thief.py:{first}:8"
    assert by_line[first].reason == "reads ~/.ssh/id_rsa, in the home (builtins.open)"
    reads = sorted(f.reason.split(",")[0] for f in report.findings if f.category == "file-read")
    assert reads == [
        "reads /etc/shadow",
        "reads ~/.aws/credentials",
        "reads ~/.cache/huggingface/token",
        "reads ~/.netrc",
        "reads ~/.ssh/id_rsa",
    ]
    variables = sorted(f.reason for f in report.findings if "credential " in f.reason)
    assert variables == [
        f"reads the credential {name} from the environment"
        for name in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    ]


def test_each_finding_says_what_the_box_does(thief: Path) -> None:
    for finding in audit(thief).findings:
        if "whole environment" in finding.reason:
            assert finding.box == "the box removes every credential from it first"
            assert not finding.refused
        elif finding.category == "environment":
            name = finding.reason.split()[3]
            assert is_credential(name)  # the box's own decision
            assert finding.box == f"refused: the box removes {name} from the environment"
        else:
            assert finding.box.startswith("refused: not a folder the box lets code read")


def test_the_command_shows_it_with_a_planted_home(
    thief: Path, home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", "hf_planted_token")
    text = (thief / "modeling_thief.py").read_text(encoding="utf-8")
    line = (
        text.splitlines().index('    self._hf = _os.environ["HF_TOKEN"]  # expect: environment') + 1
    )
    code, out, _ = run_cli(capsys, "audit", str(thief), "--fail-on", "file-read")
    assert code == 1
    assert "sandbox  8 refused under --sandbox, each marked below" in out
    assert (
        f'  modeling_thief.py:{line}:16: _os.environ["HF_TOKEN"]\n'
        "      reads the credential HF_TOKEN from the environment\n"
        "      under --sandbox: refused: the box removes HF_TOKEN from the environment\n"
    ) in out
    assert "hf_planted_token" not in out and str(home) not in out  # named, never read
    code, out, _ = run_cli(capsys, "audit", str(thief), "--json")
    data = json.loads(out)
    assert data["counts"]["file-read"] == 5 and data["counts"]["environment"] == 6
    assert sum(1 for f in data["findings"] if (f["sandbox"] or "").startswith("refused")) == 8
    assert os.environ["HF_TOKEN"] == "hf_planted_token"  # the audit changed nothing
    # inspect says the same refusals, before anything runs
    code, out, _ = run_cli(capsys, "inspect", str(thief))
    assert "sandbox (lines --sandbox refuses: 8; codeferry audit says why)" in out
    assert (f'  modeling_thief.py:{line}:16: environment _os.environ["HF_TOKEN"]\n'
            "      refused: the box removes HF_TOKEN from the environment\n") in out
    code, out, _ = run_cli(capsys, "inspect", str(thief), "--json")
    refused = json.loads(out)["sandbox"]
    assert len(refused) == 8 and all(f["sandbox"].startswith("refused") for f in refused)
    assert {f["line"] for f in refused} <= {f["line"] for f in data["findings"]}


@pytest.mark.parametrize(
    ("source", "categories"),
    [
        ("import os\nk = os.environ.get('OMP_NUM_THREADS')\nn = os.getenv('WORLD_SIZE')\n", set()),
        ("import os\ndef f(name):\n    return os.environ[name]\n", set()),  # not known statically
        ("import os\ndef f(path):\n    return open(path).read()\n", set()),
        ("import os\nenv = os.environ\n", {"environment"}),
        ("from os import environ\nt = environ['GITHUB_TOKEN']\n", {"environment"}),
        ("import os\nb = os.environb[b'AWS_ACCESS_KEY_ID']\n", {"environment"}),
        ("import os\nos.environ['HF_TOKEN'] = 'x'\n", {"environment"}),
        ("import os\nopen('/dev/null', 'rb')\nopen('/sys/devices/system/cpu/online')\n", set()),
        ("import os, sys\nopen(os.path.join(sys.prefix, 'x'))\n", set()),
        ("open('~/.netrc')\n", set()),  # a relative path named '~': not the home
        ("import netrc\nnetrc.netrc()\n", {"file-read"}),
        ("import os\nos.listdir(os.path.expanduser('~/.ssh'))\n", {"file-read"}),
        ("import torch\ntorch.load('/root/.cache/x.pt', weights_only=True)\n", {"file-read"}),
        ("from pathlib import Path\nPath('/', 'etc', 'passwd').read_text()\n", set()),
        (
            "from pathlib import Path\nPath('/', 'etc', 'ssl', 'private', 'k').read_text()\n",
            {"file-read"},
        ),
        ("import os\nopen(f\"{os.environ['HOME']}/.git-credentials\")\n", {"file-read"}),
        (
            "from pathlib import Path\nPath.home().joinpath('.cache/huggingface/hub/x').read_text()\n",
            set(),
        ),  # the model's own hub cache entry may be granted: not surely refused
    ],
)
def test_snippets(source: str, categories: set[str]) -> None:
    assert {f.category for f in audit_source(source, path="m.py")} == categories


@pytest.mark.parametrize(
    ("source", "box"),
    [
        ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', '1'])\n", ""),
        (
            "import subprocess\nsubprocess.run(['nvidia-smi'])\n",
            "refused: the box runs no program but the Python interpreter",
        ),
        (
            "import subprocess\ndef f(cmd):\n    subprocess.run(cmd)\n",
            "refused unless it runs the Python interpreter",
        ),
        ("import os\nos.system('id')\n", "refused: the box runs no shell"),
        ("import multiprocessing\nmultiprocessing.Pool(2)\n", ""),
        (
            "import socket\nsocket.create_connection(('example.com', 80))\n",
            "refused unless a Unix socket or a TCP port in CODEFERRY_SANDBOX_PORTS",
        ),
        (
            "def f(d):\n    open(d + '/x', 'w')\n",
            "refused unless the target is in TMPDIR, /dev/shm or the store",
        ),
        (
            "open('/home/u/.bashrc', 'a')\n",
            "refused: the box writes only TMPDIR, /dev/shm and the store",
        ),
        ("open('/dev/shm/x', 'w')\n", ""),
        ("import tempfile\ntempfile.mkdtemp()\n", ""),
        ("import os\nos.chdir('/')\n", ""),
    ],
)
def test_what_the_box_does_with_each_kind(source: str, box: str) -> None:
    (finding,) = audit_source(source, path="m.py")
    assert finding.box == box
