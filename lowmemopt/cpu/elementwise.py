"""Native kernels for the elementwise algorithms: which C function implements which ``math``, and how its
hyper-parameters are passed.

Each entry maps an algorithm's name (``"adam"``, ``"lion"``, ``"sgd"``, ``"signsgd"``: what the optimizer declares
on its pure fp32 math, :func:`lowmemopt.optimizer.algorithm`) to its fused kernel in ``kernels.c`` (SignSGD: the SGD
kernel with its sign flag) and to a function that turns the math's keyword arguments (the group's hyper-parameters
plus the algorithm's ``step_scalars``) into the kernel's scalars. Scalars are computed here with the same Python
expressions the math uses (``-lr / bias_correction1``, ``1 - beta1``, ...) and cast to float in C, as torch casts
Python scalars, so the kernel's results equal the eager path's. A tensor hyper-parameter (a 0-dim ``lr``) is not
taken: the torch paths run.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .. import rounding
from ..quant import q4
from ..quant.formats import BF16, FP32, Q4, Q8, StateFormat
from . import applies, build, ffi

__all__ = ["KERNELS", "Kernel", "step"]

#: rows of this many elements for fp32 / bf16 state (any size works; q8 / q4 rows are the quantization blocks); the
#: kernel also does the last partial row, so every element of a parameter takes the same arithmetic (a sharded
#: parameter's local shards step exactly as the whole one)
DENSE_ROW = 64


class Kernel(NamedTuple):
    name: str  # exported C function
    scalars: Callable[[dict[str, Any], float], tuple[tuple[float, ...], int]]  # (math kwargs, decay) -> (h, flags)
    slots: Callable[[dict[str, Any]], tuple[str, ...]]  # the slots, in the kernel's order


def _adam(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    beta1, beta2 = kw["betas"]
    l2 = kw["weight_decay"] if kw["weight_decay"] != 0 and not kw["decoupled_weight_decay"] else 0.0
    h = (l2, 1 - beta1, beta2, 1 - beta2, kw["bias_correction2_sqrt"], kw["eps"], -kw["lr"] / kw["bias_correction1"],
         decay)
    return h, int(bool(kw["maximize"])) | int(bool(kw["amsgrad"])) << 1


def _lion(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    beta1, beta2 = kw["betas"]
    return (beta1, 1 - beta1, beta2, 1 - beta2, -kw["lr"], decay), 0


def _sgd(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    flags = (int(bool(kw["maximize"])) | int(bool(kw["nesterov"])) << 1 | int(bool(kw["first_step"])) << 2
             | int(kw["momentum"] != 0) << 3 | int(bool(kw.get("wd_after_momentum", False))) << 4)
    return (kw["weight_decay"], kw["momentum"], 1 - kw["dampening"], -kw["lr"], decay), flags


def _signsgd(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    h, flags = _sgd(kw, decay)
    return h, flags | 32  # lmo_sgd's SignSGD flag: p += -lr sign(d)


def _sgd_slots(kw: dict[str, Any]) -> tuple[str, ...]:
    return ("momentum_buffer",) if kw["momentum"] != 0 else ()


KERNELS: dict[str, Kernel] = {
    "adam": Kernel("lmo_adam", _adam,
                      lambda kw: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kw["amsgrad"] else ())),
    "lion": Kernel("lmo_lion", _lion, lambda kw: ("exp_avg",)),
    "sgd": Kernel("lmo_sgd", _sgd, _sgd_slots),
    "signsgd": Kernel("lmo_sgd", _signsgd, _sgd_slots),
}


_SCALARS = (float, int, bool)


def _is_number(v: Any) -> bool:
    """A Python number, or a tuple / list of them (betas): what the kernels take as runtime scalars."""
    t = type(v)
    return t in _SCALARS or ((t is tuple or t is list) and all(type(x) in _SCALARS for x in v))


def step(algorithm: str | None, kwargs: dict[str, Any], pflat: torch.Tensor, gflat: torch.Tensor,
         state: dict[str, Any], slots: dict[str, Any], formats: dict[str, StateFormat], group: dict[str, Any],
         step: int, decay: float, scan: torch.Tensor | None = None,
         index_base: int | None = 0) -> tuple[int, bool | None]:
    """Run the fused kernel of ``algorithm`` (with the math's keyword arguments ``kwargs``; ``group``: the param
    group's storage options, ``step``: the step being taken) over the flat tensor
    ``pflat`` (contiguous; updated in place) with gradient ``gflat``, state slots decoded and encoded around it,
    ``p = p * decay + delta``: all of it for fp32 / bf16 state, the full blocks for 8- and 4-bit state (a ragged
    last block is the caller's, as on the eager path).

    ``scan``: another gradient (the next parameter's) whose finiteness the kernel checks in the same parallel loop
    (:func:`lowmemopt.cpu.ffi.scan_result`), its reads overlapping this kernel's arithmetic.

    ``index_base``: the flat index of ``pflat``'s first element in its whole parameter (a shard's offset), which
    stochastic rounding hashes; None: the elements are not one range of it (the kernel declines stochastic rounding).

    Returns ``(done, scanned)``: how many leading elements it did (0: the kernel does not apply here; the caller runs
    the rest), and whether ``scan`` is finite (None: not scanned)."""
    kernel = KERNELS.get(algorithm)
    if kernel is None or not applies(pflat) or gflat.device != pflat.device:
        return 0, None
    if pflat.dtype not in ffi.DTYPES or gflat.dtype not in ffi.DTYPES or not gflat.is_contiguous():
        return 0, None
    if not (all(map(_is_number, kwargs.values())) and _is_number(decay)):
        return 0, None
    names = kernel.slots(kwargs)
    if set(names) != set(slots):
        return 0, None
    kinds = {formats[k] for k in names}
    if len(kinds) > 1:
        return 0, None
    fmt = kinds.pop() if kinds else FP32
    quantized = fmt is Q8 or fmt is Q4
    if quantized:
        block_size = group["block_size"]
        rows, bs = pflat.numel() // block_size, block_size
        if not (16 <= bs <= ffi.MAX_BLOCK and bs % 16 == 0):
            return 0, None
    elif fmt in (FP32, BF16):
        rows, bs = pflat.numel() // DENSE_ROW, DENSE_ROW
    else:
        return 0, None
    tail = pflat.numel() - rows * bs if not quantized else 0
    if rows == 0 and tail == 0:
        return 0, None
    cslots = []
    for k in names:
        signed = slots[k].signed
        if fmt is Q8:
            codes, absmax = state[k + ".codes"], state[k + ".absmax"]
            if not (codes.is_contiguous() and absmax.is_contiguous() and absmax.dtype == torch.float32):
                return 0, None
            cslots.append(ffi.slot_q8(codes, absmax, signed))
        elif fmt is Q4:
            nibbles, absmax = state[k + ".nibbles"], state[k + ".absmax"]
            if not (nibbles.is_contiguous() and nibbles.dtype == torch.uint8 and absmax.is_contiguous()
                    and absmax.dtype == torch.float32 and nibbles.numel() >= q4.packed_len(rows * bs)
                    and absmax.numel() >= rows):
                return 0, None
            cslots.append(ffi.slot_q4(nibbles, absmax, signed))
        else:
            t = state[k]
            if not t.is_contiguous() or t.dtype != (torch.float32 if fmt is FP32 else torch.bfloat16):
                return 0, None
            cslots.append(ffi.slot_dense(t))
    h, flags = kernel.scalars(kwargs, decay)
    if scan is not None and not ffi.can_scan(scan):
        scan = None
    args = ffi.args_for(pflat, gflat, rows, bs, cslots, h, flags, tail, scan)
    mode = rounding.mode_of(group, pflat)  # bf16 / fp16 parameters: nearest / stochastic / Kahan, as the eager path
    if mode != "nearest":
        rounding.init_state(state, pflat, group)
        kahan = state.get(rounding.KAHAN) if mode == "kahan" else None
        if kahan is not None and not (kahan.is_contiguous() and kahan.dtype == pflat.dtype
                                      and kahan.numel() == pflat.numel() and kahan.device == pflat.device):
            return 0, None
        if mode == "stochastic" and index_base is None:
            return 0, None
        key = rounding.step_key(state[rounding.SEED], step) if mode == "stochastic" else 0
        ffi.set_update(args, mode, key, index_base or 0, kahan)
    ffi.call(getattr(build.library(), kernel.name), args)
    return rows * bs + tail, (None if scan is None else ffi.scan_result(args))
