"""Linear layers on CPU with their weights packed once, as oneDNN wants them.

Why: a CPU worker's decode step is mostly ``nn.Linear`` on a few rows (one token a row),
and ``F.linear`` hands oneDNN the plain weight at every call, which reorders it into its
blocked layout each time. Reordering once, when the model is built, and calling oneDNN's
linear on the packed weight (``torch.ops.mkldnn``, what inductor's CPU freezing pass uses)
gives the same products with less work per call. Measured on 2 cores (``M`` rows, a
512x1536 weight): bfloat16 75 -> 45 us at 32 rows, 2x at 8; float32 315 -> 187 us at 32
rows; a 71M Llama's greedy decode, 16% less time in float32, 14% in bfloat16.

Half precision where oneDNN has no kernel for it (a CPU without AVX-512 BF16/FP16 or AMX,
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` false): PyTorch's own bfloat16 matmul
is then several times slower than float32 (a 71M Llama's decode step at 16 rows, one
thread, AVX2: 208 ms in bfloat16, 62 ms in float32). Such a layer is packed *upcast*: a
float32 copy of its weight, the input cast up and the product cast back to the layer's
dtype. The products are those of a bfloat16 matmul that accumulates in float32, as
PyTorch's does (bfloat16 values are exact in float32; the same step: 68 ms, and 99.99% of
a layer's outputs bit-identical to ``F.linear``'s, the rest one rounding step apart). The
copy costs twice the weights' bytes, so it is made only while the copies of every worker
building at once (``sharing``) take at most half the memory the system has available;
otherwise those layers keep ``F.linear``, and a warning says so.

What is packed: modules whose type is exactly ``torch.nn.Linear`` (a subclass may compute
something else), with a float32, bfloat16 or float16 weight on the CPU, no parametrization,
and no ``forward`` of their own already set on the instance (accelerate's hooks set one).
The plain weight stays (tied weights and code that reads ``.weight`` see it unchanged); the
packed copy costs the weights' memory once more (twice, upcast). A call with autograd on,
or an input of another dtype or device, takes ``F.linear`` as before. A model whose first
packed module (of each dtype) strays from ``F.linear``'s product beyond rounding is left
unpacked.

``CODEFERRY_CPU_PACK=0`` turns it off (``_settings``).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["available_bytes", "native_dtypes", "pack_linears"]

#: The rows oneDNN plans the packed layout for: a decode batch of about this many rows.
ROWS_HINT = 32

logger = logging.getLogger(__name__)


class _Packed:
    """A Linear's ``forward``: oneDNN's linear on the packed weight (upcast: a float32 copy,
    the input cast up, the product cast back). What a call checks is read once here (it
    runs some 85 times a decode step): the module's own parameters, and the ops."""

    def __init__(self, module: Any, *, upcast: bool = False) -> None:
        import torch

        self.module, self.upcast = module, upcast
        self.plain, self.plain_bias = module.weight, module.bias  # the Parameters themselves
        self.dtype, self.device = module.weight.dtype, module.weight.device
        weight, bias = module.weight.detach(), module.bias
        if upcast:
            weight = weight.float()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
        self.bias = None if bias is None else bias.detach().to(weight.dtype)
        self.grad_enabled, self.linear = torch.is_grad_enabled, torch.nn.functional.linear
        self.packed = torch.ops.mkldnn._linear_pointwise

    def __call__(self, x: Any) -> Any:
        if self.grad_enabled() or x.dtype != self.dtype or x.device != self.device:
            return self.linear(x, self.plain, self.plain_bias)
        if self.upcast:
            return self.packed(x.float(), self.weight, self.bias, "none", [None],
                               "").to(self.dtype)
        return self.packed(x, self.weight, self.bias, "none", [None], "")


def _eligible(module: Any, dtypes: tuple[Any, ...]) -> bool:
    import torch

    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and "forward" not in vars(module)
            and not getattr(module, "parametrizations", None) and weight is not None
            and weight.device.type == "cpu" and weight.dtype in dtypes and weight.dim() == 2)


def _agrees(packed: _Packed) -> bool:
    """The packed product of a random input against ``F.linear``'s, within rounding."""
    import torch

    weight = packed.module.weight
    x = torch.randn(ROWS_HINT, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(weight.dtype)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, weight, packed.module.bias).float()
        got = packed(x).float()
    scale = float(want.abs().max()) or 1.0
    return bool(float((got - want).abs().max()) <= scale * (1e-4 if weight.dtype == torch.float32
                                                             else 2e-2))


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux); ``None`` where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def native_dtypes() -> set[Any]:
    """The dtypes oneDNN multiplies in on this CPU: float32, and half precision where the
    CPU has instructions for it."""
    import torch

    native: set[Any] = {torch.float32}
    for dtype, probe in ((torch.bfloat16, "_is_mkldnn_bf16_supported"),
                         (torch.float16, "_is_mkldnn_fp16_supported")):
        supported = getattr(torch.ops.mkldnn, probe, None)
        if supported is not None and supported():
            native.add(dtype)
    return native


def pack_linears(model: Any, *, sharing: int = 1) -> int:
    """Pack ``model``'s eligible Linear layers in place; how many were packed. ``sharing``:
    how many processes on this machine may make the same float32 copies at once (an
    executor's workers start together, and each reads the memory free before any copies)."""
    import torch

    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not available or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return 0
    native = native_dtypes()
    halves = {torch.bfloat16, torch.float16} - native
    eligible = [m for m in model.modules()
                if _eligible(m, (torch.float32, torch.bfloat16, torch.float16))]
    upcast = [m for m in eligible if m.weight.dtype in halves]
    upcast_bytes = sum(4 * m.weight.numel() for m in upcast)
    free = available_bytes() if upcast else None
    if free is not None and upcast_bytes * max(1, sharing) > free // 2:
        names = "/".join(sorted({str(m.weight.dtype).removeprefix("torch.") for m in upcast}))
        logger.warning(
            "codeferry: %s layers keep PyTorch's own matmul, slow on this CPU (no instructions "
            "for it): their float32 copies would take %.1f GiB x %d workers, more than half "
            "of the %.1f GiB available; fewer workers or a float32 model avoid it", names,
            upcast_bytes / 2**30, max(1, sharing), free / 2**30)
        halves = set()  # no room for float32 copies: those layers keep F.linear
    packed: list[_Packed] = []
    for module in eligible:
        if module.weight.dtype in native or module.weight.dtype in halves:
            try:
                packed.append(_Packed(module, upcast=module.weight.dtype in halves))
            except RuntimeError:  # a layout oneDNN refuses: that module keeps F.linear
                continue
    if not packed:
        return 0
    first = {p.module.weight.dtype: p for p in reversed(packed)}  # each dtype's first module
    if not all(_agrees(p) for p in first.values()):
        return 0
    for forward in packed:
        forward.module.forward = forward
    return len(packed)
