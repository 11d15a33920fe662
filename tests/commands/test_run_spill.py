"""Nothing finished is lost: results finished behind a slow input survive an interrupt.

A real ``codeferry run`` of 2,000 tiny requests, one of which sleeps in the model's own code
(on its marker prompt, while a flag file exists) and so holds the write position: the others
finish on the other worker and wait behind it. The run is interrupted once most of them are
done; the rerun writes them without computing them again (the model's code logs every prompt
it computes), and the output holds every id once, in input order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import read_jsonl

from codeferry._commands.spill import spill_path
from codeferry.testing import ModelSpec, write_model

#: Logs each row it computes (its text: the prompt, max_tokens is 1) to ``log``; a row that
#: is the slow prompt sleeps while the flag file exists.
LOGGED_FORWARD = '''

import json as _json
import os as _os
import time as _time

_original_forward = {cls}.forward
_chars = {{i: t for t, i in _json.load(open({vocab!r})).items()}}


def _forward(self, input_ids=None, **kwargs):
    if input_ids is not None:
        rows = ["".join(_chars[i] for i in row if i >= 4) for row in input_ids.tolist()]
        with open({log!r}, "a") as log:
            log.write("".join(r + "\\n" for r in rows))
        while "slow" in rows and _os.path.exists({flag!r}):
            _time.sleep(0.05)
    return _original_forward(self, input_ids=input_ids, **kwargs)


{cls}.forward = _forward
'''
COUNT, SLOW = 2000, 3


def _interruptible() -> None:
    """In the child, before it runs: SIGINT unblocked and at its default."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _finished(output: Path) -> set[str]:
    """The ids an interrupted run finished: written, or kept in the spill."""
    done = {row["id"] for row in read_jsonl(output)} if output.exists() else set()
    spill = spill_path(output)
    if spill.exists():
        for raw in spill.read_text().splitlines()[1:]:
            done.add(json.loads(raw)["id"])
    return done


def test_an_interrupt_behind_a_slow_request_loses_no_finished_result(tmp_path: Path) -> None:
    model = write_model(tmp_path / "logged", ModelSpec(name="logged", tokenizer=True))
    log, flag = tmp_path / "computed.log", tmp_path / "slow.flag"
    modeling = model / "modeling_logged.py"
    modeling.write_text(modeling.read_text() + LOGGED_FORWARD.format(
        cls="LoggedForCausalLM", vocab=str(model / "vocab.json"), log=str(log),
        flag=str(flag)))
    prompts = [f"p{n}" for n in range(COUNT)]
    prompts[SLOW] = "slow"
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": p, "prompt": p}) + "\n" for p in prompts))
    output = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "codeferry", "run", str(model), "--input", str(source),
            "-o", str(output), "--trust-remote-code", "--max-new-tokens", "1", "--workers", "2",
            "--start-method", "fork", "--engine", "transformers"]
    # a run that does not stop is made to dump every thread's stack (SIGABRT, faulthandler)
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONFAULTHANDLER": "1"}
    flag.touch()
    # as a user's shell starts it: SIGINT neither blocked nor ignored (a signal mask leaked
    # into this test process by an earlier library would be inherited, and the run, never
    # seeing the Ctrl-C, would wait for the slow request for ever)
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             text=True, preexec_fn=_interruptible)
    try:
        deadline = time.monotonic() + 240
        while len(_finished(output)) < COUNT * 3 // 4:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the run did not finish 3/4 of the inputs"
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        try:  # a loaded machine: the workers stop, then the spill
            _, err = first.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            first.send_signal(signal.SIGABRT)
            _, err = first.communicate(timeout=60)
            raise AssertionError(f"the interrupted run did not stop:\n{err[-20000:]}") from None
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0
    finished = _finished(output)
    written = len(read_jsonl(output)) if output.exists() else 0
    assert "slow" not in finished and written <= SLOW  # the slow one held the write position
    assert f"kept {len(finished) - written} more finished ones" in err, err
    assert f"{written} written ({len(finished) - written} more finished, kept" in err
    flag.unlink()
    log.write_text("")
    second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    computed = set(log.read_text().splitlines())
    assert "slow" in computed and not computed & finished  # nothing finished computed again
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == prompts  # every id once, in input order
    assert not spill_path(output).exists()


@pytest.mark.parametrize("producer_changes", [False, True])
def test_a_kept_result_is_taken_only_for_the_same_producer_and_request(
        tmp_path: Path, producer_changes: bool) -> None:
    from codeferry._commands.inputs import read_inputs
    from codeferry._commands.spill import Kept, Spill

    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    output = tmp_path / "out.jsonl"
    items = read_inputs(source)
    spill = Spill(output, {"model": "m"}, items)
    for item in items:
        spill.keep(item.id, Kept(b'{"id": "%s", "output": "z"}\n' % item.id.encode(), False))
    spill.close(complete=False)
    source.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "edited"}\n')
    again = Spill(output, {"model": "other" if producer_changes else "m"}, read_inputs(source))
    kept = again.read({"a", "b"})
    assert sorted(kept) == ([] if producer_changes else ["a"])  # "b"'s request changed
    again.close(complete=True)
    assert not spill_path(output).exists()
