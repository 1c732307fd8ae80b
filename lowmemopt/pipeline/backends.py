"""The per-tensor backends of the update stage (:func:`step_per_tensor`), each item by the first that applies:
the native C kernel (CPU; :mod:`lowmemopt.cpu`), the ``torch.compile``-d chunks (:mod:`lowmemopt.compiled`), then the
eager reference (decode -> :meth:`Algorithm.update` in fp32 -> encode, in block-aligned chunks), all with the eager
results; and state creation (:func:`init_state`). A backend reads the bucket's record, never a param group."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .. import compiled, cpu, rounding
from ..distributed.reduction import LOCAL, Reduction
from ..distributed.sharding import local_tensor
from ..quant import q4
from ..quant.formats import Q4, Q8, Slot, StateFormat, format_of, map_for, math_dtype
from ..quant.maps import code_book, encode_table
from ..work.items import Item, Update
from ..work.record import BucketRecord
from .algorithm import Algorithm
from .plan import unscaled

__all__ = [
    "CHUNK_NUMEL",
    "COMPILED_CHUNK_NUMEL",
    "init_state",
    "step_per_tensor",
    "update_flat",
    "update_checked",
    "update_rest",
    "run_update",
    "decode_whole",
]

#: elements per chunk of the eager path and of GaLore's CPU row blocks (1 MiB of fp32 per temporary)
CHUNK_NUMEL = 1 << 18
COMPILED_CHUNK_NUMEL = 1 << 20  # compiled path: bigger chunks, fewer calls (each call checks guards)


def init_state(
    p: torch.Tensor,
    record: BucketRecord,
    slots: dict[str, Slot],
    state: dict[str, Any],
    numel: int | None = None,
    reduce: Reduction = LOCAL,
) -> dict[str, Any]:
    """Zero state for ``p`` (a DTensor's local shard) in ``slots``' formats, picked by the whole ``numel``."""
    state["step"] = 0
    for name, slot in slots.items():
        shape = p.shape if slot.shape is None else torch.Size(slot.shape)
        size = (numel if numel is not None else p.numel()) if slot.shape is None else shape.numel()
        fmt = record.format_for(slot, size, p.dtype)
        fmt.init(state, name, shape, p.device, record.block_size)
    rounding.init_state(state, local_tensor(p), record.rounding, reduce.agree)  # bf16_update: a seed or a Kahan buffer
    return state


def step_per_tensor(
    algorithm: Algorithm,
    items: Sequence[Item],
    update_for: Callable[[Item, Any], Update],
    grad_mult: Callable[[torch.device], torch.Tensor | None] | None = None,
    scans: Sequence[torch.Tensor | None] | None = None,
    check: bool = False,
) -> list[bool | None]:
    """Step every item (full-rank, initialized) through the per-tensor backends, one tensor at a time.
    ``update_for(item, step)``: its :class:`~lowmemopt.work.items.Update`; ``scans[k]``: another gradient item ``k``'s
    kernel checks; ``check``: items the native factored step that checks its own gradient did not take, each gradient
    checked first (:func:`update_checked`). Returns one result per item (a check's, or whether it stepped).
    """
    out: list[bool | None] = []
    for k, it in enumerate(items):
        state = it.state
        up = update_for(it, state["step"])
        target, mult = it.target, None if grad_mult is None else grad_mult(it.grad.device)
        if check:
            out.append(
                update_checked(
                    algorithm,
                    target,
                    target.view(-1),
                    it.grad.reshape(-1),
                    state,
                    it.slots,
                    up.record,
                    up.step,
                    up.decay,
                    mult,
                )
            )
        else:
            out.append(
                update_flat(
                    algorithm,
                    target,
                    target.view(-1),
                    it.grad.reshape(-1),
                    state,
                    it.slots,
                    up.record,
                    up.step,
                    up.decay,
                    it.reduce or LOCAL,
                    None if scans is None else scans[k],
                    mult,
                    up.kwargs,
                )
            )
    return out


def update_flat(
    algorithm: Algorithm,
    like: torch.Tensor,
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Slot],
    record: BucketRecord,
    step: int,
    decay: float,
    reduce: Reduction = LOCAL,
    scan: torch.Tensor | None = None,
    mult: torch.Tensor | None = None,
    kwargs: dict[str, Any] | None = None,
) -> bool | None:
    """``pflat <- pflat * decay + delta`` with the state decoded and encoded around the math: native (CPU), compiled, or
    eager for what they leave. ``scan``: a gradient to check meanwhile (returns its result); ``mult``: loss scaling.
    """
    formats = {name: format_of(state, name) for name in slots}
    start, scanned = 0, None
    if pflat.device.type == "cpu" and cpu.ENABLED:  # native C kernels (lowmemopt.cpu)
        kernels = algorithm.kernels
        host = None if mult is None else mult.tolist()  # (a CPU tensor: read directly, no device to wait for)
        if kernels is None or kernels.native is None:
            pass
        elif algorithm.elementwise:  # (a shard's stochastic rounding hashes its elements' indices in the parameter)
            if kwargs is None:
                kwargs = algorithm.math_kwargs(record.hyper, step)
            start, scanned = cpu.step_elementwise(
                kernels.native,
                kwargs,
                pflat,
                gflat,
                state,
                slots,
                formats,
                record,
                step,
                decay,
                scan,
                index_base=reduce.flat_offset() if reduce.distributed else 0,
                grad_mult=host,
            )
        elif reduce is LOCAL and cpu.step_factored(
            kernels.native, like, pflat, gflat, state, record, step, decay, grad_mult=host
        ):
            start = pflat.numel()
    exact = record.rounding_of(like) == "nearest"  # the compiled path rounds to nearest only
    if start == 0 and exact and algorithm.elementwise and algorithm.math is not None and compiled.applies(like):
        start = _step_compiled(algorithm, pflat, gflat, state, slots, formats, record, step, decay, mult, kwargs)
    _step_eager(algorithm, like, pflat, gflat, state, slots, formats, record, step, decay, start, reduce, mult)
    return scanned


def update_checked(
    algorithm: Algorithm,
    like: torch.Tensor,
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Slot],
    record: BucketRecord,
    step: int,
    decay: float,
    mult: torch.Tensor | None = None,
) -> bool:
    """The eager reference of an unsharded CPU parameter whose native factored step, the one that checks its own
    gradient, does not take it (:func:`lowmemopt.cpu.factored.step_bucket`): ``gflat`` checked first; returns whether
    it stepped (what :func:`update_flat` does then: a factored algorithm has no compiled path)."""
    ok = cpu.grad_is_finite(gflat)
    if ok is None:  # (not a tensor the native check reads)
        from .finite import host_flags

        ok = host_flags([gflat])[0]
    if ok:
        formats = {name: format_of(state, name) for name in slots}
        _step_eager(algorithm, like, pflat, gflat, state, slots, formats, record, step, decay, 0, LOCAL, mult)
    return ok


def update_rest(
    algorithm: Algorithm,
    p: torch.Tensor,
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Slot],
    formats: dict[str, StateFormat],
    record: BucketRecord,
    step: int,
    decay: float,
    start: int,
    reduce: Reduction = LOCAL,
    mult: torch.Tensor | None = None,
) -> None:
    """Elements ``[start, numel)`` through the eager reference (a ragged last block a native kernel left)."""
    _step_eager(algorithm, p, pflat, gflat, state, slots, formats, record, step, decay, start, reduce, mult)


def _step_eager(
    algorithm: Algorithm,
    p: torch.Tensor,
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Slot],
    formats: dict[str, StateFormat],
    record: BucketRecord,
    step: int,
    decay: float,
    start: int,
    reduce: Reduction = LOCAL,
    mult: torch.Tensor | None = None,
) -> None:
    """Decode -> math -> encode over ``[start, numel)`` in block-aligned chunks (whole tensor if not elementwise); a
    sharded step runs its math even on an empty shard, for the other shards' reductions.
    """
    bs = record.block_size
    n = pflat.numel()
    chunk = max(bs, (CHUNK_NUMEL // bs) * bs) if algorithm.elementwise else max(n, 1)
    stop = 1 if n == 0 and reduce.distributed and not algorithm.elementwise else n
    mode = record.rounding_of(pflat)
    wide = math_dtype(pflat.dtype)
    for lo in range(start, stop, chunk):
        hi = min(n, lo + chunk)
        p32 = pflat[lo:hi].to(wide)  # (fp32 / float64 parameters: a view, updated in place)
        g32 = unscaled(gflat[lo:hi], mult)
        like = None
        if not algorithm.elementwise:
            p32, g32, like = p32.view(p.shape), g32.view(p.shape), p
        delta, alpha = run_update(algorithm, p32, g32, state, slots, formats, record, step, lo, hi, like, reduce)
        algorithm.apply_update(p32, delta, alpha, decay, record.hyper)
        # bf16: nearest / stochastic / Kahan; a shard's stochastic bits are its elements' in the whole parameter
        index = reduce.element_index(lo, hi - lo, p32.device) if reduce.distributed and mode == "stochastic" else None
        rounding.store(pflat[lo:hi], p32.view(-1), state, mode, lo, index)


def run_update(
    algorithm: Algorithm,
    p32: torch.Tensor,
    g32: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Slot],
    formats: dict[str, StateFormat],
    record: BucketRecord,
    step: int,
    lo: int,
    hi: int,
    like: torch.Tensor | None = None,
    reduce: Reduction = LOCAL,
) -> tuple[torch.Tensor, Any]:
    """Decode -> :meth:`Algorithm.update` -> encode over ``[lo, hi)`` or whole slots; returns ``(delta, alpha)``."""
    bs = record.block_size
    if like is None:
        st = {k: formats[k].decode(state, k, lo, hi, s.signed, bs) for k, s in slots.items()}
    else:
        st = {k: decode_whole(state, k, s, formats[k], like, bs) for k, s in slots.items()}
    if p32.dtype == torch.float64:  # (a float64 parameter's 16/8/4-bit state: decoded to float64 for the math)
        st = {k: v.double() for k, v in st.items()}
    delta = algorithm.update(p32, g32, st, record.hyper, step, **({} if reduce is LOCAL else {"reduce": reduce}))
    delta, alpha = delta if isinstance(delta, tuple) else (delta, 1.0)
    for k, s in slots.items():
        value = st[k].reshape(-1)
        formats[k].encode(state, k, lo, lo + value.numel(), value, s.signed, bs)
    return delta, alpha


def _step_compiled(
    algorithm: Algorithm,
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Slot],
    formats: dict[str, StateFormat],
    record: BucketRecord,
    step: int,
    decay: float,
    mult: torch.Tensor | None = None,
    kwargs: dict[str, Any] | None = None,
) -> int:
    """The fused fast path (:mod:`lowmemopt.compiled`) over the full blocks; returns how many elements it did."""
    bs = record.block_size
    rows_total = pflat.numel() // bs
    rows_per_chunk = max(1, COMPILED_CHUNK_NUMEL // bs)
    for r0 in range(0, rows_total, rows_per_chunk):
        r1 = min(rows_total, r0 + rows_per_chunk)
        lo, hi = r0 * bs, r1 * bs
        rows = []
        for k, s in slots.items():
            fmt = formats[k]
            if fmt is Q8:
                name = map_for(s.signed)
                rows.append(
                    (
                        k,
                        "q8",
                        s.signed,
                        state[k + ".codes"][lo:hi].view(-1, bs),
                        state[k + ".absmax"][r0:r1],
                        code_book(name, pflat.device),
                        encode_table(name, pflat.device).packed,
                    )
                )
            elif fmt is Q4:  # nibble rows: a block of bs elements is bs / 2 bytes
                name = q4.map4_for(s.signed)
                rows.append(
                    (
                        k,
                        "q4",
                        s.signed,
                        state[k + ".nibbles"][lo // 2 : hi // 2].view(-1, bs // 2),
                        state[k + ".absmax"][r0:r1],
                        q4.code_book(name, pflat.device),
                        q4.encode_table(name, pflat.device),
                    )
                )
            else:
                rows.append((k, fmt.name, s.signed, state[k].view(-1)[lo:hi].view(-1, bs), None, None, None))
        ok = compiled.step_rows(
            type(algorithm).math,
            pflat[lo:hi].view(-1, bs),
            gflat[lo:hi].view(-1, bs),
            tuple(rows),
            algorithm.math_kwargs(record.hyper, step) if kwargs is None else kwargs,
            decay,
            mult,
        )
        if not ok:
            return lo
    return rows_total * bs


def decode_whole(
    state: dict[str, Any], name: str, slot: Slot, fmt: StateFormat, p: torch.Tensor, bs: int
) -> torch.Tensor:
    """Slot ``name`` decoded whole, in its declared shape (``p``'s for slots without one)."""
    shape = p.shape if slot.shape is None else torch.Size(slot.shape)
    return fmt.decode(state, name, 0, shape.numel(), slot.signed, bs).view(shape)
