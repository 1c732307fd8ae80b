"""The communicate stage of the communication-compressed optimizers (1-bit Adam, :mod:`lowmemopt.optim.onebit`).

Data parallelism without DDP's gradient all-reduce: every rank holds the whole model and its own gradients, and the
stage replaces each parameter's gradient, before the update stage, by what the algorithm's math reads:

    phase "full"        the gradients averaged over the process group: one all-reduce of one flat fp32 bucket per
                        param group (skipped where a DDP comm hook, :func:`onebit_comm_hook`, already averaged them)
    phase "compressed"  what the algorithm sends (1-bit Adam: its local momentum ``beta1 m + (1 - beta1) g``), averaged
                        by the compressed all-reduce with error feedback (:mod:`.compression`): one call per param group

The stage sees plain tensors: the param groups' parameters and gradients, the algorithm's ``message`` function and
the group's phase; the error buffers live here, one pair per param group (the state dict carries them, per rank).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .compression import CompressedAllReduce, Layout

__all__ = ["OnebitStage", "onebit_comm_hook", "broadcast_parameters"]


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

    def __init__(self, process_group: Any = None) -> None:
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
