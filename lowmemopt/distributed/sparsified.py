"""Sparsified gradient exchange with error feedback as a DDP communication hook (Stich, Cordonnier and Jaggi,
"Sparsified SGD with memory", NeurIPS 2018)::

    a_t = m_{t-1} + g_t;   s_t = comp_k(a_t);   m_t = a_t - s_t;   g_avg_t = (1 / W) sum_r s_t^(r)

Nothing is lost, only delayed; any optimizer follows. Selection, costs and the differences from the paper and from
mlbench: docs/distributed_recipes.md#sparsified-sgd-with-memory.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects (dist.GradBucket).
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

__all__ = ["SparsifiedState", "sparsified_hook", "select"]

METHODS = ("top", "random", "block")
_INT32_MAX = 2**31 - 1


class SparsifiedState:
    """State of :func:`sparsified_hook`: the compression choice, each bucket's error memory, the random streams.

    Args:
        process_group: the group to average over (default: the world).
        ratio: fraction of each bucket's coordinates sent per step, ``0 < ratio <= 1`` (``k = ceil(ratio * n)``).
        k: or a fixed number per bucket (``min(k, n)``). Exactly one of ``ratio`` and ``k``.
        method: ``"top"`` (largest ``|a_t|``), ``"random"`` (``k`` distinct uniform, per rank) or ``"block"`` (``k``
            consecutive from a random start).
        start_iter: iterations of plain all-reduce first (DDP rebuilds its buckets after the first); at least 2.
        seed: seed of the random selection; rank ``r`` draws from ``seed + r``.

    ``error_dict``: bucket index -> its memory (as ``PowerSGDState``'s); ``iter`` counts backward passes.
    """

    __slots__ = (
        "process_group",
        "ratio",
        "k",
        "method",
        "start_iter",
        "seed",
        "iter",
        "error_dict",
        "_generators",
        "bytes_before",
        "bytes_sent",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        ratio: float | None = None,
        k: int | None = None,
        method: str = "top",
        start_iter: int = 2,
        seed: int = 0,
    ) -> None:
        if (ratio is None) == (k is None):
            raise ValueError("give exactly one of ratio= (a fraction of each bucket) and k= (coordinates per bucket)")
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be a positive int, got {k!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 2:
            raise ValueError(
                f"start_iter must be an int >= 2 (DDP rebuilds its buckets after the first iteration, "
                f"and the error memory is kept per bucket), got {start_iter!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.process_group = process_group
        self.ratio, self.k, self.method = ratio, k, method
        self.start_iter, self.seed, self.iter = start_iter, seed, 0
        self.error_dict: dict[int, torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self.bytes_before = 0  # gradient bytes the compressed buckets held (per rank, summed over steps)
        self.bytes_sent = 0  # bytes this rank contributed to the all-gathers

    def k_for(self, numel: int) -> int:
        """The number of coordinates sent for a bucket of ``numel`` elements."""
        k = self.k if self.k is not None else math.ceil(self.ratio * numel)
        return max(1, min(k, numel))

    def compression_stats(self) -> tuple[float, int, int]:
        """(gradient bytes / bytes sent, gradient bytes, bytes sent) of the compressed steps so far, per rank."""
        return (self.bytes_before / self.bytes_sent if self.bytes_sent else 0.0), self.bytes_before, self.bytes_sent

    def generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed + rank)
        return gen

    def __getstate__(self) -> dict[str, Any]:
        state = {s: getattr(self, s) for s in self.__slots__ if s not in ("process_group", "_generators")}
        state["_generators"] = {str(d): g.get_state() for d, g in self._generators.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None  # the default group; set it again for another one
        gens = state.pop("_generators")
        for slot, value in state.items():
            setattr(self, slot, value)
        self._generators = {}
        for dev, gstate in gens.items():
            gen = self._generators[torch.device(dev)] = torch.Generator(torch.device(dev))
            gen.set_state(gstate)


def select(acc: torch.Tensor, k: int, method: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices of the ``k`` coordinates of flat ``acc`` to send (top, random, or a block's ``[start]``)."""
    n = acc.numel()
    if method == "top":
        return _top_k(acc.abs(), k)
    if method == "random":
        return _random_subset(n, k, generator, acc.device)
    if method == "block":
        return torch.randint(0, n - k + 1, (1,), generator=generator, device=acc.device)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


_SAMPLE = 1 << 16


def _top_k(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``mag``, exactly, via ``2k`` candidates from a sample (CPU)."""
    n = mag.numel()
    if mag.device.type == "cpu" and n >= 4 * _SAMPLE and 8 * k <= n:  # on a GPU topk is fast and this would sync
        sample = mag[:: n // _SAMPLE]
        rank = max(1, int(sample.numel() * (1 - 2 * k / n)))
        threshold = torch.kthvalue(sample, rank).values
        candidates = (mag >= threshold).nonzero().flatten()
        if candidates.numel() >= k:
            return candidates[torch.topk(mag[candidates], k, sorted=False).indices]
    return torch.topk(mag, k, sorted=False).indices


def _random_subset(n: int, k: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``k`` distinct uniform indices of ``range(n)`` in O(k log k)."""
    if 4 * k <= n:
        m = k + 2 * k * k // n + 64
        distinct = torch.unique(torch.randint(0, n, (m,), generator=generator, device=device))
        if distinct.numel() >= k:
            return distinct[torch.randperm(distinct.numel(), generator=generator, device=device)[:k]]
    return torch.randperm(n, generator=generator, device=device)[:k]


def _positions(idx: torch.Tensor, k: int, method: str) -> torch.Tensor:
    """The coordinates that ``select``'s indices stand for (a block's start becomes its ``k`` positions)."""
    if method == "block":
        start = idx.reshape(()).long()
        return start + torch.arange(k, device=idx.device)
    return idx.long()


def sparsified_hook(state: SparsifiedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: send ``k`` coordinates of ``memory + gradient`` per bucket, keep the rest in memory.

    ``ddp_model.register_comm_hook(SparsifiedState(ratio=0.01, method="top"), sparsified_hook)``: one ``all_gather``
    of (index, value) pairs per bucket, summed in rank order on every rank and divided by the world size.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        if bucket.is_last():
            state.iter += 1
        return allreduce_hook(group, bucket)
    world = group.size()
    n, dtype, device = buffer.numel(), buffer.dtype, buffer.device
    memory = state.error_dict.get(bucket.index())
    if memory is not None and memory.numel() != n:
        warnings.warn(
            f"sparsified_hook: DDP bucket {bucket.index()} changed size ({memory.numel()} -> {n} elements); "
            "its error memory starts again from zero",
            stacklevel=2,
        )
        memory = None
    if memory is None:
        wide = torch.promote_types(torch.float32, dtype)  # fp32, or fp64 for fp64 gradients
        memory = state.error_dict[bucket.index()] = torch.zeros(n, dtype=wide, device=device)
    memory.add_(buffer)  # a_t = m_{t-1} + g_t (fp32)
    k = state.k_for(n)
    idx = select(memory, k, state.method, None if state.method == "top" else state.generator(device))
    pos = _positions(idx, k, state.method)
    values = memory[pos].to(dtype)
    memory[pos] -= values.to(memory.dtype)  # m_t = a_t - s_t: zero where sent, unless the dtype rounded the value
    idx = idx.to(torch.int32 if n <= _INT32_MAX else torch.int64)
    payload = torch.cat([idx.view(torch.uint8), values.view(torch.uint8)])
    idx_bytes = idx.numel() * idx.element_size()
    gathered = [torch.empty_like(payload) for _ in range(world)]
    state.bytes_before += n * buffer.element_size()
    state.bytes_sent += payload.numel()
    if bucket.is_last():
        state.iter += 1
    work = dist.all_gather(gathered, payload, group=group, async_op=True)

    def scatter(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        buffer.zero_()
        for got in gathered:  # one rank at a time: its indices are distinct, so index_add_ is deterministic
            r_idx = got[:idx_bytes].view(idx.dtype)
            r_val = got[idx_bytes:]
            r_val = (r_val if idx_bytes % values.element_size() == 0 else r_val.clone()).view(dtype)
            buffer.index_add_(0, _positions(r_idx, k, state.method), r_val)
        return buffer.div_(world)

    return work.get_future().then(scatter)
