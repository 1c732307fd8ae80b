"""Decentralized SGD: gossip averaging with neighbours as a ``torch.distributed`` model averager
(:class:`GossipAverager`, for ``PostLocalSGDOptimizer``): ``x_i <- W_ii x_i + sum_{j in N(i)} W_ij x_j`` (Lian et al.
2017, D-PSGD), one ``batch_isend_irecv`` per round. Topologies, weights and why Metropolis is the default:
docs/distributed_recipes.md#decentralized-sgd-gossip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.algorithms.model_averaging.utils import get_params_to_average

__all__ = ["GossipAverager", "mixing_weights", "ring", "torus"]

WEIGHTS = ("metropolis", "uniform")


def ring(world_size: int) -> list[list[int]]:
    """The ring graph: rank ``i`` neighbours ``i - 1`` and ``i + 1`` (mod ``world_size``); one neighbour at 2 ranks."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return [sorted({(i - 1) % world_size, (i + 1) % world_size} - {i}) for i in range(world_size)]


def torus(rows: int, cols: int) -> list[list[int]]:
    """The 2-D torus (``rows x cols``, wrapping): each rank neighbours those above, below, left, right."""
    for name, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    graph = []
    for r in range(rows):
        for c in range(cols):
            near = {
                ((r - 1) % rows) * cols + c,
                ((r + 1) % rows) * cols + c,
                r * cols + (c - 1) % cols,
                r * cols + (c + 1) % cols,
            }
            graph.append(sorted(near - {r * cols + c}))
    return graph


def _check_graph(graph: Sequence[Sequence[int]]) -> list[list[int]]:
    world = len(graph)
    out = []
    for i, near in enumerate(graph):
        near = list(near)
        for j in near:
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < world:
                raise ValueError(f"topology: rank {i} lists neighbour {j!r}, not a rank of a world of {world}")
        if i in near:
            raise ValueError(f"topology: rank {i} lists itself as a neighbour")
        if len(set(near)) != len(near):
            raise ValueError(f"topology: rank {i} lists a neighbour twice ({near})")
        out.append(sorted(near))
    for i, near in enumerate(out):
        for j in near:
            if i not in out[j]:
                raise ValueError(f"topology must be undirected: rank {i} lists {j} but rank {j} does not list {i}")
    seen, todo = {0}, [0]
    while todo:
        for j in out[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    if len(seen) != world:
        raise ValueError(
            f"topology is not connected (ranks {sorted(set(range(world)) - seen)} cannot be reached from "
            "rank 0): gossip would average each component separately"
        )
    return out


def mixing_weights(graph: Sequence[Sequence[int]], rank: int, weights: str = "metropolis") -> dict[int, float]:
    """Row ``rank`` of ``graph``'s mixing matrix (``"metropolis"`` or ``"uniform"``)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    graph = _check_graph(graph)
    deg = [len(n) for n in graph]
    if weights == "uniform":
        if len(set(deg)) > 1:
            raise ValueError(
                f"weights='uniform' (1 / (degree + 1)) is doubly stochastic only on a regular graph; "
                f"the degrees here are {deg}, so the mean would drift: use weights='metropolis'"
            )
        row = {j: 1.0 / (deg[rank] + 1) for j in graph[rank]}
    else:
        row = {j: 1.0 / (1 + max(deg[rank], deg[j])) for j in graph[rank]}
    row[rank] = 1.0 - sum(row.values())
    return row


class GossipAverager(ModelAverager):
    """Gossip model averaging for decentralized SGD, a torch ``ModelAverager``.

    Args:
        topology: every rank's neighbours (``ring(W)``, ``torus(r, c)``, a list of lists), or this rank's only (a
            list of ints, exchanged once here). Undirected and connected (ValueError otherwise).
        period: gossip every ``period`` steps after the warm-up.
        warmup_steps: steps without gossip first (as ``PeriodicModelAverager``).
        weights: ``"metropolis"`` (default) or ``"uniform"`` (regular graphs only).
        process_group: the group whose ranks ``topology`` names (default: the world).

    Only parameters with a gradient are averaged, in place; ``params`` may be parameters or ``param_groups``.
    """

    def __init__(
        self,
        topology: Sequence[Sequence[int]] | Sequence[int],
        period: int = 1,
        warmup_steps: int = 0,
        weights: str = "metropolis",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(process_group)
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a positive int, got {period!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        self.period, self.warmup_steps = period, warmup_steps
        world = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        topology = list(topology)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in topology):  # this rank's neighbours only
            graph: list = [None] * world
            dist.all_gather_object(graph, topology, group=self.process_group)
        elif all(isinstance(t, Iterable) for t in topology):
            graph = [list(t) for t in topology]
        else:
            raise TypeError("topology must be a list of neighbour ranks or a list of such lists (one per rank)")
        if len(graph) != world:
            raise ValueError(f"topology names {len(graph)} ranks, the process group has {world}")
        self.weights = mixing_weights(graph, self.rank, weights)
        self.neighbors = sorted(j for j in self.weights if j != self.rank)

    def average_parameters(self, params: Iterable[torch.nn.Parameter] | Iterable[dict]) -> None:
        """One gossip round on ``params`` if this step is due; ``step`` advances on every call."""
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            self.gossip(get_params_to_average(params))
        self.step += 1

    @torch.no_grad()
    def gossip(self, params: Sequence[torch.Tensor]) -> None:
        """One round ``x_i <- W_ii x_i + sum_j W_ij x_j`` on ``params`` (in place), now."""
        if not self.neighbors or not params:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        ops, flats = [], []
        for members in groups.values():
            flat = torch.cat([p.detach().reshape(-1) for p in members])
            received = {j: torch.empty_like(flat) for j in self.neighbors}
            for j in self.neighbors:
                ops.append(dist.P2POp(dist.isend, flat, group=self.process_group, group_peer=j))
                ops.append(dist.P2POp(dist.irecv, received[j], group=self.process_group, group_peer=j))
            flats.append((members, flat, received))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for members, flat, received in flats:
            mixed = flat.float().mul_(self.weights[self.rank])
            for j in self.neighbors:
                mixed.add_(received[j].float(), alpha=self.weights[j])
            offset = 0
            for p in members:
                p.detach().copy_(mixed[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
