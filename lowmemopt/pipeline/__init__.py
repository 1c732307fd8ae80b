"""The step pipeline (``DESIGN.md`` §1.1): one ``step()`` is one pass of buckets of parameters through small stages,
each of which sees plain tensors and knows nothing of the others::

    communicate  1-bit optimizers: each gradient replaced by its average over the ranks, or the compressed mean of
               the algorithm's message; after the update, the gradients given back, 0/1 Adam's synchronisation
                                                                                              (communicating)
    gather     params with finite gradients -> items: local tensors (an FSDP2 shard's local part), initialized state
    stage      paging: bring a batch's state to the device, the next batch's on its way    (Pager.batches, or no-op)
    project    GaLore: low-rank gradients, batched products per shape on CUDA          (plan.galore, or no-op)
    update     one backend call per bucket: Triton (kernels.dispatch) on CUDA, native C on the CPU (.native, the
               elementwise algorithms), else per tensor: native C (CPU), torch.compile, the eager reference
                                                                                          (.backends.update_flat)
    unproject  GaLore: the full-size update, weight decay on the full weight       (plan.galore.apply_back)
    apply      the parameter write
    write back paging: the batch's state home, asynchronously                                 (Pager.batches)

Whatever a parameter is (plain, paged, projected, a DTensor shard), the fused kernels take it when its device has them:
a backend is chosen per bucket, never by the feature a parameter uses. Parameters that no bucketed backend takes go
through the per-parameter path (:func:`.per_param.step_param`), which runs the same stages for one parameter with the
per-tensor backends (:mod:`.backends`); it is also the eager reference that every combination is tested against.

The optimizer hands the pipeline a :class:`~.plan.Plan` (the algorithm, the state dict, the param groups, the fused
backend's name, the projection stage, the communicate stage) and plain tensors; no stage receives the optimizer or
calls back into it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .. import cpu, rounding
from ..cpu import factored
from ..distributed.reduction import LOCAL
from ..distributed.sharding import is_dtensor, local_tensor, local_view
from ..work import Item, Update, capture
from ..work.items import LOW_RANK
from .backends import CHUNK_NUMEL, init_state
from .finite import CpuFiniteChecks, DeviceFlags
from .native import step_cpu_bucket, takes as takes_cpu_bucket
from .algorithm import KernelSet
from .plan import Plan, StepRecord
from .per_param import step_param
from .program import update_for

__all__ = ["Item", "Update", "Plan", "StepRecord", "run", "communicating", "new_seeds", "step_buckets", "step_param",
           "device_flags", "triton_usable", "CHUNK_NUMEL", "PAGE_BUCKET_BYTES"]
#: paged state moves through the device in batches of about this many bytes when a bucketed backend steps them (two
#: batches are on the device at a time: the one stepping and the one prefetched); one parameter per batch otherwise
PAGE_BUCKET_BYTES = 64 << 20

Work = list[tuple[torch.Tensor, dict[str, Any]]]


def triton_usable(devices: set[torch.device]) -> bool:
    """May the Triton backend take tensors on ``devices``? CUDA with Triton, or the CPU while a test runs the
    interpreter. CPU-only steps never import Triton otherwise."""
    runtime = sys.modules.get("lowmemopt.kernels.runtime")
    if runtime is None or not runtime._cpu_interpreter:
        if not any(d.type == "cuda" for d in devices):
            return False
        if runtime is None:
            from ..kernels import runtime
    if not (runtime.HAS_TRITON and runtime.ENABLED):
        return False
    for d in devices:  # (a loop, not any(): this runs a few times per parameter in the per-layer updates)
        if runtime.device_ok(d):
            return True
    return False


@contextmanager
def communicating(plan: Plan, work: Work) -> Iterator[None]:
    """The communicate stage around one step of ``work`` ((param, group) with gradients), where ``plan.communicate``
    is one (:class:`lowmemopt.distributed.onebit.OnebitStage`; nothing otherwise): on entry each gradient is replaced
    by what the update reads (averaged over the ranks, or the compressed mean of the algorithm's message), so that the
    non-finite check and the update see it; on exit the gradients are given back, and after an update that raised
    nothing the stage finishes the step (0/1 Adam's synchronisation)."""
    stage = plan.communicate
    if stage is None:
        yield
        return
    done = stage.begin(plan, work)
    try:
        yield
    finally:
        stage.give_back(done)
    stage.finish(plan, done)


def new_seeds(plan: Plan, work: Work) -> Any:
    """The context of a step of ``work`` ((param, group), in the step's order) in which the stochastic-rounding seeds
    of new states are drawn in that order (:func:`lowmemopt.rounding.seeds_in_order`): whatever order the backends
    and paged batches make the states in, and whichever gradients turn out non-finite, each parameter gets the seed
    it gets in the unpaged step."""
    def pending() -> list[torch.Tensor]:
        locals_ = ((local_tensor(p), group, plan.state.get(p, ())) for p, group in work)
        return [t for t, group, st in locals_
                if plan.record_of(group).rounding_of(t) == "stochastic" and rounding.SEED not in st]

    return rounding.seeds_in_order(pending)


def run(plan: Plan, todo: list[tuple[int, torch.Tensor, dict]], finite: list[bool | None],
        grads: list[torch.Tensor], pipe: CpuFiniteChecks | None, pager: Any, flags: DeviceFlags | None = None,
        device_steps: bool = False) -> None:
    """Step ``todo`` ((index, param, group) with gradients not known to be non-finite). ``finite[i] is None``: a CPU
    gradient checked in the native kernels' pipeline (:func:`step_in_order`); ``pager``: the paging manager, or None
    when nothing is paged; ``plan.kernels``: the algorithm's fused kernels (None: the per-tensor backends only);
    ``plan.galore``: the projection stage (:class:`~.plan.ProjectionStage`), or None when no group is projected;
    ``flags``: the gradients' finiteness on the device (:mod:`.finite`; ``finite`` then says True for all,
    provisionally), read on the host only after the kernels are launched. ``device_steps``: a capturable step
    (:mod:`.capture`): everything through the kernels, nothing read back."""
    kernels = plan.kernels  # (None: no Triton kernel, or none usable for this step's devices)
    if kernels is not None and (kernels.triton is None or not triton_usable({p.device for _, p, _ in todo})):
        kernels = None
    if device_steps and (kernels is None or pager is not None or flags is None):
        raise ValueError("capturable=True needs the fused Triton kernels, unpaged state and the device-side "
                         "non-finite check")
    if pager is None:
        if kernels is not None:
            checked = [(p, group) for i, p, group in todo if finite[i]]  # pipelined CPU ones (None) stay per tensor
            left = {id(p) for p, _ in step_buckets(plan, kernels, checked, flags, device_steps)}
            todo = [t for t in todo if finite[t[0]] is None or id(t[1]) in left]
        if flags is not None and todo:  # the per-tensor backends need the decision on the host (after the launches)
            for i, p, _ in todo:
                finite[i] = flags.finite(p)
            todo = [t for t in todo if finite[t[0]]]
        if todo:  # CPU parameters: one native call for the bucket (.native), the rest one at a time
            todo = step_cpu_bucket(plan, todo, finite)
        if todo:
            step_in_order(plan, todo, finite, grads, pipe)
        return
    work = [(p, group) for _, p, group in todo]
    index = {id(p): i for i, p, _ in todo}
    cpu_bucket = kernels is None and takes_cpu_bucket(plan)  # CPU parameters: one native call per batch
    # flags: nothing moves (device_flags: state resident within the budget), so this is the unpaged step
    for batch in pager.batches(work, PAGE_BUCKET_BYTES if kernels is not None or cpu_bucket else 0, cpu.copy_files):
        left = step_buckets(plan, kernels, batch, flags) if kernels is not None else batch
        if cpu_bucket:  # (it checks the gradients the optimizer left to the pipelined check: finite[i] is None)
            left = [(p, g) for _, p, g in step_cpu_bucket(plan, [(index[id(p)], p, g) for p, g in left], finite)]
        for p, group in left:
            if finite[index[id(p)]] is None:  # a pipelined CPU gradient no kernel checked
                finite[index[id(p)]] = pipe.check(index[id(p)])
            if finite[index[id(p)]] is False:
                continue
            if flags is None or flags.finite(p):  # the per-tensor backends need the decision on the host
                step_param(plan, p, p.grad, group)


def step_in_order(plan: Plan, todo: list[tuple[int, torch.Tensor, dict]], finite: list[bool | None],
                  grads: list[torch.Tensor], pipe: CpuFiniteChecks | None) -> None:
    """Step ``todo`` ((index, param, group), in order) through the per-parameter path with the pipelined non-finite
    check: a gradient not checked yet (``finite[i] is None``) is checked by its own step where that is a native
    factored step (:func:`checks_itself`), else just before its step, unless the kernel that stepped the parameter
    before it scanned it; ``finite`` is filled in as it goes."""
    for k, (i, p, group) in enumerate(todo):
        if finite[i] is None and checks_itself(plan, p, group):
            finite[i] = step_param(plan, p, p.grad, group, check=True)
            continue
        if finite[i] is None:  # a pipelined CPU gradient that the previous kernel did not scan
            finite[i] = pipe.check(i)
        if not finite[i]:  # found by that check, or by the previous kernel's scan
            continue
        nxt = todo[k + 1][0] if k + 1 < len(todo) else None
        if nxt is not None and finite[nxt] is None:
            finite[nxt] = step_param(plan, p, p.grad, group, scan=grads[nxt])
        else:
            step_param(plan, p, p.grad, group)


def checks_itself(plan: Plan, p: torch.Tensor, group: dict[str, Any]) -> bool:
    """Can ``p``'s step be its gradient's non-finite check (:func:`.backends.update_checked`)? An algorithm with a
    native factored step that checks (Adafactor, CAME), outside GaLore, for a parameter that has state (a fresh one is
    checked before its state is made, so that a skip makes none). For the pipelined CPU checks only (unsharded)."""
    native = None if plan.kernels is None else plan.kernels.native
    if not (isinstance(native, factored.FactoredStep) and native.checks):
        return False
    state = plan.state[p]
    return plan.record_of(group).rank is None and "step" in state and LOW_RANK not in state


def device_flags(plan: Plan, work: Work, grads: list[torch.Tensor], pager: Any,
                 pipe: CpuFiniteChecks | None = None, found_inf: torch.Tensor | None = None) -> DeviceFlags | None:
    """The finiteness of ``grads`` (of ``work``'s parameters) as flags on the device, for the kernels to read
    (:mod:`.finite`); None where the check must be decided on the host first: anything but one device that the
    Triton backend takes with kernels that mask by element count, or anything whose state moves (paged beyond the
    budget: state resident within it steps as unpaged), sharded, or projected where a stage would ignore the flags (a
    basis refresh due, the first step: :meth:`~.plan.ProjectionStage.device_may_check`). ``found_inf``: a
    loss-scaled step's flag (``torch.amp.GradScaler``), which then makes the flags instead of a norm per gradient
    (:meth:`DeviceFlags.from_found_inf`)."""
    if pipe is not None and pipe.indices:
        return None
    if pager is not None and pager.moves_any(work):
        return None
    if plan.kernels is None or plan.kernels.triton is None:  # (kernels that store nothing of a flagged tensor)
        return None
    devices = {g.device for g in grads}
    if len(devices) != 1 or not triton_usable(devices):
        return None
    state = plan.state
    memo: dict = {}  # (device_checkable's answers per device and dtype)
    for p, group in work:
        if is_dtensor(p):
            return None
        st = state.get(p)
        if plan.record_of(group).rank is not None:
            if st is None or not plan.galore.device_may_check(plan, p, group, st, memo):
                return None
        elif st is not None and LOW_RANK in st:  # (a group that lost its rank: the step reports it)
            return None
    params = [p for p, _ in work]
    if found_inf is not None:
        return DeviceFlags.from_found_inf(params, found_inf.to(grads[0].device, non_blocking=True))
    return DeviceFlags(params, grads)


def step_buckets(plan: Plan, kernels: KernelSet, work: Work, flags: DeviceFlags | None = None,
                 device_steps: bool = False) -> Work:
    """Gather ``work`` into items, project the GaLore ones, step what the Triton kernels take (one launch set per
    bucket), finish the projected ones; return the (param, group) pairs left for the per-parameter path. ``flags``:
    the step's device-side finiteness flags, which the launches (and GaLore's apply pass) read. ``device_steps``: a
    capturable step (:mod:`.capture`: step counts and the step's scalars on the device); it leaves nothing."""
    from ..kernels.dispatch import launch_buckets, plan_buckets, step_items

    rest: Work = []
    plain: list[Item] = []
    projected: list[Item] = []
    inner: dict[int, tuple[dict, dict, float]] = {}
    fused_galore = None  # asked at the first projected parameter
    galore, algorithm = plan.galore, plan.algorithm
    states = plan.state
    for p, group in work:
        state = states.get(p)  # (one lookup per parameter: a tensor's hash is a Python call)
        if plan.record_of(group).rank is not None or (state is not None and LOW_RANK in state):
            if fused_galore is None:
                fused_galore = galore is not None and galore.takes_fused(plan)
            if not fused_galore:
                rest.append((p, group))
                continue
            it = galore.gather(plan, p, p.grad, group, inner)
            if it is not None:  # None: no basis yet, the step is skipped
                if flags is not None:  # (galore.device_may_check: a basis, no refresh due) as a plain item's below
                    it.flag = flags.position[id(p)]
                    flags.note(p, it.state, False)
                projected.append(it)
            continue
        fresh = flags is not None and (state is None or "step" not in state)
        it = _plain_item(plan, p, group, state)
        if it is None:
            if device_steps:
                raise ValueError(f"capturable=True: a parameter of shape {tuple(p.shape)} cannot take the fused "
                                 "kernels (not contiguous, or a shard whose math needs the whole tensor)")
            rest.append((p, group))
        else:
            if flags is not None:  # the kernels read the flag
                it.flag = flags.position[id(p)]
            if device_steps:  # the count stays on the device and advances by the flag (capture.advance)
                capture.device_count(it.state, it.target.device)
            else:
                capture.host_count(it.state)
                if flags is not None:  # stepped provisionally: the host undoes a skip's count
                    flags.note(p, it.state, fresh)
            plain.append(it)
    alone: list[Item] = []
    if projected:
        galore.project_gradients(projected)
        on_stand_in = [galore.runs_on_stand_in(plan, it) for it in projected]
        alone = [it for it, s in zip(projected, on_stand_in) if not s]  # the reference core
        projected = [it for it, s in zip(projected, on_stand_in) if s]
        for it in alone:
            if it.flag is None or flags.finite(it.param):  # the per-tensor backends need the decision first
                galore.update_per_tensor(plan, it)
        galore.make_stand_ins(projected)
        galore.weight_statistics(plan, projected)  # the full weights' statistics the math reads (LAMB, Adafactor, ...)

    name = kernels.name

    def hyper(it: Item, step: Any) -> Update:  # (step: each tensor's, fp64 [T] on the device, if device_steps)
        return update_for(plan, name, it, step, device_steps)

    mult = None if plan.grad_mult is None else plan.mult  # loss scaling: the kernels apply it as they load gradients
    items = plain + projected
    if plan.keep is not None and flags is not None and not rest and not alone and not device_steps and items \
            and triton_usable({items[0].target.device}):  # a step the kernels take whole: kept for a StepProgram
        planned, left = plan_buckets(kernels, items)
        left += launch_buckets(planned, hyper, flags.tensor, False, mult)
        if not left:
            plan.keep.planned, plan.keep.projected = planned, projected
    else:
        left = step_items(kernels, items, hyper, None if flags is None else flags.tensor, device_steps, mult)
    finished: set[int] = set()
    for it in left:
        if not it.projected:
            rest.append((it.param, it.group))
        elif it.flag is not None and not flags.finite(it.param):  # the per-tensor backends need the decision first
            finished.add(id(it))  # skipped: nothing to apply
        elif not galore.update_per_tensor(plan, it):  # no kernel took it: the per-tensor backends, or the core
            finished.add(id(it))
    if projected:
        galore.apply_back(plan, [it for it in projected if id(it) not in finished],
                          None if flags is None else flags.tensor)
    return rest


def _plain_item(plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any] | None = None) -> Item | None:
    """A full-rank parameter as an item (its local shard for a DTensor), state made on the first step; None if no
    bucketed backend can take it (non-contiguous, or a sharded parameter whose math needs reductions over shards).
    ``state``: ``plan.state[p]`` when the caller has it already."""
    local, grad, reduce = local_view(p, p.grad)
    if reduce is not LOCAL and not plan.algorithm.elementwise:
        return None
    if not (local.is_contiguous() and grad.is_contiguous()) or grad.shape != local.shape:
        return None
    if state is None:
        state = plan.state[p]
    record = plan.record_of(group)
    slots = plan.slots_of(record, local)
    if "step" not in state:  # the whole parameter's size picks the format (a shard keeps the one-process format)
        state = init_state(local, record, slots, state, numel=p.numel(), reduce=reduce)
    else:  # bf16_update changed since: its state made for the whole tensor (a shard's ranks agree on a seed)
        rounding.init_state(state, local, record.rounding, reduce.agree)
    base = reduce.flat_offset() if reduce.distributed and record.rounding_of(local) == "stochastic" else 0
    return Item(param=p, group=group, target=local, grad=grad, state=state, slots=slots, index_base=base,
                record=record)
