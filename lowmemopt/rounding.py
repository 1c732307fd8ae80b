"""How a bf16 parameter takes its fp32 result: the ``bf16_update`` storage option.

Every backend computes the step in fp32, ``p32 = p * decay + alpha * delta``; this module says how ``p32`` goes back
into a bfloat16 parameter. The functions here are the reference (eager path, GaLore, the step pipeline's apply stage);
the native C kernels (``lowmemopt/cpu/kernels.c``, ``store_param``) and the Triton kernels
(:func:`lowmemopt.kernels.codec.store_param`) reproduce them bit for bit.

* ``"nearest"`` (default): round to nearest even. An update smaller than half a bf16 ulp of ``p`` is lost (at lr 1e-5
  most of a fine-tune's updates are).
* ``"stochastic"``: round up with probability equal to the fraction of the gap, so ``E[bf16(p32)] = p32``: add 16
  random bits to the low half of ``p32``'s bit pattern, then truncate. The bits are a counter-based hash of (the
  parameter's ``seed``, the step, the element's index in the parameter), so every backend, chunking and tiling gives
  the same bits; the seed is drawn from torch's generator when the state is made and kept in the state
  (``bf16_update.seed``, an int), so a resumed run rounds as the uninterrupted one. NaN stays NaN (``0x7FC0``), Inf
  stays Inf, a finite value never becomes NaN; a value above the largest bf16 may round up to Inf (with the
  probability of its distance to it, as the unbiased rounding of a value in that last gap must).
* ``"kahan"``: a compensation buffer ``bf16_update.kahan`` (bf16, shaped like ``p``: 2 bytes per element) keeps what
  rounding lost and adds it to the next update (as optimi's Kahan summation), in fp32::

      y = (p32 - p) + c;   p_new = bf16_nearest(p + y);   c = bf16_nearest(y - (p_new - p))   (0 if not finite)

  ``p32 - p = p * (decay - 1) + alpha * delta``: decoupled weight decay enters as part of the compensated update, so
  a decay too small to move ``p`` accumulates in ``c`` as the gradient's part does.

Only bfloat16 parameters are affected: fp32 parameters need neither, and fp16 parameters (which have 3 more mantissa
bits, and are usually trained with an fp32 master copy) keep round-to-nearest.

The hash (32-bit unsigned arithmetic, which torch int64 ops, C ``uint32_t`` and Triton ``uint32`` all reproduce)::

    mix(x)  = murmur3 fmix32: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    key     = mix(seed ^ mix(step * 0x9E3779B9 mod 2^32))          (once per parameter and step, on the host)
    bits(i) = mix((i mod 2^32) ^ key) >> 16                        (per element, i: its flat index)
    bf16    = (bits_of(p32) + bits(i)) >> 16                       (NaN: 0x7FC0)

Indices are taken mod 2^32, so a parameter of more than 4G elements reuses its stream once per 4G elements. ``i`` is
the element's index in the *whole* parameter: an FSDP2 / tensor-parallel shard hashes its elements' global indices
(:meth:`lowmemopt.distributed.reduction.Reduction.element_index`), and the seed is made the same on every rank that
holds a part or a copy of the parameter (the largest of the ranks' draws), so a sharded run rounds exactly as the
one-process run with that seed, and replicas (HSDP) stay identical. (A strided shard, FSDP2 over tensor parallelism,
hashes its local indices.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["MODES", "SEED", "KAHAN", "check_mode", "mode_of", "init_state", "step_key", "random_bits",
           "stochastic_round", "kahan_round", "store", "split_state"]

MODES = ("nearest", "stochastic", "kahan")
SEED = "bf16_update.seed"
KAHAN = "bf16_update.kahan"
PREFIX = "bf16_update."

M32 = 0xFFFFFFFF
_C1, _C2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def check_mode(mode: Any) -> None:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"Invalid bf16_update: {mode!r} (supported: {', '.join(repr(m) for m in MODES)})")


def mode_of(group: dict[str, Any], p: torch.Tensor) -> str:
    """The group's ``bf16_update`` where it applies (a bfloat16 ``p``), else ``"nearest"``."""
    if p.dtype != torch.bfloat16:
        return "nearest"
    return group.get("bf16_update", "nearest")


def init_state(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any],
               agree: Callable[[int], int] | None = None) -> dict[str, Any]:
    """Add what ``p``'s mode needs to its state, if missing: the stochastic seed (an int from torch's default
    generator; none drawn for a meta tensor, the paging layout probe) or the zeroed Kahan buffer. ``agree``: makes a
    new seed the same on every rank that holds part of the parameter (a collective: every such rank calls it)."""
    mode = mode_of(group, p)
    if mode == "stochastic" and SEED not in state:
        seed = 0 if p.device.type == "meta" else int(torch.randint(0, 1 << 31, (1,)).item())
        state[SEED] = seed if agree is None else agree(seed)
    elif mode == "kahan" and KAHAN not in state:
        state[KAHAN] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
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
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow (16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def random_bits(key: int, lo: int | torch.Tensor, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """16 random bits (int64 in [0, 65536)) of elements ``lo .. lo + n - 1`` of a parameter, or of the elements whose
    flat indices ``lo`` (an int64 tensor of ``n``) holds."""
    if isinstance(lo, torch.Tensor):
        idx = lo.to(device=device, dtype=torch.int64).reshape(-1) & M32
    else:
        idx = torch.arange(lo, lo + n, dtype=torch.int64, device=device) & M32
    return _mix(idx ^ key) >> 16


# ---------------------------------------------------------------------------------------------------------------------
# the roundings (pure: fp32 in, bf16 out)


def stochastic_round(p32: torch.Tensor, key: int, lo: int | torch.Tensor = 0) -> torch.Tensor:
    """``p32`` (fp32, flat elements ``lo ..`` of their parameter, or those at the flat indices ``lo`` holds) rounded
    stochastically to bfloat16."""
    bits = p32.reshape(-1).view(torch.int32).to(torch.int64) & M32
    out = (bits + random_bits(key, lo, bits.numel(), p32.device)) >> 16  # <= 0xFFFF: only a NaN's bits carry out
    out = torch.where(torch.isnan(p32.reshape(-1)), 0x7FC0, out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(torch.bfloat16).view(p32.shape)


def kahan_round(p: torch.Tensor, p32: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One compensated write: ``p`` (the old bf16 parameter), ``p32`` (the fp32 result), ``c`` (the bf16 buffer) ->
    ``(new p, new c)``, both bf16 (see the module docstring)."""
    old = p.float()
    y = (p32 - old) + c.float()
    new = (old + y).to(torch.bfloat16)
    comp = y - (new.float() - old)
    comp = torch.where(torch.isfinite(comp), comp, 0.0)
    return new, comp.to(torch.bfloat16)


def store(dst: torch.Tensor, p32: torch.Tensor, state: dict[str, Any], group: dict[str, Any], lo: int = 0,
          index: int | torch.Tensor | None = None) -> None:
    """Write the fp32 result ``p32`` into ``dst`` (elements ``lo ..`` of the flat tensor whose state is ``state``, in
    the same shape as ``p32``), rounded as the group's ``bf16_update`` says. ``state["step"]`` is this step's.
    ``index``: where those elements sit in the whole parameter when the tensor is a shard of it (the stochastic
    hash's counter: a first flat index, or one per element; see
    :meth:`lowmemopt.distributed.reduction.Reduction.element_index`); by default ``lo``."""
    mode = mode_of(group, dst)
    if mode == "nearest" or p32.dtype != torch.float32:
        if dst.data_ptr() != p32.data_ptr():
            dst.copy_(p32)
        return
    init_state(state, dst, group)
    if mode == "stochastic":
        dst.copy_(stochastic_round(p32, step_key(state[SEED], state["step"]), lo if index is None else index))
    else:
        c = state[KAHAN].view(-1)[lo:lo + dst.numel()].view(dst.shape)
        new, comp = kahan_round(dst, p32, c)
        dst.copy_(new)
        c.copy_(comp)
