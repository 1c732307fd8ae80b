"""Native steps for the factored optimizers (Adafactor, CAME, AdafactorTorch) on large 2-D CPU parameters: one C call
(``lmo_adafactor_step``, ``lmo_came_step``) and one parallel region per parameter instead of the eager math's ten
full-size passes; optionally the non-finite check too (:func:`step` with ``check=True``). Equal to the eager path to
fp32 rounding (AdafactorTorch: bit for bit, its reductions in torch), independent of the thread count, for unsharded
parameters of :data:`MIN_NUMEL` elements or more (:data:`QUANT_MIN_NUMEL` with a quantized first moment). Passes,
bytes and sums:
``docs/cpu_kernels.md#the-factored-steps-one-call-one-parallel-region``.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Callable, NamedTuple

import torch

from ..work.items import Item, Update
from ..work.record import BucketRecord
from . import build, ffi

__all__ = [
    "ADAFACTOR",
    "ADAFACTOR_TORCH",
    "CAME",
    "FactoredStep",
    "MIN_NUMEL",
    "NOT_APPLIED",
    "SKIPPED",
    "STEPPED",
    "step",
    "step_bucket",
]

MIN_NUMEL = 1 << 16
#: the size from which a 2-D parameter with quantized state (an 8- or 4-bit first moment) takes this path: its steps
#: are held to 8-bit error bounds, not to a reference's bits, and below MIN_NUMEL the eager path's ~20 torch calls per
#: matrix dominated a small model's step (the demo's LLaMA: CAME 8-bit 2.96x AdamW 8-bit's step, 1.40x from here)
QUANT_MIN_NUMEL = 1 << 12
NSEG = 16  # LMO_NSEG
CHECK = 4  # lmo_fact.flags: the step checks its gradient in pass 1

#: what :func:`step` did: nothing (the caller runs the eager path; state untouched), the step, or (``check=True``)
#: nothing because the gradient's fp32 sum of squares is not finite; (inside :func:`step_bucket`) left to its one call
NOT_APPLIED, STEPPED, SKIPPED, DEFERRED = 0, 1, 2, 3
#: a bucket's matrices below this many elements step one per thread in one call (``lmo_factored_steps``): a matrix's
#: own parallel region pays a wake-up at each pass's barrier, more than a second thread saves below ~1M elements
#: under ``OMP_WAIT_POLICY=PASSIVE`` (docs/cpu_kernels.md, "A busy machine")
ALONE_NUMEL = 1 << 20
KINDS = {"lmo_adafactor_step": 0, "lmo_came_step": 1}  # lmo_factored_steps' kinds


class Fact(ctypes.Structure):
    """Mirror of ``lmo_fact`` in ``csrc/lmo.h``."""

    _fields_ = [
        ("p", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("R", ctypes.c_int64),
        ("C", ctypes.c_int64),
        ("p_dtype", ctypes.c_int32),
        ("g_dtype", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
        ("bs", ctypes.c_int32),
        ("has_m", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("m", ffi.Slot),
        ("rf", ctypes.c_void_p),
        ("cf", ctypes.c_void_p),
        ("rf2", ctypes.c_void_p),
        ("cf2", ctypes.c_void_p),
        ("u", ctypes.c_void_p),
        ("vr", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("vr2", ctypes.c_void_p),
        ("vc2", ctypes.c_void_p),
        ("work", ctypes.c_void_p),
        ("result", ctypes.c_void_p),
        ("h", ctypes.c_double * 12),
        ("g_mult", ctypes.c_float),
    ]


def _library(memo: dict) -> Any:
    """The kernel library (None: not built), looked up once per ``memo`` (a :func:`step` or :func:`step_bucket`)."""
    lib = memo.get("library")
    if lib is None:
        lib = memo["library"] = build.library()
    return lib


class _Pass:
    """One parameter's argument struct and its small buffers: ``work`` (doubles) holds the kernels' per-segment sums
    (``NSEG * (C + 1)`` doubles) followed by ``scratch`` fp32 values (the factors a one-call step writes)."""

    def __init__(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        shape: torch.Size,
        m: ffi.Slot | None,
        bs: int,
        memo: dict,
        scratch: int = 0,
        grad_mult: float | None = None,
    ):
        rows, cols = shape
        self.lib = _library(memo)
        self.work = torch.empty(NSEG * (cols + 1) + (scratch + 1) // 2, dtype=torch.float64)
        self.f = f = Fact()
        f.p, f.g, f.R, f.C = p.data_ptr(), g.data_ptr(), rows, cols
        f.p_dtype, f.g_dtype, f.nthreads = ffi.DTYPES[p.dtype], ffi.DTYPES[g.dtype], torch.get_num_threads()
        f.bs, f.has_m = bs, m is not None
        if m is not None:
            f.m = m
        f.work = self.work.data_ptr()
        if grad_mult is not None:  # loss scaling: every pass reads g times it, rounded to g's dtype
            f.g_mult = grad_mult
        self.keep: list[torch.Tensor] = []  # tensors whose addresses the struct holds

    def call(self, name: str) -> None:
        """Call kernel ``name`` of the library on the struct."""
        fn = getattr(self.lib, name)
        rc = fn(ctypes.byref(self.f))
        if rc != 0:
            raise ffi.rejected(fn, rc)

    def set(self, **tensors: torch.Tensor) -> None:
        for k, t in tensors.items():
            t = t.contiguous()
            self.keep.append(t)
            setattr(self.f, k, t.data_ptr())

    def factors(self, *names: str) -> None:
        """Point the factors of approx_rsqrt that a one-call step writes (``rf``, ``rf2``: R floats; ``cf``,
        ``cf2``: C floats) into the scratch part of ``work`` (``scratch``: at least their total)."""
        addr = self.work.data_ptr() + 8 * NSEG * (int(self.f.C) + 1)
        for k in names:
            setattr(self.f, k, addr)
            addr += 4 * int(self.f.R if k.startswith("r") else self.f.C)

    def run_checked(self, name: str, check: bool, memo: dict | None = None) -> int:
        """Call step kernel ``name``; with ``check``, let its pass 1 check the gradient (:data:`SKIPPED`: it was not
        finite, and nothing was written). A matrix of fewer than :data:`ALONE_NUMEL` elements in a :func:`step_bucket`
        (``memo["deferred"]``) is :data:`DEFERRED` to that bucket's one call instead."""
        self.result = None
        if check:
            self.result = ctypes.c_double(0.0)
            self.f.result = ctypes.addressof(self.result)
            self.f.flags |= CHECK
        deferred = None if memo is None else memo.get("deferred")
        if deferred is not None and self.f.R * self.f.C < ALONE_NUMEL:
            deferred.append((self, name))
            return DEFERRED
        self.call(name)
        return self.outcome()

    def outcome(self) -> int:
        """:data:`STEPPED`, or :data:`SKIPPED` where the step's check found its gradient not finite."""
        return STEPPED if self.result is None or math.isfinite(self.result.value) else SKIPPED


def _slot(memo: dict, make: Callable[..., ffi.Slot], *tensors: Any) -> ffi.Slot:
    """``make(*tensors)`` (``ffi.slot_dense``, ``slot_q8``, ``slot_q4``): made once per ``memo`` and kind, then copied
    with the tensors' addresses (the code book's tables are the same for every parameter)."""
    key = (make, tensors[0].dtype)
    made = memo.get(key)
    if made is None:
        made = memo[key] = make(*tensors)
        return made
    slot = ffi.Slot.from_buffer_copy(made)
    slot.data = tensors[0].data_ptr()
    if slot.absmax:
        slot.absmax = tensors[1].data_ptr()
    return slot


def _momentum_slot(state: dict[str, Any], block_size: int, memo: dict) -> tuple[ffi.Slot, int, bool] | None:
    """The first moment as a kernel slot, the walk's block size and whether it is quantized (8- or 4-bit codes); None
    if its storage is not supported (a format without a native codec: the eager path steps it)."""
    for suffix, make in ((".codes", ffi.slot_q8), (".nibbles", ffi.slot_q4)):
        codes = state.get("exp_avg" + suffix)
        if codes is None:
            continue
        absmax = state["exp_avg.absmax"]
        if not (
            16 <= block_size <= ffi.MAX_BLOCK
            and block_size % 16 == 0
            and codes.is_contiguous()
            and absmax.is_contiguous()
            and absmax.dtype == torch.float32
        ):
            return None
        return _slot(memo, make, codes, absmax, True), block_size, True
    t = state["exp_avg"]
    if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous():
        return None
    return _slot(memo, ffi.slot_dense, t), 16, False


def _fits(p, pflat, gflat, state, record: BucketRecord, quantized: bool, memo: dict) -> bool:
    """Do the native passes take this parameter (``quantized``: its first moment is 8- or 4-bit)?"""
    if p.dim() != 2 or p.numel() < (min(QUANT_MIN_NUMEL, MIN_NUMEL) if quantized else MIN_NUMEL) or p.shape[1] % 16:
        return False
    if pflat.device.type != "cpu" or pflat.dtype not in ffi.DTYPES or gflat.dtype not in ffi.DTYPES:
        return False
    if gflat.device != pflat.device or not gflat.is_contiguous() or _library(memo) is None:
        return False
    if record.rounding != "nearest" and record.rounding_of(pflat) != "nearest":  # bf16_update: nearest only here
        return False
    stats = [state[k] for k in state if k.endswith(("_row", "_col", "_var"))]
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in stats):
        return False
    return not isinstance(record.hyper.get("lr"), torch.Tensor)


def _adafactor(p, pflat, gflat, state, record, step, decay, weight, grad_mult, check, memo) -> int:
    hyper = record.hyper
    if decay != 1.0 or "exp_avg_sq_row" not in state:  # (its weight decay is part of the math)
        return NOT_APPLIED
    eps1, eps2 = hyper["eps"]
    m = None
    if hyper["beta1"] is not None:
        m = _momentum_slot(state, record.block_size, memo)
        if m is None:
            return NOT_APPLIED
    if not _fits(p, pflat, gflat, state, record, m is not None and m[2], memo):
        return NOT_APPLIED
    rho = hyper["lr"]
    if hyper["relative_step"]:
        rho = min(1e-6 * step if hyper["warmup_init"] else 1e-2, 1.0 / math.sqrt(step))
    alpha = rho
    if hyper["scale_parameter"] and weight is not None:  # (else the kernel takes RMS(p) in its first pass)
        alpha = weight.clamp(min=eps2) * rho
    beta2t = 1.0 - math.pow(step, hyper["decay_rate"])

    run = _Pass(pflat, gflat, p.shape, m[0] if m else None, m[1] if m else 16, memo, sum(p.shape), grad_mult)
    run.set(vr=state["exp_avg_sq_row"], vc=state["exp_avg_sq_col"])
    run.factors("rf", "cf")
    f, wd = run.f, hyper["weight_decay"]
    f.h[0], f.h[1], f.h[5], f.h[7] = eps1, beta2t, hyper["clip_threshold"], eps2
    if hyper["beta1"] is not None:
        f.h[2], f.h[3] = hyper["beta1"], 1 - hyper["beta1"]
    if hyper["scale_parameter"] and weight is None:  # RMS(p) from the kernel's first pass
        f.flags, f.h[4], f.h[6] = 2, -wd, rho
    else:
        f.h[4], f.h[6] = float(-wd * alpha), float(alpha)
    if wd != 0:
        f.flags |= 1
    return run.run_checked("lmo_adafactor_step", check, memo)


def _came(p, pflat, gflat, state, record, step, decay, weight, grad_mult, check, memo) -> int:
    hyper = record.hyper
    if decay != 1.0 or "exp_avg_sq_row" not in state:
        return NOT_APPLIED
    m = _momentum_slot(state, record.block_size, memo)
    if m is None or not _fits(p, pflat, gflat, state, record, m[2], memo):
        return NOT_APPLIED
    eps1, eps2 = hyper["eps"]
    beta1, beta2, beta3 = hyper["betas"]
    lr = hyper["lr"]

    run = _Pass(pflat, gflat, p.shape, m[0], m[1], memo, 2 * sum(p.shape), grad_mult)
    run.set(
        vr=state["exp_avg_sq_row"],
        vc=state["exp_avg_sq_col"],
        vr2=state["exp_avg_res_row"],
        vc2=state["exp_avg_res_col"],
    )
    run.factors("rf", "cf", "rf2", "cf2")
    f = run.f
    f.h[0], f.h[1], f.h[2], f.h[3] = eps1, beta2, beta1, 1 - beta1
    f.h[5], f.h[6], f.h[7], f.h[8] = hyper["clip_threshold"], float(lr), eps2, beta3
    if hyper["weight_decay"] != 0:
        f.flags, f.h[4] = 1, float(-hyper["weight_decay"] * lr)
    return run.run_checked("lmo_came_step", check, memo)


def _adafactor_torch(p, pflat, gflat, state, record, step, decay, weight, grad_mult, check, memo) -> int:
    """torch.optim.Adafactor's step on a 2-D parameter, bit for bit (as
    :func:`~lowmemopt.optim.adafactor.adafactor_torch_math`): the reductions in torch, as the eager math and torch take
    them (RMS(p), the row / column norms of g, mean(row_var), RMS(u); the scalars from them in float64), and two C
    passes for the rest: ``u`` into a buffer, then ``p = fma(u, s, p decay)`` (CPU tensors: a read is no sync)."""
    hyper = record.hyper
    if "row_var" not in state or check:  # (its scalars are taken in torch between the calls: no check of its own)
        return NOT_APPLIED
    if not _fits(p, pflat, gflat, state, record, False, memo):
        return NOT_APPLIED
    rows, cols = p.shape
    eps1, eps2 = hyper["eps"]
    eps1 = torch.finfo(torch.float32).eps if eps1 is None else eps1
    rho = min(hyper["lr"], 1 / step**0.5)
    p32 = pflat.view(p.shape).float()  # (the eager math's fp32 working copy; fp32: pflat itself)
    rms = torch.linalg.vector_norm(p32).double() / p.numel() ** 0.5 if weight is None else weight.double()
    alpha = rms.clamp_(min=eps2) * rho
    g = gflat.view(p.shape).float()  # the eager math's fp32 gradient (lowmemopt.pipeline.plan.unscaled)
    if grad_mult is not None:
        g = g * grad_mult if gflat.dtype == torch.float32 else (g * grad_mult).to(gflat.dtype).float()

    one_minus_beta2_t = step ** hyper["beta2_decay"]
    row_var, col_var = state["row_var"], state["col_var"]  # [R, 1], [1, C]
    row_var.lerp_(torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_().div_(cols), one_minus_beta2_t)
    col_var.lerp_(torch.linalg.vector_norm(g, dim=-2, keepdim=True).square_().div_(rows), one_minus_beta2_t)
    u = torch.empty(p.shape, dtype=torch.float32)
    run = _Pass(pflat, g, p.shape, None, 16, memo)
    run.set(rf=row_var, cf=col_var, u=u)
    f = run.f
    f.h[0], f.h[1] = float(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)), eps1 * eps1
    run.call("lmo_adafactor_torch_u")
    denom = (torch.linalg.vector_norm(u).double() / (p.numel() ** 0.5 * hyper["d"])).clamp_(min=1.0)
    scale = float(alpha / denom)  # torch's -alpha / denom (its update is -u with maximize)
    f.h[2], f.h[3] = scale if hyper["maximize"] else -scale, float(decay)
    run.call("lmo_adafactor_torch_apply")
    return STEPPED


class FactoredStep(NamedTuple):
    """A factored algorithm's native step, as its module declares it (:class:`lowmemopt.work.kernel_set.KernelSet`):
    the function, and whether it can be its gradient's non-finite check (``check=True``)."""

    run: Callable[..., int]
    checks: bool


ADAFACTOR = FactoredStep(_adafactor, checks=True)
CAME = FactoredStep(_came, checks=True)
ADAFACTOR_TORCH = FactoredStep(_adafactor_torch, checks=False)


def step(
    native: FactoredStep | None,
    p: torch.Tensor,
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    record: BucketRecord,
    step: int,
    decay: float,
    weight: torch.Tensor | None = None,
    grad_mult: float | None = None,
    check: bool = False,
    memo: dict | None = None,
) -> int:
    """One native step ``native`` for parameter ``p`` (``pflat``: its contiguous flat storage, updated in
    place; ``record``: its bucket's options): :data:`STEPPED`, or :data:`NOT_APPLIED` (the caller runs the eager path;
    state is untouched then). ``weight``: a GaLore stand-in's full-weight RMS(p), read instead of ``p``'s
    (``lowmemopt.projection.update.weight_statistics``). ``grad_mult``: the loss scaling multiplier, applied wherever a
    pass loads the gradient (None: none). ``check``: the step is also the optimizer's non-finite check of ``gflat``
    (Adafactor, CAME): :data:`SKIPPED` if its fp32 sum of squares is not finite, with nothing written (AdafactorTorch:
    :data:`NOT_APPLIED`). ``memo``: what the parameters of one :func:`step_bucket` share."""
    if not isinstance(native, FactoredStep):
        return NOT_APPLIED
    return native.run(
        p, pflat, gflat, state, record, step, decay, weight, grad_mult, check, {} if memo is None else memo
    )


def step_bucket(
    native: FactoredStep, items: list[Item], update_for: Callable[[Item, Any], Update], grad_mult: float | None = None
) -> list[int]:
    """Step ``items`` (CPU, full rank, initialized) with ``native`` in order, each step its gradient's non-finite check
    (Adafactor, CAME), up to the first one it does not take; returns the outcome of each one stepped (:data:`STEPPED`:
    its step count advanced, or :data:`SKIPPED`: nothing written). ``update_for(item, step)``: the item's bucket's
    :class:`~lowmemopt.work.items.Update`, asked once per bucket and step count; ``grad_mult``: loss scaling. The
    library and the code books' kernel slots are looked up once per call."""
    deferred: list[tuple[_Pass, str]] = []
    memo: dict = {"deferred": deferred}
    out: list[int] = []
    waiting: list[tuple[int, dict, int]] = []  # (index in out, state, step count) of the deferred steps
    up = None
    for it in items:
        state, target = it.state, it.target
        count = state["step"] + 1
        if up is None or up.record is not it.record or up.step != count:
            up = update_for(it, count)
        flat, grad = target.view(-1), it.grad.reshape(-1)
        outcome = native.run(target, flat, grad, state, up.record, count, up.decay, None, grad_mult, True, memo)
        if outcome == NOT_APPLIED:
            break
        if outcome == DEFERRED:
            waiting.append((len(out), state, count))
        elif outcome == STEPPED:
            state["step"] = count
        out.append(outcome)
    if deferred:
        outcomes, error = _run_deferred(deferred)
        for (k, state, count), outcome in zip(waiting, outcomes):
            out[k] = outcome
            if outcome == STEPPED:
                state["step"] = count
        if error is not None:
            raise error
    return out


def _run_deferred(deferred: list[tuple[_Pass, str]]) -> tuple[list[int], RuntimeError | None]:
    """The deferred steps of a bucket in one ``lmo_factored_steps`` call (one alone: its own call, its threads):
    their outcomes in order, and the error of the first one the kernel refused (it wrote nothing; None: none)."""
    if len(deferred) == 1:
        run, name = deferred[0]
        run.call(name)
        return [run.outcome()], None
    n = len(deferred)
    lib = deferred[0][0].lib
    structs = (ctypes.POINTER(Fact) * n)(*(ctypes.pointer(run.f) for run, _ in deferred))
    kinds = (ctypes.c_int32 * n)(*(KINDS[name] for _, name in deferred))
    rcs = (ctypes.c_int32 * n)()
    fn = lib.lmo_factored_steps
    rc = fn(structs, kinds, rcs, ctypes.c_int64(n), ctypes.c_int32(torch.get_num_threads()))
    if rc != 0:
        raise ffi.rejected(fn, rc)
    outcomes = [run.outcome() if code == 0 else NOT_APPLIED for (run, _), code in zip(deferred, rcs)]
    refused = next((i for i, code in enumerate(rcs) if code != 0), None)
    error = None if refused is None else ffi.rejected(getattr(lib, deferred[refused][1]), rcs[refused])
    return outcomes, error
