"""Bad lines in ``codeferry run``'s input that Python's JSON reader accepts, or half accepts:
each refused while the input is read, as ``InputFormatError`` naming ``file:line``, with one
line on the CLI and nothing written to the output.

* a lone surrogate (JSON ``"\\ud800"``) anywhere in a line (``stop``, an OpenAI body's
  ``chat_template_kwargs``, a key passed through to the output line, a key's own name): the
  line is refused, not round-tripped. It is no text: the run record's digest of the request
  failed on it on every run (a traceback in ``record.input_digests``), and a pass-through
  key was written back as ``"\\ud800"``, which strict JSON readers refuse;
* an integer of more digits than Python converts (a 5000-digit ``custom_id``): a
  ``ValueError`` from ``json.loads``;
* 100,000 nested brackets: a ``RecursionError`` from ``json.loads``, in a line and as a
  whole file (which the JSON-array check reads first); a line nested past ``MAX_DEPTH`` that
  Python still reads is refused too, since encoding it again later (the output line, the
  record) could overflow where nothing catches it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from codeferry._commands.inputs import MAX_DEPTH, read_inputs
from codeferry.cli import _demo, main
from codeferry.errors import InputFormatError

DEEP = 100_000
DEMO = _demo()
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _openai(custom_id: object, body: dict[str, object]) -> str:
    """An OpenAI chat batch line; ``json.dumps`` writes a lone surrogate as ``\\ud800``."""
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})


#: name: (the input file's text, its bad line, words of the message)
CASES: dict[str, tuple[str, int, str]] = {
    "surrogate in stop": (
        '{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "x", "stop": "\\ud800"}\n', 2,
        '"stop" holds a lone surrogate \\ud800'),
    "surrogate in a stop list": (
        '{"id": "b", "prompt": "x", "stop": ["ok", "a\\udfff"]}\n', 1,
        '"stop[1]" holds a lone surrogate \\udfff (character 2)'),
    "surrogate in chat_template_kwargs": (
        _openai("r1", {**CHAT, "chat_template_kwargs": {"persona": "\ud800"}}) + "\n", 1,
        '"body.chat_template_kwargs.persona" holds a lone surrogate \\ud800'),
    "surrogate in a pass-through key": (
        '{"id": 1, "prompt": "x", "note": {"tags": ["\\ud800"]}}\n', 1,
        '"note.tags[0]" holds a lone surrogate \\ud800'),
    "surrogate in a key's name": (
        '{"id": 1, "prompt": "x", "\\ud800": 1}\n', 1, 'holds a lone surrogate \\ud800'),
    "5000-digit custom_id": (
        '{"custom_id": ' + "1" * 5000 + ', "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "hi"}}\n', 1, "a number has more than 4300 digits"),
    "5000-digit id in a later line": (
        '{"id": 1, "prompt": "x"}\n{"id": ' + "9" * 5000 + ', "prompt": "y"}\n', 2,
        "a number has more than 4300 digits"),
    "100,000 nested brackets in a line": (
        '{"id": 1, "prompt": "x"}\n{"id": 2, "prompt": "y", "note": '
        + "[" * DEEP + "]" * DEEP + "}\n", 2, f"more than {MAX_DEPTH} levels deep"),
    "100,000 nested brackets as the file": (
        "[" * DEEP + "]" * DEEP + "\n", 1, f"more than {MAX_DEPTH} levels deep"),
    "a line Python reads, nested past the limit": (
        '{"id": 1, "prompt": "x", "note": ' + "[" * 900 + "]" * 900 + "}\n", 1,
        f"more than {MAX_DEPTH} levels deep"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_line_is_refused_typed_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, line, words = CASES[case]
    source = tmp_path / "in.jsonl"
    source.write_text(text, encoding="utf-8")
    with pytest.raises(InputFormatError) as info:
        read_inputs(source)
    assert (info.value.path, info.value.line) == (str(source), line)
    assert words in str(info.value) and info.value.fix
    output = tmp_path / "out.jsonl"
    code = main(["run", DEMO, "--input", str(source), "--output", str(output)])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("codeferry: error: ")
    assert f"in.jsonl:{line}: " in err and words in err and "Fix:" in err
    assert "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == [source]  # no output, no record, no lock left


def test_a_line_as_deep_as_the_limit_is_read(tmp_path: Path) -> None:
    """The limit refuses nothing a request needs: a pass-through key nested to it is read."""
    inner = MAX_DEPTH - 1  # the line's object is level 1, the lists of "note" the others
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "x", "note": ' + "[" * inner + "]" * inner + "}\n")
    assert [item.id for item in read_inputs(source)] == [1]
    source.write_text('{"id": 1, "prompt": "x", "note": ' + "[" * (inner + 1)
                      + "]" * (inner + 1) + "}\n")
    with pytest.raises(InputFormatError):
        read_inputs(source)


def test_a_surrogate_added_to_a_resumed_input_leaves_the_output_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rerun that crashed in the record's digests: the run over, one line of its input
    given a surrogate stop, and the same command again is one typed line, changing nothing."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    output = tmp_path / "out.jsonl"
    argv = ["run", DEMO, "--input", str(source), "--output", str(output), "--max-new-tokens", "2",
            "--workers", "1"]
    assert main(argv) == 0
    capsys.readouterr()
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    source.write_text('{"id": "a", "prompt": "one"}\n'
                      '{"id": "b", "prompt": "two", "stop": "\\udfff"}\n')
    written["in.jsonl"] = source.read_bytes()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in.jsonl:2: " in err and '"stop" holds' in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == written


@pytest.mark.parametrize("bad", ["deep", "digits"])
def test_an_output_line_python_cannot_read_is_foreign(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    """An existing ``--output`` whose line nests 100,000 deep or holds a 5000-digit number is
    no output codeferry wrote: ``ForeignOutputError`` naming the line, the file left as it is
    (it was a ``RecursionError`` or ``ValueError`` from reading it)."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "x"}\n')
    output = tmp_path / "out.jsonl"
    line = "[" * DEEP + "]" * DEEP if bad == "deep" else '{"custom_id": ' + "1" * 5000 + "}"
    output.write_text('{"id": 1, "output": "y"}\n' + line + "\n")
    before = output.read_bytes()
    code = main(["run", DEMO, "--input", str(source), "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "out.jsonl:2: " in err
    assert "is not an output of codeferry run" in err and "Traceback" not in err
    assert output.read_bytes() == before
