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
from typing import Any

import torch

from .. import cpu, rounding
from ..distributed.sharding import local_view
from ..quant.formats import format_of
from ..work import capture
from .backends import init_state, update_rest
from .plan import Plan

__all__ = ["step_cpu_bucket"]

#: per parameter: its kernel arguments from the last step and what they were made for (``sig`` in
#: :func:`step_cpu_bucket`: the state's tensors by address, the parameter, the storage options); a step whose
#: parameter matches refreshes only what changes per step (:func:`lowmemopt.cpu.elementwise.refresh`)
_ARGS: dict[int, tuple[weakref.ref, tuple, Any, int]] = {}  # id(param) -> (param, sig, args, done)


def _forget(key: int) -> Any:
    return lambda ref: _ARGS.pop(key, None) if _ARGS.get(key, (None,))[0] is ref else None

Todo = list[tuple[int, torch.Tensor, dict[str, Any]]]


def takes(plan: Plan) -> bool:
    """Does a native many-parameter kernel implement ``plan``'s algorithm here?"""
    algorithm = plan.algorithm
    if not (cpu.ENABLED and algorithm.elementwise and algorithm.fused is not None):
        return False
    from ..cpu.elementwise import KERNELS

    return algorithm.fused in KERNELS and cpu.available()


def step_cpu_bucket(plan: Plan, todo: Todo, finite: list[bool | None]) -> Todo:
    """Step the CPU parameters of ``todo`` ((index, param, group)) that the native kernels take, in one call; fill in
    ``finite`` for the ones checked here; return the rest, in order, for the per-parameter path."""
    if not todo or not takes(plan):
        return todo
    from ..cpu.elementwise import prepare, refresh, step_many

    algorithm, states = plan.algorithm, plan.state
    name = algorithm.fused
    rest: Todo = []
    batch, taken = [], []
    kwargs_memo: dict[tuple[int, int], dict[str, Any]] = {}  # (group, step) -> the math's keyword arguments
    memo: dict = {}  # what prepare derives from those alone (kept alive with them: ids stay unique)
    mult = host_mult = None  # loss scaling's multiplier (applied as g is loaded), read at the first CPU parameter
    for i, p, group in todo:
        grad = p.grad
        if p.device.type != "cpu" or group.get("rank") is not None or grad is None:
            rest.append((i, p, group))
            continue
        if plan.grad_mult is not None and mult is None:
            mult = plan.mult(torch.device("cpu"))
            host_mult = mult.tolist()
        numel = p.numel()  # a DTensor's whole size: it picks the state format
        local, grad, reduce = local_view(p, grad)  # a DTensor (FSDP2) steps its local shard
        if not (local.is_contiguous() and grad.is_contiguous() and grad.shape == local.shape):
            rest.append((i, p, group))
            continue
        state = states[p]
        if "galore.side" in state:
            rest.append((i, p, group))
            continue
        slots = algorithm.slots(group, local)
        record = plan.record_of(group)
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
            capture.host_count(state)
            if reduce.distributed:  # bf16_update changed since: the shard's ranks make its seed together
                rounding.init_state(state, local, record.rounding, reduce.agree)
        state["step"] += 1
        step = state["step"]
        key = (id(group), step)
        kw = kwargs_memo.get(key)
        if kw is None:
            kw = kwargs_memo[key] = algorithm.math_kwargs(group, step)
        pflat, gflat = local.view(-1), grad.view(-1)
        decay = algorithm.decay_factor(group)
        index_base = reduce.flat_offset() if reduce.distributed else 0
        scan = gflat if finite[i] is None else None
        # the kernel arguments of this parameter's last step, made again only when what they point at changed
        sig = (name, id(state), tuple(state), *(v.data_ptr() for v in state.values() if type(v) is torch.Tensor),
               pflat.data_ptr(), pflat.dtype, pflat.numel(), gflat.dtype, record.block_size,
               record.rounding_of(local), index_base)
        cached = _ARGS.get(id(p))
        if (cached is not None and cached[0]() is p and cached[1] == sig
                and refresh(cached[2], name, kw, gflat, state, slots, step, decay, scan, memo, host_mult)):
            args, done = cached[2], cached[3]
        else:
            formats = {k: format_of(state, k) for k in slots}
            args, done = prepare(name, kw, pflat, gflat, state, slots, formats, record, step, decay, scan=scan,
                                 index_base=index_base, memo=memo, grad_mult=host_mult)
            if args is not None:
                _ARGS[id(p)] = (weakref.ref(p, _forget(id(p))), sig, args, done)
        if args is None or (finite[i] is None and args.scan is None):  # the per-parameter path takes it
            state["step"] -= 1
            rest.append((i, p, group))
            continue
        batch.append(args)
        taken.append((i, local, gflat, record, state, slots, step, decay, done, reduce))
    if not batch:
        return rest
    stepped = step_many(name, batch)
    for ok, (i, local, gflat, record, state, slots, step, decay, done, reduce) in zip(stepped, taken):
        finite[i] = ok
        if not ok:  # nothing of it was written (a fresh parameter was checked before)
            state["step"] -= 1
        elif done < local.numel():  # a ragged last 8- / 4-bit block: the reference path, as after a one-parameter call
            formats = {k: format_of(state, k) for k in slots}
            update_rest(algorithm, local, local.view(-1), gflat, state, slots, formats, record, step, decay, done,
                        reduce, mult)
    return rest
