"""The communicate stage of the 1-bit optimizers (:mod:`lowmemopt.optim.onebit`), ``Plan.communicate``: before the
update it replaces each gradient by what the algorithm reads (phase ``"full"``: the all-reduced mean; ``"compressed"``:
the compressed mean of its message, :mod:`.compression`; ``"local"``: nothing), and gives them back after. It keeps the
error buffers and the schedule counters per param group. Docs: docs/onebit.md.
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
    """The block size ``p``'s server chunks are multiples of: its quantized first moment's, else 8."""
    fmt = choose_format(group["state_bits"], p.numel(), group["min_quant_numel"])
    return group["block_size"] if fmt.bits < 16 else 8


def apply_mask(group: dict[str, Any], params: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
    """Multiply ``group``'s compressed means by its ``exp_avg_mask`` (DeepSpeed's key), if any."""
    mask = group.get("exp_avg_mask")
    if mask is None:
        return
    for p, r in zip(params, results):
        r.view(p.shape).mul_(mask.to(r.device, r.dtype))


@dataclass
class Communicated:
    """What :meth:`OnebitStage.begin` did: per group ``(index, group, phase, params)``, and the replaced gradients."""

    groups: list[tuple[int, dict[str, Any], str, list[torch.Tensor]]] = field(default_factory=list)
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def broadcast_parameters(params: Sequence[torch.Tensor], process_group: Any = None) -> None:
    """Make every rank's ``params`` equal to the group's first rank's (one broadcast per dtype and device)."""
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
    """Communication for one optimizer: process group, compressed all-reduce, error buffers per group."""

    def __init__(self, process_group: Any = None, settings: dict[str, Any] | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "the 1-bit optimizers need torch.distributed initialized (dist.init_process_group) "
                "before they are constructed"
            )
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
        """Before the update: each group's phase and communication, replacing ``.grad`` where needed."""
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
                    ps[i], gs[i], state.get(ps[i], {}), g
                )
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
        """After the update: the algorithm's ``comm_after`` per group that stepped (0/1 Adam's synchronisation)."""
        for index, group, phase, params in done.groups:
            plan.algorithm.comm_after(self, plan, index, group, phase, params)

    # -- the two phases ---------------------------------------------------------------------------------------------

    def average(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean over the group of each of ``grads``, as new fp32 tensors (one all-reduce)."""
        if not grads:
            return []
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        return [part.view(g.shape) for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]))]

    def compressed(self, index: int, messages: list[torch.Tensor], aligns: list[int]) -> list[torch.Tensor]:
        """The compressed mean of each of ``messages``, as views of group ``index``'s bucket."""
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

    def communicate(
        self,
        index: int,
        phase: str,
        grads: list[torch.Tensor],
        message: Callable[[int], torch.Tensor],
        aligns: list[int],
    ) -> list[torch.Tensor] | None:
        """What group ``index``'s update reads instead of ``grads`` this step (None: its own)."""
        if phase == "full":
            return None if self.ddp_reduces else self.average(grads)
        if phase == "compressed":
            return self.compressed(index, [message(i) for i in range(len(grads))], aligns)
        if phase == "local":
            return None
        raise ValueError(f"unknown communication phase {phase!r}")

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def errors_state(self) -> dict[str, Any]:
        """This rank's error buffers as plain tensors, ints and lists."""
        groups = {}
        for index, (layout, _, w, s) in self.buckets.items():
            groups[str(index)] = dict(
                numels=list(layout.numels), aligns=list(layout.aligns), worker_error=w.clone(), server_error=s.clone()
            )
        return dict(world=self.world, rank=self.rank, groups=groups)

    def load_errors(self, saved: dict[str, Any] | None, device: torch.device | str = "cpu") -> str | None:
        """Restore :meth:`errors_state`; returns why they were reset instead, or None."""
        self.buckets = {}
        if not saved:
            return None
        if saved.get("world") != self.world or saved.get("rank") != self.rank:
            return (
                f"they were saved by rank {saved.get('rank')} of {saved.get('world')} and this is rank "
                f"{self.rank} of {self.world}"
            )
        for key, entry in saved.get("groups", {}).items():
            layout = Layout(tuple(entry["numels"]), tuple(entry["aligns"]), self.world)
            w, s = entry["worker_error"], entry["server_error"]
            if w.numel() != layout.numel or s.numel() != layout.server_numel:
                self.buckets = {}
                return f"param group {key}'s buffers do not match its tensors"
            op = CompressedAllReduce(layout, self.group)
            self.buckets[int(key)] = (
                layout,
                op,
                w.detach().to(device, torch.float32, copy=True).reshape(-1),
                s.detach().to(device, torch.float32, copy=True).reshape(-1),
            )
        return None


def onebit_comm_hook(state: Any, bucket: "dist.GradBucket") -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: DDP's average before a 1-bit optimizer's "full" step, local gradients otherwise."""
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
onebit_comm_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
