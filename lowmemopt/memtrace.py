"""Live tensor memory of a piece of PyTorch code, by category, and its peak: the same count on real and fake tensors.

:class:`LiveMemory` is a ``TorchDispatchMode``: every tensor an operator returns is noted by its storage (once, with
its size in bytes, rounded up to ``round_to``) and forgotten when the storage is freed (a weak reference's callback).
A storage is in one category: ``weights``, ``gradients``, ``optimizer state``, ``activations`` (made during the
forward pass), ``temporaries`` (made later: backward, recomputed checkpoints, the step) or ``step workspace`` (bytes
the optimizer's step holds for a moment, declared with :meth:`LiveMemory.hold`). The peak keeps its breakdown.
Under ``FakeTensorMode`` nothing is allocated and the count is the same as the real run's (``tests/
test_estimate_traced.py`` checks it); bytes that C code allocates outside torch are not seen.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CATEGORIES", "LiveMemory"]

CATEGORIES = ("weights", "gradients", "optimizer state", "activations", "temporaries", "step workspace")


class LiveMemory(TorchDispatchMode):
    """Bytes of live storage by category (:data:`CATEGORIES`), with the peak and its breakdown.

    Args:
        round_to: each storage's bytes are rounded up to a multiple of this (512: the CUDA caching allocator's
            smallest block; 1: exact bytes).
    """

    def __init__(self, round_to: int = 1) -> None:
        super().__init__()
        self.round_to = max(1, int(round_to))
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [bytes, category, weakref]
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = 0
        self.at_peak = dict(self.current)
        self.phase = "activations"  # the category of new storages: "activations" in forward, then "temporaries"

    # -- counting --------------------------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Bytes live now."""
        return sum(self.current.values())

    def note(self, tensors: Iterable[Any], category: str | None = None) -> None:
        """Count the storages of ``tensors`` (others are skipped) as ``category`` (default: the phase's); a storage
        already counted moves to ``category`` if one is given."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":  # (a fake tensor's device is its fake one)
                continue
            st = t.untyped_storage()
            key = id(st)
            entry = self._live.get(key)
            if entry is not None and entry[2]() is st:
                if category is not None and entry[1] != category:
                    self.current[entry[1]] -= entry[0]
                    self.current[category] += entry[0]
                    entry[1] = category
                continue
            n = -(-st.nbytes() // self.round_to) * self.round_to
            cat = category or self.phase
            self._live[key] = [n, cat, weakref.ref(st, self._forget(key))]
            self.current[cat] += n
            self._check_peak()

    def _forget(self, key: int) -> Any:
        def forget(ref: Any) -> None:
            entry = self._live.get(key)
            if entry is not None and entry[2] is ref:
                del self._live[key]
                self.current[entry[1]] -= entry[0]

        return forget

    def _check_peak(self) -> None:
        total = self.total
        if total > self.peak:
            self.peak = total
            self.at_peak = dict(self.current)

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` of step workspace for a moment: the peak sees them, the live count does not keep them."""
        if nbytes > 0:
            self.current["step workspace"] += nbytes
            self._check_peak()
            self.current["step workspace"] -= nbytes

    @contextmanager
    def phase_of(self, category: str) -> Iterator[None]:
        """New storages inside the block are ``category``."""
        before, self.phase = self.phase, category
        try:
            yield
        finally:
            self.phase = before

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.total
        self.at_peak = dict(self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.note(tree_flatten(out)[0])
        return out
