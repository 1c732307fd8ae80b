"""The step pipeline (``DESIGN.md`` §1.1): one ``step()`` is one pass of buckets of parameters through small stages,
each of which sees plain tensors and knows nothing of the others::

    gather     params with finite gradients -> items: local tensors (an FSDP2 shard's local part), initialized state
    stage      paging: bring a batch's state to the device, the next batch's on its way    (Pager.batches, or no-op)
    project    GaLore: low-rank gradients, batched products per shape on CUDA          (projection.step, or no-op)
    update     one backend call per bucket: Triton (kernels.dispatch) on CUDA, else per tensor: native C (CPU),
               torch.compile, the eager reference                                    (LowMemOptimizer._update_flat)
    unproject  GaLore: the full-size update, weight decay on the full weight                 (projection.step.finish)
    apply      the parameter write
    write back paging: the batch's state home, asynchronously                                 (Pager.batches)

Whatever a parameter is (plain, paged, projected, a DTensor shard), the fused kernels take it when its device has them:
a backend is chosen per bucket, never by the feature a parameter uses. Parameters that no bucketed backend takes go
through the per-parameter path (``LowMemOptimizer._step_param``), which runs the same stages for one parameter with the
per-tensor backends; it is also the eager reference that every combination is tested against.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from .. import rounding
from ..distributed.reduction import LOCAL
from ..distributed.sharding import local_view
from . import capture
from .finite import DeviceFlags
from .items import Item, Update

if TYPE_CHECKING:
    from ..optimizer import LowMemOptimizer

__all__ = ["Item", "Update", "run", "step_buckets", "triton_usable", "CHUNK_NUMEL", "PAGE_BUCKET_BYTES"]

#: elements per chunk of the per-tensor eager path and of GaLore's CPU row blocks (1 MiB of fp32 per temporary)
CHUNK_NUMEL = 1 << 18
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


def run(optimizer: LowMemOptimizer, todo: list[tuple[int, torch.Tensor, dict]], finite: list[bool | None],
        grads: list[torch.Tensor], pipe: Any, pager: Any, name: str | None, galore: Any,
        flags: DeviceFlags | None = None, device_steps: bool = False) -> None:
    """Step ``todo`` ((index, param, group) with gradients not known to be non-finite). ``finite[i] is None``: a CPU
    gradient checked in the native kernels' pipeline (``optimizer._step_in_order``); ``pager``: the paging manager,
    or None when nothing is paged; ``name``: the optimizer's fused algorithm (None: no bucketed backend, e.g. a
    subclass that steps its parameters itself); ``galore``: the GaLore stage (:mod:`lowmemopt.projection.step`), or
    None when no param group is projected; ``flags``: the gradients' finiteness on the device (:mod:`.finite`;
    ``finite`` then says True for all, provisionally), read on the host only after the kernels are launched.
    ``device_steps``: a capturable step (:mod:`.capture`): everything through the kernels, nothing read back."""
    if name is not None and not triton_usable({p.device for _, p, _ in todo}):
        name = None
    if name is not None:  # (imported here: lowmemopt imports without its kernels package, e.g. from a source tree)
        from ..kernels.registry import ALGORITHMS

        if name not in ALGORITHMS:
            name = None
    if device_steps and (name is None or pager is not None or flags is None):
        raise ValueError("capturable=True needs the fused Triton kernels, unpaged state and the device-side "
                         "non-finite check")
    if pager is None:
        if name is not None:
            checked = [(p, group) for i, p, group in todo if finite[i]]  # pipelined CPU ones (None) stay per tensor
            left = {id(p) for p, _ in step_buckets(optimizer, name, checked, galore, flags, device_steps)}
            todo = [t for t in todo if finite[t[0]] is None or id(t[1]) in left]
        if flags is not None and todo:  # the per-tensor backends need the decision on the host (after the launches)
            for i, p, _ in todo:
                finite[i] = flags.finite(p)
            todo = [t for t in todo if finite[t[0]]]
        if todo:
            optimizer._step_in_order(todo, finite, grads, pipe)
        return
    work = [(p, group) for _, p, group in todo]
    # flags: nothing moves (optimizer.device_flags: state resident within the budget), so this is the unpaged step
    for batch in pager.batches(work, PAGE_BUCKET_BYTES if name is not None else 0):
        left = step_buckets(optimizer, name, batch, galore, flags) if name is not None else batch
        for p, group in left:
            if flags is None or flags.finite(p):  # the per-tensor backends need the decision on the host
                optimizer._step_param(p, p.grad, group)


def step_buckets(optimizer: LowMemOptimizer, name: str, work: Work, galore: Any,
                 flags: DeviceFlags | None = None, device_steps: bool = False) -> Work:
    """Gather ``work`` into items, project the GaLore ones, step what the Triton kernels take (one launch set per
    bucket), finish the projected ones; return the (param, group) pairs left for the per-parameter path. ``flags``:
    the step's device-side finiteness flags, which the launches (and GaLore's apply pass) read. ``device_steps``: a
    capturable step (:mod:`.capture`: step counts and the step's scalars on the device); it leaves nothing."""
    from ..kernels.dispatch import step_items

    rest: Work = []
    plain: list[Item] = []
    projected: list[Item] = []
    inner: dict[int, tuple[dict, dict, float]] = {}
    fused_galore = None  # asked at the first projected parameter
    states = optimizer.state
    for p, group in work:
        state = states.get(p)  # (one lookup per parameter: a tensor's hash is a Python call)
        if group.get("rank") is not None or (state is not None and "galore.side" in state):
            if fused_galore is None:
                fused_galore = galore is not None and galore.fused(optimizer)
            if not fused_galore:
                rest.append((p, group))
                continue
            it = galore.prepare(optimizer, p, p.grad, group, inner)
            if it is not None:  # None: no basis yet, the step is skipped
                if flags is not None:  # (galore.device_checkable: a basis, no refresh due) as a plain item's below
                    it.flag = flags.position[id(p)]
                    flags.note(p, it.state, False)
                projected.append(it)
            continue
        fresh = flags is not None and (state is None or "step" not in state)
        it = _plain_item(optimizer, p, group, state)
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
    if projected:
        galore.project(projected)
        stands_in = [galore.stands_in(optimizer, it) for it in projected]
        alone = [it for it, s in zip(projected, stands_in) if not s]  # the reference core
        projected = [it for it, s in zip(projected, stands_in) if s]
        for it in alone:
            if it.flag is None or flags.finite(it.param):  # the per-tensor backends need the decision first
                galore.update_alone(optimizer, it)
        galore.stand_ins(projected)
        galore.weights(optimizer, projected)  # the full weights' statistics the math reads (LAMB, Adafactor, ...)

    def update_for(it: Item, step: Any) -> Update:
        group = it.group
        if device_steps:  # step: each tensor's, fp64 [T] on the device; a tensor lr is read there too
            group = dict(group, lr=capture.device_value(group["lr"], it.target.device))
        decay = 1.0 if it.projected else optimizer._decay_factor(group)
        return Update(name, optimizer._math_kwargs(group, step), it.group, decay, 0 if device_steps else step,
                      it.group["block_size"], step if device_steps else None)

    left = step_items(name, plain + projected, update_for, None if flags is None else flags.tensor, device_steps)
    finished: set[int] = set()
    for it in left:
        if not it.projected:
            rest.append((it.param, it.group))
        elif it.flag is not None and not flags.finite(it.param):  # the per-tensor backends need the decision first
            finished.add(id(it))  # skipped: nothing to apply
        elif not galore.update_alone(optimizer, it):  # no kernel took it: the per-tensor backends, or the core
            finished.add(id(it))
    if projected:
        galore.finish_many(optimizer, [it for it in projected if id(it) not in finished],
                           None if flags is None else flags.tensor)
    return rest


def _plain_item(optimizer: LowMemOptimizer, p: torch.Tensor, group: dict[str, Any],
                state: dict[str, Any] | None = None) -> Item | None:
    """A full-rank parameter as an item (its local shard for a DTensor), state made on the first step; None if no
    bucketed backend can take it (non-contiguous, or a sharded parameter whose math needs reductions over shards).
    ``state``: ``optimizer.state[p]`` when the caller has it already."""
    local, grad, reduce = local_view(p, p.grad)
    if reduce is not LOCAL and not optimizer.elementwise:
        return None
    if not (local.is_contiguous() and grad.is_contiguous()) or grad.shape != local.shape:
        return None
    if state is None:
        state = optimizer.state[p]
    slots = optimizer._slots(group, local)
    if "step" not in state:  # the whole parameter's size picks the format (a shard keeps the one-process format)
        state = optimizer._init_state(local, group, slots, state, numel=p.numel(), reduce=reduce)
    elif reduce.distributed:  # bf16_update changed since: the shard's ranks make its seed together
        rounding.init_state(state, local, group, reduce.agree)
    base = reduce.flat_offset() if reduce.distributed and rounding.mode_of(group, local) == "stochastic" else 0
    return Item(param=p, group=group, target=local, grad=grad, state=state, slots=slots, index_base=base)
