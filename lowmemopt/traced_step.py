"""The peak memory of one whole training step (forward, loss, backward, the optimizer's update), traced on fake
tensors: nothing is allocated, and a 7B config traces in well under a minute on a laptop CPU.

:func:`trace_step` builds the transformers model from its config, gives it fake storage (``FakeTensorMode``), lays the
optimizer's state out with the optimizer's own code (``_first_state``: its slot declarations, formats, block sizes,
GaLore's low-rank slots and basis) and runs the model's real forward, loss and backward under
:class:`~lowmemopt.memtrace.LiveMemory`. The update itself (native C or Triton kernels, which cannot read fake
tensors) is counted by construction (:func:`step_workspace`): the fused kernels update state in place; GaLore holds
its projected gradient, the low-rank update and the full-size update of one matrix (whole-model steps: the projected
gradients of all matrices), and at a basis refresh the SVD's factors. :func:`measure_step` runs the same step for
real and measures it the same way (``tests/test_estimate_traced.py`` compares the two).
"""

from __future__ import annotations

import math

import time
import warnings
from typing import Any, Mapping, NamedTuple

import torch

from .memtrace import CATEGORIES, LiveMemory

__all__ = ["StepPeak", "build_optimizer", "cheaper_steps", "measure_step", "real_model", "step_workspace", "trace_step"]

#: the CUDA caching allocator's smallest block: every allocation there is rounded up to it
CUDA_BLOCK = 512


class StepPeak(NamedTuple):
    """The peak of one training step and what was live at that moment (bytes by :data:`~lowmemopt.memtrace.
    CATEGORIES`)."""

    optimizer: str
    state_bits: int
    galore_rank: int | None
    batch: int
    seq: int
    checkpointing: bool
    per_layer: bool
    params: int  # trainable parameters
    peak: int
    at_peak: dict[str, int]
    seconds: float  # how long the trace (or the real step) took

    @property
    def total(self) -> int:
        """The peak (the figure that must fit)."""
        return self.peak


def build_optimizer(
    model: torch.nn.Module,
    optimizer: str,
    state_bits: int,
    galore_rank: int | None = None,
    galore_target_modules: Any = "all-linear",
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer`` (a registry name) on ``model``'s parameters as ``lowmemopt estimate`` builds it (GaLore groups if
    ``galore_rank`` is given, else the class's own groups).
    """
    from .estimate import _optimizer_for

    return _optimizer_for(model, optimizer, state_bits, galore_rank, galore_target_modules, optimizer_kwargs)


def _matrices(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    return [(p, g) for g in opt.param_groups if g.get("rank") is not None for p in g["params"]]


def step_workspace(
    opt: torch.optim.Optimizer, device: str = "cuda", per_layer: bool = False, refresh: bool = True
) -> dict[Any, int]:
    """Bytes the optimizer's update holds beyond the state: ``{param: bytes}`` for a per-layer step, ``{None: bytes}``
    for a whole-model step (GaLore's and APOLLO's temporaries; the fused kernels hold none; ``refresh``: count a basis
    refresh).
    """
    from .pipeline.backends import CHUNK_NUMEL
    from .projection import projector as pj
    from .projection.gather import proj_dtype

    from .optim.apollo import APOLLOAdamW

    apollo = isinstance(opt, APOLLOAdamW)
    held: dict[Any, int] = {}
    low_total, largest = 0, 0
    for p, group in _matrices(opt):
        m, n = pj.matrix_shape(p.shape)
        side = pj.choose_side(group.get("proj_type", "std"), m, n)
        k = min(group["rank"], m, n)
        low = k * n if side == pj.LEFT else m * k if side == pj.RIGHT else k * k
        copy = 0 if p.dtype == torch.float32 else m * n * 4
        if apollo:  # the fp32 gradient, this step's random projection, low-rank gradient and update, the scaled update
            low_bytes = 2 * low * 4
            one = copy + m * n * 4 + k * (m if side == pj.LEFT else n) * 4 + low_bytes + m * n * 4
        else:
            narrow = proj_dtype(group, p)
            product = 0 if narrow is None else low * torch.finfo(narrow).bits // 8
            low_bytes = 2 * low * 4 + product  # low-rank gradient and update in fp32 (+ the narrow product)
            rows = m if device == "cuda" else max(1, min(m, CHUNK_NUMEL // max(n, 1)))
            full = rows * n * (4 + (0 if narrow is None else torch.finfo(narrow).bits // 8))
            kk = min(m, n)
            svd = copy + (m * kk + kk * n + kk) * 4 if refresh else 0
            # proj_bits < 32: the basis decoded to fp32 for the products (one matrix's at a time)
            basis = (
                0
                if group.get("proj_bits", 32) == 32
                else sum(map(math.prod, pj.basis_shapes(m, n, k, side).values())) * 4
            )
            one = max(low_bytes + full + copy, svd) + basis
        if per_layer:
            held[p] = one
        low_total += low_bytes
        largest = max(largest, one - low_bytes)
    if not per_layer and largest:
        held[None] = low_total + largest
    return held


def _checkpointing(model: torch.nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _run(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: int,
    seq: int,
    per_layer: bool,
    tracker: LiveMemory,
    real: bool,
    device: str,
    refresh: bool = True,
) -> None:
    """One step under ``tracker``: real (the optimizer's own step, or :func:`lowmemopt.step_in_backward`) or traced
    (the state by construction, the update's workspace held for a moment)."""
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is None or not hasattr(model, "lm_head") and not hasattr(model, "get_output_embeddings"):
        raise ValueError(
            f"{type(model).__name__}: tracing a step needs a causal language model (a config whose "
            "model_type transformers builds as AutoModelForCausalLM)"
        )
    trainable = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    handles = []

    def tag(p: torch.Tensor) -> None:
        tracker.note([p.grad], "gradients")

    for p in trainable:
        handles.append(p.register_post_accumulate_grad_hook(tag))
    stepper = None
    if real and per_layer:
        from .per_layer import step_in_backward

        stepper = step_in_backward(model, opt)
    elif per_layer:
        held = step_workspace(opt, device, per_layer=True, refresh=refresh)

        def traced_update(p: torch.Tensor) -> None:
            tracker.hold(held.get(p, 0))
            p.grad = None

        for p in trainable:
            handles.append(p.register_post_accumulate_grad_hook(traced_update))
    try:
        with tracker:
            ids = torch.randint(0, vocab, (batch, seq), device=device if real else "cpu")
            with tracker.phase_of("activations"):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            with tracker.phase_of("temporaries"):
                loss.backward()
                del loss
                if real and not per_layer:
                    opt.step()
                elif not per_layer:
                    tracker.hold(sum(step_workspace(opt, device, refresh=refresh).values()))
                for p in trainable:
                    p.grad = None
    finally:
        for h in handles:
            h.remove()
        if stepper is not None:
            stepper.remove()


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def trace_step(
    config: str | Mapping[str, Any],
    optimizer: str,
    state_bits: int,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype = torch.float32,
    galore_rank: int | None = None,
    galore_target_modules: Any = "all-linear",
    checkpointing: bool = False,
    per_layer: bool = False,
    device: str = "cuda",
    refresh: bool = True,
    **optimizer_kwargs: Any,
) -> StepPeak:
    """The peak of one training step of the model ``config`` describes, traced on fake tensors (module docstring).

    Args:
        config: a transformers config (a dict, a ``config.json`` path or a preset name).
        optimizer: a registry name (``"adamw"``, ``"galore_adamw_8bit"``...); state_bits: its state format.
        batch, seq: the step's input, ``batch`` sequences of ``seq`` tokens (labels: the inputs, as causal LM
            fine-tuning does).
        dtype: the weights' (and gradients') dtype.
        galore_rank, galore_target_modules: GaLore groups, as ``lowmemopt.galore_param_groups`` makes them.
        checkpointing: activation checkpointing on every decoder layer (non-reentrant).
        per_layer: each parameter updated inside backward and its gradient freed (:func:`lowmemopt.
            step_in_backward`).
        device: the device to account for: ``"cuda"`` (allocations rounded to the caching allocator's 512-byte
            blocks; GaLore's full-size update in one piece) or ``"cpu"`` (exact bytes; the CPU's row chunks).
        refresh: count a GaLore basis refresh (the SVD; every ``update_proj_gap`` steps, so part of a run's peak);
            False: a step between refreshes.
        optimizer_kwargs: more optimizer keywords.

    Returns:
        The :class:`StepPeak`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .estimate import model_from_config

    _check_input(batch, seq)
    start = time.perf_counter()
    model = model_from_config(config, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        opt = build_optimizer(model, optimizer, state_bits, galore_rank, galore_target_modules, **optimizer_kwargs)
        if any(g.get("paged") for g in opt.param_groups):
            raise NotImplementedError(
                f"{optimizer}: paged state is not traced (the device holds only what is in "
                "flight); the layout estimate (without --batch / --seq) counts it"
            )
        peak = _step_peak(
            model,
            opt,
            optimizer,
            state_bits,
            galore_rank,
            batch,
            seq,
            checkpointing,
            per_layer,
            real=False,
            device=device,
            lay_out=True,
            refresh=refresh,
        )
    return peak._replace(seconds=time.perf_counter() - start)


def measure_step(
    model: torch.nn.Module,
    optimizer: str,
    state_bits: int,
    *,
    batch: int,
    seq: int,
    galore_rank: int | None = None,
    galore_target_modules: Any = "all-linear",
    checkpointing: bool = False,
    per_layer: bool = False,
    warmup: int = 1,
    **optimizer_kwargs: Any,
) -> StepPeak:
    """The peak of one real training step of ``model`` after ``warmup`` steps, counted as :func:`trace_step` counts."""
    _check_input(batch, seq)
    device = next(model.parameters()).device.type
    opt = build_optimizer(model, optimizer, state_bits, galore_rank, galore_target_modules, **optimizer_kwargs)
    if checkpointing:
        _checkpointing(model)
    model.train()
    for _ in range(warmup):
        _run(model, opt, batch, seq, per_layer, LiveMemory(), real=True, device=device)
    start = time.perf_counter()
    peak = _step_peak(
        model,
        opt,
        optimizer,
        state_bits,
        galore_rank,
        batch,
        seq,
        False,
        per_layer,
        real=True,
        device=device,
        lay_out=False,
    )
    return peak._replace(seconds=time.perf_counter() - start, checkpointing=checkpointing)


def _step_peak(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    name: str,
    state_bits: int,
    galore_rank: int | None,
    batch: int,
    seq: int,
    checkpointing: bool,
    per_layer: bool,
    real: bool,
    device: str,
    lay_out: bool,
    refresh: bool = True,
) -> StepPeak:
    tracker = LiveMemory(round_to=CUDA_BLOCK if device == "cuda" else 1)
    if checkpointing:
        _checkpointing(model)
    model.train()
    tracker.note(list(model.parameters()) + list(model.buffers()), "weights")
    if lay_out:
        with tracker:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        opt._first_state(p, group)
    tracker.note(_state_tensors(opt), "optimizer state")
    tracker.reset_peak()
    _run(model, opt, batch, seq, per_layer, tracker, real, device, refresh)
    trainable = sum(p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad)
    return StepPeak(
        type(opt).__name__,
        state_bits,
        galore_rank,
        batch,
        seq,
        checkpointing,
        per_layer,
        trainable,
        tracker.peak,
        {c: tracker.at_peak[c] for c in CATEGORIES},
        0.0,
    )


def cheaper_steps(
    config: str | Mapping[str, Any],
    optimizer: str,
    state_bits: int,
    *,
    budget: int,
    batch: int,
    seq: int,
    checkpointing: bool = False,
    per_layer: bool = False,
    max_traces: int = 8,
    **trace_kwargs: Any,
) -> list[StepPeak]:
    """Changes to a step that bring its traced peak within ``budget`` bytes, fewest changes first: activation
    checkpointing, per-layer updates, 8- then 4-bit state, each alone; then all of them; then all of them with the
    batch halved until it fits (or is 1). At most ``max_traces`` steps are traced (a 7B config: seconds each).

    Args:
        config, optimizer, state_bits, batch, seq, checkpointing, per_layer, trace_kwargs: the step asked for, as
            :func:`trace_step` takes it.
        budget: bytes the peak must fit in (the device's memory less a margin).

    Returns:
        The traced steps that fit, in the order above.
    """
    from .registry import resolve_optimizer

    singles: list[dict[str, Any]] = []
    if not checkpointing:
        singles.append(dict(checkpointing=True))
    if not per_layer and getattr(resolve_optimizer(optimizer).cls, "per_layer_updates", True):
        singles.append(dict(per_layer=True))
    singles += [dict(state_bits=b) for b in (8, 4) if b < state_bits]
    every: dict[str, Any] = {}
    for change in singles:
        every.update(change)
    candidates = singles + ([every] if len(singles) > 1 else [])
    b = batch // 2
    while b >= 1:
        candidates.append({**every, "batch": b})
        b //= 2
    asked = dict(state_bits=state_bits, batch=batch, seq=seq, checkpointing=checkpointing, per_layer=per_layer)
    fits = []
    for change in candidates[:max_traces]:
        step = {**asked, **change}
        bits = step.pop("state_bits")
        peak = trace_step(config, optimizer, bits, **step, **trace_kwargs)
        if peak.peak <= budget:
            fits.append(peak)
            if "batch" in change:  # the largest batch that fits, with everything else on: enough
                break
    return fits


def _check_input(batch: Any, seq: Any) -> None:
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def real_model(
    config: Mapping[str, Any], dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0
) -> torch.nn.Module:
    """A real transformers causal LM built from the config dict ``config`` on ``device``, initialized from ``seed``
    as transformers initializes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    data = dict(config)
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).to(dtype)
