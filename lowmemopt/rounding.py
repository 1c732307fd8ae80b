"""How a 16-bit float parameter takes its fp32 result: the ``bf16_update`` storage option.

Every backend computes the step in fp32, ``p32 = p * decay + alpha * delta``; this module says how ``p32`` goes back
into a bfloat16 or float16 parameter (the option is named for its first use, and applies to both). The functions here
are the reference (eager path, GaLore, the step pipeline's apply stage); the native C kernels
(``lowmemopt/cpu/csrc/elementwise.c``, ``store_param``) and the Triton kernels (:func:`lowmemopt.kernels.codec.store_param_as`)
reproduce them bit for bit.

* ``"nearest"`` (default): round to nearest even. An update smaller than half an ulp of ``p`` is lost (at lr 1e-5
  most of a bf16 fine-tune's updates are; fp16's ulp is 8 times finer, but an fp16 weight near 1 still loses updates
  below 2^-11 = 4.9e-4).
* ``"stochastic"``: round away from zero with probability equal to the fraction of the gap, so
  ``E[round(p32)] = p32``. The random bits are a counter-based hash of (the parameter's ``seed``, the step, the
  element's index in the parameter), so every backend, chunking and tiling gives the same bits; the seed is drawn from
  torch's generator when the state is made (a step's new states draw theirs together, in the step's parameter order:
  :func:`seeds_in_order`, so the seeds do not depend on the order the backends or paged batches make the states in)
  and kept in the state (``bf16_update.seed``, an int), so a resumed run rounds as the uninterrupted one.
* ``"kahan"``: a compensation buffer ``bf16_update.kahan`` (in the parameter's dtype, shaped like ``p``: 2 bytes per
  element) keeps what rounding lost and adds it to the next update (as optimi's Kahan summation), in fp32; ``R`` is
  round to nearest even into the parameter's dtype::

      y = (p32 - p) + c;   p_new = R(p + y);   c = R(y - (p_new - p))   (0 if not finite)

  ``p32 - p = p * (decay - 1) + alpha * delta``: decoupled weight decay enters as part of the compensated update, so
  a decay too small to move ``p`` accumulates in ``c`` as the gradient's part does.

fp32 and float64 parameters need neither and ignore the option (a float64 parameter's step is float64, stored as
it is).

**The hash** (32-bit unsigned arithmetic, which torch int64 ops, C ``uint32_t`` and Triton ``uint32`` all reproduce)::

    mix(x)  = murmur3 fmix32: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    key     = mix(seed ^ mix(step * 0x9E3779B9 mod 2^32))          (once per parameter and step, on the host)
    r(i)    = mix((i mod 2^32) ^ key) >> 16                         (per element, i: its flat index; 16 bits)

Both dtypes use one rule: with ``u`` the ulp of the 16-bit grid at ``|p32|`` and ``f = |p32| / u - floor(|p32| / u)``
the fraction of the gap, ``|p32|`` rounds up iff ``floor(f * 2^16) + r(i) >= 2^16``; the sign is kept. Rounding up
then happens with probability ``floor(f * 2^16) / 2^16``, which is ``f`` exactly whenever ``f`` has at most 16
bits below ``u``.

**bf16** (8 exponent bits: no subnormal or overflow concern beyond fp32's own): the 16 bits below the ulp are the low
half of ``p32``'s pattern, so ``bf16 = (bits(p32) + r(i)) >> 16`` (NaN: ``0x7FC0``). Exact for every fp32 input. Inf
stays Inf, a finite value never becomes NaN; a value above the largest bf16 may round up to Inf (with the
probability of its distance to it, as the unbiased rounding of a value in that last gap must).

**fp16** (5 exponent bits, 10 mantissa bits; normal from 2^-14 = 6.1e-5 to 65504, subnormals multiples of 2^-24),
on ``a = |p32|`` with fp32 pattern ``b``:

* normal range, ``2^-14 <= a <= 65504``: the ulp is ``2^(e - 10)``, 13 bits of ``b`` lie below it, and
  ``floor(f * 2^16) + r >= 2^16`` is ``low13(b) + (r >> 3) >= 2^13``, so
  ``h = ((b + (r >> 3)) >> 13) - (112 << 10)`` (fp32's exponent bias 127 less fp16's 15, at fp16's exponent
  position). A carry into the exponent is the next binade's first value, as it must be. Exactly unbiased.
* subnormal range, ``a < 2^-14``: the ulp is ``2^-24``; ``t = floor(a * 2^40)`` (exact in fp32, then truncated to an
  integer: ``t < 2^26``) holds ``a`` in units of ``2^-40``, ``h = (t + r) >> 16``: the subnormal's pattern, or
  ``0x0400`` (2^-14, the least normal) for a carry. ``f`` of a subnormal result has up to 23 significant bits below
  the ulp (more for fp32 values below 2^-24); those past the 16th are dropped, so rounding up is less likely than
  ``f`` by less than ``2^-16`` of the ulp: a bias toward zero of under ``2^-40`` (9.1e-13) in absolute value, per
  rounding. Values below ``2^-40`` always round to 0 (they would round up with probability under ``2^-16``). Small
  updates to small fp16 weights therefore survive in expectation down to that floor, where round to nearest drops
  everything below ``2^-25``.
* past 65504 (and Inf, NaN): round to nearest, as a cast does: ``65504 < a < 65520`` gives 65504, ``a >= 65520``
  gives Inf, NaN gives NaN. Rounding stochastically toward the next grid point above 65504 (``2^16``, which fp16
  cannot hold) would turn a weight just past the largest finite fp16 into Inf with probability ``(a - 65504) / 32``;
  the cast's rule keeps finite every value that round to nearest keeps finite. This is the one place fp16
  stochastic rounding is biased (toward zero, by under 16 for values round to nearest keeps at 65504).

The Kahan buffer of an fp16 parameter is fp16 too. ``c`` is the last rounding's error, at most half an ulp of ``p``,
so it fits fp16's range whenever ``p`` does; fp16's 11 significant bits hold it to ``2^-12`` relative where
``c >= 2^-14``. Below that ``c`` is a subnormal, held to ``2^-25`` absolute (half its ulp): a parameter near 0.01
(ulp 2^-17) keeps its compensation to 6 bits, and an update of size ``d`` per step is carried to within
``2^-25 / d`` relative (under 1% for ``d >= 3e-6``). fp32 would hold it exactly for 2 more bytes per parameter; fp16
is enough in practice: fine-tuning the byte MLP with fp16 weights at lr 1e-5 (``bench/bf16_update.py --dtype fp16
--lr 1e-5``), Kahan's held-out loss equals the fp32-weights run's to 4 digits (1.8669), where round to nearest ends
1.3% above it.

Indices are taken mod 2^32, so a parameter of more than 4G elements reuses its stream once per 4G elements. ``i`` is
the element's index in the *whole* parameter: an FSDP2 / tensor-parallel shard hashes its elements' global indices
(:meth:`lowmemopt.distributed.reduction.Reduction.element_index`), and the seed is made the same on every rank that
holds a part or a copy of the parameter (the largest of the ranks' draws), so a sharded run rounds exactly as the
one-process run with that seed, and replicas (HSDP) stay identical. (A strided shard, FSDP2 over tensor parallelism,
hashes its local indices.)
"""

from __future__ import annotations

import contextvars
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

__all__ = ["MODES", "DTYPES", "SEED", "KAHAN", "check_mode", "applied", "init_state", "seeds_in_order", "step_key",
           "random_bits", "stochastic_round", "kahan_round", "store", "split_state"]

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
    """The stochastic-rounding seeds of one step (:func:`seeds_in_order`): at the first one asked for, one draw per
    tensor of ``pending()`` (the step's tensors that need a seed then, in the step's order), handed out by the
    tensor's address."""

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
    """Within a step: the seeds :func:`init_state` gives new stochastic-rounding states are drawn from torch's
    generator together, in the order of ``pending()`` (called once, at the first seed needed: the step's tensors, in
    its parameter order, whose state has no seed yet), whatever order the backends and paged batches make the states
    in, so that every parameter gets the seed it would get in any other run of the same step (paged or not)."""
    token = _SEEDS.set(_Seeds(pending))
    try:
        yield
    finally:
        _SEEDS.reset(token)


def init_state(state: dict[str, Any], p: torch.Tensor, mode: str,
               agree: Callable[[int], int] | None = None) -> dict[str, Any]:
    """Add what ``p``'s rounding needs to its state, if missing (``mode``: the ``bf16_update`` setting, applied as
    :func:`applied` says): the stochastic seed (an int from torch's default
    generator, in the step's parameter order within :func:`seeds_in_order`; none drawn for a meta tensor, the paging
    layout probe) or the zeroed Kahan buffer (``p``'s dtype).
    ``agree``: makes a new seed the same on every rank that holds part of the parameter (a collective: every such rank
    calls it)."""
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


def stochastic_round(p32: torch.Tensor, key: int, lo: int | torch.Tensor = 0,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``p32`` (fp32, flat elements ``lo ..`` of their parameter, or those at the flat indices ``lo`` holds) rounded
    stochastically to ``dtype`` (bfloat16 or float16; the rules in the module docstring)."""
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
    """fp16 patterns (int64 in [0, 65536)) of fp32 ``x`` (flat; ``bits``: its patterns as int64) rounded with the
    16 random bits ``r``: normal, subnormal and past-65504 cases of the module docstring."""
    mag = bits & 0x7FFFFFFF
    normal = ((mag + (r >> 3)) >> 13) - (112 << 10)
    small = mag.clamp(max=F16_MIN_NORMAL).to(torch.int32).view(torch.float32)  # the subnormal lanes' |x|
    subnormal = ((small * 2.0 ** 40).to(torch.int64) + r) >> 16  # a < 2^-14: a * 2^40 < 2^26, exact
    out = torch.where(mag < F16_MIN_NORMAL, subnormal, normal) | ((bits >> 16) & 0x8000)
    nearest = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return torch.where(mag > F16_MAX, nearest, out)  # past 65504, Inf, NaN: as the cast rounds


def kahan_round(p: torch.Tensor, p32: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One compensated write: ``p`` (the old bf16 / fp16 parameter), ``p32`` (the fp32 result), ``c`` (the buffer) ->
    ``(new p, new c)``, both in ``p``'s dtype (see the module docstring)."""
    old = p.float()
    y = (p32 - old) + c.float()
    new = (old + y).to(p.dtype)
    comp = y - (new.float() - old)
    comp = torch.where(torch.isfinite(comp), comp, 0.0)
    return new, comp.to(p.dtype)


def store(dst: torch.Tensor, p32: torch.Tensor, state: dict[str, Any], mode: str, lo: int = 0,
          index: int | torch.Tensor | None = None) -> None:
    """Write the fp32 result ``p32`` into ``dst`` (elements ``lo ..`` of the flat tensor whose state is ``state``, in
    the same shape as ``p32``), rounded as ``mode`` (the ``bf16_update`` setting) says. ``state["step"]`` is this
    step's.
    ``index``: where those elements sit in the whole parameter when the tensor is a shard of it (the stochastic
    hash's counter: a first flat index, or one per element; see
    :meth:`lowmemopt.distributed.reduction.Reduction.element_index`); by default ``lo``."""
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
        c = state[KAHAN].view(-1)[lo:lo + dst.numel()].view(dst.shape)
        new, comp = kahan_round(dst, p32, c)
        dst.copy_(new)
        c.copy_(comp)
