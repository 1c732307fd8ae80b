"""Muon's math (``torch.optim.Muon``): the momentum, the quintic Newton-Schulz orthogonalization in bfloat16 (one
matrix, or a batch of matrices of one shape) and the learning-rate adjustment by shape. See :mod:`.muon`."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["NS_COEFFICIENTS", "ADJUST_LR_FNS", "adjusted_lr", "momentum_input", "newton_schulz", "orthogonalize"]

#: Keller Jordan's quintic coefficients (torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(x: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float) -> torch.Tensor:
    """``steps`` quintic Newton-Schulz iterations of ``x`` ((m, n) or (B, m, n)) in bfloat16: torch's
    ``_zeropower_via_newtonschulz`` for one matrix (the same bits), ``baddbmm`` for a batch. Returns bfloat16."""
    a, b, c = coefficients
    y = x.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        y = y.mT
    if y.dim() == 2:
        y = y / y.norm().clamp(min=eps)
        for _ in range(steps):
            gram = y @ y.T
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    else:
        y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = torch.bmm(y, y.mT)
            y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.mT if tall else y


def orthogonalize(mats: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
    """:func:`newton_schulz` of ``mats`` (one shape) with ``group``'s settings, several as one batch."""
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if len(mats) == 1:
        return [newton_schulz(mats[0], *args)]
    return list(newton_schulz(torch.stack(mats), *args).unbind(0))


def adjusted_lr(lr: Any, adjust_lr_fn: str | None, shape: Sequence[int]) -> Any:
    """``torch.optim.Muon``'s learning rate for a matrix of ``shape`` (rows, cols): ``lr sqrt(max(1, rows / cols))``
    (None / ``"original"``) or ``0.2 lr sqrt(max(rows, cols))`` (``"match_rms_adamw"``)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def momentum_input(
    g: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool, in_place: bool = True
) -> torch.Tensor:
    """``B <- lerp(B, g, 1 - mu)`` (in place unless ``in_place`` is False) and the matrix to orthogonalize:
    ``lerp(g, B, mu)`` (nesterov) or ``B``."""
    buf = buf.lerp_(g, 1 - momentum) if in_place else buf.lerp(g, 1 - momentum)
    return g.lerp(buf, momentum) if nesterov else buf
