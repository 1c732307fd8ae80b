"""How a bf16 / fp16 parameter takes its fp32 result: the ``bf16_update`` option (``"nearest"``, ``"stochastic"``,
``"kahan"``).

The reference for every backend; the native C kernels (``cpu/csrc/elementwise.c``) and the Triton kernels
(``kernels/codec.py``) reproduce it bit for bit. The rules, the hash and fp16's ranges: docs/rounding.md.
"""

from __future__ import annotations

import contextvars
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

__all__ = [
    "MODES",
    "DTYPES",
    "SEED",
    "KAHAN",
    "check_mode",
    "applied",
    "init_state",
    "seeds_in_order",
    "step_key",
    "random_bits",
    "stochastic_round",
    "kahan_round",
    "store",
    "split_state",
]

MODES = ("nearest", "stochastic", "kahan")
#: the parameter dtypes the option applies to
DTYPES = (torch.bfloat16, torch.float16)
SEED = "bf16_update.seed"
KAHAN = "bf16_update.kahan"
PREFIX = "bf16_update."

M32 = 0xFFFFFFFF
_C1, _C2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def check_mode(mode: Any) -> None:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"Invalid bf16_update: {mode!r} (supported: {', '.join(repr(m) for m in MODES)})")


def applied(mode: str, p: torch.Tensor) -> str:
    """``mode`` (a ``bf16_update`` setting) where it applies (a bfloat16 or float16 ``p``), else ``"nearest"``."""
    return mode if p.dtype in DTYPES else "nearest"


def _draw() -> int:
    return int(torch.randint(0, 1 << 31, (1,)).item())


class _Seeds:
    """One step's seeds: drawn for all of ``pending()`` at the first one asked for, handed out by tensor address."""

    def __init__(self, pending: Callable[[], list[torch.Tensor]]) -> None:
        self.pending = pending
        self.seeds: dict[int, deque[int]] | None = None

    def take(self, p: torch.Tensor) -> int:
        if self.seeds is None:
            self.seeds = {}
            for t in self.pending():
                self.seeds.setdefault(t.data_ptr(), deque()).append(_draw())
        drawn = self.seeds.get(p.data_ptr())
        return drawn.popleft() if drawn else _draw()


_SEEDS: contextvars.ContextVar[_Seeds | None] = contextvars.ContextVar("lowmemopt_rounding_seeds", default=None)


@contextmanager
def seeds_in_order(pending: Callable[[], list[torch.Tensor]]) -> Iterator[None]:
    """Within it, a step's new stochastic-rounding seeds are drawn together, in ``pending()``'s order."""
    token = _SEEDS.set(_Seeds(pending))
    try:
        yield
    finally:
        _SEEDS.reset(token)


def init_state(
    state: dict[str, Any], p: torch.Tensor, mode: str, agree: Callable[[int], int] | None = None
) -> dict[str, Any]:
    """Add the stochastic seed or the zeroed Kahan buffer ``p``'s rounding needs to ``state``, if missing.

    Args:
        mode: the ``bf16_update`` setting (applied as :func:`applied` says; a meta tensor gets seed 0).
        agree: makes a new seed equal on every rank holding part of ``p`` (a collective).
    """
    mode = applied(mode, p)
    if mode == "stochastic" and SEED not in state:
        seeds = _SEEDS.get()
        seed = 0 if p.device.type == "meta" else seeds.take(p) if seeds is not None else _draw()
        state[SEED] = seed if agree is None else agree(seed)
    elif mode == "kahan" and KAHAN not in state:
        state[KAHAN] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    return state


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(bf16_update entries, the rest)`` of one parameter's state."""
    ours = {k: v for k, v in state.items() if k.startswith(PREFIX)}
    return ours, {k: v for k, v in state.items() if not k.startswith(PREFIX)}


# ---------------------------------------------------------------------------------------------------------------------
# the hash


def _mix_int(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 13
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def step_key(seed: int, step: int) -> int:
    """The per-(parameter, step) key of the hash: a uint32 as a Python int."""
    return _mix_int((seed & M32) ^ _mix_int((step * _GOLDEN) & M32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) without overflow (16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def random_bits(key: int, lo: int | torch.Tensor, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """16 random bits (int64) of flat elements ``lo .. lo + n - 1``, or of the flat indices in tensor ``lo``."""
    if isinstance(lo, torch.Tensor):
        idx = lo.to(device=device, dtype=torch.int64).reshape(-1) & M32
    else:
        idx = torch.arange(lo, lo + n, dtype=torch.int64, device=device) & M32
    return _mix(idx ^ key) >> 16


# ---------------------------------------------------------------------------------------------------------------------
# the roundings (pure: fp32 in, bf16 / fp16 out)


def stochastic_round(
    p32: torch.Tensor, key: int, lo: int | torch.Tensor = 0, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``p32`` (flat elements ``lo ..``, or at the indices ``lo`` holds) rounded stochastically to bf16 or fp16."""
    x = p32.reshape(-1)
    bits = x.view(torch.int32).to(torch.int64) & M32
    r = random_bits(key, lo, bits.numel(), p32.device)
    if dtype == torch.bfloat16:
        out = (bits + r) >> 16  # <= 0xFFFF: only a NaN's bits carry out
        out = torch.where(torch.isnan(x), 0x7FC0, out)
    elif dtype == torch.float16:
        out = _fp16_stochastic_bits(x, bits, r)
    else:
        raise TypeError(f"stochastic_round: dtype must be torch.bfloat16 or torch.float16, not {dtype}")
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(dtype).view(p32.shape)


#: fp32 patterns of fp16's least normal (2^-14) and largest finite value (65504)
F16_MIN_NORMAL, F16_MAX = 0x38800000, 0x477FE000


def _fp16_stochastic_bits(x: torch.Tensor, bits: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp16 patterns of ``x`` rounded with random bits ``r`` (docs/rounding.md#fp16)."""
    mag = bits & 0x7FFFFFFF
    normal = ((mag + (r >> 3)) >> 13) - (112 << 10)
    small = mag.clamp(max=F16_MIN_NORMAL).to(torch.int32).view(torch.float32)  # the subnormal lanes' |x|
    subnormal = ((small * 2.0**40).to(torch.int64) + r) >> 16  # a < 2^-14: a * 2^40 < 2^26, exact
    out = torch.where(mag < F16_MIN_NORMAL, subnormal, normal) | ((bits >> 16) & 0x8000)
    nearest = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return torch.where(mag > F16_MAX, nearest, out)  # past 65504, Inf, NaN: as the cast rounds


def kahan_round(p: torch.Tensor, p32: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One compensated write: old ``p``, fp32 result ``p32``, buffer ``c`` -> ``(new p, new c)`` in ``p``'s dtype."""
    old = p.float()
    y = (p32 - old) + c.float()
    new = (old + y).to(p.dtype)
    comp = y - (new.float() - old)
    comp = torch.where(torch.isfinite(comp), comp, 0.0)
    return new, comp.to(p.dtype)


def store(
    dst: torch.Tensor,
    p32: torch.Tensor,
    state: dict[str, Any],
    mode: str,
    lo: int = 0,
    index: int | torch.Tensor | None = None,
) -> None:
    """Write fp32 ``p32`` into ``dst`` rounded as ``mode`` says.

    Args:
        state: the state of the flat tensor ``dst`` is elements ``lo ..`` of; ``state["step"]`` is this step's.
        index: the elements' place in the whole parameter for a shard (a first flat index or one per element;
            ``Reduction.element_index``); by default ``lo``.
    """
    mode = applied(mode, dst)
    if mode == "nearest" or p32.dtype != torch.float32:
        if dst.data_ptr() != p32.data_ptr():
            dst.copy_(p32)
        return
    init_state(state, dst, mode)
    if mode == "stochastic":
        key = step_key(state[SEED], state["step"])
        dst.copy_(stochastic_round(p32, key, lo if index is None else index, dst.dtype))
    else:
        c = state[KAHAN].view(-1)[lo : lo + dst.numel()].view(dst.shape)
        new, comp = kahan_round(dst, p32, c)
        dst.copy_(new)
        c.copy_(comp)
