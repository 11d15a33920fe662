"""Checks the parent makes before it starts a worker, so that a mistake fails here, typed.

A worker that cannot use its device, or that dies while multiprocessing bootstraps it,
reports at best an exit code or a traceback from another process. Both mistakes are
visible in the parent before anything starts:

* ``check_device``: the device string parses (``torch.device``), its backend is
  available in this torch on this machine, and its index exists. Otherwise ``cuda`` on a
  machine without CUDA would run on CPU silently, and ``cuda:0`` fail inside every worker.
* ``check_main_guard``: spawn and forkserver children import the main script again
  (``multiprocessing.spawn`` does, as ``__mp_main__``). A script that starts workers at
  module level, outside ``if __name__ == "__main__":``, would start them again in every
  child, which multiprocessing refuses with a RuntimeError in the child; the parent
  only saw "exit code 1".
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import sys
from types import FrameType

from ... import _settings
from ...errors import DeviceError, DTypeError, MainGuardError

__all__ = ["check_device", "check_main_guard", "dtype_name"]

_KINDS = "cpu, cuda, cuda:N, mps or xpu"


def check_device(device: str) -> None:
    """Raise ``DeviceError`` unless ``device`` names a device torch can use here."""
    if device == "cpu":
        return  # no torch import in the parent for the common case
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {device!r} is not a device string torch knows.",
                          device=device, fix=f"use {_KINDS} (lower case).") from None
    kind, index = parsed.type, parsed.index
    if kind == "cpu":
        return
    if kind == "meta":
        raise DeviceError(f"device {device!r} holds no data: no model runs on it.",
                          device=device, fix=f"use {_KINDS}.")
    if kind == "mps":
        available = bool(torch.backends.mps.is_available())
        count = 1 if available else 0
    else:
        backend = getattr(torch, kind, None)
        if backend is None or not hasattr(backend, "is_available"):
            raise DeviceError(f"device {device!r}: this torch ({torch.__version__}) has no "
                              f"{kind} backend.", device=device, fix=f"use {_KINDS}.")
        available = bool(backend.is_available())
        count = int(backend.device_count()) if available and hasattr(backend, "device_count") else 0
    if not available or count == 0:
        raise DeviceError(f"device {device!r} is not available: {_why_not(kind)}.",
                          device=device, fix=f"use --device cpu (device='cpu'), or run where "
                          f"torch can use {kind}.")
    if index is not None and index >= count:
        names = ", ".join(f"{kind}:{i}" for i in range(count))
        raise DeviceError(
            f"device {device!r} does not exist: this machine has {count} {kind} "
            f"device{'s' if count > 1 else ''} ({names}).", device=device,
            fix=f"use one of {names}, or {kind!r} to spread the workers over all of them.")


def dtype_name(dtype: object) -> str | None:
    """``dtype`` as workers and run records carry it: ``"float16"`` for ``torch.float16``,
    ``"float16"`` or ``"torch.float16"``, as ``from_pretrained(dtype=...)`` takes both.

    A name torch does not know as a dtype raises ``DTypeError`` here, not in every worker.
    """
    if dtype is None:
        return None
    kind = type(dtype)
    if kind.__module__ == "torch" and kind.__name__ == "dtype":  # without importing torch
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype.strip():
        name = dtype.strip().removeprefix("torch.")
        import torch

        if isinstance(getattr(torch, name, None), torch.dtype):
            return name
    raise DTypeError(
        f"dtype {dtype!r} is neither a torch.dtype nor the name of one.", dtype=repr(dtype),
        fix="pass a torch.dtype (torch.float16) or its name (\"float16\", \"bfloat16\", "
        "\"float32\"), or None for the model's own dtype.")


def _why_not(kind: str) -> str:
    import torch

    if kind == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"this torch ({torch.__version__}) is built without CUDA"
        visible = _settings.cuda_visible_devices()
        return "torch sees no CUDA device" + (
            f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    if kind == "mps":
        return "MPS needs Apple silicon and a torch built with MPS"
    return f"torch sees no {kind} device"


def check_main_guard(start_method: str) -> None:
    """Raise ``MainGuardError`` when starting workers now would fail in their bootstrap.

    In a child that is importing the main script (multiprocessing marks it
    ``_inheriting``), any start is refused. In the parent, a start is refused when the
    main script will be imported again by the children and the statement of it that
    led here is not inside an ``if __name__ == "__main__":`` block.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise MainGuardError(
            "this process is a worker importing the main script, and the script starts "
            "an executor while being imported.",
            fix='put the code that starts it under `if __name__ == "__main__":` in the '
            "main script, or use start_method='fork'.")
    if start_method == "fork":
        return
    main = sys.modules.get("__main__")
    if main is None or not _reimported(main):
        return
    file = getattr(main, "__file__", None)
    if isinstance(file, str) and file.startswith("<") and file.endswith(">"):  # <stdin>
        raise MainGuardError(
            f"the main script was read from {file}, and every {start_method} worker imports "
            "the main script again from its file: there is none to read, and each worker "
            "would die in its bootstrap (FileNotFoundError).",
            fix="save the script to a file and run that file, or use start_method='fork'.")
    frame = _main_frame(main.__dict__)
    if frame is None:
        return
    path, line = frame.f_code.co_filename, frame.f_lineno
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return  # cannot tell: let the start go ahead
    if any(_guarded(node, line) for node in ast.walk(tree)):
        return
    raise MainGuardError(
        f"this line starts {start_method} workers while the main script runs at module "
        f"level; every {start_method} worker imports the script again and would start "
        "workers itself, which multiprocessing refuses (\"An attempt has been made to start "
        "a new process before the current process has finished its bootstrapping phase\").",
        path=path, line=line,
        fix='move the code that starts them under `if __name__ == "__main__":`, '
        "or use start_method='fork'.")


def _reimported(main: object) -> bool:
    """Whether spawn/forkserver children run the main module again (``multiprocessing.spawn``'s rule)."""
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        return not (name == "__main__" or name.endswith(".__main__"))
    return getattr(main, "__file__", None) is not None


def _main_frame(namespace: dict[str, object]) -> FrameType | None:
    """The outermost frame running the main module's own top-level code."""
    found = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is namespace and frame.f_code.co_name == "<module>":
            found = frame
        frame = frame.f_back
    return found


def _guarded(node: ast.AST, line: int) -> bool:
    """Whether ``node`` is an ``if __name__ == "__main__":`` whose body holds ``line``."""
    if not isinstance(node, ast.If) or not node.body:
        return False
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    named = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    main = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    end = node.body[-1].end_lineno or node.body[-1].lineno
    return named and main and node.body[0].lineno <= line <= end
