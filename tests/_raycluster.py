"""A real 2-node Ray cluster on this machine, in network namespaces the test creates.

::

    namespace A (10.200.0.1)               namespace B (10.200.0.2), own mount namespace
    ───────────────────────                ─────────────────────────────────────────────
    head node (ray start --head)  ◀─veth─▶  node2 (ray start --address=...)
    drivers (python _ray_driver.py ...)     fresh tmpfs over /tmp (or the test's folders),
                                            ~/.cache and /dev/shm; env -i: no HF_*, no
                                            PYTHONPATH, no CODEFERRY_*

Traffic never leaves the two namespaces; node2 cannot read the driver's files, so code
and weights that work there came through Ray. Each node runs ``ray start --block``: one
launcher pid per node, whose SIGTERM drains it (never ``ray stop``, which would end every
Ray process on the machine). Needs root (namespaces, mounts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEAD_IP, NODE2_IP, PORT = "10.200.0.1", "10.200.0.2", 6379
ADDRESS = f"{HEAD_IP}:{PORT}"
NODE2_TMP = "/tmp/cfr2"  # node2's own /tmp: its processes name it
DRIVER = Path(__file__).with_name("_ray_driver.py")
RAY = str(Path(sys.executable).with_name("ray"))


def missing() -> str | None:
    """Why this machine cannot run the cluster, or ``None``."""
    if os.geteuid() != 0:
        return "a multi-node cluster needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed"
    return None


def python_cli() -> list[str]:
    return [sys.executable, "-m", "codeferry"]


def kill_session(sid: int) -> int:
    """SIGKILL every process in session ``sid`` until none is left; how many it killed.

    A node is its whole session: ``ray start --block`` leads it, raylet and every worker
    it forks stay in it, whatever title they set themselves (``ray::RayWorker``), so this
    is a whole machine losing power, not one daemon crashing while its workers run on.
    """
    killed: set[int] = set()
    for _ in range(50):
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(stat.parent.name))
        if not found:
            return len(killed)
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.05)
    raise RuntimeError(f"session {sid} still has processes after SIGKILL")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        suffix = f"{os.getpid() % 100000}"
        self.ns_a, self.ns_b = f"cfa{suffix}", f"cfb{suffix}"
        self.head: subprocess.Popen[bytes] | None = None
        self.node2: subprocess.Popen[bytes] | None = None
        self.hub = root / "head-hub"  # the head node's own hub cache
        self.hub.mkdir()
        self.logs = root / "logs"
        self.logs.mkdir()
        self._seen: set[str] = set()
        self._node2_lost = False

    # -- namespaces -----------------------------------------------------------------------

    def _netns(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", "a0", "netns", self.ns_a, "type", "veth",
            "peer", "name", "b0", "netns", self.ns_b)
        _sh("ip", "-n", self.ns_a, "addr", "add", f"{HEAD_IP}/24", "dev", "a0")
        _sh("ip", "-n", self.ns_b, "addr", "add", f"{NODE2_IP}/24", "dev", "b0")
        _sh("ip", "-n", self.ns_a, "link", "set", "a0", "up")
        _sh("ip", "-n", self.ns_b, "link", "set", "b0", "up")

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ADDRESS,
               "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        return {**env, **extra}

    def start(self) -> None:
        self._netns()
        head_tmp = Path(tempfile.mkdtemp(prefix="cfrh", dir="/tmp"))
        self._head_tmp = head_tmp
        self.head = subprocess.Popen(
            ["ip", "netns", "exec", self.ns_a, RAY, "start", "--head", "--block",
             f"--node-ip-address={HEAD_IP}", f"--port={PORT}", "--num-cpus=2",
             '--resources={"head": 1}', "--object-store-memory=100000000",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={head_tmp}"],
            env=self.env(HF_HUB_CACHE=str(self.hub)),
            stdout=open(self.logs / "head.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.start_node2()

    def _hidden(self) -> list[str]:
        """What node2 must not see: the test's folders (all of /tmp when the venv is not
        under it), ``~/.cache``, ``/dev/shm``."""
        venv_in_tmp = Path(sys.prefix).resolve().is_relative_to("/tmp")
        tmp = [str(self.root.parent.parent)] if venv_in_tmp else ["/tmp"]
        return [*tmp, os.path.expanduser("~/.cache"), "/dev/shm"]

    def start_node2(self) -> None:
        mounts = " && ".join(f"mkdir -p {p} && mount -t tmpfs tmpfs {p}" for p in self._hidden())
        path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        command = (
            f"{mounts} && mkdir -p /tmp/cfr2 && exec env -i PATH={path} HOME={Path.home()} "
            f"RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 {RAY} start --block "
            f"--address={ADDRESS} --node-ip-address={NODE2_IP} --num-cpus=2 "
            "'--resources={\"node2\": 1}' --object-store-memory=100000000 "
            "--disable-usage-stats --temp-dir=/tmp/cfr2"
        )
        self.node2 = subprocess.Popen(
            ["ip", "netns", "exec", self.ns_b, "unshare", "--mount", "--propagation",
             "private", "sh", "-c", command],
            stdout=open(self.logs / "node2.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.wait_nodes(2)

    def lose_node2(self) -> None:
        """After a test killed node2 (or part of it): end what is left; ``ensure_node2``
        starts it again for the next test that needs it (the GCS takes 12-15 s to see the
        old one dead, a wait the module's last test need not pay)."""
        if self.node2 is not None:
            kill_session(self.node2.pid)
            self.node2.wait(10)
        self._node2_lost = True

    def ensure_node2(self) -> None:
        if self._node2_lost:
            self._node2_lost = False
            self.start_node2()

    def wait_nodes(self, count: int, timeout: float = 120) -> None:
        """Until ``count`` nodes are alive, one of them a node2 not seen before (a killed
        node2 stays "alive" in the GCS for 12-15 s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.driver("nodes", timeout=60, check=False)
            ids = set(out.get("ids", []))
            if len(ids) == count and ids - self._seen:
                self._seen |= ids
                return
            time.sleep(1)
        raise RuntimeError(f"the cluster did not reach {count} nodes: "
                           f"{(self.logs / 'node2.log').read_text()[-3000:]}")

    def node2_pids(self, name: str) -> list[int]:
        """Pids of node2's processes whose command line contains ``name``."""
        out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True,
                             check=True).stdout
        return [int(line.split()[0]) for line in out.splitlines()
                if name in line and f"={NODE2_TMP}/" in line]

    # -- drivers --------------------------------------------------------------------------

    def driver_command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns_a, sys.executable, str(DRIVER), *args]

    def driver(self, scenario: str, *args: str, timeout: float = 300, check: bool = True,
               env: dict[str, str] | None = None) -> dict[str, Any]:
        proc = subprocess.run(self.driver_command(scenario, *args), env=env or self.env(),
                              capture_output=True, text=True, timeout=timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if check and (proc.returncode != 0 or not lines):
            raise AssertionError(f"driver {scenario} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        return json.loads(lines[-1]) if lines else {}

    def stop(self) -> None:
        """Both nodes lose power (every process of their sessions SIGKILLed): a drain
        (SIGTERM) took up to 20 s after a test had killed node2, and nothing here needs one."""
        for proc in (self.node2, self.head):
            if proc is not None:
                kill_session(proc.pid)
                proc.wait(10)
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(getattr(self, "_head_tmp", ""), ignore_errors=True)
