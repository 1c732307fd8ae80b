"""A bucket's whole-tensor reductions in few collectives (:class:`ReductionRounds`): each parameter's step runs in a
thread of its own, one at a time, until it asks for a sum (:func:`.reduction.all_reduce`) or ends; once every step has,
the calling thread reduces all waiting tensors of one (process groups, op, dtype, device) as one flat tensor, in the
steps' order, and the steps go on in turn. Docs: docs/distributed.md#batched-reductions.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .reduction import ROUND

__all__ = ["ReductionRounds"]


class _Abandoned(Exception):
    """Raised in a waiting step when another step of its bucket failed or the caller was interrupted."""


class ReductionRounds:
    """Runs a bucket's steps together, their reductions batched per round (the pipeline's ``ReductionStage``).

    The steps take turns (a semaphore each; the caller waits on its own): exactly one thread runs at any time, so
    the steps compute as they would one after another, on the cores and in the order they would have.
    """

    def __init__(self) -> None:
        self.rounds = 0  # rounds of the last run (each: one collective per kind of tensor and process group)
        self._go: list[threading.Semaphore] = []
        self._back: threading.Semaphore | None = None
        self._waiting: dict[int, tuple[torch.Tensor, tuple, Any]] = {}
        self._answers: dict[int, BaseException | None] = {}
        self._abandoned = False

    def run(self, steps: Sequence[Callable[[], Any]]) -> list[Any]:
        """Call every step and return their results in order; sums go out in rounds. Every rank must run the same
        steps in the same order, as it would call them one by one. The first error is raised."""
        n = len(steps)
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        grad = torch.is_grad_enabled()
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        stream = None if cuda is None else torch.cuda.current_stream(cuda)
        self._go = [threading.Semaphore(0) for _ in range(n)]
        self._back = threading.Semaphore(0)
        self._waiting, self._answers, self._abandoned, self.rounds = {}, {}, False, 0

        def body(k: int) -> None:
            self._go[k].acquire()
            try:
                if self._abandoned:
                    return
                torch.set_grad_enabled(grad)  # (thread-local: the step's mode; and its device and stream)
                if cuda is not None:
                    torch.cuda.set_device(cuda)
                    torch.cuda.set_stream(stream)
                ROUND.rounds, ROUND.index = self, k
                results[k] = steps[k]()
            except BaseException as e:  # noqa: BLE001 - raised by run()
                errors[k] = e
            finally:
                ROUND.rounds = None
                self._back.release()

        threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(n)]
        for t in threads:
            t.start()
        live = list(range(n))
        try:
            while live:
                for k in live:  # each step in turn, up to its next sum or its end
                    self._go[k].release()
                    self._back.acquire()
                batch = sorted(self._waiting.items())
                self._waiting.clear()
                live = [k for k, _ in batch]
                answer: BaseException | None = None
                if any(e is not None for e in errors):
                    answer = _Abandoned()
                elif batch:
                    try:
                        self._reduce(batch)
                        self.rounds += 1
                    except BaseException as e:  # noqa: BLE001 - every waiting step raises it
                        answer = e
                for k in live:
                    self._answers[k] = answer
        finally:
            if live:  # (interrupted: the steps still waiting raise and end)
                self._abandoned = True
                for k in live:
                    self._go[k].release()
            for t in threads:
                t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, _Abandoned)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    def wait(self, t: torch.Tensor, groups: tuple, op: Any) -> torch.Tensor:
        """In a step: ``t`` all-reduced in place over ``groups`` in turn, in the next round; returns ``t``."""
        k = ROUND.index
        self._waiting[k] = (t, groups, op)
        self._back.release()  # (the turn back to the caller)
        self._go[k].acquire()
        if self._abandoned:
            raise _Abandoned()
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
