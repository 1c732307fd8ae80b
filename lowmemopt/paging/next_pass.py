"""The next pass's first bucket (a step's, or a layer's with per-layer updates), set on its way when a pass ends so its
load overlaps the forward pass.
"""

from __future__ import annotations

from typing import Callable

import torch

from .engine import BucketInFlight

__all__ = ["NextPass"]

#: last buckets remembered at most (a bound: a pass per layer of a very deep model)
MAX_FOLLOWS = 4096


class NextPass:
    """What follows which pass, and the bucket prefetched for the next one (:attr:`early`: its params and bucket)."""

    def __init__(self) -> None:
        self.early: tuple[list[torch.Tensor], BucketInFlight] | None = None
        self._follows: dict[tuple[int, ...], list[torch.Tensor]] = {}  # last bucket of a pass -> first of the next
        self._last: tuple[int, ...] | None = None  # the last pass's last bucket

    def adopt(
        self,
        first: list[torch.Tensor],
        discard: Callable[[list[torch.Tensor], BucketInFlight], None],
    ) -> dict[int, BucketInFlight]:
        """A pass starts with bucket ``first``: ``{0: bucket}`` if it was prefetched, else ``{}``."""
        if self._last is not None and first:
            if len(self._follows) > MAX_FOLLOWS:
                self._follows.clear()
            self._follows[self._last] = list(first)
        early = self.take()
        if early is None:
            return {}
        params, bucket = early
        if len(params) == len(first) and all(a is b for a, b in zip(params, first)):
            return {0: bucket}
        discard(params, bucket)
        return {}

    def ended(self, last: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """A pass ended with bucket ``last``: the params that followed it last time, if any."""
        if last:
            self._last = tuple(map(id, last))
        return self._follows.get(self._last) if self._last is not None else None

    def take(self) -> tuple[list[torch.Tensor], BucketInFlight] | None:
        """The bucket on its way (its params and bucket), no longer kept here; None if there is none."""
        early, self.early = self.early, None
        return early
