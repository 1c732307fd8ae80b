"""LowMemOptimizer: the base class of every lowmemopt optimizer, the ``torch.optim`` contract.

It checks arguments, owns the param groups and the state-dict hooks, and its ``step()`` (and the per-layer hook,
:meth:`LowMemOptimizer._step_some`) builds one :class:`~lowmemopt.pipeline.plan.Plan` and calls
:func:`lowmemopt.pipeline.run`, the one way through a step (docs/architecture.md). An optimizer class supplies its
argument checks and its :class:`~lowmemopt.pipeline.algorithm.Algorithm` (slots, fp32 math, fused kernels).
Storage options: README's "Choosing an optimizer" and docs/state_format.md; non-finite gradients and
``torch.amp.GradScaler``: docs/internals.md; torch.optim's keywords and what differs: docs/torch_optim.md.
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
from .distributed.rounds import ReductionRounds
from .distributed.sharding import is_dtensor, local_tensor
from .group_keys import GroupKeyWatch, check_new_group, group_keys_loaded, group_keys_pre_hook
from .pipeline.algorithm import Algorithm, fused
from .pipeline.backends import init_state
from .pipeline.fits import check_grad
from .pipeline.finite import CpuFiniteChecks, DeviceFlags, PendingSkip
from .pipeline.plan import Plan, StepRecord, inv_scale
from .pipeline.program import StateDict, StepProgram
from .projection.stage import GALORE as galore
from .quant.formats import Slot, default_block_size
from .signature import checked_init, set_signature
from .state_dicts import (
    FORMAT_VERSION,
    STORAGE_DEFAULTS,
    load_state_dict_post_hook,
    load_state_dict_pre_hook,
    state_dict_post_hook,
    state_dict_pre_hook,
)
from .work.items import LOW_RANK
from .work.record import BucketRecord

__all__ = ["LowMemOptimizer", "Slot", "FORMAT_VERSION", "STORAGE_DEFAULTS", "algorithm", "kernel_algorithm"]

#: the non-finite check decided on the device where the kernels allow it (:mod:`lowmemopt.pipeline.finite`); False:
#: always on the host, before the step (tests compare both)
DEFER_FINITE_CHECK = True


_first, _second, _grad = operator.itemgetter(0), operator.itemgetter(1), operator.attrgetter("grad")

#: the decorator that marks an algorithm's math with its fused backends' name
#: (:func:`lowmemopt.pipeline.algorithm.fused`)
algorithm = fused


def kernel_algorithm(optimizer: "LowMemOptimizer | type") -> str | None:
    """The name of the fused algorithm an optimizer (instance or class) runs, or None: its
    :class:`~lowmemopt.pipeline.algorithm.Algorithm`'s (:func:`~lowmemopt.pipeline.algorithm.fused_name`)."""
    alg = optimizer.algorithm
    return None if alg is None else alg.fused


# ---------------------------------------------------------------------------------------------------------------------


class LowMemOptimizer(torch.optim.Optimizer):
    """Base class: a ``torch.optim.Optimizer`` whose state is made lazily in the format its param group asks for.

    Args (keyword-only on every optimizer, also settable per param group):
        state_bits: 32 (fp32 state; float64 for float64 parameters), 16 (bf16), 8 or 4 (block-wise quantization).
        block_size: elements per quantization block, a power of two >= 16 (default 256; 128 at 4 bits).
        min_quant_numel: tensors with fewer elements keep fp32 state.
        paged: False, True / ``"cpu"`` (host RAM) or ``"disk"`` (files in ``offload_dir``) between steps; with
            ``page_budget_bytes`` (``"auto"``: what the device has room for, less ``page_headroom_bytes``) kept
            resident (docs/paging.md).
        bf16_update: how a bf16 / fp16 parameter takes the fp32 result: ``"nearest"``, ``"stochastic"`` or
            ``"kahan"`` (docs/rounding.md).
        capturable: a step that reads nothing back from the GPU (CUDA graphs).
        foreach, fused, differentiable: torch.optim's, accepted for drop-in use; they choose nothing
            (``differentiable=True`` is refused; docs/torch_optim.md).
    """

    #: the algorithm the pipeline runs for this class: slots, fp32 math, step scalars, decay rules
    algorithm: Algorithm | None = None
    #: ``torch.amp.GradScaler`` hands ``step()`` the scale and its Inf check (``grad_scale``, ``found_inf``) instead of
    #: unscaling the gradients itself and reading ``found_inf`` on the host (docs/internals.md)
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
        if "__init__" in cls.__dict__ and cls.__module__.startswith("lowmemopt."):  # (a user's subclass: its own)
            cls.__init__ = checked_init(cls, cls.__dict__["__init__"])  # a misspelt keyword named as such

    def _attach(self) -> None:
        """Install the state-dict and step hooks and runtime fields; also after unpickling or ``copy.deepcopy``."""
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

    def _init_state(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        slots: dict[str, Slot],
        state: dict[str, Any] | None = None,
        numel: int | None = None,
        reduce: Reduction = LOCAL,
    ) -> dict[str, Any]:
        """Zero state for ``p`` in ``slots``' formats, in ``self.state[p]`` unless ``state`` is given
        (:func:`lowmemopt.pipeline.backends.init_state`)."""
        return init_state(p, BucketRecord.of(group), slots, self.state[p] if state is None else state, numel, reduce)

    def _first_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Make ``p``'s state as its first step would (a GaLore group: the low-rank slots and an empty projector), in
        ``self.state[p]``; the paging manager calls it on a meta twin of ``p`` to learn the layout ahead."""
        if group.get("rank") is not None:
            return galore.init_projected_state(self._plan(), p, group)
        local = local_tensor(p)  # a DTensor's state is its local shard's, its formats picked by the whole size
        return self._init_state(local, group, self._slots(group, local), self.state[p], numel=p.numel())

    def _plan(self, grad_mult: torch.Tensor | None = None, found_inf: torch.Tensor | None = None, **mode: Any) -> Plan:
        """The plan handed to the step pipeline (:class:`lowmemopt.pipeline.plan.Plan`)."""
        alg = self.algorithm
        return Plan(
            alg,
            self.state,
            self.param_groups,
            alg.kernels,
            self._record,
            galore,
            grad_mult,
            found_inf,
            communicate=self._communicate,
            reductions=ReductionRounds(),
            defer_finite=DEFER_FINITE_CHECK,
            first_state=self._first_state,
            **mode,
        )

    def _amp_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(gradient multiplier, found_inf)`` that ``GradScaler.step`` set for this step, or Nones
        (docs/internals.md#mixed-precision-gradscalers-native-path).
        """
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
        state.update(
            _nonfinite_skips=self.nonfinite_skips, _default_block_size=self._default_block_size, _record=self._record
        )
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
        if (
            getattr(self, "_default_block_size", False)
            and isinstance(param_group, dict)
            and "state_bits" in param_group
            and param_group.get("block_size") is None
        ):
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
                raise ValueError(
                    f"{type(self).__name__} does not support capturable=True (it has no fused kernel that "
                    "reads the step's scalars on the device)"
                )
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
        """Perform one optimization step (optionally re-evaluating the loss with ``closure``); ``GradScaler.step`` calls
        it with ``grad_scale`` and ``found_inf`` set (docs/internals.md).
        """
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
        if (
            found_inf is not None
            and found_inf.device.type == "cpu"
            and not pipeline.triton_usable({found_inf.device})
            and found_inf.reshape(-1).tolist()[0] != 0
        ):
            return loss  # the scaler found an Inf / NaN: skip the step (on the host: nothing to wait for)
        # (values of the whole step, e.g. a global gradient norm; of the unscaled gradients under loss scaling)
        work = self.algorithm.step_work(work) if mult is None else self.algorithm.step_work(work, mult)
        capturable = self._capturable(work, groups)
        plan = self._plan(
            mult, found_inf, work=work, capturable=capturable, pager=paging.pager_of(self), program=self._program
        )
        self._run(plan)
        return loss

    def _run(self, plan: Plan) -> None:
        """Run ``plan`` and take what it left: the launch tables to keep (also when it raised), the skips to count
        now or at the next step, a capturable step's count of skips on the device."""
        try:
            outcome = pipeline.run(plan)
        finally:
            self._program = plan.program
        if outcome.pending is not None:
            self._pending_skip = outcome.pending
        self._count_skips(outcome.skipped, "this step")
        skipped = outcome.device_skipped
        if skipped is not None:
            if self._device_skips is None or self._device_skips.device != skipped.device:
                if self._device_skips is not None:  # (moved to another device: fold the old count in, once)
                    self._nonfinite_skips += int(self._device_skips.item())
                self._device_skips = torch.zeros((), dtype=torch.int64, device=skipped.device)
            self._device_skips.add_(skipped)

    @property
    def nonfinite_skips(self) -> int:
        """Parameters skipped for a NaN/Inf gradient so far (docs/internals.md#non-finite-gradients). Capturable steps
        count theirs on the device: reading this then waits for the device."""
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
        """Is this a capturable step? Raises ValueError before anything changes where one cannot be made."""
        modes = {bool(group.get("capturable", False)) for group in groups}
        if modes == {False}:
            return False
        if len(modes) > 1:
            raise ValueError("capturable=True is set in some param groups and not in others: a step is captured whole")
        for group in groups:
            check_storage(group)  # (paging, stochastic rounding, GaLore: changed since the group was added)
        devices = {p.device for p, _ in work}
        if len(devices) != 1 or not pipeline.triton_usable(devices):
            raise ValueError(
                f"capturable=True needs every parameter on one CUDA device with the fused Triton kernels "
                f"(got {sorted(map(str, devices))})"
            )
        if not DEFER_FINITE_CHECK:
            raise ValueError("capturable=True needs the non-finite check on the device (DEFER_FINITE_CHECK)")
        state = self.state
        for p, _ in work:
            if is_dtensor(p):
                raise ValueError("capturable=True does not take DTensor (FSDP2) parameters")
            if LOW_RANK in state.get(p, ()):
                raise ValueError("capturable=True: a parameter has GaLore state from a projected group")
        return True

    def device_flags(
        self,
        work: list[tuple[torch.Tensor, dict]],
        grads: list[torch.Tensor],
        pager: Any,
        pipe: CpuFiniteChecks | None = None,
    ) -> DeviceFlags | None:
        """The finiteness of ``grads`` as flags on the device where the kernels can read them, else None
        (:func:`lowmemopt.pipeline.device_flags`; always None with ``DEFER_FINITE_CHECK`` off)."""
        if not DEFER_FINITE_CHECK:
            return None
        return pipeline.device_flags(self._plan(), work, grads, pager, pipe)

    def _step_some(self, work: list[tuple[torch.Tensor, dict[str, Any]]], flags: DeviceFlags | None = None) -> None:
        """Step ``work``'s parameters (gradients known finite, or checked by ``flags`` on the device) through the
        pipeline: the per-layer updates inside ``backward()``.
        """
        if any(group.get("capturable") for _, group in work):
            raise ValueError("capturable=True param groups step in optimizer.step() only, not in per-layer updates")
        # (with flags, device_flags vouches that nothing moves: resident paged state is unpaged)
        plan = self._plan(
            work=work,
            finite_known=True,
            flags=flags,
            pager=self._pager_for(work) if flags is None else None,
            program=self._program,
        )
        self._run(plan)

    def _pager_for(self, work: list[tuple[torch.Tensor, dict[str, Any]]]) -> Any:
        """The optimizer's pager if a param group of ``work`` is paged, or was (its state comes back), else None."""
        pager = paging.pager_of(self)
        return pager if pager is not None and any(paging.tier_of(g) or p in pager.entries for p, g in work) else None

    def close(self, *, keep_files: bool = False) -> None:
        """Free paged state's host memory and files (``keep_files=True`` keeps the files and a ``manifest.json``); the
        optimizer cannot step again. Also done at garbage collection or exit; nothing to do unpaged.
        """
        paging.close(self, keep_files=keep_files)

    def paging_report(self) -> paging.PagingReport:
        """Where the paged state is: per device, what stays resident and what pages (``print`` it for a summary);
        per parameter, ``(label, where, bytes)``. Empty for an unpaged optimizer (see docs/paging.md)."""
        return paging.report(self)

    # -- introspection -------------------------------------------------------------------------------------------------

    def state_nbytes(self) -> int:
        """Bytes held by optimizer state tensors (all params)."""
        return sum(
            v.numel() * v.element_size()
            for st in self.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
