"""The communicate stage of the communication-compressed optimizers (1-bit Adam, :mod:`lowmemopt.optim.onebit`).

Data parallelism without DDP's gradient all-reduce: every rank holds the whole model and its own gradients, and the
stage replaces each parameter's gradient, before the update stage, by what the algorithm's math reads:

    phase "full"        the gradients averaged over the process group: one all-reduce of one flat fp32 bucket per
                        param group (skipped where a DDP comm hook, :func:`onebit_comm_hook`, already averaged them)
    phase "compressed"  what the algorithm sends (1-bit Adam: its local momentum ``beta1 m + (1 - beta1) g``), averaged
                        by the compressed all-reduce with error feedback (:mod:`.compression`): one call per param group

The optimizer hands the stage to the pipeline as ``Plan.communicate``; :func:`lowmemopt.pipeline.communicating` runs it
around the update: :meth:`OnebitStage.begin` swaps the gradients, :meth:`OnebitStage.give_back` restores them and
:meth:`OnebitStage.finish` runs what follows the update (0/1 Adam's synchronisation). The stage sees plain tensors and
the plan: the param groups, the state dict and the algorithm, which says what each step communicates (its ``phase``
and ``message``; the hooks ``comm_phase``, ``comm_begin`` and ``comm_after``). The error buffers live here, one pair per
param group, with the algorithm's schedule counters (``counters``) and its fixed settings (``settings``); the state
dict carries the buffers and the counters, per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..quant.formats import choose_format
from .compression import CompressedAllReduce, Layout

__all__ = ["OnebitStage", "Communicated", "onebit_comm_hook", "broadcast_parameters", "align_of", "apply_mask"]


def align_of(group: dict[str, Any], p: torch.Tensor) -> int:
    """The block size that ``p``'s server chunks are multiples of: its first moment's, where quantized (8 else)."""
    fmt = choose_format(group["state_bits"], p.numel(), group["min_quant_numel"])
    return group["block_size"] if fmt.bits < 16 else 8


def apply_mask(group: dict[str, Any], params: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
    """Multiply each compressed mean of ``group``'s ``params`` in place by the group's ``exp_avg_mask`` (DeepSpeed's
    group key: a tensor broadcastable to each parameter's shape, e.g. zeros for the rows of an embedding that the
    data never reaches, so that their momentum stays exactly zero); nothing without one."""
    mask = group.get("exp_avg_mask")
    if mask is None:
        return
    for p, r in zip(params, results):
        r.view(p.shape).mul_(mask.to(r.device, r.dtype))


@dataclass
class Communicated:
    """What :meth:`OnebitStage.begin` did this step: per param group with gradients ``(index, group, phase, params)``,
    and the ``(param, its own gradient)`` pairs whose ``.grad`` it replaced."""

    groups: list[tuple[int, dict[str, Any], str, list[torch.Tensor]]] = field(default_factory=list)
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def broadcast_parameters(params: Sequence[torch.Tensor], process_group: Any = None) -> None:
    """Make every rank's ``params`` equal to those of the group's first rank: one broadcast per dtype and device."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for tensors in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src, group=process_group)
        for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
            t.data.copy_(part.view_as(t))


class OnebitStage:
    """Communication for one optimizer: its process group, a compressed all-reduce and error buffers per param
    group (made at the group's first compressed step, or loaded), and whether a DDP comm hook averages the
    gradients of "full" steps (``ddp_reduces``)."""

    def __init__(self, process_group: Any = None, settings: dict[str, Any] | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("the 1-bit optimizers need torch.distributed initialized (dist.init_process_group) "
                             "before they are constructed")
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.ddp_reduces = False
        #: param group index -> (layout, collective, worker_error, server_error)
        self.buckets: dict[int, tuple[Layout, CompressedAllReduce, torch.Tensor, torch.Tensor]] = {}
        self.sent_bytes = 0  # (counted by the bench by wrapping the collectives; kept for users' logs)
        #: the algorithm's fixed schedule settings (0/1 Adam's scalers), and its counters (checkpointed per rank)
        self.settings: dict[str, Any] = dict(settings or {})
        self.counters: dict[str, Any] = {}

    # -- the stage around the update ---------------------------------------------------------------------------------

    def phase_of(self, plan: Any, index: int) -> str:
        """The communication phase of param group ``index``'s next step ("full", "compressed" or "local")."""
        return plan.algorithm.comm_phase(self, plan.state, index, plan.groups[index])

    def begin(self, plan: Any, work: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> Communicated:
        """Before the update: for each param group with gradients (in ``work``), its phase, the algorithm's
        ``comm_begin`` and :meth:`communicate`; each gradient the update must not read as it is is replaced (``.grad``)
        by what it reads. On an error the gradients are given back before it propagates."""
        algorithm, state = plan.algorithm, plan.state
        stepping = {id(p) for p, _ in work}
        done = Communicated()
        try:
            for index, group in enumerate(plan.groups):
                params = [p for p in group["params"] if id(p) in stepping]
                if not params:
                    continue
                grads = [p.grad for p in params]
                phase = self.phase_of(plan, index)
                algorithm.comm_begin(self, plan, index, group, phase)
                done.groups.append((index, group, phase, params))
                message = lambda i, ps=params, gs=grads, g=group: algorithm.message(  # noqa: E731
                    ps[i], gs[i], state.get(ps[i], {}), g)
                new = self.communicate(index, phase, grads, message, [align_of(group, p) for p in params])
                if phase == "compressed":
                    apply_mask(group, params, new)
                if new is not None:
                    for p, g in zip(params, new):
                        done.swapped.append((p, p.grad))
                        p.grad = g.view_as(p)
        except BaseException:
            self.give_back(done)
            raise
        return done

    @staticmethod
    def give_back(done: Communicated) -> None:
        """Restore the gradients that :meth:`begin` replaced."""
        for p, g in done.swapped:
            p.grad = g
        done.swapped = []

    def finish(self, plan: Any, done: Communicated) -> None:
        """After the update: the algorithm's ``comm_after`` for each param group that stepped (0/1 Adam's
        synchronisation; its schedule's counters)."""
        for index, group, phase, params in done.groups:
            plan.algorithm.comm_after(self, plan, index, group, phase, params)

    # -- the two phases ---------------------------------------------------------------------------------------------

    def average(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean over the group of each of ``grads``, as new fp32 tensors (one all-reduce of their concatenation;
        summed, then divided by the world size)."""
        if not grads:
            return []
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        return [part.view(g.shape) for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]))]

    def compressed(self, index: int, messages: list[torch.Tensor], aligns: list[int]) -> list[torch.Tensor]:
        """The compressed mean over the group of each of ``messages`` (fp32), as views of the bucket of param group
        ``index`` (made, with zero error buffers, when its layout changes)."""
        if self.world == 1:  # (as DeepSpeed: nothing to average, nothing compressed)
            return messages
        numels = [m.numel() for m in messages]
        layout = Layout.of(numels, self.world, aligns)
        bucket = self.buckets.get(index)
        if bucket is None or bucket[0] != layout:
            op = CompressedAllReduce(layout, self.group)
            bucket = (layout, op, *op.new_errors(messages[0].device))
            self.buckets[index] = bucket
        layout, op, worker_error, server_error = bucket
        flat = torch.zeros(layout.numel, device=messages[0].device)
        for view, m in zip(layout.views(flat), messages):
            view.copy_(m.reshape(-1))
        op(flat, worker_error, server_error)
        return [view.view(m.shape) for view, m in zip(layout.views(flat), messages)]

    def communicate(self, index: int, phase: str, grads: list[torch.Tensor],
                    message: Callable[[int], torch.Tensor], aligns: list[int]) -> list[torch.Tensor] | None:
        """What param group ``index``'s update reads in place of ``grads`` this step: averaged gradients (phase
        "full"; None where a DDP hook already averaged them), the compressed mean of ``message(i)`` for each
        parameter i (phase "compressed"), or None ("local": nothing moves)."""
        if phase == "full":
            return None if self.ddp_reduces else self.average(grads)
        if phase == "compressed":
            return self.compressed(index, [message(i) for i in range(len(grads))], aligns)
        if phase == "local":
            return None
        raise ValueError(f"unknown communication phase {phase!r}")

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def errors_state(self) -> dict[str, Any]:
        """This rank's error buffers: ``{"world", "rank", "groups": {index: {"numels", "aligns", "worker_error",
        "server_error"}}}`` (plain tensors, ints and lists)."""
        groups = {}
        for index, (layout, _, w, s) in self.buckets.items():
            groups[str(index)] = dict(numels=list(layout.numels), aligns=list(layout.aligns),
                                      worker_error=w.clone(), server_error=s.clone())
        return dict(world=self.world, rank=self.rank, groups=groups)

    def load_errors(self, saved: dict[str, Any] | None, device: torch.device | str = "cpu") -> str | None:
        """Restore the error buffers of :meth:`errors_state`; returns why they were reset instead (saved at another
        world size or rank, or for other tensors), or None."""
        self.buckets = {}
        if not saved:
            return None
        if saved.get("world") != self.world or saved.get("rank") != self.rank:
            return (f"they were saved by rank {saved.get('rank')} of {saved.get('world')} and this is rank "
                    f"{self.rank} of {self.world}")
        for key, entry in saved.get("groups", {}).items():
            layout = Layout(tuple(entry["numels"]), tuple(entry["aligns"]), self.world)
            w, s = entry["worker_error"], entry["server_error"]
            if w.numel() != layout.numel or s.numel() != layout.server_numel:
                self.buckets = {}
                return f"param group {key}'s buffers do not match its tensors"
            op = CompressedAllReduce(layout, self.group)
            self.buckets[int(key)] = (layout, op, w.detach().to(device, torch.float32, copy=True).reshape(-1),
                                      s.detach().to(device, torch.float32, copy=True).reshape(-1))
        return None


def onebit_comm_hook(state: Any, bucket: "dist.GradBucket") -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that follows a 1-bit optimizer's phase (``state``: the optimizer, or anything with a
    ``next_phase()`` method): the gradients averaged as DDP's default hook does (all-reduce, divided by the world size)
    where the optimizer's next step is a "full" one, and left local otherwise (the optimizer communicates itself).
    Register it with ``ddp.register_comm_hook(optimizer, onebit_comm_hook)``, or ``optimizer.register_ddp(ddp)``."""
    tensor = bucket.buffer()
    if state.next_phase() != "full":
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    group = getattr(state, "process_group", None)
    world = dist.get_world_size(group)
    tensor.div_(world)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


# DDP checks a hook's annotations as objects (this module's are strings: ``from __future__ import annotations``)
onebit_comm_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}
