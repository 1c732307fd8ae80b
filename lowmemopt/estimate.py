"""Training memory of a model and optimizer choice, without allocating it: the model is built on the ``meta`` device and
the optimizer makes each parameter's state there as its first step would, so ``state_nbytes()`` is exact by
construction. ``paged`` (at most three batches of state on the device) and ``per_layer`` (one gradient at a time)
change what the device holds; :func:`cheapest_fits` searches the options that fit a budget;
:mod:`lowmemopt.traced_step` traces a whole step's peak. See ``docs/estimate.md``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from .model_presets import missing_config_message, preset
from .pipeline import PAGE_BUCKET_BYTES
from .projection.checks import GROUP_DEFAULTS
from .registry import instantiate, model_params, needs_process_group, resolve_optimizer

__all__ = [
    "MemoryEstimate",
    "cheapest_fits",
    "config_dtype",
    "default_state_bits",
    "estimate",
    "format_bytes",
    "galore_ranks",
    "model_from_config",
    "parse_bytes",
    "state_nbytes_after_first_step",
]

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

#: GaLore's group keys, which ``optimizer_kwargs`` may hold for the GaLore groups (``proj_bits=8``)
GALORE_GROUP_KEYS = frozenset(GROUP_DEFAULTS)
#: device-resident batches of state when paged: the one updating, the next arriving, the last being written back
PAGED_IN_FLIGHT = 3


class MemoryEstimate(NamedTuple):
    """Bytes of one (optimizer, state_bits, GaLore rank, paging, per-layer) choice for one model, on the device."""

    optimizer: str
    state_bits: int
    galore_rank: int | None
    params: int  # trainable parameter count
    weights: int
    grads: int  # all gradients; per_layer: the largest one
    state: int  # all state; paged: PAGED_IN_FLIGHT batches (see the module docstring), at most all of it
    paged: bool = False
    per_layer: bool = False

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.state


def _config_dict(config: str | os.PathLike | Mapping[str, Any]) -> Any:
    """The config as a dict: ``config`` itself, the JSON file at that path, or a preset (:mod:`.model_presets`) for a
    name that is not a file."""
    if isinstance(config, Mapping):
        return dict(config)
    if not os.path.exists(config) and (found := preset(os.fspath(config))) is not None:
        return found[1]
    try:
        with open(config) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(missing_config_message(os.fspath(config))) from None


def config_dtype(config: str | os.PathLike | Mapping[str, Any]) -> str | None:
    """The weights' dtype a transformers config names (``torch_dtype``, or ``dtype`` in newer configs) as ``"fp32"``,
    ``"bf16"`` or ``"fp16"``; None if it names none (or ``"auto"``, or another dtype)."""
    data = _config_dict(config)
    if not isinstance(data, dict):
        return None
    name = data.get("torch_dtype") or data.get("dtype")
    if not isinstance(name, str):
        return None
    dtype = DTYPES.get(name.removeprefix("torch."))
    return None if dtype is None else SHORT_DTYPE_NAMES[dtype]


def model_from_config(
    config: str | os.PathLike | Mapping[str, Any], dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A transformers model (``AutoModelForCausalLM``, else ``AutoModel``) built from a ``config.json`` path, a dict or
    a preset name (:mod:`lowmemopt.model_presets`: ``"llama-2-7b"``) on the meta device: every parameter has its real
    shape and ``dtype`` and no storage."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    data = _config_dict(config)
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{config!r}: not a transformers model config (a JSON object with a 'model_type')")
    data = dict(data)
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not a causal LM architecture
            model = AutoModel.from_config(cfg)
    return model.to(dtype)


def state_nbytes_after_first_step(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of state ``optimizer`` holds once every parameter with ``requires_grad`` has taken a step, computed by
    letting it create that state on the meta device (its parameters may be real or meta; nothing real is allocated
    and the optimizer's own state is left untouched)."""
    return sum(_state_nbytes_per_param(optimizer))


def _state_nbytes_per_param(optimizer: torch.optim.Optimizer) -> list[int]:
    """:func:`state_nbytes_after_first_step`, one figure per parameter that has state."""
    meta: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if p.requires_grad:
                meta.setdefault(p, torch.nn.Parameter(torch.empty_like(p, device="meta")))
                params.append(meta[p])
        groups.append({**group, "params": params})
    shadow = instantiate(type(optimizer), [g for g in groups if g["params"]])  # groups keep their own lr
    for group in shadow.param_groups:
        for p in group["params"]:
            shadow._first_state(p, group)  # GaLore: low-rank slots and the projector
    errors: dict[torch.Tensor, int] = {}
    if hasattr(shadow, "error_nbytes_per_param"):  # the 1-bit optimizers' compression error buffers
        stage = getattr(optimizer, "_stage", None)
        errors = shadow.error_nbytes_per_param(stage.world if stage is not None else None)
    return [
        sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor)) + errors.get(p, 0)
        for p, st in shadow.state.items()
    ]


def estimate(
    model: torch.nn.Module,
    optimizer: str,
    state_bits: int,
    *,
    galore_rank: int | None = None,
    galore_target_modules: Any = "all-linear",
    paged: bool = False,
    per_layer: bool = False,
    **optimizer_kwargs: Any,
) -> MemoryEstimate:
    """Weights, gradients (one per trainable parameter, in its dtype) and optimizer state of training ``model``
    (meta or real) with ``optimizer`` (a name, see :mod:`lowmemopt.registry`) at ``state_bits``, optionally with
    GaLore groups of ``galore_rank`` over ``galore_target_modules``; ``paged`` and ``per_layer`` count what the device
    holds then (module docstring)."""
    layout = _layout(model, optimizer, state_bits, galore_rank, galore_target_modules, optimizer_kwargs)
    return _variant(layout, paged, per_layer)


class _Layout(NamedTuple):
    optimizer: str
    state_bits: int
    galore_rank: int | None
    params: int
    weights: int
    grads: list[int]  # bytes per trainable parameter's gradient
    state: list[int]  # bytes per parameter's state


def _variant(layout: _Layout, paged: bool, per_layer: bool) -> MemoryEstimate:
    state = sum(layout.state)
    if paged:
        state = min(state, PAGED_IN_FLIGHT * max(PAGE_BUCKET_BYTES, max(layout.state, default=0)))
    grads = max(layout.grads, default=0) if per_layer else sum(layout.grads)
    return MemoryEstimate(
        layout.optimizer,
        layout.state_bits,
        layout.galore_rank,
        layout.params,
        layout.weights,
        grads,
        state,
        paged,
        per_layer,
    )


def _optimizer_for(
    model: torch.nn.Module,
    optimizer: str,
    state_bits: int,
    galore_rank: int | None,
    galore_target_modules: Any,
    optimizer_kwargs: Mapping[str, Any],
) -> torch.optim.Optimizer:
    """The optimizer ``optimizer`` names, on ``model``'s parameters (GaLore groups for a ``galore_rank``, the class's
    own groups otherwise; meta copies for a class that needs a process group), no state yet."""
    import lowmemopt

    resolved = resolve_optimizer(optimizer)
    named = list(model.named_parameters())
    optimizer_kwargs = dict(optimizer_kwargs)
    if galore_rank is not None:
        if not hasattr(lowmemopt, "galore_param_groups"):
            raise NotImplementedError("GaLore is not available in this version of lowmemopt (no galore_param_groups)")
        if issubclass(resolved.cls, lowmemopt.APOLLOAdamW):  # APOLLO's groups; rank 1: APOLLO-Mini's tensor scale
            params: Any = lowmemopt.apollo_param_groups(
                model, galore_rank, galore_target_modules, scale_type="tensor" if galore_rank == 1 else "channel"
            )
        else:  # GaLore's group keys among the keywords (proj_bits, ...) go to its groups
            keys = {k: optimizer_kwargs.pop(k) for k in list(optimizer_kwargs) if k in GALORE_GROUP_KEYS}
            params = lowmemopt.galore_param_groups(
                model, target_modules=galore_target_modules, rank=galore_rank, **keys
            )
    elif getattr(resolved.cls, "named_groups", False):  # (Adam-mini: its blocks by name, heads from the config)
        params = [(n, p) for n, p in named if p.requires_grad]
        optimizer_kwargs = {**resolved.cls.model_keywords(getattr(model, "config", None)), **optimizer_kwargs}
    else:
        params = model_params(resolved.cls, model)  # (Muon: its hidden matrices and the rest)
    if galore_rank is None or issubclass(resolved.cls, lowmemopt.APOLLOAdamW):
        for k in GALORE_GROUP_KEYS:  # (no basis to store: GaLore's own keys say nothing here)
            optimizer_kwargs.pop(k, None)
    if needs_process_group(resolved.cls):  # built on meta copies: a layout, without a process group
        params = _on_meta(params)
    try:
        return instantiate(resolved.cls, params, **{**resolved.kwargs, **optimizer_kwargs, "state_bits": state_bits})
    except TypeError as e:
        raise TypeError(f"{resolved.cls.__name__}: {e}") from e


def _layout(model, optimizer, state_bits, galore_rank, galore_target_modules, optimizer_kwargs) -> _Layout:
    opt = _optimizer_for(model, optimizer, state_bits, galore_rank, galore_target_modules, optimizer_kwargs)
    named = list(model.named_parameters())
    trainable = [p for _, p in named if p.requires_grad]
    return _Layout(
        optimizer=type(opt).__name__,
        state_bits=state_bits,
        galore_rank=galore_rank,
        params=sum(p.numel() for p in trainable),
        weights=sum(p.numel() * p.element_size() for _, p in named),
        grads=[p.numel() * p.element_size() for p in trainable],
        state=_state_nbytes_per_param(opt),
    )


def _on_meta(params: Any) -> list[Any]:
    """``params`` (tensors or param group dicts) with each tensor replaced by a meta copy."""

    def meta(p: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)

    return [{**g, "params": [meta(p) for p in g["params"]]} if isinstance(g, dict) else meta(g) for g in params]


def galore_ranks(model: torch.nn.Module, target_modules: Any = "all-linear", count: int = 3) -> list[int]:
    """GaLore ranks worth trying on ``model``: the ``count`` largest powers of two from 1024 down to 8 that are at most
    a quarter of the largest target matrix's smaller side (the hidden size, for a transformer)."""
    import lowmemopt

    groups = lowmemopt.galore_param_groups(model, target_modules=target_modules, rank=1)
    sides = [min(p.shape) for g in groups if "rank" in g for p in g["params"]]
    top = max(sides, default=0) // 4
    return [r for r in (1024, 512, 256, 128, 64, 32, 16, 8) if r <= top][:count]


def cheapest_fits(
    model: torch.nn.Module,
    optimizer: str,
    budget: int,
    *,
    state_bits: Sequence[int] = (32, 16, 8, 4),
    ranks: Sequence[int] | None = None,
    galore_target_modules: Any = "all-linear",
    limit: int = 5,
    **optimizer_kwargs: Any,
) -> list[MemoryEstimate]:
    """The combinations of ``state_bits``, GaLore rank (none or one of ``ranks``, default :func:`galore_ranks`),
    paging and per-layer updates whose total fits ``budget`` bytes with the fewest changes: a combination is left out
    when another that fits gives up no more on every count (more state bits, a larger or no GaLore rank, unpaged,
    whole-model steps are each better). Sorted by the number of changes, then by total; at most ``limit``."""
    cls = resolve_optimizer(optimizer).cls
    ranks = galore_ranks(model, galore_target_modules) if ranks is None else sorted(set(ranks), reverse=True)
    if not getattr(cls, "supports_galore", True):  # (class attributes: what the optimizer refuses)
        ranks = []
    pagings = (False, True) if getattr(cls, "supports_paged", True) else (False,)
    per_layers = (False, True) if getattr(cls, "per_layer_updates", True) else (False,)
    bits = sorted(set(state_bits), reverse=True)
    fits = []
    for b in bits:
        for r in [None, *ranks]:
            layout = _layout(model, optimizer, b, r, galore_target_modules, optimizer_kwargs)
            for paged in pagings:
                for per_layer in per_layers:
                    e = _variant(layout, paged, per_layer)
                    if e.total <= budget:
                        cost = (bits.index(b), 0 if r is None else 1 + ranks.index(r), int(paged), int(per_layer))
                        fits.append((cost, e))
    best = [(c, e) for c, e in fits if not any(d != c and all(x <= y for x, y in zip(d, c)) for d, _ in fits)]
    best.sort(key=lambda ce: (sum(1 for x in ce[0] if x), ce[1].total))
    return [e for _, e in best[:limit]]


def default_state_bits(optimizer: str) -> int:
    """The ``state_bits`` an optimizer name implies: 8 for ``"adamw8bit"``, 32 for ``"adamw"``."""
    resolved = resolve_optimizer(optimizer)
    probe = instantiate(resolved.cls, [torch.nn.Parameter(torch.zeros(1, device="meta"))], **resolved.kwargs)
    return probe.defaults["state_bits"]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_bytes(text: str, number_unit: str = "B") -> int:
    """``"24GiB"`` -> 25769803776, ``"24 GB"`` -> 24000000000. Units, in any case and after an optional space: B;
    KiB/MiB/GiB/TiB and K/M/G/T (powers of 1024); KB/MB/GB/TB (powers of 1000). A number without a unit is in
    ``number_unit`` (bytes unless given: ``lowmemopt estimate --gpu-memory 24`` reads GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = (m.group(2) or number_unit).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size (e.g. 24GiB, '24 GiB', 80GB, 16G, or a number of {number_unit})"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Human-readable binary size: ``1.50 GiB``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
