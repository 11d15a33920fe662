"""Check the documentation: the site builds, every relative link resolves, marked examples run.

Run from anywhere, with the dev environment's Python (it needs nothing beyond
``requirements-dev.txt``)::

    HF_HUB_OFFLINE=1 python tools/docs/check.py

1. ``python -m mkdocs build --strict`` into a temporary folder; any warning fails.
2. Every relative link (and image) in ``README.md`` and ``docs/*.md``, outside code, must name
   an existing file; a ``#anchor`` must name a heading of that file, under both the site's
   slugs (Python-Markdown's ``toc``) and GitHub's.
3. Every fenced block whose line right before it is ``<!-- run -->`` runs, each in a fresh
   temporary folder, and must exit 0:

   - ``python``: with this interpreter. If the next block is marked ``<!-- output -->``, its
     lines are the expected output.
   - ``bash``/``sh``: with ``bash -e``.
   - ``console``: lines starting with ``$ `` are commands (a trailing ``\\`` continues one),
     run together with ``bash -e``; the other lines are the expected output.

   Expected lines must appear in the actual output (stdout and stderr together), in order;
   ``...`` inside a line matches anything, and a line that is only ``...`` skips. Blank
   expected lines are ignored.
4. ``docs/cli.md`` is what ``tools/docs/cli_reference.py`` makes from the command-line
   parser (regenerate: ``python tools/docs/cli_reference.py --write``).

Everything runs with ``HF_HUB_OFFLINE=1`` and a temporary ``CODEFERRY_HOME``, ``HF_HOME`` and
``XDG_CACHE_HOME``, so nothing touches the user's caches or the network. The last line is a
summary; the exit status is 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tools/docs/check.py
DOCS = ROOT / "docs"
HERE = Path(__file__).resolve().parent
RUN_MARK = "<!-- run -->"
OUTPUT_MARK = "<!-- output -->"
BLOCK_TIMEOUT_S = 600
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str  # the line right before the fence


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# -- parsing ---------------------------------------------------------------------------------


def split_markdown(path: Path) -> tuple[list[tuple[int, str]], list[Block]]:
    """The lines outside fenced code (number, text), and the fenced blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, lang = match.group(2), match.group(3).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence (or the end of the file)
        marker = lines[start - 1].strip() if start > 0 else ""
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker))
    return prose, blocks


def heading_text(raw: str) -> str:
    """A heading's text as rendered: links to their text, no code or emphasis marks."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), text)
    return re.sub(r"(\*\*|__|\*)", "", text).strip()


def site_slug(text: str) -> str:
    """Python-Markdown's ``toc`` slugify (what mkdocs uses)."""
    try:
        from markdown.extensions.toc import slugify
    except ImportError:  # the same rule, for a Python without mkdocs's dependencies
        value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        value = re.sub(r"[^\w\s-]", "", value).strip().lower()
        return re.sub(r"[-\s]+", "-", value)
    return str(slugify(text, "-"))


def github_slug(text: str) -> str:
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """The heading ids of a Markdown file: (the site's, GitHub's), duplicates numbered."""
    prose, _ = split_markdown(path)
    site: set[str] = set()
    github: set[str] = set()
    for _, line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        text = heading_text(match.group(2))
        _add_unique(site, site_slug(text), "_")
        _add_unique(github, github_slug(text), "-")
    return site, github


def _add_unique(seen: set[str], slug: str, sep: str) -> None:
    """``slug`` into ``seen``, numbered after ``sep`` when taken, as each renderer does."""
    candidate, n = slug, 0
    while candidate in seen:
        n += 1
        candidate = f"{slug}{sep}{n}"
    seen.add(candidate)


# -- 1. the site -----------------------------------------------------------------------------


def check_build(env: dict[str, str], tmp: Path) -> list[str]:
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp / "site")]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if line.lstrip().startswith(("WARNING", "ERROR"))]
    if proc.returncode != 0 or warnings:
        detail = "\n    ".join(warnings or output.strip().splitlines()[-20:])
        return [f"mkdocs build --strict failed (exit {proc.returncode}):\n    {detail}"]
    return []


# -- 2. links --------------------------------------------------------------------------------


def check_links() -> tuple[int, list[str]]:
    failures: list[str] = []
    checked = 0
    cache: dict[Path, tuple[set[str], set[str]]] = {}
    for path in markdown_files():
        prose, _ = split_markdown(path)
        for number, line in prose:
            line = CODE_SPAN.sub("", line)
            targets = LINK.findall(line)
            match = REFERENCE.match(line)
            if match:
                targets.append(match.group(1))
            for target in targets:
                if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                    continue  # http:, https:, mailto: ...: not relative
                checked += 1
                where = f"{rel(path)}:{number}: {target}"
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                if not dest.is_file():
                    failures.append(f"{where}: no such file {rel(dest)}")
                    continue
                if not anchor:
                    continue
                if dest.suffix != ".md":
                    failures.append(f"{where}: an anchor into a file that is not Markdown")
                    continue
                site, github = cache.setdefault(dest, anchors(dest))
                missing = [name for name, ids in (("site", site), ("GitHub", github))
                           if anchor not in ids]
                if missing:
                    failures.append(f"{where}: no heading with that id in {rel(dest)} "
                                    f"(for {' and '.join(missing)}; it has: "
                                    f"{', '.join(sorted(site)) or 'none'})")
    return checked, failures


# -- 3. runnable blocks ----------------------------------------------------------------------


def expected_matches(expected: list[str], actual: str) -> str | None:
    """None if every expected line appears in order; else the first one that does not."""
    lines = [line.rstrip() for line in actual.splitlines()]
    position = 0
    for want in expected:
        want = want.rstrip()
        if not want.strip() or want.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + r"\Z")
        for index in range(position, len(lines)):
            if pattern.match(lines[index]):
                position = index + 1
                break
        else:
            return want
    return None


def console_script(text: str) -> tuple[str, list[str]]:
    """A console block's commands (``$ `` stripped) and its expected output lines."""
    commands: list[str] = []
    expected: list[str] = []
    continuing = False
    for line in text.splitlines():
        if continuing:
            commands.append(line)
            continuing = line.rstrip().endswith("\\")
        elif line.startswith("$ "):
            commands.append(line[2:])
            continuing = line.rstrip().endswith("\\")
        else:
            expected.append(line)
    return "\n".join(commands) + "\n", expected


def runnable_blocks() -> list[tuple[Block, list[str] | None]]:
    """Each marked block with its expected output (None: only the exit status counts)."""
    found: list[tuple[Block, list[str] | None]] = []
    for path in markdown_files():
        _, blocks = split_markdown(path)
        for index, block in enumerate(blocks):
            if block.marker != RUN_MARK:
                continue
            expected = None
            following = blocks[index + 1] if index + 1 < len(blocks) else None
            if following is not None and following.marker == OUTPUT_MARK:
                expected = following.text.splitlines()
            found.append((block, expected))
    return found


def run_block(block: Block, expected: list[str] | None, env: dict[str, str],
              tmp: Path) -> str | None:
    workdir = Path(tempfile.mkdtemp(prefix="block-", dir=tmp))
    if block.lang in ("python", "py", "python3"):
        script = workdir / "block.py"
        script.write_text(block.text, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    elif block.lang in ("bash", "sh", "shell", "console", "shell-session"):
        text = block.text
        if block.lang in ("console", "shell-session"):
            text, expected = console_script(text)
        script = workdir / "block.sh"
        script.write_text(text, encoding="utf-8")
        cmd = ["bash", "-e", str(script)]
    else:
        return f"marked {RUN_MARK}, but a block of '{block.lang or 'no language'}' cannot run"
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return f"still running after {BLOCK_TIMEOUT_S} s"
    tail = "\n      ".join(proc.stdout.strip().splitlines()[-15:])
    if proc.returncode != 0:
        return f"exit {proc.returncode}; output ends:\n      {tail}"
    if expected:
        missing = expected_matches(expected, proc.stdout)
        if missing is not None:
            return f"expected line not in the output: {missing!r}; output ends:\n      {tail}"
    return None


# -- 4. generated pages ---------------------------------------------------------------------


def check_generated(env: dict[str, str]) -> list[str]:
    """The command-line reference matches the parser (its script's check mode)."""
    proc = subprocess.run([sys.executable, str(HERE / "cli_reference.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        return [(proc.stdout + proc.stderr).strip() or f"cli_reference.py: exit {proc.returncode}"]
    return []


# -- main ------------------------------------------------------------------------------------


def isolated_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("HF_HUB_CACHE", "HF_MODULES_CACHE", "HUGGINGFACE_HUB_CACHE",
                 "TRANSFORMERS_CACHE", "CODEFERRY_LOCK"):
        env.pop(name, None)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "CODEFERRY_HOME": str(tmp / "codeferry-home"),
        "HF_HOME": str(tmp / "hf-home"),
        "XDG_CACHE_HOME": str(tmp / "cache"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # `codeferry` and `python` of this interpreter's environment come first
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    })
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="skip the mkdocs build")
    parser.add_argument("--no-run", action="store_true", help="skip the runnable blocks")
    args = parser.parse_args(argv)
    failures: list[str] = []
    summary: list[str] = []
    with tempfile.TemporaryDirectory(prefix="codeferry-docs-") as name:
        tmp = Path(name)
        # The store refuses a home below a folder other users could swap it from (/tmp is
        # sticky, so a private folder under it is fine).
        os.chmod(tmp, 0o700)
        env = isolated_env(tmp)
        if not args.no_build:
            errors = check_build(env, tmp)
            failures += errors
            summary.append("build " + ("FAILED" if errors else "ok"))
        checked, errors = check_links()
        failures += errors
        summary.append(f"{checked - len(errors)}/{checked} links ok")
        errors = check_generated(env)
        failures += errors
        summary.append("cli.md " + ("STALE" if errors else "ok"))
        if not args.no_run:
            blocks = runnable_blocks()
            failed = 0
            for block, expected in blocks:
                where = f"{rel(block.path)}:{block.line} ({block.lang})"
                print(f"running {where}", file=sys.stderr, flush=True)
                error = run_block(block, expected, env, tmp)
                if error:
                    failed += 1
                    failures.append(f"{where}: {error}")
            summary.append(f"{len(blocks) - failed}/{len(blocks)} blocks ran ok")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    verdict = f"{len(failures)} FAILED" if failures else "all ok"
    print(f"docs: {', '.join(summary)}: {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
