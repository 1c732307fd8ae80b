"""The GaLore projector (Zhao et al. 2024): which side a matrix is projected on, the projection and its inverse, and the
refresh of the basis. Sides, refresh, ``proj_moments``, state keys and the transposed basis layout:
``docs/galore.md#the-projector-sides-refresh-moments-state``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from .._stacklevel import external_stacklevel
from ..quant.formats import FORMATS
from . import storage
from .basis import randomized_svd_basis, svd_basis

__all__ = [
    "LEFT",
    "RIGHT",
    "BOTH",
    "PROJ_TYPES",
    "PROJECTOR_KEYS",
    "matrix_shape",
    "choose_side",
    "low_rank_shape",
    "init_projector",
    "decoded",
    "bases",
    "project",
    "project_back_rows",
    "compute_basis",
]

LEFT, RIGHT, BOTH = 0, 1, 2
SIDE_NAMES = {LEFT: "left", RIGHT: "right", BOTH: "both"}
PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")

PROJ = "galore.proj"
PROJ_RIGHT = "galore.proj_right"
SIDE = "galore.side"
NEXT_REFRESH = "galore.next_refresh"
REFRESHED_AT = "galore.refreshed_at"
PROJECTOR_TENSORS = (PROJ, PROJ_RIGHT)
PROJECTOR_INTS = (SIDE, NEXT_REFRESH, REFRESHED_AT)
PROJECTOR_KEYS = PROJECTOR_TENSORS + PROJECTOR_INTS


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) a parameter of >= 2 dims is projected as: ``(shape[0], prod(shape[1:]))``."""
    if len(shape) == 2:  # (a step asks this of every projected matrix)
        return int(shape[0]), int(shape[1])
    return int(shape[0]), int(math.prod(shape[1:]))


def choose_side(proj_type: str, m: int, n: int) -> int:
    """The projected side of an m x n matrix for ``proj_type`` (docs/galore.md)."""
    if proj_type == "std":
        return RIGHT if m >= n else LEFT
    if proj_type == "reverse_std":
        return LEFT if m >= n else RIGHT
    sides = {"left": LEFT, "right": RIGHT, "full": BOTH}
    if proj_type not in sides:
        raise ValueError(f"Invalid proj_type: {proj_type!r} (expected one of {', '.join(PROJ_TYPES)})")
    return sides[proj_type]


def low_rank_shape(m: int, n: int, rank: int, side: int) -> tuple[int, int]:
    """Shape of the projected gradient (and of the inner algorithm's state) of an m x n matrix."""
    k = min(rank, m, n)
    if side == LEFT:
        return k, n
    if side == RIGHT:
        return m, k
    if side == BOTH:
        return k, k
    raise KeyError(side)


@functools.lru_cache(maxsize=4096)
def basis_shapes(m: int, n: int, rank: int, side: int) -> dict[str, tuple[int, int]]:
    """Shapes of the stored (transposed) basis tensors (one dict per shape, asked for at every step: not to be
    changed)."""
    k = min(rank, m, n)
    if side == LEFT:
        return {PROJ: (k, m)}
    if side == RIGHT:
        return {PROJ: (n, k)}
    return {PROJ: (k, m), PROJ_RIGHT: (n, k)}


def init_projector(
    state: dict[str, Any], m: int, n: int, rank: int, side: int, device: torch.device, bits: int = 32
) -> None:
    """Add an empty projector (zero basis stored at ``bits``: :mod:`.storage`, refresh due at step 0) to a
    parameter's state."""
    for key, shape in basis_shapes(m, n, rank, side).items():
        storage.init_basis(state, key, shape, bits, device)
    state[SIDE] = side
    state[NEXT_REFRESH] = 0
    state[REFRESHED_AT] = -1


def decoded(state: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """A projector whose bases (of ``shapes``: :func:`basis_shapes`) are fp32 tensors, for :func:`bases`: ``state``
    itself where they are stored so, else the side and decoded copies (``proj_bits`` < 32)."""
    first = state.get(PROJ)
    if first is not None and first.dtype == torch.float32:
        return state
    out: dict[str, Any] = {SIDE: state[SIDE]}
    for key, shape in shapes.items():
        out[key] = storage.decode_basis(state, key, shape)
    return out


def bases(state: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(P, Q)``: the left basis (m x k) and the right basis (k x n) as views of the fp32 bases of ``state`` (stored
    so, or :func:`decoded`; None: that side is not projected)."""
    side = state[SIDE]
    if side == LEFT:
        return state[PROJ].t(), None
    if side == RIGHT:
        return None, state[PROJ].t()
    return state[PROJ].t(), state[PROJ_RIGHT].t()


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


def project(g: torch.Tensor, state: dict[str, Any], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The low-rank gradient of the fp32 matrix ``g`` in the stored basis (the same products as galore-torch).
    ``dtype`` (bf16): the products in that dtype instead (``g`` and the basis cast to it; the matmul accumulates in
    fp32 and rounds its result to ``dtype``)."""
    p, q = (_cast(t, dtype) for t in bases(state))
    g = _cast(g, dtype)
    if q is None:
        return torch.matmul(p.t(), g)
    if p is None:
        return torch.matmul(g, q.t())
    return torch.matmul(p.t(), g) @ q.t()


def project_back_rows(
    u: torch.Tensor, state: dict[str, Any], r0: int, r1: int, row0: int = 0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the full-rank update ``P u`` / ``u Q`` / ``P u Q`` (unscaled), so that the full-size
    update is never materialized at once. (Row blocks of a product are the product's rows: bit-identical on CPU.)
    ``row0``: the matrix is a row shard starting at row ``row0`` of the whole one (rows of ``P`` are offset by it;
    a side-right ``u`` holds the shard's rows only). See :mod:`lowmemopt.distributed.galore`. ``dtype``: as for
    :func:`project` (the result in ``dtype``)."""
    p, q = bases(state)
    if q is None:
        return torch.matmul(_cast(p[row0 + r0 : row0 + r1], dtype), _cast(u, dtype))
    if p is None:
        return torch.matmul(_cast(u[r0:r1], dtype), _cast(q, dtype))
    return torch.matmul(_cast(p[row0 + r0 : row0 + r1], dtype), _cast(u, dtype)) @ _cast(q, dtype)


def compute_basis(g: torch.Tensor, rank: int, side: int, method: str, seed: int) -> dict[str, torch.Tensor] | None:
    """A new basis for the fp32 matrix ``g``, as stored: ``{galore.proj: P^T or Q^T, [galore.proj_right: Q^T]}``
    (views; the caller copies them into the state), or None if the
    gradient or its SVD is not finite or the SVD fails to converge. One host synchronization (the finiteness check)."""
    try:
        if method == "randomized":
            u, vh = randomized_svd_basis(g, rank, seed=seed)
        else:
            u, vh = svd_basis(g, rank)
    except torch.linalg.LinAlgError:
        return None
    if side == LEFT:
        new = {PROJ: u.t()}
    elif side == RIGHT:
        new = {PROJ: vh.t()}
    else:
        new = {PROJ: u.t(), PROJ_RIGHT: vh.t()}
    finite = torch.stack([t.isfinite().all() for t in new.values()]).all()
    if not bool(finite):
        return None
    return new


def change_of_basis(old: dict[str, Any], new: dict[str, Any]):
    """The maps ``M -> L M R`` that carry low-rank coordinates from the ``old`` basis into the ``new`` one (both
    projector states, or stored-basis dicts with ``galore.side``): ``(L, R)`` with ``L = P_new^T P_old`` (None for
    side right) and ``R = Q_old Q_new^T`` (None for side left)."""
    p_old, q_old = bases(old)
    p_new, q_new = bases(new)
    left = None if p_old is None else p_new.t() @ p_old
    right = None if q_old is None else q_old @ q_new.t()
    return left, right


def warn_refresh_failed(record: Any, where: str) -> None:
    """Warn once per optimizer (``record``: its :class:`~lowmemopt.pipeline.plan.StepRecord`) that a refresh failed."""
    if record.galore_refresh_warned:
        return
    record.galore_refresh_warned = True
    warnings.warn(
        f"{record.owner}: GaLore projector refresh failed for {where} (non-finite gradient or SVD, or the "
        "SVD did not converge); keeping the previous basis (a parameter with no basis yet skips its step). "
        "Warned once per optimizer; optimizer.galore_refresh_failures counts them.",
        RuntimeWarning,
        stacklevel=external_stacklevel(),
    )


# -- the projector in state dicts and state files (used by lowmemopt.checkpoint) -------------------------------------


def split_projector_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(projector entries, the rest)`` of one parameter's state."""
    projector = {k: v for k, v in state.items() if k.startswith("galore.")}
    return projector, {k: v for k, v in state.items() if not k.startswith("galore.")}


def projector_at(projector: dict[str, Any], group: dict[str, Any], shape: torch.Size) -> dict[str, Any]:
    """A copy of ``projector`` (one that :func:`projector_problem` takes) with its bases stored at ``group``'s
    ``proj_bits``: those stored otherwise are converted (fp32 <-> bf16 <-> 8 / 4-bit), the rest kept as they are."""
    m, n = matrix_shape(shape)
    out = dict(projector)
    storage.store_at(out, basis_shapes(m, n, group["rank"], out[SIDE]), group.get("proj_bits", 32))
    return out


def _stored_keys(key: str) -> tuple[str, ...]:
    """Every key basis ``key`` may be stored under (:mod:`.storage`)."""
    return tuple(dict.fromkeys(k for f in FORMATS.values() for k in f.keys(key)))


_STORED_KEYS = frozenset(k for key in PROJECTOR_TENSORS for k in _stored_keys(key))


def projector_problem(projector: dict[str, Any], group: dict[str, Any], shape: torch.Size) -> str | None:
    """Why ``projector`` (a parameter's ``galore.*`` state, tensors or shape descriptions) cannot be the projector of
    a parameter of ``shape`` in ``group`` (None: it can). Its bases may be stored at any ``proj_bits``."""
    projected = group.get("rank") is not None
    if not projector:
        return "its param group has rank (GaLore) but the state has no projector" if projected else None
    if not projected:
        return f"the state has a GaLore projector ({sorted(projector)}) but its param group has no rank"
    unknown = sorted(set(projector) - set(PROJECTOR_INTS) - _STORED_KEYS)
    if unknown:
        return f"unknown projector state {unknown}"
    for key in PROJECTOR_INTS:
        value = projector.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"projector entry '{key}' must be an int, got {value!r}"
    side = projector[SIDE]
    if side not in SIDE_NAMES:
        return f"projector side {side} (expected 0 left, 1 right or 2 both)"
    m, n = matrix_shape(shape)
    expected = basis_shapes(m, n, group["rank"], side)
    got = {
        k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v)
        for k, v in projector.items()
        if k not in PROJECTOR_INTS
    }
    matched: set[str] = set()
    for key, want in expected.items():
        layouts = ({k: tuple(s) for k, (_, s) in storage.stored_entries(key, want, b).items()} for b in (32, 8, 4))
        layout = next((lay for lay in layouts if all(got.get(k) == s for k, s in lay.items())), None)
        if layout is None:
            break
        matched |= set(layout)
    if len(matched) != len(got) or not matched:
        return (
            f"projector bases {got}, rank {group['rank']} on a {m}x{n} matrix (side {SIDE_NAMES[side]}) "
            f"needs {expected}"
        )
    for key in expected:
        t = projector.get(key)
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            return f"projector basis '{key}' is {t.dtype}, expected float"
    return None
