"""One step's Muon orthogonalizations in batches: the Newton-Schulz iteration of matrices of one shape as one batched
product, and under FSDP2 each matrix on one rank only (docs/muon.md#batches-and-fsdp2). :func:`plan_batches` groups
the matrices and orders the work; the first matrix of a batch to update runs the batch (:meth:`MuonBatches.take`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.reduction import Reduction
from ..distributed.sharding import is_dtensor, local_view
from ..distributed.whole import map_whole
from ..paging import tier_of
from ..pipeline.backends import decode_whole
from ..pipeline.plan import unscaled
from ..quant.formats import Slot, format_of
from .muon_math import momentum_input, orthogonalize

__all__ = ["BATCHES", "INDEX", "BATCH_BYTES", "MuonBatches", "plan_batches"]

#: the param group view's keys: the step's :class:`MuonBatches`, and the matrix's index in it
BATCHES, INDEX = "muon.batches", "muon.index"
#: bfloat16 bytes of whole matrices orthogonalized in one batch (the iteration's temporaries are a few times this)
BATCH_BYTES = 256 << 20

Work = list[tuple[torch.Tensor, dict[str, Any]]]


def _key(p: torch.Tensor, group: dict[str, Any]) -> tuple:
    layout = (id(p.device_mesh), tuple(p.placements)) if is_dtensor(p) else None
    return (p.device, tuple(p.shape), layout, tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])


def plan_batches(work: Work, state: dict, grad_mult: torch.Tensor | None = None) -> Work:
    """``work`` with its Muon matrices in batches: the other pairs first, then each batch's matrices with a view of
    their group naming the batch. ``grad_mult``: the loss-scaling multiplier, or None. Returns ``work`` itself where
    there is nothing to batch."""
    rest: Work = []
    by_key: dict[tuple, list[tuple[torch.Tensor, dict]]] = {}  # (first-seen order: the same on every rank)
    for p, group in work:
        if group.get("use_muon") and tier_of(group) is None and p.grad is not None:
            by_key.setdefault(_key(p, group), []).append((p, group))
        else:
            rest.append((p, group))
    batches: list[list[int]] = []
    members: Work = []
    for (_, shape, _, _, _, _), pairs in by_key.items():
        per_batch = max(1, BATCH_BYTES // max(1, 2 * shape[0] * shape[1]))  # (an empty matrix: one batch)
        for lo in range(0, len(pairs), per_batch):
            batches.append(list(range(len(members), len(members) + len(pairs[lo : lo + per_batch]))))
            members.extend(pairs[lo : lo + per_batch])
    if not any(len(b) > 1 or is_dtensor(members[b[0]][0]) for b in batches):
        return work
    plan = MuonBatches(members, batches, state, grad_mult)
    out = rest
    for j, (p, group) in enumerate(members):
        out.append((p, {**group, BATCHES: plan, INDEX: j}))
    return out


class MuonBatches:
    """One step's batches: ``members`` (param, group) of each matrix, ``batches`` lists of member indices."""

    def __init__(self, members: Work, batches: list[list[int]], state: dict, grad_mult: torch.Tensor | None) -> None:
        self.members, self.batches, self.state, self.grad_mult = members, batches, state, grad_mult
        self.batch_of = {j: b for b, js in enumerate(batches) for j in js}
        self.first = [sum(len(b) for b in batches[:i]) for i in range(len(batches))]  # ranks deal on from here
        self.done: dict[int, torch.Tensor] = {}

    def take(self, j: int, u: torch.Tensor) -> torch.Tensor:
        """Matrix ``j``'s orthogonalized update given its input ``u``; the first to step runs the batch."""
        if j not in self.done:
            b = self.batch_of[j]
            batch = self.batches[b]
            inputs = [u if k == j else self._input(k) for k in batch]
            p, group = self.members[batch[0]]
            reduce = local_view(p, p.grad)[2]
            results = _map(inputs, reduce, group, self.first[b])
            self.done.update(zip(batch, results))
        return self.done.pop(j)

    def _input(self, k: int) -> torch.Tensor:
        """Matrix ``k``'s momentum-updated matrix as its own step will make it (the momentum read, not written)."""
        p, group = self.members[k]
        local, grad, _ = local_view(p, p.grad)
        mult = self.grad_mult
        if mult is not None and mult.device != grad.device:
            mult = mult.to(grad.device, non_blocking=True)
        g = unscaled(grad.reshape(-1), mult).view(local.shape)
        st = self.state.get(p)
        if st is None or "step" not in st:  # no momentum yet: zeros, as its first step makes them
            buf = torch.zeros_like(g)
        else:
            buf = decode_whole(
                st, "momentum_buffer", Slot(signed=True), format_of(st, "momentum_buffer"), local, group["block_size"]
            )
        return momentum_input(g, buf, group["momentum"], group["nesterov"], in_place=False)


def _map(inputs: list[torch.Tensor], reduce: Reduction, group: dict[str, Any], first: int) -> list[torch.Tensor]:
    return map_whole(inputs, reduce, lambda mats: orthogonalize(mats, group), torch.bfloat16, first=first)
