"""Where the suite's CPU goes: a pytest plugin that closes every run with the CPU seconds of
each test file, beside ``--durations`` (wall seconds).

Why: on CI's two cores the suite is CPU-bound (both cores busy 97% of the run), so wall
durations say little: a test that waits on a Ray cluster is slow and cheap, a test that
starts ten fresh interpreters is fast and dear. Each test's CPU is read from ``getrusage``
around its set-up, call and tear-down, in the process that runs it (an xdist worker): its own
seconds and those of the child processes it waited for. Processes nobody in the test waits
for (Ray's daemons and actors, a vLLM driver's engine processes, fixtures' pools reaped
later) are not in any test's figure, so the summary also prints the machine's busy CPU
seconds while the run lasted (``/proc/stat``, every process on the machine): the gap
between the two is that unattributed work, and whatever else the machine ran.
"""

from __future__ import annotations

import collections
import resource
from typing import Any

import pytest

#: The ``user_properties`` key a test's report carries its CPU seconds under.
KEY = "cpu_s"
#: Files listed in the summary, most CPU first.
SHOWN = 25

_START = pytest.StashKey[float]()       # a test's CPU seconds when it began
_SESSION = pytest.StashKey[float | None]()  # the machine's busy seconds when the run began


def _cpu() -> float:
    own, waited = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def _busy() -> float | None:
    """Busy CPU seconds of the whole machine since boot (Linux), else ``None``."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / 100  # USER_HZ: 100 on Linux


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    item.stash[_START] = _cpu()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "teardown" and _START in item.stash:
        report.user_properties.append((KEY, _cpu() - item.stash[_START]))
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SESSION] = _busy()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    by_file: dict[str, float] = collections.defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == KEY and getattr(report, "when", None) == "teardown":
                    by_file[report.nodeid.split("::", 1)[0]] += value
    if not by_file:
        return
    terminalreporter.write_sep("=", f"CPU seconds by test file (the {SHOWN} dearest)")
    for name, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
    start, end = config.stash.get(_SESSION, None), _busy()
    machine = ("" if start is None or end is None
               else f"; the machine's busy CPU while the run lasted: {end - start:.0f} s")
    terminalreporter.write_line(f"in tests: {sum(by_file.values()):.1f} s (the test's own "
                                f"process and the children it waited for){machine}")
