"""``benchmarks/bench_suite.py`` charges a process a test starts to that test's file, through
a real pytest-xdist worker (the README's test command runs three)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "bench_suite.py"

BURN = '''
import subprocess, sys

def test_starts_a_process_that_burns_a_cpu_second():
    code = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass"
    subprocess.run([sys.executable, "-c", code], check=True)

def test_starts_nothing():
    pass
'''


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="bench_suite reads /proc")
def test_a_child_process_is_charged_to_the_file_whose_test_started_it(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(BURN, encoding="utf-8")
    (tmp_path / "test_idle.py").write_text("def test_idle():\n    pass\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--", "-q", "-n", "1", "-p",
                           "no:cacheprovider", "test_burn.py", "test_idle.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {m[0]: [float(x) for x in m[1:]] for m in re.findall(
        r"^\| (test_\w+\.py) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", done.stdout, re.M)}
    assert set(rows) == {"test_burn.py", "test_idle.py"}, done.stdout
    tests, _, processes, their_cpu, _ = rows["test_burn.py"]
    assert tests == 2 and processes == 1 and their_cpu >= 1, done.stdout
    assert rows["test_idle.py"][:1] + rows["test_idle.py"][2:4] == [1, 0, 0], done.stdout
    assert "3 tests" in done.stdout, done.stdout
