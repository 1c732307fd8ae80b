"""The step pipeline: :func:`run`, the one way through a step (docs/architecture.md), and the stages it runs over
buckets of parameters (:func:`run_stages`: gather, stage, project, update, unproject, apply, write back;
docs/pipeline.md). Each stage sees plain tensors and the :class:`~.plan.Plan`, never the optimizer. The backends:
:mod:`.native` (CPU buckets), :mod:`.backends` (per tensor), ``lowmemopt.kernels.dispatch`` (Triton)."""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch

from .. import cpu, rounding
from .._stacklevel import external_stacklevel
from ..cpu import factored
from ..distributed.reduction import LOCAL
from ..distributed.sharding import agree_finite, any_dtensor, is_dtensor, local_tensor, local_view
from ..work import Item, Update, capture
from ..work.items import LOW_RANK
from ..work.record import BucketRecord
from .algorithm import Algorithm, KernelSet
from .backends import CHUNK_NUMEL, init_state
from .finite import CpuFiniteChecks, DeviceFlags, host_flags
from .fits import check_state_fits
from .native import step_cpu_bucket, takes as takes_cpu_bucket
from .plan import Plan, StepOutcome, StepRecord
from .per_param import batches_reductions, checks_itself, step_batched, step_checked, step_param
from .program import Kept, StepProgram, update_for

__all__ = [
    "Item",
    "Update",
    "Plan",
    "StepOutcome",
    "StepRecord",
    "run",
    "run_stages",
    "communicating",
    "new_seeds",
    "step_buckets",
    "step_param",
    "device_flags",
    "triton_usable",
    "CHUNK_NUMEL",
    "PAGE_BUCKET_BYTES",
]
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
    """``plan.communicate`` (the 1-bit optimizers' stage) around one step of ``work`` (docs/onebit.md)."""
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
    """The context in which new states draw their stochastic-rounding seeds in ``work``'s order, whatever order the
    backends and paged batches make them in (:func:`lowmemopt.rounding.seeds_in_order`)."""

    def pending() -> list[torch.Tensor]:
        out, last, record, state = [], None, None, plan.state
        for p, group in work:
            if group is not last:  # (a group's parameters come together)
                last, record = group, plan.record_of(group)
            if record.rounding == "stochastic" and rounding.SEED not in state.get(p, ()):
                t = local_tensor(p) if plan.sharded else p
                if record.rounding_of(t) == "stochastic":
                    out.append(t)
        return out

    return rounding.seeds_in_order(pending)


def run(plan: Plan) -> StepOutcome:
    """Step ``plan.work``, whatever the entry (``step()``, the per-layer hook): the one way through a step.

    Args:
        plan: the step's plan; its fields choose the strategy (capturable, per-layer, the kept launch tables, loss
            scaling, paging, where the non-finite check is decided: docs/architecture.md). The run leaves in
            ``plan.program`` the launch tables to keep.

    Returns:
        The skips to count now and to settle at the next step.
    """
    work = plan.work
    plan.sharded = any_dtensor([t for p, _ in work for t in (p, p.grad)])
    if plan.capturable:
        check_state_fits(plan, work, plan.record.owner)
        return _capturable(plan)
    if plan.finite_known or plan.program is None:  # (a kept program was made by a checked step: it checks what changed)
        check_state_fits(plan, work, plan.record.owner)
    pager = plan.pager
    if pager is not None and not pager.begin(work, plan.first_state):  # (checks, homes; False: all resident)
        pager = None
    if plan.finite_known:
        with new_seeds(plan, work):
            run_stages(
                plan,
                _indexed(work),
                [True] * len(work),
                _grads(plan),
                None,
                pager,
                plan.flags,
            )
        return StepOutcome()
    # (new seeds in work's order, paged or not; communicating: the 1-bit optimizers' stage around the rest)
    with new_seeds(plan, work), communicating(plan, work):
        return _checked(plan, pager)


def _indexed(work: Work) -> list[tuple[int, torch.Tensor, dict]]:
    return [(i, p, group) for i, (p, group) in enumerate(work)]


def _grads(plan: Plan) -> list[torch.Tensor]:
    """The gradients of ``plan.work`` as the stages step them (a DTensor's local shard)."""
    if plan.sharded:
        return [local_tensor(p.grad) for p, _ in plan.work]
    return [p.grad for p, _ in plan.work]


def _checked(plan: Plan, pager: Any) -> StepOutcome:
    """A step whose gradients are checked for NaN / Inf here (or by the scaler): the kept program where it still
    applies, else the stages, the check decided on the device where the kernels read it, else on the host."""
    work = plan.work
    if plan.program is not None:
        outcome = _programmed(plan, pager)
        if outcome is not None:
            return outcome
    if (
        plan.defer_finite
        and pager is None
        and plan.communicate is None
        and type(plan.algorithm).step_work is Algorithm.step_work
    ):
        plan.keep = Kept()  # (a step the kernels take whole keeps its buckets: the program of the next steps)
    grads = _grads(plan)
    if plan.found_inf is not None:
        return _scaled(plan, grads, pager)
    # CPU params stepped by the native kernels are checked in a pipeline instead of up front: each kernel also scans
    # the next such gradient (CpuFiniteChecks); paged ones too (a skipped parameter's state goes home unchanged).
    pipe = CpuFiniteChecks([p for p, _ in work], grads, plan.sharded and any(is_dtensor(p) for p, _ in work))
    finite: list[bool | None] = [None] * len(work)
    on_device = device_flags(plan, work, grads, pager, pipe) if plan.defer_finite else None
    if on_device is not None:  # no synchronization: the kernels read the device's flags
        finite = [True] * len(work)  # provisionally
        run_stages(plan, _indexed(work), finite, grads, pipe, pager, on_device)
        if not on_device.read:  # settled at the next step, from a copy made without waiting
            _keep_program(plan)
            return StepOutcome(pending=on_device.deferred(counted=True))
        on_device.undo_skipped()  # (read already: a parameter took a per-tensor backend)
        finite = [on_device.finite(p) for p, _ in work]
    else:
        upfront = [i for i in range(len(work)) if pipe is None or i not in pipe.indices]
        flags = agree_finite(
            host_flags([grads[i] for i in upfront]), [work[i][0] for i in upfront], [grads[i] for i in upfront]
        )
        for i, ok in zip(upfront, flags):
            finite[i] = ok
        todo = [(i, p, group) for i, (p, group) in enumerate(work) if finite[i] is not False]
        run_stages(plan, todo, finite, grads, pipe, pager)
    return StepOutcome(skipped=sum(f is False for f in finite))


def _programmed(plan: Plan, pager: Any) -> StepOutcome | None:
    """This step through the kept program if it still applies (docs/pipeline.md says when), else None with the
    program dropped. Its skips are settled at the next step, as the device-side check's."""
    work = plan.work
    params = [p for p, _ in work]
    grads = [p.grad for p in params]
    if (
        pager is not None
        or plan.communicate is not None
        or not plan.defer_finite
        or not plan.program.matches(plan.state, params, [group for _, group in work], grads)
    ):
        plan.program = None
        check_state_fits(plan, work, plan.record.owner)  # (what changed may be a parameter's shape)
        return None
    return StepOutcome(pending=plan.program.step(plan, grads))


def _scaled(plan: Plan, grads: list[torch.Tensor], pager: Any) -> StepOutcome:
    """A step under ``torch.amp.GradScaler`` with its ``found_inf`` (docs/internals.md, Mixed precision)."""
    work, found_inf = plan.work, plan.found_inf
    todo = _indexed(work)
    finite: list[bool | None] = [True] * len(work)
    flags = device_flags(plan, work, grads, pager, None, found_inf) if plan.defer_finite else None
    if flags is None:
        if found_inf.reshape(-1).tolist()[0] != 0:  # (a device's: a synchronization; a CPU one is read directly)
            return StepOutcome()
        run_stages(plan, todo, finite, grads, None, pager)
        return StepOutcome()
    run_stages(plan, todo, finite, grads, None, pager, flags)
    _keep_program(plan)
    return StepOutcome(pending=flags.deferred())


def _keep_program(plan: Plan) -> None:
    """Keep this step's buckets as the program of the next steps where the kernels took it whole."""
    kept = plan.keep
    if kept is not None and kept.planned and sum(len(pl.members) for pl in kept.planned) == len(plan.work):
        plan.program = StepProgram(plan, plan.work, kept)


def _capturable(plan: Plan) -> StepOutcome:
    """A step that reads nothing back from the device (:mod:`lowmemopt.work.capture`)."""
    work, found_inf = plan.work, plan.found_inf
    grads = _grads(plan)
    device = grads[0].device
    if capture.capturing(device):
        for group in {id(g): g for _, g in work}.values():
            lr = group["lr"]
            if lr is not None and not (isinstance(lr, torch.Tensor) and lr.device == device):
                warnings.warn(
                    f"{plan.record.owner}: lr={lr!r} is not a tensor on {device}: the captured step keeps "
                    "this value at every replay. Give lr as a tensor on the device (a scheduler fills it in "
                    "place) to change it between replays",
                    RuntimeWarning,
                    stacklevel=external_stacklevel(),
                )
                break
    params = [p for p, _ in work]
    if found_inf is not None:
        flags = DeviceFlags.from_found_inf(params, found_inf.to(device, non_blocking=True))
    else:
        flags = DeviceFlags(params, grads)
    run_stages(plan, _indexed(work), [True] * len(work), grads, None, None, flags, device_steps=True)
    return StepOutcome(device_skipped=None if found_inf is not None else (flags.tensor == 0).sum())


def run_stages(
    plan: Plan,
    todo: list[tuple[int, torch.Tensor, dict]],
    finite: list[bool | None],
    grads: list[torch.Tensor],
    pipe: CpuFiniteChecks | None,
    pager: Any,
    flags: DeviceFlags | None = None,
    device_steps: bool = False,
) -> None:
    """The stages over ``todo``: kernel buckets, the rest one at a time, in batches when paged."""
    kernels = plan.kernels  # (None: no Triton kernel, or none usable for this step's devices)
    if kernels is not None and (kernels.triton is None or not triton_usable({p.device for _, p, _ in todo})):
        kernels = None
    if device_steps and (kernels is None or pager is not None or flags is None):
        raise ValueError(
            "capturable=True needs the fused Triton kernels, unpaged state and the device-side non-finite check"
        )
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


def step_in_order(
    plan: Plan,
    todo: list[tuple[int, torch.Tensor, dict]],
    finite: list[bool | None],
    grads: list[torch.Tensor],
    pipe: CpuFiniteChecks | None,
) -> None:
    """Step ``todo`` in order, per parameter, with the pipelined non-finite check filling in ``finite``; a run of
    parameters whose native factored steps check their own gradients (:func:`checks_itself`) at once
    (:func:`.per_param.step_checked`), and a run of sharded ones whose reductions batch as one bucket
    (:func:`.per_param.step_batched`)."""
    native = None if plan.kernels is None else plan.kernels.native
    checking = isinstance(native, factored.FactoredStep) and native.checks
    batching = plan.sharded and plan.reductions is not None and plan.algorithm.batched_reductions
    k = 0
    while k < len(todo):
        i, p, group = todo[k]
        if batching and finite[i] and batches_reductions(plan, p, plan.record_of(group)):
            k = step_batched(plan, todo, k, finite)
            continue
        if checking and finite[i] is None and checks_itself(plan, p, plan.record_of(group)):
            k = step_checked(plan, todo, k, finite)
            continue
        k += 1
        if finite[i] is None:  # a pipelined CPU gradient that the previous kernel did not scan
            finite[i] = pipe.check(i)
        if not finite[i]:  # found by that check, or by the previous kernel's scan
            continue
        nxt = todo[k][0] if k < len(todo) else None
        if nxt is not None and finite[nxt] is None:
            finite[nxt] = step_param(plan, p, p.grad, group, scan=grads[nxt])
        else:
            step_param(plan, p, p.grad, group)


def device_flags(
    plan: Plan,
    work: Work,
    grads: list[torch.Tensor],
    pager: Any,
    pipe: CpuFiniteChecks | None = None,
    found_inf: torch.Tensor | None = None,
) -> DeviceFlags | None:
    """The finiteness of ``grads`` as device flags, or None where the host must decide first."""
    if pipe is not None and pipe.indices:
        return None
    if pager is not None and pager.moves_any(work):
        return None
    if plan.kernels is None or plan.kernels.triton is None:  # (kernels that store nothing of a flagged tensor)
        return None
    devices = {g.device for g in grads}
    if len(devices) != 1 or not triton_usable(devices):
        return None
    params = [p for p, _ in work]
    sharded = any_dtensor(params + [p.grad for p in params])  # (a parameter's, or a gradient's)
    if sharded and any_dtensor(params):
        return None
    state = plan.state
    memo: dict = {}  # (device_may_check's answers per device and dtype)
    last = rank = None
    for p, group in work:
        st = state.get(p)
        if group is not last:  # (the record once per run of parameters of one group)
            last, rank = group, plan.record_of(group).rank
        if rank is not None:
            if st is None or not plan.galore.device_may_check(plan, p, group, st, memo):
                return None
        elif st is not None and LOW_RANK in st:  # (a group that lost its rank: the step reports it)
            return None
    if found_inf is not None:
        flags = DeviceFlags.from_found_inf(params, found_inf.to(grads[0].device, non_blocking=True))
    else:
        flags = DeviceFlags(params, grads)
    flags.whole = not sharded
    return flags


def step_buckets(
    plan: Plan, kernels: KernelSet, work: Work, flags: DeviceFlags | None = None, device_steps: bool = False
) -> Work:
    """Gather, project, step what the Triton kernels take, finish the projected; return the pairs left for the
    per-parameter path.
    """
    from ..kernels.dispatch import step_triton

    rest: Work = []
    plain: list[Item] = []
    fresh: list[bool] = []  # per plain item: its state made by this step
    projected: list[Item] = []
    inner: dict[int, tuple[dict, dict, float]] = {}
    fused_galore = None  # asked at the first projected parameter
    galore = plan.galore
    states = plan.state
    whole = flags is not None and flags.whole  # (no DTensor among the parameters and gradients: each its own view)
    if not whole:
        tensors = [p for p, _ in work]
        whole = not any_dtensor(tensors + [p.grad for p in tensors])
    slots: dict = {}  # the slots per record, shape and dtype, asked once per step_buckets
    last = record = None
    for p, group in work:
        state = states.get(p)  # (one lookup per parameter: a tensor's hash is a Python call)
        if group is not last:  # (the record once per run of parameters of one group)
            last, record = group, plan.record_of(group)
        if record.rank is not None or (state is not None and LOW_RANK in state):
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
        made = flags is not None and (state is None or "step" not in state)
        it = _plain_item(plan, p, group, state, record, whole, slots)
        if it is None:
            if device_steps:
                raise ValueError(
                    f"capturable=True: a parameter of shape {tuple(p.shape)} cannot take the fused "
                    "kernels (not contiguous, or a shard whose math needs the whole tensor)"
                )
            rest.append((p, group))
            continue
        if flags is not None:  # the kernels read the flag
            it.flag = flags.position[id(p)]
        if device_steps:  # the count stays on the device and advances by the flag (capture.advance)
            capture.device_count(it.state, it.target.device)
        plain.append(it)
        fresh.append(made)
    if plain and not device_steps:
        capture.host_counts([it.state for it in plain])
        if flags is not None:  # stepped provisionally: the host undoes a skip's count
            flags.note_all(plain, fresh)
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

    # (step: each tensor's, fp64 [T] on the device, if device_steps)
    hyper = partial(update_for, plan, kernels.name, device_steps=device_steps)
    mult = None if plan.grad_mult is None else plan.mult  # loss scaling: the kernels apply it as they load gradients
    items = plain + projected
    on_device = None if flags is None else flags.tensor
    if plan.keep is not None and flags is not None and not rest and not alone and not device_steps and items:
        planned: list = []  # a step the kernels take whole: its buckets kept for a StepProgram
        left = step_triton(kernels, items, hyper, on_device, False, mult, planned)
        if not left:
            plan.keep.planned, plan.keep.projected = planned, projected
    else:
        left = step_triton(kernels, items, hyper, on_device, device_steps, mult)
    finished: set[int] = set()
    for it in left:
        if not it.projected:
            rest.append((it.param, it.group))
        elif it.flag is not None and not flags.finite(it.param):  # the per-tensor backends need the decision first
            finished.add(id(it))  # skipped: nothing to apply
        elif not galore.update_per_tensor(plan, it):  # no kernel took it: the per-tensor backends, or the core
            finished.add(id(it))
    if projected:
        galore.apply_back(plan, [it for it in projected if id(it) not in finished], on_device)
    return rest


def _plain_item(
    plan: Plan,
    p: torch.Tensor,
    group: dict[str, Any],
    state: dict[str, Any] | None = None,
    record: BucketRecord | None = None,
    whole: bool = False,
    slots: dict | None = None,
) -> Item | None:
    """A full-rank parameter as an item (a DTensor's local shard), state made; None if no bucket takes it.
    ``record``: ``group``'s (None: asked here); ``whole``: ``p`` and its gradient are known to be no DTensors;
    ``slots``: the caller's memo of the slots per record, shape and dtype."""
    local, grad, reduce = (p, p.grad, LOCAL) if whole else local_view(p, p.grad)
    if reduce is not LOCAL and not plan.algorithm.elementwise:
        return None
    if not (local.is_contiguous() and grad.is_contiguous()) or grad.shape != local.shape:
        return None
    if state is None:
        state = plan.state[p]
    if record is None:
        record = plan.record_of(group)
    key = (id(record), local.shape, local.dtype)
    item_slots = None if slots is None else slots.get(key)
    if item_slots is None:
        item_slots = plan.slots_of(record, local)
        if slots is not None:
            slots[key] = item_slots
    if "step" not in state:  # the whole parameter's size picks the format (a shard keeps the one-process format)
        state = init_state(local, record, item_slots, state, numel=p.numel(), reduce=reduce)
    elif record.rounding != "nearest":  # bf16_update changed since: its state made for the whole tensor (a shard's
        rounding.init_state(state, local, record.rounding, reduce.agree)  # ranks agree on a seed); nearest needs none
    base = reduce.flat_offset() if reduce.distributed and record.rounding_of(local) == "stochastic" else 0
    return Item(
        param=p, group=group, target=local, grad=grad, state=state, slots=item_slots, index_base=base, record=record
    )
