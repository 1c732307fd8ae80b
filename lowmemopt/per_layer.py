"""Per-layer updates inside the backward pass (:func:`step_in_backward`): each parameter is stepped in its
post-accumulate-grad hook as soon as its gradient is complete, and the gradient freed, alone or in buckets of
``bucket_bytes``. Accumulation, clipping, non-finite gradients and checkpoints: docs/per_layer.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ._stacklevel import external_stacklevel
from .distributed.sharding import agree_finite, local_tensor
from .optimizer import LowMemOptimizer
from .pipeline.finite import host_flags as _finite_flags
from .pipeline.finite import DeviceFlags, resolve
from .pipeline.fits import SPARSE

__all__ = ["BackwardStepper", "PerLayerSteps", "step_in_backward", "step_batch", "step_one"]


def step_batch(optimizer: LowMemOptimizer, work: list[tuple[torch.Tensor, dict]], pending: list[DeviceFlags]) -> int:
    """Step ``work``'s parameters through the pipeline as a hook or bucket does (device checks appended to ``pending``);
    returns how many the host skipped.
    """
    if torch.is_grad_enabled():  # (a hook inside backward() runs with grad mode off already)
        with torch.no_grad():
            return step_batch(optimizer, work, pending)
    grads = [local_tensor(p.grad) for p, _ in work]  # a DTensor (FSDP2): check the local shard, then agree
    flags = optimizer.device_flags(work, grads, optimizer._pager_for(work))
    if flags is not None:  # decided by the kernels on the device; read at the end of the backward pass
        optimizer._step_some(work, flags)
        pending.append(flags)
        return 0
    finite = agree_finite(_finite_flags(grads), [p for p, _ in work], [p.grad for p, _ in work])
    todo = [w for w, ok in zip(work, finite) if ok]
    if todo:
        optimizer._step_some(todo)
    return len(work) - len(todo)


def step_one(optimizer: LowMemOptimizer, p: torch.Tensor, group: dict, pending: list[DeviceFlags]) -> bool:
    """:func:`step_batch` of one parameter, ``p``: False when the host skipped it for a non-finite gradient."""
    return step_batch(optimizer, [(p, group)], pending) == 0


class PerLayerSteps:
    """One backward pass's per-layer updates: :meth:`add` steps or holds (``bucket_bytes``), :meth:`finish` the rest."""

    def __init__(self, optimizer: LowMemOptimizer, bucket_bytes: int = 0) -> None:
        self.optimizer = optimizer
        self.bucket_bytes = bucket_bytes
        self.held: list[tuple[torch.Tensor, dict]] = []
        self.held_bytes = 0
        self.pending: list[DeviceFlags] = []  # this backward's device-side finiteness checks (pipeline.finite)
        self.skipped = 0

    def add(self, p: torch.Tensor, group: dict) -> None:
        self.held.append((p, group))
        # the whole gradient's size (a DTensor's too): every rank of a sharded model cuts its buckets at the same
        # parameters, so that their collectives (agree_finite) pair up
        self.held_bytes += p.grad.numel() * p.grad.element_size()
        if self.held_bytes >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        """Step the held parameters and free their gradients."""
        if not self.held:
            return
        held, self.held, self.held_bytes = self.held, [], 0
        self.skipped += step_batch(self.optimizer, held, self.pending)
        for p, _ in held:
            p.grad = None

    def finish(self) -> int:
        """Flush, read the device-side checks (one sync), and return how many parameters were skipped."""
        self.flush()
        skipped = self.skipped + resolve(self.pending)
        self.pending, self.skipped = [], 0
        return skipped


class BackwardStepper:
    """The handle :func:`step_in_backward` returns: ``state_dict`` / ``load_state_dict``, ``remove``."""

    def __init__(
        self, model: torch.nn.Module, optimizer: LowMemOptimizer, accumulation_steps: int, bucket_bytes: int = 0
    ) -> None:
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.micro_step = 0  # backward passes done since the last update (0 .. accumulation_steps - 1)
        self.steps = 0  # updates done
        self._in_backward = False
        self._updates = PerLayerSteps(optimizer, bucket_bytes)
        # param -> index of its group: the group dict is looked up at each step, because load_state_dict (a resume,
        # accelerate's prepare) replaces the optimizer's group dicts, and an LR scheduler updates the new ones
        self._group_of: dict[torch.Tensor, int] = {}
        names = {id(p): n for n, p in model.named_parameters()}
        for gi, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in names:
                    raise ValueError(
                        f"step_in_backward: parameter {i} of param group {gi} (shape {tuple(p.shape)}) is not a "
                        "parameter of the model"
                    )
                self._group_of[p] = gi
        in_opt = {id(p) for p in self._group_of}
        loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_opt]
        if loose:
            warnings.warn(
                f"step_in_backward: trainable parameters not in the optimizer keep their gradients: {loose[:5]}",
                UserWarning,
                stacklevel=external_stacklevel(),
            )
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._group_of if p.requires_grad]
        self._handles.append(optimizer.register_step_pre_hook(self._step_pre_hook))

    # -- hooks ---------------------------------------------------------------------------------------------------------

    def _hook(self, p: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.micro_step + 1 < self.accumulation_steps or p.grad is None:
            return  # accumulating: the gradient stays in .grad
        if p.grad.is_sparse:
            raise TypeError(SPARSE.format(owner=type(self.optimizer).__name__))
        self._updates.add(p, self.optimizer.param_groups[self._group_of[p]])

    def _end_of_backward(self) -> None:
        self._in_backward = False
        skipped = self._updates.finish()  # one synchronization per backward pass, none per parameter
        self.micro_step += 1
        if self.micro_step == self.accumulation_steps:
            self.micro_step = 0
            self.steps += 1
        if skipped:
            self.optimizer._nonfinite_skips += skipped
            warnings.warn(
                f"{type(self.optimizer).__name__} (step_in_backward): skipped {skipped} parameter(s) with NaN/Inf "
                "gradients this step (their values and optimizer state are unchanged)",
                RuntimeWarning,
                stacklevel=external_stacklevel(),  # the user's backward() line
            )

    def _step_pre_hook(self, optimizer, args, kwargs) -> None:
        if self.micro_step != 0:
            raise RuntimeError(
                "optimizer.step() called between micro-batches while step_in_backward accumulates gradients "
                f"({self.micro_step} of {self.accumulation_steps} backward passes done): the update happens in the "
                "last backward pass; do not call step() (or zero_grad()) in between"
            )

    # -- state ---------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The stepper's position ``{"accumulation_steps", "micro_step", "steps"}``; RuntimeError mid-accumulation."""
        if self.micro_step != 0:
            raise RuntimeError(
                f"step_in_backward: state_dict() after {self.micro_step} of {self.accumulation_steps} micro-batches; "
                "their gradients are in .grad and would be lost: save at a step boundary"
            )
        return {"accumulation_steps": self.accumulation_steps, "micro_step": self.micro_step, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("accumulation_steps", "micro_step", "steps"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"step_in_backward state: {key!r} must be an int >= 0, got {value!r}")
        if state["accumulation_steps"] != self.accumulation_steps:
            raise ValueError(
                f"step_in_backward state was saved with accumulation_steps={state['accumulation_steps']}, this stepper "
                f"uses {self.accumulation_steps}"
            )
        if state["micro_step"] >= self.accumulation_steps:
            raise ValueError(f"step_in_backward state: micro_step {state['micro_step']} >= accumulation_steps")
        self.micro_step, self.steps = state["micro_step"], state["steps"]

    def remove(self) -> None:
        """Remove the hooks: the model and optimizer go back to ordinary ``backward()`` + ``step()``."""
        for h in self._handles:
            h.remove()
        self._handles = []


def step_in_backward(
    model: torch.nn.Module,
    optimizer: LowMemOptimizer,
    *,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    bucket_bytes: int = 0,
) -> BackwardStepper:
    """Step every parameter of ``optimizer`` inside ``backward()`` as soon as its gradient is complete, and free it.

    Args:
        accumulation_steps: update on every N-th backward pass (the others accumulate in ``.grad``).
        max_grad_norm: must be None or 0 (global-norm clipping cannot be done per layer; ValueError).
        bucket_bytes: 0 steps each parameter alone; N > 0 holds completed gradients until they reach N bytes and
            steps them together (one launch set per bucket, far less host work).

    Returns:
        The :class:`BackwardStepper` (its ``state_dict`` belongs in checkpoints; ``remove()`` undoes this).
    """
    if not isinstance(optimizer, LowMemOptimizer):
        raise TypeError(f"step_in_backward needs a lowmemopt optimizer, got {type(optimizer).__name__}")
    if not getattr(optimizer, "per_layer_updates", True):  # (the 1-bit optimizers: one communication per step)
        raise ValueError(
            f"{type(optimizer).__name__} does not support per-layer updates (step_in_backward): "
            "call optimizer.step() after backward()"
        )
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"Invalid accumulation_steps: {accumulation_steps!r} (must be an int >= 1)")
    if max_grad_norm:
        raise ValueError(
            f"step_in_backward cannot clip gradients by global norm (max_grad_norm={max_grad_norm}): each parameter is "
            "updated as soon as its own gradient is ready, before the others (and so the global norm) exist. Train "
            "without clipping (max_grad_norm=None / 0), or without per-layer updates (backward(), clip, "
            "optimizer.step())"
        )
    if any(group.get("capturable") for group in optimizer.param_groups):
        raise ValueError(
            "step_in_backward does not take capturable=True param groups: a capturable step is one "
            "optimizer.step() (a CUDA graph captures it whole), not updates inside backward()"
        )
    return BackwardStepper(model, optimizer, accumulation_steps, check_bucket_bytes(bucket_bytes))


def check_bucket_bytes(value: Any) -> int:
    """``bucket_bytes`` checked: an int >= 0 (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"step_in_backward: bucket_bytes must be an int >= 0, got {value!r}")
    return value
