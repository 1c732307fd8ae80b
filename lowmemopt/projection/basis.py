"""Orthonormal bases of a gradient's top singular subspaces: exact (``torch.linalg.svd``) or randomized (Halko,
Martinsson & Tropp 2011, "Finding structure with randomness", Alg. 4.4 + 5.1), and the measures that compare them.

For a gradient ``G`` (m x n, fp32) and rank r::

    full:        G = U S V^T (thin SVD);  left basis U_r = U[:, :r] (m x r),  right basis V_r^T = V^T[:r] (r x n)
    randomized:  Y = G W (W: n x l Gaussian, l = r + oversample);  q power iterations  Y <- G (G^T Y), each step
                 re-orthonormalized by QR;  Q = orth(Y);  B = Q^T G = U_B S V^T;  U ~ Q U_B

The randomized basis costs O(m n l) against the full SVD's O(m n min(m, n)); its error is governed by the decay of the
singular values beyond r (see :func:`captured_energy`, :func:`principal_angles`). The sketch ``W`` comes from a
generator seeded by the caller (lowmemopt seeds it with the step), so a resumed run draws the same sketch.
"""

from __future__ import annotations

import torch

__all__ = ["svd_basis", "randomized_svd_basis", "principal_angles", "captured_energy"]


def svd_basis(g: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r, V_r^T)`` of the thin SVD of the 2-D fp32 ``g``: shapes (m, k) and (k, n), k = min(rank, m, n).
    Raises ``torch.linalg.LinAlgError`` if the SVD does not converge."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u[:, :rank], vh[:rank, :]


def randomized_svd_basis(
    g: torch.Tensor, rank: int, *, oversample: int = 8, power_iters: int = 2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate ``(U_r, V_r^T)`` of the 2-D fp32 ``g`` by a randomized range finder (module docstring), with a
    Gaussian sketch drawn from a generator seeded with ``seed`` on ``g``'s device. Same shapes as :func:`svd_basis`."""
    m, n = g.shape
    k = min(rank, m, n)
    width = min(k + oversample, m, n)
    transpose = m < n  # sketch the longer side: the QR factors are then (max(m, n) x width)
    a = g.t() if transpose else g
    gen = torch.Generator(device=g.device).manual_seed(int(seed))
    sketch = torch.randn(a.shape[1], width, generator=gen, device=g.device, dtype=g.dtype)
    q = torch.linalg.qr(a @ sketch).Q
    for _ in range(power_iters):
        q = torch.linalg.qr(a.t() @ q).Q
        q = torch.linalg.qr(a @ q).Q
    ub, _, vh = torch.linalg.svd(q.t() @ a, full_matrices=False)
    u = (q @ ub[:, :k]).contiguous()
    vh = vh[:k, :]
    if transpose:  # a = g^T = U S V^T  =>  g = V S U^T
        return vh.t().contiguous(), u.t().contiguous()
    return u, vh


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, ascending, float64) between the column spans of orthonormal ``a`` and ``b`` (both
    m x k): ``atan2(sin, cos)`` with the cosines the singular values of ``a^T b`` and the sines those of
    ``b - a (a^T b)`` (Bjorck & Golub 1973). ``arccos`` of the cosine alone cannot resolve small angles: a cosine a few
    fp32 ulps below 1 reads as ~1e-3 rad (``sqrt(2 * 4 * 2^-24)``) whatever the true angle, and which few ulps depends
    on the BLAS's summation order (thread count, CPU)."""
    a, b = a.double(), b.double()
    ab = a.t() @ b
    cos = torch.linalg.svdvals(ab)  # descending: smallest angle first
    sin = torch.linalg.svdvals(b - a @ ab).flip(0)  # ascending: the same order of angles
    return torch.atan2(sin, cos)


def captured_energy(g: torch.Tensor, left: torch.Tensor) -> float:
    """Fraction of ``||g||_F^2`` inside the column span of the orthonormal ``left`` (m x k): ``||left^T g||^2 /
    ||g||^2``. The rank-k SVD basis maximizes it (Eckart-Young)."""
    return float((left.t() @ g).square().sum() / g.square().sum())
