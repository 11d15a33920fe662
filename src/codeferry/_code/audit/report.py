"""What a model's code can do beyond computing: ``codeferry audit``.

Pure ``ast`` over the exact bytes ``resolve`` hashed (``Bundle.contents``): nothing is
imported or executed. Every finding names a category, a place (file, line, column), the
code, and why it matters:

* ``process``: runs programs or processes (``subprocess``, ``os.system``, ``os.exec*``,
  ``os.spawn*``, ``os.fork``, ``pty``, multiprocessing workers);
* ``network``: talks to the network (``socket``, ``requests``, ``urllib.request``,
  ``http.client``, ``httpx``, ``aiohttp``, Hub downloads, ``from_pretrained``, ``torch.hub``);
* ``dynamic-code``: runs code that is not in these files (``eval``, ``exec``, ``compile``,
  ``__import__``, ``importlib``, ``runpy``, another repo's remote code), and the doors the
  model's JSON files open (``_code.doors``: Hub kernels, ``trust_remote_code`` keys, custom
  pipelines), at the file and line that names them;
* ``native-code``: loads or builds native code (``ctypes``, ``cffi``,
  ``torch.utils.cpp_extension``, ``torch.ops.load_library``, compilers run as programs,
  shared library names);
* ``file-read``: reads files the box does not let code read (the home: ``~/.ssh``, the hub
  token; absolute paths outside the model's folder, the Python environment and the system
  files the box grants), where the target is known statically;
* ``file-write``: writes, moves or deletes files outside the module's own folder (a
  target built from ``Path(__file__).parent`` and constant names without ``..`` is inside;
  so is what a ``save_pretrained``/``save_vocabulary`` hook writes into the folder its
  caller passes);
* ``unpickle``: deserialises objects that can run code (``pickle``, ``dill``, ``joblib``,
  ``torch.load`` without ``weights_only=True``, ``numpy.load(allow_pickle=True)``,
  ``marshal``, ``yaml.load`` without a safe loader);
* ``environment``: reads a credential variable (the box's own rule,
  ``_sandbox.policy.is_credential``) or the whole environment, or changes the process for
  everyone (``os.environ`` writes, ``sys.path``, ``sys.modules``, ``os.chdir``, signal
  handlers, patching ``builtins``, the standard library or transformers).

Each finding says what the box (``--sandbox``) does with it (``Finding.box``, from
``sandbox``), so a user knows before running which lines would fail there.

Names are resolved through imports and simple assignments in every scope
(``import subprocess as sp``, ``from os import system``, ``run = sp.run``,
``getattr(os, "system")``, ``__import__("os")``, ``importlib.import_module("os")``,
``sys.modules["os"]``, ``from subprocess import *``). Static analysis cannot see
everything (a name built at run time); ``dynamic-code`` findings mark where that happens.
"""


from __future__ import annotations

import ast
import os

from ..automap import qualified
from ..doors import find_doors
from ..resolve import Bundle, resolve
from .findings import CATEGORIES, AuditReport, Finding
from .visitor import Auditor

__all__ = ["CATEGORIES", "AuditReport", "Finding", "audit", "audit_bundle", "audit_source",
           "render_audit"]  # fmt: skip


def audit_source(text: str, *, path: str, repo: str | None = None,
                 roots: tuple[str, ...] = ()) -> list[Finding]:
    """Findings of one module's source (raises ``SyntaxError``, ``RecursionError``...);
    ``roots``: the model's folders, which the box lets its code read."""
    tree = ast.parse(text, filename=path)
    auditor = Auditor(text, repo, path, tree, roots)
    auditor.visit(tree)
    return sorted(auditor.findings.values(), key=lambda f: (f.line, f.col, CATEGORIES.index(f.category)))


def audit_bundle(bundle: Bundle) -> AuditReport:
    """Audit every Python file of a resolved model (its hashed bytes; nothing is executed)."""
    findings: list[Finding] = []
    skipped: list[tuple[str, str]] = []
    root = bundle.origin.root
    roots = tuple(dict.fromkeys([str(root), os.path.realpath(root)]))
    for (repo, path), data in sorted(bundle.contents.items(), key=lambda item: (item[0][0] or "", item[0][1])):
        if not path.endswith(".py"):
            continue  # assets: data the code reads
        shown = qualified(repo, path)
        try:
            text = data.decode("utf-8")
            findings += audit_source(text, path=path, repo=repo, roots=roots)
        except UnicodeDecodeError:
            skipped.append((shown, "not UTF-8"))
        except SyntaxError as exc:
            skipped.append((shown, f"not valid Python (line {exc.lineno}), so it cannot run either"))
        except (RecursionError, MemoryError):
            skipped.append((shown, "nested too deeply to analyse"))
        except ValueError as exc:  # e.g. null bytes, on Pythons that report them so
            skipped.append((shown, f"not valid Python ({exc})"))
    findings += door_findings(bundle)
    return AuditReport(bundle.origin.name, bundle.digest, tuple(findings), tuple(skipped))


def door_findings(bundle: Bundle) -> list[Finding]:
    """The doors the model's JSON files open (``_code.doors``), as ``dynamic-code`` findings:
    each runs or fetches code that the audited Python files do not show."""
    return [Finding(None, door.file, door.line, 1, "dynamic-code", f"{door.key} = {door.value}",
                    f"{door.kind}: {door.reason}") for door in find_doors(bundle.origin.root)]


def audit(model: str | os.PathLike[str], *, revision: str | None = None,
          cache_dir: str | os.PathLike[str] | None = None) -> AuditReport:
    """What the remote code of ``model`` can do beyond computing. Executes nothing.

    ``model`` is a folder or a repo id in the local hub cache, as for ``resolve``; its
    errors (``codeferry.errors``) propagate.
    """
    return audit_bundle(resolve(model, revision=revision, cache_dir=cache_dir))


def render_box(report: AuditReport) -> str:
    """The ``sandbox`` section of ``inspect``: each line ``--sandbox`` would refuse (nothing
    when none), so a user knows before running; ``codeferry audit`` says why of each."""
    if not report.refused:
        return ""
    out = [f"sandbox (lines --sandbox refuses: {len(report.refused)}; codeferry audit says why)"]
    out += [f"  {f.location}: {f.category} {f.code}\n      {f.box}" for f in report.refused]
    return "\n".join(out) + "\n"


def render_audit(report: AuditReport) -> str:
    """The human form of ``codeferry audit``: findings grouped by category, with counts."""
    files = {f.file for f in report.findings}
    total = len(report.findings)
    out = [
        f"model    {report.model}",
        f"digest   {report.digest}",
        f"findings {total} in {len(files)} file{'s' if len(files) != 1 else ''} "
        "(static analysis: nothing was executed)" if total else
        "findings none found (static analysis: nothing was executed)",
    ]
    if report.refused:
        some = sum(1 for f in report.refused if not f.box.startswith("refused:"))
        out.append(f"sandbox  {len(report.refused)} refused under --sandbox"
                   + (f" ({some} only in some cases)" if some else "") + ", each marked below")
    counts = report.counts
    for category in CATEGORIES:
        if not counts[category]:
            out.append(f"{category}: none found")
            continue
        out.append(f"{category} ({counts[category]})")
        for f in report.findings:
            if f.category == category:
                out.append(f"  {f.location}: {f.code}")
                out.append(f"      {f.reason}")
                if f.box:
                    out.append(f"      under --sandbox: {f.box}")
    if report.skipped:
        out.append("not audited")
        out += [f"  {file}: {why}" for file, why in report.skipped]
    return "\n".join(out) + "\n"
