"""``codeferry run`` erases nothing it did not write.

A last line without its newline used to be cut away as "torn", whatever the file: ``-o
notes.txt`` on a text file erased it. Only a line that starts as codeferry's own do
(``{"id": ``) is cut; any other line that is not codeferry's JSON makes the file someone
else's: refused (``ForeignOutputError``) before a worker starts, left byte for byte.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from _helpers import run_cli

from codeferry import cli, errors
from codeferry._commands.inputs import read_inputs
from codeferry._commands.output import Sink

DEMO = Path(cli._demo())
PROMPTS = DEMO / "prompts.txt"


@pytest.mark.parametrize(("content", "line"), [
    (b"my notes", 1),                             # one line, no final newline
    (b"my notes\n", 1),                           # one line
    (b"first line\nsecond line", 1),              # two lines, no final newline
    (b'{"id": 1, "output": "x"}\nmy notes', 2),   # codeferry's first line, then someone's
    (b'{"id": 1, "output": "x"}\n{"key": 1}\n', 2),  # JSON, but not an output line
    (b"\n", 1),                                   # an empty line is not codeferry's either
])
def test_a_file_codeferry_did_not_write_is_refused_and_left_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, line: int
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    stat = notes.stat()
    code, out, err = run_cli(capsys, "run", "-o", str(notes), "--workers", "1",
                             "--start-method", "fork")
    assert notes.read_bytes() == content
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and err.startswith(f"codeferry: error: {notes}:{line}: ")
    assert "is not an output of codeferry run" in err and "Fix: choose another --output" in err
    assert notes.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no record, no lock
    sink = Sink(notes, io.StringIO())
    with pytest.raises(errors.ForeignOutputError) as info:
        sink.open(read_inputs(PROMPTS), "generate")
    assert (info.value.path, info.value.line) == (str(notes), line)
    assert isinstance(info.value, errors.OutputError) and info.value.fix
    assert notes.read_bytes() == content


def test_a_torn_line_of_codeferry_is_still_cut(tmp_path: Path) -> None:
    """What a kill (or a full disk) leaves: the start of a line codeferry writes."""
    output = tmp_path / "out.jsonl"
    for torn in (b'{"id": 2, "outp', b'{"i', b'{"id": 2, "output": "cut\n'):
        output.write_bytes(b'{"id": 1, "output": "x"}\n' + torn)
        sink = Sink(output, io.StringIO())
        state = sink.open(read_inputs(PROMPTS), "generate")
        assert output.read_bytes().endswith(torn)  # opening changes nothing...
        sink.repair(state)  # ...the cut comes once every check has passed
        sink.close()
        assert output.read_bytes() == b'{"id": 1, "output": "x"}\n'
        assert state.ids == {1}
