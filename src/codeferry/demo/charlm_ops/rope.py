"""Rotary position embeddings, in a sub-package of ``charlm``."""

import torch


def rope(x, base=10000.0):
    """Rotate the two halves of the last axis of ``x`` (batch, seq, dim) by position."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
