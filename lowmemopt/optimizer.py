"""LowMemOptimizer: the base class every lowmemopt optimizer derives from, the ``torch.optim`` contract.

It checks arguments, owns the param groups and the state-dict hooks, and its ``step()`` hands the step pipeline a plan
(:mod:`lowmemopt.pipeline.plan`: the class's :class:`~lowmemopt.pipeline.algorithm.Algorithm`, the state dict, the
param groups, the fused backend's name, the GaLore stage) with the parameters that have gradients. The pipeline
(:mod:`lowmemopt.pipeline`, ``docs/pipeline.md``) runs every stage and backend; an optimizer class supplies only its
argument checks and its algorithm (slots and fp32 math)::

    for each param with a finite gradient:
        decode state (fp32)  ->  delta = algorithm(p, g, state, group, step)  ->  encode state  ->  p += delta

Storage options (constructor keywords, also settable per param group):

* ``state_bits``: 32 (fp32 state; float64 for float64 parameters, whose math is float64 as torch's:
  :mod:`lowmemopt.quant.formats`), 16 (bf16), 8 or 4 (block-wise quantization, see :mod:`lowmemopt.quant`; 4-bit
  state steps through the fused kernels too).
* ``block_size``: elements per quantization block (a power of two >= 16); default (None) 256, or 128 where
  ``state_bits`` is 4 (a param group that sets ``state_bits`` and no ``block_size`` gets its bits' default).
* ``min_quant_numel`` (4096): tensors with fewer elements keep fp32 state.
* ``paged`` (False), ``offload_dir``, ``page_budget_bytes`` ("auto"), ``page_headroom_bytes`` (None): keep the state
  in host RAM (``"cpu"``/True) or in files (``"disk"``) between steps, bringing each parameter's state to its device
  while it updates, except what the budget keeps resident ("auto": what a CUDA device has room for, less the headroom)
  (:mod:`lowmemopt.paging`: the pipeline's stage and write-back stages; the load and state_dict hooks keep it paged).
* ``bf16_update`` ("nearest"): how a bfloat16 or float16 parameter takes the fp32 result, round to nearest,
  ``"stochastic"`` or ``"kahan"`` (:mod:`lowmemopt.rounding`; state ``bf16_update.seed`` / ``bf16_update.kahan``).

Non-finite gradients (policy): before updating a parameter, ``step()`` checks its gradient. A parameter whose gradient
norm is not finite (a NaN or an Inf element, or elements beyond ~1e19 whose squares overflow fp32; a float64
gradient's norm is float64) is **skipped**: its
value, its state and its step count stay exactly as they were, so one bad batch can never write a NaN ``absmax`` that
would poison a quantization block for good. Skips are counted in ``optimizer.nonfinite_skips`` and warned about. The
check is one fused multi-tensor L2 norm per device up front (one host synchronization per step, none per parameter),
except in two cases. CPU parameters stepped by the native kernels: the bucket's one native call checks each gradient
before that parameter's update, while the previous one is updated (:mod:`lowmemopt.pipeline.native`); Adafactor's and
CAME's native step checks its own gradient in its first pass, before it writes anything (:mod:`lowmemopt.cpu.factored`);
and a kernel stepping one parameter at a time sums the squares of the next gradient while it steps
(:class:`~lowmemopt.pipeline.finite.CpuFiniteChecks`); each saves a separate pass over all gradients. Parameters of one
GPU that the Triton kernels step (every algorithm; GaLore parameters between basis refreshes), with no state moving
between host and device and nothing sharded: the skip is decided on the device (:mod:`lowmemopt.pipeline.finite`: the
kernels read the flags), and the host reads the flags only after every launch, so the GPU never waits for the host to
build the step.

Loss scaling (``torch.amp.GradScaler``): ``_step_supports_amp_scaling = True``, so ``scaler.step(opt)`` sets
``opt.grad_scale`` (the scale; None after ``scaler.unscale_(opt)``) and ``opt.found_inf`` (1.0 where a gradient had an
Inf / NaN) and calls ``step()`` instead of unscaling the gradients in a separate pass and reading ``found_inf`` on the
host. The plan carries ``grad_scale.double().reciprocal().float()`` (``unscale_``'s multiplier) and ``found_inf``;
every backend multiplies ``g`` by it as it loads it (the Triton kernels read it through a pointer, the native CPU
kernels as a scalar argument, the compiled path as a graph input), rounded to ``g``'s dtype as ``unscale_`` stores it,
so a step equals ``unscale_`` + ``step()`` bit for bit. The optimizer's own non-finite check is not run (the scaler
checked every gradient). A set ``found_inf`` skips the step: on the CPU it is read directly; on a device the Triton
kernels read it (the launches masked as by :class:`~lowmemopt.pipeline.finite.DeviceFlags`) and the host restores the
step counts at the next step (:class:`~lowmemopt.pipeline.finite.PendingSkip`: a non-blocking copy to pinned memory and
an event), elsewhere it is read before the step. Skipped steps are not counted in :attr:`nonfinite_skips`. fp16
gradients are accepted. The 1-bit optimizers (:mod:`lowmemopt.optim.onebit`) keep the generic path.

torch.optim's keywords (drop-in): every optimizer also takes ``foreach`` and ``fused`` (None or a bool, not both
True: torch's RuntimeError), for code written for ``torch.optim``. They choose nothing here: the fused kernels run
wherever the device has one (Triton on CUDA, native C on CPU) and the eager reference elsewhere, with the same results,
so neither is stored in the param groups (nor do they change ``_step_supports_amp_scaling``: see "Loss scaling"
above). ``differentiable=False`` is accepted and ``differentiable=True`` refused (the step writes
parameters and quantized state in place under ``no_grad``); ``capturable`` is a storage keyword (above). As in torch,
``lr`` may be a Tensor of one element in any shape (held as its 0-dim view, which an in-place scheduler update
reaches; one set on a group later is viewed so before the step), and ``betas`` (and ``weight_decay``) one-element Tensors, read once as Python numbers
(:func:`torch_scalars`). Complex parameters are refused (TypeError): optimize ``torch.view_as_real`` views, which is
how torch's Adam, AdamW and SGD step them.

GaLore (a param group with ``rank``), paging, FSDP2 shards and the backends (Triton on CUDA, native C on the CPU,
``torch.compile``, the eager reference) are stages and backends of the pipeline; all give the eager path's results
(to fp32 rounding).

State: plain named tensors and ints only (``step``, ``exp_avg.codes``, ``exp_avg.absmax``, ...), plus
``state_dict()["lowmemopt_format"]`` (:data:`FORMAT_VERSION`; format 1, whose 8-bit state is in bitsandbytes' dynamic
maps, still loads and is re-encoded into the ``pow2`` maps). ``load_state_dict`` keeps uint8 codes and fp32 state
exactly as saved (torch would cast floating state to the parameter's dtype) by setting the tensors aside in a pre-hook
and restoring them, moved to the parameter's device, in a post-hook. It also converts: each slot is stored in the format this optimizer's param group
asks for, whatever the state dict holds (lowmemopt state at 32/16/8/4 bits, ``torch.optim`` state, bitsandbytes 8-bit
state; see :func:`lowmemopt.quant.convert.convert_param_state`). Slots already in that format are kept as they are, with no
copy. Hyper-parameters come from the state dict, as in torch; storage options (``state_bits``, ``block_size``, ...)
stay this optimizer's. For safetensors files see :mod:`lowmemopt.checkpoint`.
"""

from __future__ import annotations

import operator
import os
import warnings
from typing import Any, Callable, Iterable

import torch

from . import paging, pipeline
from ._stacklevel import external_stacklevel
from .checks import _lr_views_pre_hook, check_param, check_storage, check_torch_flags, torch_scalars
from .distributed.reduction import LOCAL, Reduction
from .distributed.sharding import agree_finite, is_dtensor, local_tensor
from .group_keys import GroupKeyWatch, check_new_group, group_keys_loaded, group_keys_pre_hook
from .pipeline.algorithm import Algorithm, fused
from .pipeline.backends import init_state
from .pipeline.fits import check_grad, check_state_fits
from .pipeline.finite import CpuFiniteChecks, DeviceFlags, PendingSkip, host_flags
from .pipeline.plan import Plan, StepRecord, inv_scale
from .pipeline.program import Kept, StateDict, StepProgram
from .projection.stage import GALORE as galore
from .quant.formats import Slot, default_block_size
from .signature import set_signature
from .state_dicts import (
    FORMAT_VERSION, STORAGE_DEFAULTS, load_state_dict_post_hook, load_state_dict_pre_hook,
    state_dict_post_hook, state_dict_pre_hook,
)
from .work import capture
from .work.items import LOW_RANK
from .work.record import BucketRecord

__all__ = ["LowMemOptimizer", "Slot", "FORMAT_VERSION", "STORAGE_DEFAULTS", "algorithm", "kernel_algorithm"]

#: the non-finite check decided on the device where the kernels allow it (:mod:`lowmemopt.pipeline.finite`); False:
#: always on the host, before the step (tests compare both)
DEFER_FINITE_CHECK = True


_first, _second, _grad = operator.itemgetter(0), operator.itemgetter(1), operator.attrgetter("grad")

#: the decorator that marks an algorithm's math with its fused backends' name (:func:`lowmemopt.pipeline.algorithm.fused`)
algorithm = fused


def kernel_algorithm(optimizer: "LowMemOptimizer | type") -> str | None:
    """The name of the fused algorithm an optimizer (instance or class) runs, or None: its
    :class:`~lowmemopt.pipeline.algorithm.Algorithm`'s (:func:`~lowmemopt.pipeline.algorithm.fused_name`)."""
    alg = optimizer.algorithm
    return None if alg is None else alg.fused


# ---------------------------------------------------------------------------------------------------------------------


class LowMemOptimizer(torch.optim.Optimizer):
    """Base class: a ``torch.optim.Optimizer`` with lazily created, format-aware state. See the module docstring.

    Keyword-only, on every optimizer: the storage options (``state_bits``, ``block_size``, ``min_quant_numel``,
    ``paged``, ``offload_dir``, ``page_budget_bytes``, ``page_headroom_bytes``, ``bf16_update``, ``capturable``; also
    per param group) and
    torch.optim's ``foreach`` / ``fused`` (accepted, choose nothing: the fused kernels always run where they exist) and
    ``differentiable`` (False only)."""

    #: True: the update of element i depends only on element i of p, g and state (chunked execution is exact).
    #: the algorithm the pipeline runs for this class: slots, fp32 math, step scalars, decay rules
    algorithm: Algorithm | None = None
    #: ``torch.amp.GradScaler`` hands ``step()`` the scale and its Inf check (``grad_scale``, ``found_inf``) instead of
    #: unscaling the gradients itself and reading ``found_inf`` on the host (the module docstring, "Loss scaling")
    _step_supports_amp_scaling = True
    #: param group keys this class reads beyond its defaults (:mod:`lowmemopt.group_keys`: others are refused)
    _extra_group_keys: frozenset[str] = frozenset()
    #: the communicate stage the plan carries (``Plan.communicate``: the 1-bit optimizers' process-group
    #: communication around the update, :func:`lowmemopt.pipeline.communicating`), or None
    _communicate: Any = None

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        state_bits: int = 32,
        block_size: int | None = None,
        min_quant_numel: int = 4096,
        paged: bool | str = False,
        offload_dir: str | os.PathLike | None = None,
        page_budget_bytes: int | str = "auto",
        page_headroom_bytes: int | None = None,
        bf16_update: str = "nearest",
        capturable: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        check_torch_flags(foreach, fused, differentiable)  # accepted, not stored: see the class docstring
        defaults = dict(defaults)
        torch_scalars(defaults)
        self._default_block_size = block_size is None  # groups that set state_bits get their bits' block size
        if block_size is None and isinstance(state_bits, int):
            block_size = default_block_size(state_bits)
        defaults.update(
            state_bits=state_bits,
            block_size=block_size,
            min_quant_numel=min_quant_numel,
            paged=paged,
            offload_dir=offload_dir,
            page_budget_bytes=page_budget_bytes,
            page_headroom_bytes=page_headroom_bytes,
            bf16_update=bf16_update,
            capturable=capturable,
        )
        check_storage(defaults)
        self._check_group(defaults)
        self._nonfinite_skips = 0
        super().__init__(params, defaults)
        self._attach()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        set_signature(cls, LowMemOptimizer.__init__)  # the storage options by name, not **storage (lowmemopt.signature)

    def _attach(self) -> None:
        """What a lowmemopt optimizer has beyond torch's: its state-dict and step hooks and runtime fields. Also run
        after unpickling or ``copy.deepcopy`` (:meth:`__setstate__`), which torch restores without hooks: a copy would
        otherwise load 8-bit codes cast to the parameter's dtype."""
        self._versioned_state()
        self._device_skips: torch.Tensor | None = None  # capturable steps count their skips on the device
        self._load_stash: tuple[dict, dict] | None = None
        self._pending_skip: PendingSkip | None = None  # a step's skips decided on the device, read at the next step
        self._program: StepProgram | None = None  # the buckets of the last steps, launched again while they apply
        if "_record" not in self.__dict__:  # (kept by a copy: its refresh failures so far)
            self._record = StepRecord(owner=type(self).__name__)  # what steps report (GaLore refresh failures)
        self.register_state_dict_pre_hook(state_dict_pre_hook)
        self.register_state_dict_post_hook(state_dict_post_hook)
        self.register_load_state_dict_pre_hook(load_state_dict_pre_hook)
        self.register_load_state_dict_post_hook(load_state_dict_post_hook)
        self.register_step_pre_hook(_lr_views_pre_hook)
        self._group_keys = GroupKeyWatch(self.param_groups)  # unknown group keys: refused (lowmemopt.group_keys)
        self.register_step_pre_hook(group_keys_pre_hook)
        self.register_load_state_dict_post_hook(group_keys_loaded)

    # -- what an optimizer class provides -------------------------------------------------------------------------

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate the algorithm's hyper-parameters in ``group`` (raise ValueError / TypeError)."""

    # -- the algorithm's state, for the state-dict layer and the paging manager ---------------------------------------

    def _slots(self, group: dict[str, Any], param: torch.Tensor) -> dict[str, Slot]:
        """The state slots the algorithm declares for ``param`` (:meth:`Algorithm.slots`)."""
        return self.algorithm.slots(group, param)

    def _state_slots(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Slot]:
        """The slots ``p``'s state holds: the algorithm's, or for a parameter of a GaLore group (one with ``rank``) the
        same slots shaped for its low-rank gradient (:mod:`lowmemopt.projection`)."""
        if group.get("rank") is not None:
            return galore.projected_slots(self._plan(), group, p)
        return self._slots(group, local_tensor(p))  # a DTensor's state is its local shard's

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], slots: dict[str, Slot],
                    state: dict[str, Any] | None = None, numel: int | None = None,
                    reduce: Reduction = LOCAL) -> dict[str, Any]:
        """Zero state for ``p`` in ``slots``' formats, in ``self.state[p]`` unless ``state`` is given
        (:func:`lowmemopt.pipeline.backends.init_state`)."""
        return init_state(p, BucketRecord.of(group), slots, self.state[p] if state is None else state, numel,
                          reduce)

    def _first_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Make ``p``'s state as its first step would (a GaLore group: the low-rank slots and an empty projector), in
        ``self.state[p]``; the paging manager calls it on a meta twin of ``p`` to learn the layout ahead."""
        if group.get("rank") is not None:
            return galore.init_projected_state(self._plan(), p, group)
        return self._init_state(p, group, self._slots(group, p))

    def _plan(self, grad_mult: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> Plan:
        """The plan handed to the step pipeline: the algorithm, the state dict, the param groups, the fused backend's
        name, the GaLore stage and the communicate stage, if any (:mod:`lowmemopt.pipeline.plan`); a loss-scaled step's
        gradient multiplier and ``found_inf``."""
        alg = self.algorithm
        return Plan(alg, self.state, self.param_groups, alg.kernels, self._record, galore, grad_mult, found_inf,
                    communicate=self._communicate)

    def _amp_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(gradient multiplier, found_inf)`` that ``torch.amp.GradScaler.step`` set on this optimizer for this
        step (``grad_scale``: the scale, None once ``unscale_`` ran; ``found_inf``: float, nonzero where a gradient had
        an Inf / NaN), or Nones. The multiplier is ``unscale_``'s own: ``grad_scale.double().reciprocal().float()``."""
        grad_scale = getattr(self, "grad_scale", None)
        return (None if grad_scale is None else inv_scale(grad_scale)), getattr(self, "found_inf", None)

    def _resolve_pending(self) -> None:
        """Settle the previous step's skips decided on the device (:class:`~lowmemopt.pipeline.finite.PendingSkip`):
        restore the skipped parameters' step counts and, for the optimizer's own check, count and warn about them."""
        pending = self.__dict__.get("_pending_skip")
        if pending is not None:
            self._pending_skip = None
            skipped = pending.resolve()
            if pending.counted:
                self._count_skips(skipped, "in the previous step")

    def _count_skips(self, skipped: int, when: str) -> None:
        """Count ``skipped`` parameters of a step ``when`` it was taken, and warn about them."""
        if skipped:
            self._nonfinite_skips += skipped
            warnings.warn(
                f"{type(self).__name__}: skipped {skipped} parameter(s) with NaN/Inf gradients {when} "
                "(their values and optimizer state are unchanged)",
                RuntimeWarning,
                stacklevel=external_stacklevel(),  # the user's step() line, past torch's wrappers
            )

    @property
    def galore_refresh_failures(self) -> int:
        """GaLore basis refreshes whose SVD failed (the previous basis was kept)."""
        return self._record.galore_refresh_failures

    # -- param groups ----------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        self._resolve_pending()
        state = super().__getstate__()  # (pickling, deepcopy: torch's keys, and what ours cannot be rebuilt without)
        state.update(_nonfinite_skips=self.nonfinite_skips, _default_block_size=self._default_block_size,
                     _record=self._record)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # (load_state_dict, unpickling, deepcopy)
        # torch adds ``differentiable`` to the defaults for its own step decorator; lowmemopt has no such option, and
        # the load hook fills groups from the defaults: a loaded state dict would gain the key
        self.defaults.pop("differentiable", None)
        if "_load_stash" not in self.__dict__:  # unpickled or deep-copied: __init__ did not run
            self._attach()
        self._versioned_state()

    def _versioned_state(self) -> None:
        """``self.state`` as a :class:`~lowmemopt.pipeline.program.StateDict` (the same entries), whose replaced
        entries a step program sees."""
        if type(self.state) is not StateDict:
            self.state = StateDict(dict, self.state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if (getattr(self, "_default_block_size", False) and isinstance(param_group, dict)
                and "state_bits" in param_group and param_group.get("block_size") is None):
            param_group = {**param_group, "block_size": default_block_size(param_group["state_bits"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_new_group(self, group)
            torch_scalars(group)
            check_storage(group)
            self._check_group(group)
            kernels = self.algorithm.kernels if self.algorithm is not None else None
            if group.get("capturable") and not (kernels is not None and kernels.capturable):
                raise ValueError(f"{type(self).__name__} does not support capturable=True (it has no fused kernel that "
                                 "reads the step's scalars on the device)")
            if group.get("rank") is not None:  # a GaLore group: fill its defaults and check them
                galore.check_group(group)
            for i, p in enumerate(group["params"]):
                check_param(p, type(self).__name__, i, len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        if "_group_keys" in self.__dict__:  # (constructing: _attach sees every group)
            self._group_keys.add(group)

    # -- the step ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (optionally re-evaluating the loss with ``closure``). Under
        ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` calls it with ``grad_scale`` and ``found_inf`` set (the
        module docstring, "Loss scaling")."""
        self._resolve_pending()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        groups = []  # the groups with gradients this step
        for group in self.param_groups:
            n = len(work)
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse or grad.dtype != p.dtype:  # (refused before step_work reads it)
                    check_grad(p, self.param_groups, type(self).__name__)
                work.append((p, group))
            if len(work) > n:
                groups.append(group)
        if not work:
            return loss
        mult, found_inf = self._amp_inputs()
        if (found_inf is not None and found_inf.device.type == "cpu" and not pipeline.triton_usable({found_inf.device})
                and found_inf.reshape(-1).tolist()[0] != 0):
            return loss  # the scaler found an Inf / NaN: skip the step (on the host: nothing to wait for)
        # (values of the whole step, e.g. a global gradient norm; of the unscaled gradients under loss scaling)
        work = self.algorithm.step_work(work) if mult is None else self.algorithm.step_work(work, mult)
        capturable = self._capturable(work, groups)
        plan = self._plan(mult, found_inf)
        if self._program is None or capturable:  # (a kept program was made by a checked step: it checks what changed)
            check_state_fits(plan, work, type(self).__name__)
        if capturable:
            return self._capturable_step(work, groups, loss, mult, found_inf)
        pager = paging.pager_of(self)  # None unless a param group is paged
        if pager is not None:
            if not pager.begin(work, self._first_state):  # (checks, homes; False: all resident, an unpaged step)
                pager = None
        # (new seeds in work's order, paged or not; communicating: the 1-bit optimizers' stage around the rest)
        with pipeline.new_seeds(plan, work), pipeline.communicating(plan, work):
            self._step_planned(plan, work, pager)
        return loss

    def _step_planned(self, plan: Plan, work: list[tuple[torch.Tensor, dict[str, Any]]], pager: Any) -> None:
        """The non-finite check and the pipeline's pass over ``work`` (what :meth:`step` does once it has a plan):
        the kept :class:`~lowmemopt.pipeline.program.StepProgram` where it still applies, else the pipeline."""
        if self._program is not None and self._programmed(plan, work, pager):
            return
        if DEFER_FINITE_CHECK and pager is None and plan.communicate is None and \
                type(self.algorithm).step_work is Algorithm.step_work:
            plan.keep = Kept()  # (a step the kernels take whole keeps its buckets: the program of the next steps)
        grads = [local_tensor(p.grad) for p, _ in work]
        if plan.found_inf is not None:
            self._scaled_step(plan, work, grads, pager, plan.found_inf)
            return
        # Non-finite check (policy in the module docstring). CPU params stepped by the native kernels are checked in a
        # pipeline instead of up front: each kernel also scans the next such gradient (CpuFiniteChecks); paged ones
        # too (a skipped parameter's state goes home unchanged).
        pipe = CpuFiniteChecks([p for p, _ in work], grads, any(is_dtensor(p) for p, _ in work))
        finite: list[bool | None] = [None] * len(work)
        on_device = pipeline.device_flags(plan, work, grads, pager, pipe) if DEFER_FINITE_CHECK else None
        if on_device is not None:  # no synchronization: the kernels read the device's flags
            finite = [True] * len(work)  # provisionally
            pipeline.run(plan, [(i, p, group) for i, (p, group) in enumerate(work)], finite, grads, pipe, pager,
                         on_device)
            if not on_device.read:  # settled at the next step, from a copy made without waiting
                self._pending_skip = on_device.deferred(counted=True)
                self._keep_program(plan, work)
                return
            on_device.undo_skipped()  # (read already: a parameter took a per-tensor backend)
            finite = [on_device.finite(p) for p, _ in work]
        else:
            upfront = [i for i in range(len(work)) if pipe is None or i not in pipe.indices]
            flags = agree_finite(host_flags([grads[i] for i in upfront]), [work[i][0] for i in upfront],
                                 [grads[i] for i in upfront])
            for i, ok in zip(upfront, flags):
                finite[i] = ok
            todo = [(i, p, group) for i, (p, group) in enumerate(work) if finite[i] is not False]
            pipeline.run(plan, todo, finite, grads, pipe, pager)
        self._count_skips(sum(f is False for f in finite), "this step")

    @property
    def nonfinite_skips(self) -> int:
        """Parameters skipped for a NaN/Inf gradient so far (see the module docstring). Capturable steps count theirs
        on the device: reading this then waits for the device."""
        self._resolve_pending()
        n = self._nonfinite_skips
        if self._device_skips is not None:
            n += int(self._device_skips.item())
        return n

    @nonfinite_skips.setter
    def nonfinite_skips(self, value: int) -> None:
        self._resolve_pending()
        self._nonfinite_skips = int(value)
        self._device_skips = None

    def _capturable(self, work: list[tuple[torch.Tensor, dict]], groups: list[dict]) -> bool:
        """Is this a capturable step (``capturable=True``, :mod:`lowmemopt.work.capture`)? ``groups``: those of
        ``work``. Raises ValueError before anything changes where one cannot be made: some groups capturable and
        others not, several devices, no fused kernels there, DTensor shards, or a group changed since construction
        (paged, GaLore)."""
        modes = {bool(group.get("capturable", False)) for group in groups}
        if modes == {False}:
            return False
        if len(modes) > 1:
            raise ValueError("capturable=True is set in some param groups and not in others: a step is captured whole")
        for group in groups:
            check_storage(group)  # (paging, stochastic rounding, GaLore: changed since the group was added)
        devices = {p.device for p, _ in work}
        if len(devices) != 1 or not pipeline.triton_usable(devices):
            raise ValueError(f"capturable=True needs every parameter on one CUDA device with the fused Triton kernels "
                             f"(got {sorted(map(str, devices))})")
        if not DEFER_FINITE_CHECK:
            raise ValueError("capturable=True needs the non-finite check on the device (DEFER_FINITE_CHECK)")
        state = self.state
        for p, _ in work:
            if is_dtensor(p):
                raise ValueError("capturable=True does not take DTensor (FSDP2) parameters")
            if LOW_RANK in state.get(p, ()):
                raise ValueError("capturable=True: a parameter has GaLore state from a projected group")
        return True

    def _scaled_step(self, plan: Plan, work: list[tuple[torch.Tensor, dict]], grads: list[torch.Tensor], pager: Any,
                     found_inf: torch.Tensor) -> None:
        """A step under ``torch.amp.GradScaler`` with its ``found_inf`` (a set one on the CPU was read in :meth:`step`,
        unless the Triton kernels take CPU tensors: the interpreter). The scaler checked every gradient already, so
        there is no check of the optimizer's own: the
        kernels read ``found_inf`` on the device and store nothing when it is set, and the host reads it at the next
        step (:class:`~lowmemopt.pipeline.finite.PendingSkip`) to restore the step counts. Where the kernels cannot
        decide it on the device (per-tensor backends, state that moves, several devices) it is read now."""
        todo = [(i, p, group) for i, (p, group) in enumerate(work)]
        finite: list[bool | None] = [True] * len(work)
        flags = pipeline.device_flags(plan, work, grads, pager, None, found_inf) if DEFER_FINITE_CHECK else None
        if flags is None:
            if found_inf.reshape(-1).tolist()[0] != 0:  # (a device's: a synchronization; a CPU one is read directly)
                return
            pipeline.run(plan, todo, finite, grads, None, pager)
            return
        pipeline.run(plan, todo, finite, grads, None, pager, flags)
        self._pending_skip = flags.deferred()
        self._keep_program(plan, work)

    def _keep_program(self, plan: Plan, work: list[tuple[torch.Tensor, dict]]) -> None:
        """Keep this step's buckets as the program of the next steps where the kernels took it whole
        (:class:`~lowmemopt.pipeline.program.StepProgram`)."""
        kept = plan.keep
        if kept is not None and kept.planned and sum(len(pl.members) for pl in kept.planned) == len(work):
            self._program = StepProgram(plan, work, kept)

    def _programmed(self, plan: Plan, work: list[tuple[torch.Tensor, dict]], pager: Any) -> bool:
        """Take this step through the kept program if it still applies (its module docstring says when); True if it
        did. The step's skips are settled at the next step, as the pipeline's device-side check's."""
        params = list(map(_first, work))
        grads = list(map(_grad, params))
        if pager is not None or plan.communicate is not None or not DEFER_FINITE_CHECK or \
                not self._program.matches(self.state, params, list(map(_second, work)), grads):
            self._program = None
            check_state_fits(plan, work, type(self).__name__)  # (what changed may be a parameter's shape)
            return False
        self._pending_skip = self._program.step(plan, grads)
        return True

    def _capturable_step(self, work: list[tuple[torch.Tensor, dict]], groups: list[dict], loss: Any,
                         mult: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> Any:
        """A step that reads nothing back from the device (:mod:`lowmemopt.work.capture`): the non-finite check,
        the step counts and the step's scalars stay there, and skips are counted in a device tensor, not warned
        about. ``groups``: those of ``work``. Under loss scaling (``mult``, ``found_inf``) the scaler's flag replaces
        the check and a skipped step is not counted (as ``unscale_`` + ``step()``, which skip the call)."""
        grads = [local_tensor(p.grad) for p, _ in work]
        device = grads[0].device
        if capture.capturing(device):
            for group in groups:
                lr = group["lr"]
                if lr is not None and not (isinstance(lr, torch.Tensor) and lr.device == device):
                    warnings.warn(f"{type(self).__name__}: lr={lr!r} is not a tensor on {device}: the captured step "
                                  "keeps this value at every replay. Give lr as a tensor on the device (a scheduler "
                                  "fills it in place) to change it between replays", RuntimeWarning,
                                  stacklevel=external_stacklevel())
                    break
        params = [p for p, _ in work]
        if found_inf is not None:
            flags = DeviceFlags.from_found_inf(params, found_inf.to(device, non_blocking=True))
        else:
            flags = DeviceFlags(params, grads)
        pipeline.run(self._plan(mult, found_inf), [(i, p, group) for i, (p, group) in enumerate(work)],
                     [True] * len(work), grads, None, None, flags, device_steps=True)
        if found_inf is not None:
            return loss
        skipped = (flags.tensor == 0).sum()
        if self._device_skips is None or self._device_skips.device != skipped.device:
            if self._device_skips is not None:  # (moved to another device: fold the old count in, once)
                self._nonfinite_skips += int(self._device_skips.item())
            self._device_skips = torch.zeros((), dtype=torch.int64, device=skipped.device)
        self._device_skips.add_(skipped)
        return loss

    def device_flags(self, work: list[tuple[torch.Tensor, dict]], grads: list[torch.Tensor], pager: Any,
                     pipe: CpuFiniteChecks | None = None) -> DeviceFlags | None:
        """The finiteness of ``grads`` as flags on the device where the kernels can read them, else None
        (:func:`lowmemopt.pipeline.device_flags`; always None with ``DEFER_FINITE_CHECK`` off)."""
        if not DEFER_FINITE_CHECK:
            return None
        return pipeline.device_flags(self._plan(), work, grads, pager, pipe)

    def _step_some(self, work: list[tuple[torch.Tensor, dict[str, Any]]], flags: DeviceFlags | None = None) -> None:
        """Step ``work``'s parameters, whose gradients (``p.grad``) are known to be finite, or whose finiteness
        ``flags`` holds on the device (:meth:`device_flags`), through the pipeline as ``step()`` does (state fit
        check, paging, the fused kernels): the per-layer updates inside ``backward()``
        (:func:`lowmemopt.step_in_backward`), one parameter or a bucket of them at a time."""
        if any(group.get("capturable") for _, group in work):
            raise ValueError("capturable=True param groups step in optimizer.step() only, not in per-layer updates")
        plan = self._plan()
        check_state_fits(plan, work, type(self).__name__)
        pager = None
        if flags is None:  # (with flags, device_flags vouches that nothing moves: resident paged state is unpaged)
            pager = self._pager_for(work)
            if pager is not None and not pager.begin(work, self._first_state):
                pager = None  # (nothing of work moves: the unpaged step, as in step())
        with pipeline.new_seeds(plan, work):
            pipeline.run(plan, [(i, p, group) for i, (p, group) in enumerate(work)], [True] * len(work),
                         [local_tensor(p.grad) for p, _ in work], None, pager, flags)

    def _pager_for(self, work: list[tuple[torch.Tensor, dict[str, Any]]]) -> Any:
        """The optimizer's pager if a param group of ``work`` is paged, or was (its state comes back), else None."""
        pager = paging.pager_of(self)
        return pager if pager is not None and any(paging.tier_of(g) or p in pager.entries for p, g in work) else None

    def close(self, *, keep_files: bool = False) -> None:
        """Free what paged state holds: its host memory and its files in ``offload_dir`` (``keep_files=True`` keeps
        the files, described by a ``manifest.json``). The paged state is dropped and the optimizer cannot step again.
        Also done when the optimizer is garbage-collected or Python exits. Nothing to do for an unpaged optimizer."""
        paging.close(self, keep_files=keep_files)

    def paging_report(self) -> paging.PagingReport:
        """Where the paged state is: per device, what stays resident and what pages (``print`` it for a summary);
        per parameter, ``(label, where, bytes)``. Empty for an unpaged optimizer (see docs/paging.md)."""
        return paging.report(self)

    # -- introspection -------------------------------------------------------------------------------------------------

    def state_nbytes(self) -> int:
        """Bytes held by optimizer state tensors (all params)."""
        return sum(
            v.numel() * v.element_size() for st in self.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        )
