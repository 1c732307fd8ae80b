"""The update stage's CPU bucket: many CPU parameters of one elementwise algorithm stepped by one call of its fused C
kernel (:func:`lowmemopt.cpu.elementwise.step_many`).

Stepping the parameters one call at a time costs, per parameter, a fork/join of the kernel's threads (on a busy
machine, a wait for the slowest thread) and the Python around the call; one call per bucket costs that once per step.
The bucket's non-finite gradient check is in the same call: each gradient that the optimizer left to the pipelined
check (``finite[i] is None``, :class:`~lowmemopt.pipeline.finite.CpuFiniteChecks`) is read while the parameter before
it is updated (the 8- and 4-bit kernels' arithmetic hides that read), and a parameter whose gradient is not finite is
left as it was: its step count advances before the call (the kernel's bias corrections
read it) and is put back after a skip. A parameter without state yet is checked before its state is made (a skip
makes none, as the up-front check leaves it).

An FSDP2 parameter (a DTensor; with ``CPUOffloadPolicy`` its shard is on the CPU) steps its local shard, as on the
per-parameter path. What the kernels do not take (GaLore groups, non-contiguous tensors, tensor hyper-parameters,
formats without a fused kernel) goes on to the per-parameter path, in order.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .. import cpu, rounding
from ..distributed.reduction import LOCAL
from ..distributed.sharding import local_view
from ..quant.formats import format_of
from ..work import Item, Update, capture
from ..work.items import LOW_RANK
from .algorithm import Algorithm
from .backends import init_state, update_rest
from .plan import Plan

__all__ = ["step_cpu_bucket", "step_native_bucket"]

#: per parameter: its kernel arguments from the last step and what they were made for (``sig`` in
#: :func:`step_cpu_bucket`: the state's tensors by address, the parameter, the storage options); a step whose
#: parameter matches refreshes only what changes per step (:func:`lowmemopt.cpu.elementwise.refresh`)
_ARGS: dict[int, tuple[weakref.ref, tuple, Any, int]] = {}  # id(param) -> (param, sig, args, done)


def _forget(key: int) -> Any:
    return lambda ref: _ARGS.pop(key, None) if _ARGS.get(key, (None,))[0] is ref else None


Todo = list[tuple[int, torch.Tensor, dict[str, Any]]]


def takes(plan: Plan) -> bool:
    """Does a native many-parameter kernel implement ``plan``'s algorithm here?"""
    kernels = plan.kernels  # (the algorithm's)
    if not (cpu.ENABLED and plan.algorithm.elementwise and kernels is not None):
        return False
    from ..cpu.elementwise import NativeKernel

    return isinstance(kernels.native, NativeKernel) and cpu.available()


def step_cpu_bucket(plan: Plan, todo: Todo, finite: list[bool | None]) -> Todo:
    """Step the CPU parameters of ``todo`` ((index, param, group)) that the native kernels take, in one call; fill in
    ``finite`` for the ones checked here; return the rest, in order, for the per-parameter path. The gather stage
    (here: items, state made, step counts advanced) and the update (:func:`step_native_bucket`, which reads the items
    and their :class:`~lowmemopt.work.items.Update` only)."""
    if not todo or not takes(plan):
        return todo
    algorithm, states, sharded = plan.algorithm, plan.state, plan.sharded
    rest: Todo = []
    items: list[Item] = []
    index: list[int] = []
    last = record = None
    slots_of: dict = {}  # (shape, dtype) -> the slots, in the group of the parameters at hand
    for i, p, group in todo:
        if group is not last:  # (a group's parameters come together)
            last, record = group, plan.record_of(group)
            slots_of.clear()
        grad = p.grad
        if p.device.type != "cpu" or record.rank is not None or grad is None:
            rest.append((i, p, group))
            continue
        numel = p.numel()  # a DTensor's whole size: it picks the state format
        reduce = LOCAL
        if sharded:  # a DTensor (FSDP2) steps its local shard
            local, grad, reduce = local_view(p, grad)
        else:
            local = p
        if not (local.is_contiguous() and grad.is_contiguous() and grad.shape == local.shape):
            rest.append((i, p, group))
            continue
        state = states[p]
        if LOW_RANK in state:
            rest.append((i, p, group))
            continue
        slots = slots_of.get((local.shape, local.dtype))
        if slots is None:
            slots = slots_of[local.shape, local.dtype] = plan.slots_of(record, local)
        if "step" not in state:
            if finite[i] is None:  # checked before its state is made (a skip makes none, and draws no seed)
                finite[i] = cpu.grad_is_finite(grad)
                if finite[i] is None:
                    rest.append((i, p, group))
                    continue
                if not finite[i]:
                    continue
            init_state(local, record, slots, state, numel=numel, reduce=reduce)
        else:
            if type(state["step"]) is not int:  # a capturable step's count
                capture.host_count(state)
            if record.rounding != "nearest":  # bf16_update changed since: its state made for the whole tensor
                rounding.init_state(state, local, record.rounding, reduce.agree)  # (a shard's ranks agree on a seed)
        state["step"] += 1
        items.append(
            Item(
                param=p,
                group=group,
                target=local,
                grad=grad,
                state=state,
                slots=slots,
                record=record,
                index_base=reduce.flat_offset() if reduce.distributed else 0,
                reduce=reduce,
            )
        )
        index.append(i)
    if not items:
        return rest
    mult = None if plan.grad_mult is None else plan.mult
    results = step_native_bucket(algorithm, items, plan.update_of, [finite[i] is None for i in index], mult)
    left = set()
    for i, it, ok in zip(index, items, results):
        if ok is None:  # not taken: the per-parameter path steps it
            it.state["step"] -= 1
            left.add(i)
            continue
        finite[i] = ok
        if not ok:  # nothing of it was written (a fresh parameter was checked before)
            it.state["step"] -= 1
    if left:  # in the step's order
        left.update(i for i, _, _ in rest)
        rest = [t for t in todo if t[0] in left]
    return rest


def step_native_bucket(
    algorithm: Algorithm,
    items: list[Item],
    update_for: Callable[[Item, Any], Update],
    check: list[bool],
    grad_mult: Callable[[torch.device], torch.Tensor | None] | None = None,
) -> list[bool | None]:
    """The native bucket backend: step ``items`` (CPU, contiguous, initialized, step counts advanced) of
    ``algorithm`` by one call of its many-parameter kernel. ``update_for(item, step)``: the item's bucket's
    :class:`~lowmemopt.work.items.Update`; ``check[k]``: item ``k``'s gradient is checked for NaN/Inf in the same
    call; ``grad_mult``: loss scaling (device -> multiplier). Returns per item: True (stepped), False (its gradient
    was not finite: nothing written), None (the kernel does not take it: untouched, for the per-tensor backends)."""
    from ..cpu.elementwise import prepare, refresh_many, step_many

    kernel = algorithm.kernels.native
    name = kernel.name
    out: list[bool | None] = [None] * len(items)
    memo: dict = {}  # what prepare derives from the math's arguments alone (kept alive with them: ids stay unique)
    mult = host_mult = None  # loss scaling's multiplier (applied as g is loaded), read at the first item
    if grad_mult is not None and items:
        mult = grad_mult(torch.device("cpu"))
        host_mult = mult.tolist()
    up = rounds = None  # the last item's Update and (record, dtype, rounding): the next item's, mostly
    steps, kept, again = [], [], []  # per item: (up, pflat, gflat, scan, index_base, sig); kept arguments to refresh
    for k, it in enumerate(items):
        state, record, local = it.state, it.record, it.target
        step = state["step"]
        if up is None or up.record is not record or up.step != step:
            up = update_for(it, step)
        if rounds is None or rounds[0] is not record or rounds[1] is not local.dtype:
            rounds = (record, local.dtype, record.rounding_of(local))
        pflat, gflat = local.view(-1), it.grad.view(-1)
        scan = gflat if check[k] else None
        index_base = it.index_base or 0
        # the kernel arguments of this parameter's last step, made again only when what they point at changed
        sig = (
            name,
            id(state),
            tuple(state),
            *(v.data_ptr() for v in state.values() if type(v) is torch.Tensor),
            pflat.data_ptr(),
            pflat.dtype,
            pflat.numel(),
            gflat.dtype,
            record.block_size,
            rounds[2],
            index_base,
        )
        steps.append((up, pflat, gflat, scan, index_base, sig))
        p = it.param
        cached = _ARGS.get(id(p))
        if cached is not None and cached[0]() is p and cached[1] == sig:
            kept.append(k)
            again.append((cached[2], up.kwargs, gflat, state, it.slots, step, up.decay, scan))
    refreshed = dict(zip(kept, refresh_many(kernel, again, memo, host_mult)))
    batch, taken = [], []
    for k, it in enumerate(items):
        up, pflat, gflat, scan, index_base, sig = steps[k]
        p, state, slots = it.param, it.state, it.slots
        if refreshed.get(k):
            args, done = _ARGS[id(p)][2:]
        else:
            formats = {s: format_of(state, s) for s in slots}
            args, done = prepare(
                kernel,
                up.kwargs,
                pflat,
                gflat,
                state,
                slots,
                formats,
                it.record,
                state["step"],
                up.decay,
                scan=scan,
                index_base=index_base,
                memo=memo,
                grad_mult=host_mult,
            )
            if args is not None:
                _ARGS[id(p)] = (weakref.ref(p, _forget(id(p))), sig, args, done)
        if args is None or (check[k] and args.scan is None):  # the per-tensor backends take it
            continue
        batch.append(args)
        taken.append((k, done, up))
    if not batch:
        return out
    stepped = step_many(kernel, batch)
    for ok, (k, done, up) in zip(stepped, taken):
        out[k] = ok
        it = items[k]
        if ok and done < it.target.numel():  # a ragged last 8- / 4-bit block: the reference path, as after one call
            formats = {s: format_of(it.state, s) for s in it.slots}
            update_rest(
                algorithm,
                it.target,
                it.target.view(-1),
                it.grad.view(-1),
                it.state,
                it.slots,
                formats,
                up.record,
                up.step,
                up.decay,
                done,
                it.reduce or LOCAL,
                mult,
            )
    return out
