"""A locked module of transformers' module cache with a ``.pyc`` planted beside it, executed
through transformers' ``get_class_in_module`` (``tests/runtime/test_bytecode.py`` runs it in a
new process per case, and under ``codeferry exec``). Plain transformers until ``how`` says
otherwise; what ran is what the class says and what the marker file got."""

from __future__ import annotations

import importlib.util
import marshal
import os
import py_compile
import tempfile
from pathlib import Path
from typing import Any

MODULE = "configuration_pyc.py"
HELPER = "helper_pyc.py"

#: The locked source: the class says "source", and so does its relative import.
SOURCE = {
    MODULE: "from .helper_pyc import HELPER\n\n\nclass PycConfig:\n"
            "    WHO = 'source'\n    HELPER = HELPER\n",
    HELPER: "HELPER = 'source'\n",
}


def _planted(marker: str, module: str) -> str:
    """What the planted pyc of ``module`` does: writes to ``marker``, says "pyc"."""
    return (f"with open({marker!r}, 'a', encoding='utf-8') as _f:\n"
            f"    _f.write('{module} pyc ran\\n')\n"
            "HELPER = 'pyc'\n"
            "class PycConfig:\n    WHO = 'pyc'\n    HELPER = 'pyc'\n")


def write(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        '{"model_type": "pycmodel", "auto_map": {"AutoConfig": "configuration_pyc.PycConfig"}}')
    for name, text in SOURCE.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def plant(module_file: str, source: str, mode: str) -> None:
    """Put ``source``, compiled, where the import system looks for ``module_file``'s pyc:
    unchecked-hash (never compared with the source) or timestamp with the source's own mtime
    and size (compared by those alone)."""
    cfile = importlib.util.cache_from_source(module_file)
    os.makedirs(os.path.dirname(cfile), exist_ok=True)
    if mode == "unchecked-hash":
        with tempfile.TemporaryDirectory() as other:
            path = os.path.join(other, "other.py")
            Path(path).write_text(source, encoding="utf-8")
            py_compile.compile(path, cfile=cfile, doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        return
    st = os.stat(module_file)
    header = (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
              + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
              + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
    Path(cfile).write_bytes(header + marshal.dumps(compile(source, module_file, "exec")))


def run(model: str, marker: str, mode: str, how: str = "plain",
        lock: str | None = None, force_reload: bool = False) -> dict[str, Any]:
    """Copy the model's module into transformers' cache, plant the pycs, then ask
    ``get_class_in_module`` for its class. ``how``: ``plain`` (no codeferry in the process, or
    ``codeferry exec`` around it) or ``load`` (``codeferry.load(model, lock=lock)`` first).
    ``force_reload``: transformers' own, as ``force_download`` sets it: the module is dropped
    from ``sys.modules`` and executed from its file again, after the gate."""
    if how == "load":
        import codeferry

        codeferry.load(model, lock=lock)
    import transformers.dynamic_module_utils as dmu

    path = dmu.get_cached_module_file(model, MODULE)
    module_file = os.path.join(dmu.HF_MODULES_CACHE, path)
    for name in SOURCE:
        plant(os.path.join(os.path.dirname(module_file), name), _planted(marker, name), mode)
    try:
        cls = dmu.get_class_in_module("PycConfig", path, force_reload=force_reload)
        got = f"{cls.WHO} {cls.HELPER}"
    except Exception as exc:  # the type is the answer
        got = type(exc).__name__
    ran = Path(marker).read_text(encoding="utf-8").splitlines() if Path(marker).exists() else []
    return {"got": got, "ran": ran}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(*sys.argv[1:4])))
