"""Decentralized SGD: gossip averaging with neighbours, as a ``torch.distributed`` model averager.

Each rank ``i`` replaces its parameters by a weighted mean of its own and its neighbours' (Lian et al. 2017, D-PSGD;
Koloskova et al. 2019)::

    x_i <- W_ii x_i + sum_{j in N(i)} W_ij x_j

With ``W`` symmetric and doubly stochastic on a connected undirected graph, every round keeps the mean over ranks
(``sum_i x_i`` is unchanged) and the ranks converge to it geometrically, at the rate of ``W``'s second largest
eigenvalue modulus. The default Metropolis-Hastings weights, ``W_ij = 1 / (1 + max(d_i, d_j))`` on each edge and
``W_ii = 1 - sum_j W_ij``, are doubly stochastic on any undirected graph (Xiao & Boyd 2004). mlbench's
``DecentralizedSGD`` uses ``1 / (d_i + 1)`` for every neighbour (``weights="uniform"`` here), which is doubly
stochastic only when every rank has the same degree: on an irregular graph it drifts the mean, so it is accepted
only on regular graphs.

:class:`GossipAverager` implements torch's ``ModelAverager`` (``average_parameters(params)``, ``step``, a ``period``
and ``warmup_steps`` as in ``PeriodicModelAverager``), so it plugs into ``PostLocalSGDOptimizer``::

    opt = PostLocalSGDOptimizer(lowmemopt.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                GossipAverager(ring(dist.get_world_size()), period=1))

One round exchanges each rank's parameters with every neighbour in one ``batch_isend_irecv`` (one flat tensor per
dtype and device), so it holds ``degree`` extra copies of the averaged parameters while it runs.
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
    """The 2-D torus (a ``rows x cols`` grid with wrap-around): rank ``r * cols + c`` neighbours the ranks above,
    below, left and right of it. A side of 1 or 2 gives fewer distinct neighbours (a side of 1 is a ring)."""
    for name, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    graph = []
    for r in range(rows):
        for c in range(cols):
            near = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                    r * cols + (c - 1) % cols, r * cols + (c + 1) % cols}
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
        raise ValueError(f"topology is not connected (ranks {sorted(set(range(world)) - seen)} cannot be reached from "
                         "rank 0): gossip would average each component separately")
    return out


def mixing_weights(graph: Sequence[Sequence[int]], rank: int, weights: str = "metropolis") -> dict[int, float]:
    """Row ``rank`` of the mixing matrix of ``graph`` (neighbours of every rank): ``{rank: W_ii, j: W_ij, ...}``.

    ``"metropolis"``: ``W_ij = 1 / (1 + max(d_i, d_j))``, doubly stochastic on any undirected graph. ``"uniform"``:
    ``1 / (d_i + 1)`` for the rank and each neighbour (mlbench's), doubly stochastic only on a regular graph, so an
    irregular graph raises ``ValueError``."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    graph = _check_graph(graph)
    deg = [len(n) for n in graph]
    if weights == "uniform":
        if len(set(deg)) > 1:
            raise ValueError(f"weights='uniform' (1 / (degree + 1)) is doubly stochastic only on a regular graph; "
                             f"the degrees here are {deg}, so the mean would drift: use weights='metropolis'")
        row = {j: 1.0 / (deg[rank] + 1) for j in graph[rank]}
    else:
        row = {j: 1.0 / (1 + max(deg[rank], deg[j])) for j in graph[rank]}
    row[rank] = 1.0 - sum(row.values())
    return row


class GossipAverager(ModelAverager):
    """Gossip model averaging for decentralized SGD, a torch ``ModelAverager`` (use it with
    ``torch.distributed.optim.PostLocalSGDOptimizer``, or call ``average_parameters`` after ``optimizer.step()``).

    Args:
        topology: the neighbours of every rank (``ring(W)``, ``torus(r, c)``, or any list of lists over the group's
            ranks), or only this rank's neighbours (a list of ints; the ranks then exchange their lists once, here,
            with ``all_gather_object``). Must be undirected and connected (checked, ``ValueError``).
        period: gossip every ``period`` steps after the warm-up (1: every step, as D-PSGD and mlbench do).
        warmup_steps: steps without gossip first (as ``PeriodicModelAverager``).
        weights: ``"metropolis"`` (default) or ``"uniform"`` (regular graphs only); see :func:`mixing_weights`.
        process_group: the group whose ranks ``topology`` names (default: the world).

    Like torch's averagers, only parameters that have a gradient are averaged (``get_params_to_average``); ``params``
    may be parameters or an optimizer's ``param_groups``. Parameters are updated in place.
    """

    def __init__(self, topology: Sequence[Sequence[int]] | Sequence[int], period: int = 1, warmup_steps: int = 0,
                 weights: str = "metropolis", process_group: dist.ProcessGroup | None = None) -> None:
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
        """One gossip round on ``params`` if this step is due (``step >= warmup_steps`` and
        ``(step - warmup_steps) % period == 0``); ``step`` advances on every call."""
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
                p.detach().copy_(mixed[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
