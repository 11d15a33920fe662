"""Linear layers on CPU with their weights packed once, as oneDNN wants them.

Why: a CPU worker's decode step is mostly ``nn.Linear`` on a few rows (one token a row),
and ``F.linear`` hands oneDNN the plain weight at every call, which reorders it into its
blocked layout each time. Reordering once, when the model is built, and calling oneDNN's
linear on the packed weight (``torch.ops.mkldnn``, what inductor's CPU freezing pass uses)
gives the same products with less work per call. Measured on 2 cores (``M`` rows, a
512x1536 weight): bfloat16 75 -> 45 us at 32 rows, 2x at 8; float32 315 -> 187 us at 32
rows; a 71M Llama's greedy decode, 16% less time in float32, 14% in bfloat16.

What is packed: modules whose type is exactly ``torch.nn.Linear`` (a subclass may compute
something else), with a float32 or bfloat16 weight on the CPU, no parametrization, and no
``forward`` of their own already set on the instance (accelerate's hooks set one).
bfloat16 only where oneDNN does it on this CPU. The plain weight stays (tied weights and
code that reads ``.weight`` see it unchanged); the packed copy costs the weights' memory
once more. A call with autograd on, or an input of another dtype or device, takes
``F.linear`` as before. A model whose first packed module (of each dtype) strays from
``F.linear``'s product beyond rounding is left unpacked.

``CODEFERRY_CPU_PACK=0`` turns it off (``_settings``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["pack_linears"]

#: The rows oneDNN plans the packed layout for: a decode batch of about this many rows.
ROWS_HINT = 32


class _Packed:
    """A Linear's ``forward``: oneDNN's linear on the packed weight. What a call checks is
    read once here (it runs some 85 times a decode step): the module's own parameters, and
    the two ops."""

    def __init__(self, module: Any) -> None:
        import torch

        self.module = module
        self.plain, self.plain_bias = module.weight, module.bias  # the Parameters themselves
        self.dtype, self.device = module.weight.dtype, module.weight.device
        self.weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), ROWS_HINT)
        self.bias = None if module.bias is None else module.bias.detach()
        self.grad_enabled, self.linear = torch.is_grad_enabled, torch.nn.functional.linear
        self.packed = torch.ops.mkldnn._linear_pointwise

    def __call__(self, x: Any) -> Any:
        if self.grad_enabled() or x.dtype != self.dtype or x.device != self.device:
            return self.linear(x, self.plain, self.plain_bias)
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
    return bool(float((got - want).abs().max()) <= scale * (2e-2 if weight.dtype == torch.bfloat16
                                                             else 1e-4))


def pack_linears(model: Any) -> int:
    """Pack ``model``'s eligible Linear layers in place; how many were packed."""
    import torch

    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not available or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return 0
    dtypes: tuple[Any, ...] = (torch.float32,)
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if bf16 is not None and bf16():
        dtypes += (torch.bfloat16,)
    packed: list[_Packed] = []
    for module in model.modules():
        if _eligible(module, dtypes):
            try:
                packed.append(_Packed(module))
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
