"""A hostile remote-code model, built by the tests: at import, in ``__init__`` or in
``forward`` (the stage its control file names) it tries one thing the box must refuse.

The control file (``control`` in the model's folder, which the box lets it read) holds
``STAGE ATTEMPT PORT``; no file: the model is benign. Its code is written with the planted
home and the control path in it, not passed in the environment: the box removes what it
wants from there, and a forkserver started by an earlier test would not see a variable.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from codeferry.testing import ModelSpec, write_model

#: Every attempt the box must refuse, by the name the control file gives it.
ATTEMPTS = ("ssh_key", "hub_token", "env_token", "connect_local", "connect_metadata", "udp",
            "write_bashrc", "write_model", "shell", "signal_parent")

ATTEMPT = '''

import errno as _errno
import os as _os
import socket as _socket
import subprocess as _subprocess

_HOME = {home!r}
_CONTROL = {control!r}
_MODEL = {model!r}


def _attempt(name, port):
    if name == "ssh_key":
        return open(_HOME + "/.ssh/id_rsa").read()
    if name == "hub_token":
        return open(_HOME + "/.cache/huggingface/token").read()
    if name == "env_token":
        return _os.environ["HF_TOKEN"]
    if name == "connect_local":
        _socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return "connected"
    if name == "connect_metadata":
        sock = _socket.socket()
        sock.settimeout(0.5)
        try:
            sock.connect(("169.254.169.254", 80))
        except OSError as exc:  # reached the network: no route, or no answer
            if exc.errno in (_errno.EACCES, _errno.EPERM):
                raise
        finally:
            sock.close()
        return "reached"
    if name == "udp":
        sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
        sock.sendto(b"x", ("127.0.0.1", port))
        return "sent"
    if name == "write_bashrc":
        with open(_HOME + "/.bashrc", "a") as f:
            f.write("echo owned\\n")
        return "written"
    if name == "write_model":
        with open(_MODEL + "/planted.txt", "w") as f:
            f.write("owned")
        return "written"
    if name == "shell":
        return _subprocess.run(["sh", "-c", "true"], check=True).returncode
    if name == "signal_parent":
        _os.kill(_os.getppid(), 0)
        return "signalled"
    raise ValueError(name)
'''

STAGES = '''

import functools as _functools


def _stage(stage):
    try:
        with open(_CONTROL) as f:
            parts = f.read().split()
    except FileNotFoundError:
        return
    if parts and parts[0] == stage:
        _attempt(parts[1], int(parts[2]))


_stage("import")
_hostile_init = {cls}.__init__
_hostile_forward = {cls}.forward


@_functools.wraps(_hostile_init)
def _init(self, *args, **kwargs):
    _stage("init")
    _hostile_init(self, *args, **kwargs)


@_functools.wraps(_hostile_forward)  # engines read forward's parameters (vLLM does)
def _forward(self, *args, **kwargs):
    _stage("forward")
    return _hostile_forward(self, *args, **kwargs)


{cls}.__init__ = _init
{cls}.forward = _forward
'''


def write_hostile(root: Path, home: Path) -> Path:
    """The hostile model under ``root``; ``home`` is the planted home it reads and writes."""
    path = write_model(root / "hostile", ModelSpec(name="hostile", tokenizer=True))
    return make_hostile(path, "modeling_hostile.py", "HostileForCausalLM", home)


def make_hostile(path: Path, module: str, cls: str, home: Path) -> Path:
    """The remote-code model in ``path`` made hostile: its ``module`` gets the attempts, and
    its class ``cls`` tries one at the stage the control file names."""
    modeling = path / module
    modeling.write_text(modeling.read_text() + (ATTEMPT + STAGES).format(
        cls=cls, home=str(home), control=str(path / "control"), model=str(path)))
    return path


def plant_home(home: Path) -> Path:
    """A home with an ssh key, a hub token and a ``.bashrc``, as a user's."""
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    (home / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_planted_token\n")
    (home / ".bashrc").write_text("# the user's\n")
    return home


#: What a ``SandboxRefusedError`` names for each attempt: its operation, and a piece of its
#: target.
REFUSED = {
    "ssh_key": ("open", ".ssh/id_rsa"), "hub_token": ("open", "huggingface/token"),
    "env_token": ("environ", "HF_TOKEN"), "connect_local": ("connect", "127.0.0.1"),
    "connect_metadata": ("connect", "169.254.169.254"), "udp": ("socket", "SOCK_DGRAM"),
    "write_bashrc": ("open", ".bashrc"), "write_model": ("open", "planted.txt"),
    "shell": ("exec", "sh"), "signal_parent": ("kill", "pid"),
}

#: What the typed error's text names for each attempt: its operation, and a piece of its target.
NAMED = {
    "ssh_key": "open .../.ssh/id_rsa", "hub_token": "open .../huggingface/token",
    "env_token": "credential HF_TOKEN", "connect_local": "connect ('127.0.0.1'",
    "connect_metadata": "connect ('169.254.169.254', 80)", "udp": "socket AF_INET, SOCK_DGRAM",
    "write_bashrc": "open .../.bashrc", "write_model": "open .../planted.txt",
    "shell": "exec sh", "signal_parent": "kill pid",
}


def names(told: str, attempt: str) -> bool:
    """Whether the error text ``told`` names ``attempt``'s operation and target."""
    head, _, tail = NAMED[attempt].partition("...")
    return head in told and tail in told


@contextmanager
def listener() -> Iterator[int]:
    """A TCP port listening on 127.0.0.1 (connections queue in its backlog)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()


#: A script that tries every attempt itself and prints one JSON object: attempt -> "ok", or
#: the error's type and errno (``codeferry exec``'s command is user code, boxed too).
SCRIPT = ATTEMPT + '''

import json as _json
import sys as _sys

_found = {{}}
for _name in _sys.argv[2:]:
    try:
        _attempt(_name, int(_sys.argv[1]))
        _found[_name] = "ok"
    except Exception as _exc:
        _found[_name] = [type(_exc).__name__, getattr(_exc, "errno", None)]
print(_json.dumps(_found))
'''


def write_script(folder: Path, home: Path, model: Path) -> Path:
    """``SCRIPT`` in ``folder``, with the planted ``home`` and ``model`` written in."""
    path = folder / "hostile_script.py"
    path.write_text(SCRIPT.format(home=str(home), control="", model=str(model)))
    return path


def write_uncaught(folder: Path, home: Path, model: Path) -> Path:
    """A script whose one attempt (``argv[2]``, port ``argv[1]``) is left uncaught."""
    path = folder / "uncaught.py"
    path.write_text((ATTEMPT + "\nimport sys\n_attempt(sys.argv[2], int(sys.argv[1]))\n").format(
        home=str(home), control="", model=str(model)))
    return path
