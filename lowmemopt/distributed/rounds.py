"""A bucket's whole-tensor reductions in few collectives (:class:`ReductionRounds`): each parameter's step runs in a
thread of its own, a sum it asks for (:func:`.reduction.all_reduce`) waits, and once every step waits or is done the
calling thread reduces all waiting tensors of one (process groups, op, dtype, device) as one flat tensor, in the steps'
order. Docs: docs/distributed.md#batched-reductions.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .reduction import ROUND

__all__ = ["ReductionRounds"]


class _Abandoned(Exception):
    """Raised in a waiting step when another step of its bucket failed (the bucket's rounds stop)."""


class ReductionRounds:
    """Runs a bucket's steps together, their reductions batched per round (the pipeline's ``ReductionStage``)."""

    def __init__(self) -> None:
        self._cv: threading.Condition | None = None  # (made by the first run: a plan makes one per step)
        self._waiting: dict[int, tuple[torch.Tensor, tuple, Any]] = {}
        self._answers: dict[int, BaseException | None] = {}
        self._running = 0
        self.rounds = 0  # rounds of the last run (each: one collective per kind of tensor and process group)

    def run(self, steps: Sequence[Callable[[], Any]]) -> list[Any]:
        """Call every step (each in a thread; sums go out in rounds) and return their results in order. Every rank must
        run the same steps in the same order, as it would call them one by one. The first error is raised."""
        n = len(steps)
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        grad = torch.is_grad_enabled()
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        stream = None if cuda is None else torch.cuda.current_stream(cuda)
        cv = self._cv = self._cv or threading.Condition()

        def body(k: int) -> None:
            torch.set_grad_enabled(grad)  # (thread-local: the step's mode; and its device and stream)
            if cuda is not None:
                torch.cuda.set_device(cuda)
                torch.cuda.set_stream(stream)
            ROUND.rounds, ROUND.index = self, k
            try:
                results[k] = steps[k]()
            except BaseException as e:  # noqa: BLE001 - raised by run()
                errors[k] = e
            finally:
                ROUND.rounds = None
                with cv:
                    self._running -= 1
                    cv.notify_all()

        self._running, self.rounds = n, 0
        threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(n)]
        for t in threads:
            t.start()
        try:
            while True:
                with cv:
                    cv.wait_for(lambda: len(self._waiting) == self._running)
                    if not self._running:
                        break
                    batch = sorted(self._waiting.items())
                    self._waiting.clear()
                failed = next((e for e in errors if e is not None), None)
                answer: BaseException | None = None
                if failed is not None:
                    answer = _Abandoned()
                else:
                    try:
                        self._reduce(batch)
                        self.rounds += 1
                    except BaseException as e:  # noqa: BLE001 - every waiting step raises it
                        answer = e
                with cv:
                    for k, _ in batch:
                        self._answers[k] = answer
                    cv.notify_all()
        finally:
            for t in threads:
                t.join()
            self._answers.clear()
        first = next((e for e in errors if e is not None and not isinstance(e, _Abandoned)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    def wait(self, t: torch.Tensor, groups: tuple, op: Any) -> torch.Tensor:
        """In a step: ``t`` all-reduced in place over ``groups`` in turn, in the next round; returns ``t``."""
        k, cv = ROUND.index, self._cv
        with cv:
            self._waiting[k] = (t, groups, op)
            cv.notify_all()
            cv.wait_for(lambda: k in self._answers)
            answer = self._answers.pop(k)
        if answer is not None:
            raise answer
        return t

    @staticmethod
    def _reduce(batch: list[tuple[int, tuple[torch.Tensor, tuple, Any]]]) -> None:
        """One round: the tensors of each (groups, op, dtype, device) concatenated in the steps' order, each
        concatenation all-reduced over its groups in turn, the sums copied back."""
        kinds: dict[tuple, tuple[tuple, Any, list[torch.Tensor]]] = {}
        for _, (t, groups, op) in batch:
            key = (tuple(id(g) for g in groups), str(op), t.dtype, t.device)
            kinds.setdefault(key, (groups, op, []))[2].append(t)
        for groups, op, tensors in kinds.values():
            one = len(tensors) == 1 and tensors[0].is_contiguous()
            flat = tensors[0] if one else torch.cat([x.reshape(-1) for x in tensors])
            for group in groups:
                dist.all_reduce(flat, op=op, group=group)
            if one:
                continue
            start = 0
            for x in tensors:
                n = x.numel()
                x.copy_(flat[start : start + n].view(x.shape))
                start += n
