"""Compressed all-reduce with error feedback: 1 bit per element plus a scale per tensor (1-bit Adam, Tang et al.
2021, arXiv 2102.02888, section 4; also 0/1 Adam and 1-bit LAMB). Two collectives per call (all-to-all of signs and
scales to the servers, all-gather of the servers' results), plain ``torch.distributed``.

The algorithm, the padding that keeps quantization blocks inside a server chunk, bytes sent and non-finite input:
docs/onebit.md#the-compressed-all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Layout", "CompressedAllReduce", "pack_signs", "unpack_signs", "scales_of", "compress"]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 of ``numel / 8`` bytes: bit 7 - k of byte b is 1 where ``x[8 b + k] >= 0``."""
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits * _BITS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """fp32 +-1 from :func:`pack_signs`'s bytes."""
    bits = packed.unsqueeze(-1).bitwise_and(_BITS.to(packed.device)).ne(0)
    out = bits.to(torch.float32).mul_(2).sub_(1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def scales_of(x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """fp32 ``[len(sizes)]``: ``||seg|| / sqrt(len(seg))`` of each consecutive segment of ``x`` (of ``sizes``)."""
    return torch.stack([torch.linalg.vector_norm(seg) / math.sqrt(seg.numel()) for seg in torch.split(x, list(sizes))])


def compress(x: torch.Tensor, sizes: Sequence[int], error: torch.Tensor) -> torch.Tensor:
    """Error-feedback compression of flat ``x``: per-segment scales; ``error <- x - scale * sign(x)``."""
    scales = scales_of(x, sizes)
    per_element = scales.repeat_interleave(torch.tensor(list(sizes), device=x.device))
    sign = torch.where(x >= 0, 1.0, -1.0)
    new = x - per_element * sign
    keep = ~torch.isfinite(per_element)
    error.copy_(torch.where(keep, error, new))
    return scales


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a bucket lies, padded for ``world`` ranks (server chunks of whole blocks)."""

    numels: tuple[int, ...]
    aligns: tuple[int, ...]
    world: int

    @staticmethod
    def of(numels: Sequence[int], world: int, aligns: Sequence[int] | None = None) -> "Layout":
        """The layout of tensors of ``numels`` elements for ``world`` ranks (``aligns``: block sizes; None: 8)."""
        if world < 1:
            raise ValueError(f"world must be >= 1 (got {world})")
        aligns = [8] * len(numels) if aligns is None else list(aligns)
        if len(aligns) != len(numels):
            raise ValueError(f"aligns has {len(aligns)} entries for {len(numels)} tensors")
        fixed = []
        for a in aligns:
            if a < 1:
                raise ValueError(f"aligns must be positive (got {a})")
            fixed.append(a * 8 // math.gcd(a, 8))  # a multiple of both: whole bytes of signs, whole blocks
        return Layout(tuple(int(n) for n in numels), tuple(fixed), int(world))

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(max(1, -(-n // (self.world * a))) * a for n, a in zip(self.numels, self.aligns))

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(self.world * c for c in self.chunks)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for size in self.padded:
            out.append(at)
            at += size
        return tuple(out)

    @property
    def numel(self) -> int:
        """Elements of the padded bucket (and of a worker error buffer)."""
        return sum(self.padded)

    @property
    def server_numel(self) -> int:
        """Elements of one server's part (and of a server error buffer)."""
        return sum(self.chunks)

    def views(self, bucket: torch.Tensor) -> list[torch.Tensor]:
        """The unpadded flat view of each tensor in ``bucket``."""
        return [bucket[o : o + n] for o, n in zip(self.offsets, self.numels)]

    def message_bytes(self) -> tuple[int, int]:
        """Bytes of one rank's message to one server (all-to-all) and of one server's message (all-gather)."""
        n = len(self.numels)
        return self.server_numel // 8 + 4 * n, self.server_numel // 8 + 4 * n


class CompressedAllReduce:
    """The compressed average of a bucket over ``process_group``; error buffers are the caller's."""

    def __init__(self, layout: Layout, process_group: Any = None) -> None:
        world = dist.get_world_size(process_group)
        if layout.world != world:
            raise ValueError(f"layout is padded for {layout.world} ranks, the process group has {world}")
        self.layout = layout
        self.group = process_group
        self.world = world
        self.rank = dist.get_rank(process_group)

    def new_errors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Zero (worker_error, server_error) buffers for this layout."""
        return (torch.zeros(self.layout.numel, device=device), torch.zeros(self.layout.server_numel, device=device))

    def __call__(self, bucket: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
        """Average flat fp32 ``bucket`` over the group in place, updating the error buffers; returns ``bucket``."""
        lay, world = self.layout, self.world
        if bucket.numel() != lay.numel or worker_error.numel() != lay.numel:
            raise ValueError(
                f"bucket and worker_error need {lay.numel} elements (got {bucket.numel()}, {worker_error.numel()})"
            )
        if server_error.numel() != lay.server_numel:
            raise ValueError(f"server_error needs {lay.server_numel} elements (got {server_error.numel()})")
        n = len(lay.numels)
        chunks = list(lay.chunks)
        # worker: compensate, compress, send chunk j of every tensor to rank j
        x = bucket.add_(worker_error)
        scales = compress(x, lay.padded, worker_error)
        packed = pack_signs(x)
        parts = [seg.view(world, c // 8) for seg, c in zip(torch.split(packed, [p // 8 for p in lay.padded]), chunks)]
        send = torch.cat(parts + [scales.view(torch.uint8).view(1, 4 * n).expand(world, 4 * n)], dim=1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        # server: this rank's chunk of every tensor, from every rank, summed in rank order
        sb = lay.server_numel // 8
        signs = unpack_signs(recv[:, :sb])  # [world, server_numel]
        worker_scales = recv[:, sb:].contiguous().view(torch.float32)  # [world, n]
        sizes = torch.tensor(chunks, device=bucket.device)
        c = None
        for r in range(world):
            term = signs[r] * (worker_scales[r] / world).repeat_interleave(sizes)
            c = term if c is None else c + term
        c = c + server_error
        server_scales = compress(c, chunks, server_error)
        message = torch.cat([pack_signs(c), server_scales.view(torch.uint8)])
        gathered = torch.empty(world, message.numel(), dtype=torch.uint8, device=bucket.device)
        _all_gather_into(gathered, message, self.group)
        # every rank: the servers' chunks, back into the bucket's layout
        values = unpack_signs(gathered[:, :sb])
        values.mul_(gathered[:, sb:].contiguous().view(torch.float32).repeat_interleave(sizes, dim=1))
        for i, (seg, part) in enumerate(zip(torch.split(bucket, list(lay.padded)), torch.split(values, chunks, 1))):
            seg.view(world, chunks[i]).copy_(part)
        return bucket


def _all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """``out[r] = tensor`` of rank r, in one collective."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), tensor, group=group)
