"""APOLLO's math (``apollo_torch.APOLLOAdamW``): the random projection regenerated from a seed, the SVD projection,
the scaling factor and Fira's norm-growth limiter; the optimizer is :mod:`.apollo`. The seed chain (``s_{k+1}`` the
last of 15 int64s drawn by a CPU generator seeded with ``s_k``): docs/apollo.md ("The projection: a seed and a step").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..distributed.reduction import LOCAL, Reduction

__all__ = [
    "LEFT",
    "RIGHT",
    "SCALE_EPS",
    "projection_seed",
    "random_projection",
    "side_of",
    "svd_projection",
    "lapack_layout",
    "apply_projection",
    "scaling_factor",
    "limit_norm_growth",
    "refresh_due_at",
]

LEFT, RIGHT = 0, 1  # R = P^T G (P: m x r) | R = G P^T (P: r x n)
#: added to the low-rank gradient's norm in the scaling factor, and to the previous norm in the limiter
SCALE_EPS = 1e-8
_ADVANCE = 15  # int64s drawn per seed advance (apollo-torch's ADV_DEFAULT)
_CHAINS: dict[int, list[int]] = {}  # first seed -> [s_1, s_2, ...] computed so far (shared: it is deterministic)


def next_seed(seed: int) -> int:
    """The seed after ``seed``: the last of :data:`_ADVANCE` int64s a CPU generator seeded with ``seed`` draws."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, torch.iinfo(torch.int64).max, (_ADVANCE,), generator=gen).tolist()[-1]


def projection_seed(first: int, refresh: int) -> int:
    """``s_refresh`` of the chain that starts at ``first`` (``refresh`` >= 1), memoized."""
    chain = _CHAINS.setdefault(first, [first])
    while len(chain) < refresh:
        chain.append(next_seed(chain[-1]))
    return chain[refresh - 1]


def refresh_due_at(step: int, gap: int) -> tuple[bool, int]:
    """(is ``step`` (1-based) a refresh, refreshes so far): where ``step - 1`` is a multiple of ``gap``."""
    return (step - 1) % gap == 0, (step - 1) // gap + 1


def side_of(proj_type: str, m: int, n: int) -> int:
    """The projected side of an ``m x n`` gradient: ``std`` right where ``m >= n``, else left; ``reverse_std`` the
    opposite; ``left`` / ``right`` as named."""
    if proj_type == "std":
        return RIGHT if m >= n else LEFT
    if proj_type == "reverse_std":
        return LEFT if m >= n else RIGHT
    return RIGHT if proj_type == "right" else LEFT


def projection_shape(side: int, m: int, n: int, rank: int) -> tuple[int, int]:
    """The projection matrix's shape: ``(m, rank)`` (left) or ``(rank, n)`` (right)."""
    return (m, rank) if side == LEFT else (rank, n)


def projected_shape(side: int, m: int, n: int, rank: int) -> tuple[int, int]:
    """The projected gradient's (and the moments') shape: ``(rank, n)`` (left) or ``(m, rank)`` (right)."""
    return (rank, n) if side == LEFT else (m, rank)


def random_projection(shape: tuple[int, int], seed: int, rank: int, device: torch.device) -> torch.Tensor:
    """``randn(shape) / sqrt(rank)`` in fp32 from a generator on ``device`` seeded with ``seed`` (``stable_randn``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / math.sqrt(rank)


def svd_projection(g: torch.Tensor, side: int, rank: int) -> torch.Tensor:
    """GaLore's basis of ``g`` (fp32): the first ``rank`` left (side left) or right singular vectors."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u[:, :rank] if side == LEFT else vh[:rank, :]


def lapack_layout(proj: torch.Tensor) -> torch.Tensor:
    """A column-major copy of ``proj`` (rank x n or m x rank: small), the layout in which ``torch.linalg.svd``
    returns its factors and apollo-torch multiplies them. MKL chooses its GEMM kernel by the operands' layout, and
    on CPUs where it takes its SSE/AVX2 paths the two layouts round differently (measured: up to ~1e-6 on the
    projected gradient); the stored basis is contiguous, so the product is taken from this copy."""
    return proj.t().contiguous().t()


def apply_projection(g: torch.Tensor, proj: torch.Tensor, side: int) -> torch.Tensor:
    """``P^T G`` (left) or ``G P^T`` (right)."""
    return torch.matmul(proj.t(), g) if side == LEFT else torch.matmul(g, proj.t())


def scaling_factor(
    norm_grad: torch.Tensor, low: torch.Tensor, scale_type: str, norm_dim: int, reduce: Reduction = LOCAL
) -> torch.Tensor:
    """``||norm_grad|| / (||R|| + 1e-8)`` over ``norm_dim`` (``channel``) or the whole tensors (``tensor``);
    ``norm_grad = m / (sqrt(v) + eps)``, ``R`` the projected gradient; ``reduce`` for a row shard."""
    if scale_type == "channel":
        factor = reduce.norm_along(norm_grad, norm_dim, norm_dim) / (
            reduce.norm_along(low, norm_dim, norm_dim) + SCALE_EPS
        )
        return factor.unsqueeze(1) if norm_dim == 1 else factor
    return reduce.norm(norm_grad) / (reduce.norm(low) + SCALE_EPS)


def limit_norm_growth(
    update: torch.Tensor, previous: torch.Tensor, first: bool, reduce: Reduction = LOCAL
) -> torch.Tensor:
    """Fira's limiter: scale ``u`` so its norm grows at most 1% a step; ``previous`` (one element) is updated in
    place. The first step only records the norm."""
    norm = reduce.norm(update)
    if first:
        previous.copy_(norm.reshape(previous.shape))
        return update
    limiter = torch.clamp(norm / (previous + SCALE_EPS), min=1.01) / 1.01
    previous.copy_((norm / limiter).reshape(previous.shape))
    return update / limiter


def check_factor_shape(shape: Any, side: int, rank: int, scale_type: str) -> str | None:
    """Why a channel-wise factor cannot scale a gradient of ``shape`` (None: it can): its dim must be the kept one."""
    if scale_type != "channel":
        return None
    m, n = shape
    norm_dim = 0 if m < n else 1
    low = projected_shape(side, m, n, rank)
    length = low[1 - norm_dim]
    want = n if norm_dim == 0 else m
    if length in (want, 1):
        return None
    return (
        f"scale_type='channel' on a {m}x{n} matrix projected to {low[0]}x{low[1]}: the factor has {length} "
        f"channels, the gradient {want}; use proj_type='std' or scale_type='tensor'"
    )
