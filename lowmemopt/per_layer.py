"""Per-layer updates inside the backward pass (the GaLore paper's "per-layer weight updates"): each parameter is
stepped as soon as its gradient is complete, in a post-accumulate-grad hook, and its gradient is freed at once, so
at most one parameter's gradient (plus those autograd is still producing) is alive instead of all of them.

    stepper = lowmemopt.step_in_backward(model, optimizer, accumulation_steps=4)
    for batch in batches:
        (model(batch).loss / 4).backward()    # every 4th backward updates the parameters and frees their gradients
        # no optimizer.step() / zero_grad() needed (at a step boundary optimizer.step() is a no-op: no gradients)
    torch.save({"opt": optimizer.state_dict(), "stepper": stepper.state_dict()}, path)

Gradient accumulation: the hooks count backward passes (a callback queued at the end of each one); gradients of the
first ``accumulation_steps - 1`` accumulate in ``.grad`` as usual and the last one steps. Accumulating gradients keeps
them all alive, which is what per-layer updates save: with accumulation the memory gain is only on the last
micro-batch.

Gradient clipping by global norm is refused: it needs every gradient before the first update, and here the first
update happens before the last gradient exists. Pass ``max_grad_norm`` only as None / 0 (a positive value raises);
``torch.nn.utils.clip_grad_norm_`` after ``backward()`` would see no gradients (they are freed) and clip nothing.

Non-finite gradients: as in ``optimizer.step()``, a parameter whose gradient has a NaN/Inf is skipped (value and state
unchanged, counted in ``optimizer.nonfinite_skips``, one warning per backward). Where the element-wise Triton kernels
step the parameter (AdamW / Adam, SGD, Lion on a GPU, nothing paged, projected or sharded), the skip is decided on the
device (:mod:`lowmemopt.pipeline.finite`) and the flags are read once, at the end of the backward pass; elsewhere the
check costs one host synchronization per parameter (``step()`` batches it per device).

Checkpointing: the optimizer's state is its ``state_dict()``; the stepper's (the micro-batch position) is
:meth:`BackwardStepper.state_dict`, restored with :meth:`BackwardStepper.load_state_dict`. Save at a step boundary:
mid-accumulation, the partial gradients live in ``.grad`` and are not part of any state dict, so ``state_dict()``
raises there.
"""

from __future__ import annotations

import warnings

import torch

from ._stacklevel import external_stacklevel
from .distributed.sharding import agree_finite, local_tensor
from .optimizer import LowMemOptimizer, _finite_flags
from .pipeline.finite import DeviceFlags, resolve

__all__ = ["BackwardStepper", "step_in_backward", "step_one"]


def step_one(optimizer: LowMemOptimizer, p: torch.Tensor, group: dict, pending: list[DeviceFlags]) -> bool:
    """Step ``p`` with its gradient ``p.grad`` (not sparse) as a per-layer hook does, through the step pipeline (paged
    state fetched and written back, the fused kernels where its device has them). The non-finite check: decided on
    the device where the kernels allow it (the flags are appended to ``pending``, for one :func:`resolve` at the end
    of the backward pass), else on the host now (a DTensor's ranks agree on it). Returns False when the host skipped
    ``p`` for a non-finite gradient. ``bench/host_overhead.py --mode per-layer`` measures this."""
    if torch.is_grad_enabled():  # (a hook inside backward() runs with grad mode off already)
        with torch.no_grad():
            return step_one(optimizer, p, group, pending)
    local = local_tensor(p.grad)  # a DTensor (FSDP2): check the local shard, then agree across its ranks
    flags = optimizer.device_flags([(p, group)], [local], optimizer._pager_for(group))
    if flags is not None:  # decided by the kernel on the device; read at the end of the backward pass
        optimizer._step_alone(p, group, flags)
        pending.append(flags)
    elif agree_finite(_finite_flags([local]), [p], [p.grad])[0]:
        optimizer._step_alone(p, group)
    else:
        return False
    return True


class BackwardStepper:
    """The handle :func:`step_in_backward` returns: hook bookkeeping, ``state_dict`` / ``load_state_dict``,
    ``remove``."""

    def __init__(self, model: torch.nn.Module, optimizer: LowMemOptimizer, accumulation_steps: int) -> None:
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.micro_step = 0  # backward passes done since the last update (0 .. accumulation_steps - 1)
        self.steps = 0  # updates done
        self._in_backward = False
        self._skipped = 0
        self._pending: list[DeviceFlags] = []  # this backward's device-side finiteness checks (pipeline.finite)
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
            raise TypeError(f"{type(self.optimizer).__name__} does not support sparse gradients")
        if not step_one(self.optimizer, p, self.optimizer.param_groups[self._group_of[p]], self._pending):
            self._skipped += 1
        p.grad = None

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self._skipped += resolve(self._pending)  # one synchronization per backward pass, none per parameter
        self._pending = []
        self.micro_step += 1
        if self.micro_step == self.accumulation_steps:
            self.micro_step = 0
            self.steps += 1
        if self._skipped:
            self.optimizer.nonfinite_skips += self._skipped
            warnings.warn(
                f"{type(self.optimizer).__name__} (step_in_backward): skipped {self._skipped} parameter(s) with NaN/Inf "
                "gradients this step (their values and optimizer state are unchanged)",
                RuntimeWarning,
                stacklevel=external_stacklevel(),  # the user's backward() line
            )
            self._skipped = 0

    def _step_pre_hook(self, optimizer, args, kwargs) -> None:
        if self.micro_step != 0:
            raise RuntimeError(
                "optimizer.step() called between micro-batches while step_in_backward accumulates gradients "
                f"({self.micro_step} of {self.accumulation_steps} backward passes done): the update happens in the "
                "last backward pass; do not call step() (or zero_grad()) in between"
            )

    # -- state -----------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The stepper's position: ``{"accumulation_steps", "micro_step", "steps"}`` (ints). Raises RuntimeError
        mid-accumulation (see the module docstring)."""
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
) -> BackwardStepper:
    """Step every parameter of ``optimizer`` inside ``backward()``, as soon as its gradient is complete, and free the
    gradient (module docstring). Works with every lowmemopt optimizer and with GaLore groups. Returns the
    :class:`BackwardStepper` (keep it: its ``state_dict`` belongs in checkpoints; ``remove()`` undoes this).

    ``accumulation_steps``: update on every N-th backward pass (gradients of the others accumulate in ``.grad``).
    ``max_grad_norm``: global-norm gradient clipping cannot be done per layer; a positive value raises ValueError."""
    if not isinstance(optimizer, LowMemOptimizer):
        raise TypeError(f"step_in_backward needs a lowmemopt optimizer, got {type(optimizer).__name__}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"Invalid accumulation_steps: {accumulation_steps!r} (must be an int >= 1)")
    if max_grad_norm:
        raise ValueError(
            f"step_in_backward cannot clip gradients by global norm (max_grad_norm={max_grad_norm}): each parameter is "
            "updated as soon as its own gradient is ready, before the others (and so the global norm) exist. Train "
            "without clipping (max_grad_norm=None / 0), or without per-layer updates (backward(), clip, "
            "optimizer.step())"
        )
    return BackwardStepper(model, optimizer, accumulation_steps)
