"""The box's parts on the running kernel: the ``ctypes`` Landlock layer, the seccomp socket
filter, the policy's rules (credential names, the home never granted whole, the ELF loader)
and failing closed. Each restriction is tried in a fresh interpreter, since it lasts for the
life of the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from codeferry._sandbox import landlock
from codeferry._sandbox.box import NEEDED_ABI
from codeferry._sandbox.policy import Request, build_policy, elf_interpreter, is_credential


def _child(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_kernel_here_has_the_abi_the_box_needs() -> None:
    assert landlock.abi_version() >= NEEDED_ABI


def test_a_ruleset_allows_what_its_rules_name_and_nothing_else(tmp_path: Path) -> None:
    """Read in one folder, not in its sibling; TCP connect on the allowed port only."""
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "f").write_text("yes")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f").write_text("no")
    out = _child(f"""
        import errno, os, socket, sys
        from codeferry._sandbox import landlock as L
        abi = L.abi_version()
        rs = L.Ruleset(abi, L.fs_rights(tuple(L.FS), abi), L.NET_CONNECT_TCP | L.NET_BIND_TCP)
        for p in sys.path + [sys.prefix, sys.base_prefix, "/usr", "/lib", "/lib64"]:
            if p and os.path.exists(p):
                rs.allow_path(p, L.fs_rights(("read_file", "read_dir"), abi))
        rs.allow_path({str(tmp_path / "allowed")!r}, L.fs_rights(("read_file",), abi))
        server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(4)
        port = server.getsockname()[1]
        other = socket.socket(); other.bind(("127.0.0.1", 0)); other.listen(4)
        rs.allow_port(port, L.NET_CONNECT_TCP)
        L.no_new_privs(); rs.restrict_self()
        print(open({str(tmp_path / "allowed" / "f")!r}).read())
        try:
            open({str(tmp_path / "other" / "f")!r})
        except PermissionError as e:
            print("refused", e.errno)
        socket.create_connection(("127.0.0.1", port)).close(); print("connected")
        try:
            socket.create_connection(("127.0.0.1", other.getsockname()[1]))
        except PermissionError as e:
            print("refused", e.errno)
    """)
    assert out.splitlines() == ["yes", "refused 13", "connected", "refused 13"]


def test_the_socket_filter_lets_only_unix_and_tcp_sockets_be_made() -> None:
    out = _child("""
        import socket
        from codeferry._sandbox import landlock, seccomp
        landlock.no_new_privs(); seccomp.install_socket_filter()
        for family, kind, proto in [(socket.AF_UNIX, socket.SOCK_STREAM, 0),
                                    (socket.AF_INET, socket.SOCK_STREAM, 0),
                                    (socket.AF_INET6, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, 6),
                                    (socket.AF_INET, socket.SOCK_DGRAM, 0),
                                    (socket.AF_INET6, socket.SOCK_DGRAM, 0),
                                    (socket.AF_INET, socket.SOCK_STREAM, 132),
                                    (socket.AF_NETLINK, socket.SOCK_RAW, 0),
                                    (socket.AF_PACKET, socket.SOCK_RAW, 0)]:
            try:
                socket.socket(family, kind, proto).close(); print("made")
            except PermissionError as e:
                print("refused", e.errno)
    """)
    assert out.splitlines() == ["made"] * 3 + ["refused 13"] * 5


def test_a_thread_beside_the_caller_fails_closed(tmp_path: Path) -> None:
    """Landlock before ABI 8 holds the calling thread only: a running thread would stay
    outside, so entering is refused, typed, and nothing was restricted."""
    outside = tmp_path / "outside"
    outside.write_text("free")
    out = _child(f"""
        import threading, time
        from codeferry._sandbox.box import enter
        from codeferry._sandbox.policy import Request
        from codeferry.errors import SandboxUnavailableError
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        try:
            enter(Request(), [])
        except SandboxUnavailableError as e:
            print("refused", "thread" in e.reason)
        print(open({str(outside)!r}).read())
    """)
    assert out.splitlines() == ["refused True", "free"]


@pytest.mark.parametrize(("name", "credential"), [
    ("HF_TOKEN", True), ("HUGGING_FACE_HUB_TOKEN", True), ("AWS_SESSION_TOKEN", True),
    ("AWS_REGION", True), ("GOOGLE_APPLICATION_CREDENTIALS", True), ("AZURE_CLIENT_ID", True),
    ("OPENAI_API_KEY", True), ("DB_PASSWORD", True), ("MY_SECRET_THING", True),
    ("TOKENIZERS_PARALLELISM", False), ("PATH", False), ("HOME", False),
    ("KEYBOARD_LAYOUT", False), ("OMP_NUM_THREADS", False),
])
def test_credentials_are_named_as_the_box_removes_them(name: str, credential: bool) -> None:
    assert is_credential(name) is credential
    assert not is_credential(name, keep=(name,))


def test_the_policy_never_grants_the_home_whole(tmp_path: Path) -> None:
    """A model folder above the home, or the home itself, is not granted from what the
    process found; the scratch and the model's own folder are; ``environ`` is not."""
    home = tmp_path / "home"
    (home / "model").mkdir(parents=True)
    policy = build_policy(Request(), model_paths=[str(tmp_path), str(home),
                                                  str(home / "model")],
                          scratch=str(tmp_path / "scratch"), home=str(home))
    assert str(tmp_path) not in policy.read and str(home) not in policy.read
    assert str(home / "model") in policy.read
    assert not any(p.endswith("/environ") for p in policy.read)
    assert os.path.realpath(sys.executable) in policy.execute


def test_the_interpreters_loader_is_found() -> None:
    loader = elf_interpreter(os.path.realpath(sys.executable))
    assert loader is not None and os.path.exists(loader) and "ld" in os.path.basename(loader)


def test_the_users_own_folder_on_sys_path_is_not_granted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The current folder on ``sys.path`` (a project with its ``.env``) is left out; the
    environment's folders are in."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    policy = build_policy(Request(), model_paths=[], scratch=str(tmp_path), home="/nonexistent")
    assert str(project) not in policy.read
    assert os.path.realpath(sys.prefix) in policy.read


def test_the_scopes_refuse_signals_and_abstract_sockets_outside_the_box() -> None:
    """Landlock's scopes (ABI 6): a signal to the parent and a connection to an abstract
    Unix socket the parent listens on are refused; the child's own work goes on."""
    out = _child("""
        import os, socket
        from codeferry._sandbox import landlock as L
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind("\\0codeferry-scope-test-%d" % os.getpid()); server.listen(1)
        pid = os.fork()
        if pid == 0:
            abi = L.abi_version()
            rs = L.Ruleset(abi, 0, 0, L.SCOPE_SIGNAL | L.SCOPE_ABSTRACT_UNIX)
            L.no_new_privs(); rs.restrict_self()
            found = []
            try:
                os.kill(os.getppid(), 0); found.append("signalled")
            except PermissionError as e:
                found.append(f"signal refused {e.errno}")
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                client.connect(server.getsockname()); found.append("connected")
            except PermissionError as e:
                found.append(f"connect refused {e.errno}")
            os.kill(os.getpid(), 0)  # itself: inside the box
            print("; ".join(found), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    assert out == "signal refused 1; connect refused 1"


def test_a_gone_process_scratch_folder_is_swept(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch of a boxed process that is gone (an ``exec``'d command runs no atexit of
    codeferry's) is removed by the next box built; a live one's stays."""
    import tempfile

    from codeferry._sandbox.box import policy_for

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"codeferry-box-{gone.pid}-abc"
    live = tmp_path / f"codeferry-box-{os.getpid()}-def"
    for folder in (stale, live):
        (folder / "sub").mkdir(parents=True)
    policy = policy_for(Request(), [])
    assert not stale.exists() and live.exists()
    assert Path(policy.scratch).parent == tmp_path
