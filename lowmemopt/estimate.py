"""Training memory of a model and optimizer choice, without allocating it: weights, gradients and optimizer state.

The model is built from its config on the ``meta`` device (shapes, no storage). The optimizer is constructed on those
meta parameters and asked to create each parameter's state exactly as its first step would (its own slot declarations,
formats, block sizes and ``min_quant_numel``), still on the meta device; the state figure is then the optimizer's own
``state_nbytes()``. So the number is exact by construction and follows any optimizer or format change, with no
per-optimizer formula to keep in step. Activations, temporaries and framework overhead (CUDA context, allocator
caching) are not included.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, NamedTuple

import torch

from .registry import instantiate, resolve

__all__ = ["MemoryEstimate", "default_state_bits", "estimate", "format_bytes", "model_from_config", "parse_bytes", "state_nbytes_after_first_step"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class MemoryEstimate(NamedTuple):
    """Bytes of one (optimizer, state_bits, GaLore rank) choice for one model."""

    optimizer: str
    state_bits: int
    galore_rank: int | None
    params: int  # trainable parameter count
    weights: int
    grads: int
    state: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.state


def model_from_config(config: str | os.PathLike | Mapping[str, Any], dtype: torch.dtype = torch.float32
                      ) -> torch.nn.Module:
    """A transformers model (``AutoModelForCausalLM``, else ``AutoModel``) built from a ``config.json`` path or dict
    on the meta device: every parameter has its real shape and ``dtype`` and no storage."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if isinstance(config, Mapping):
        data = dict(config)
    else:
        with open(config) as f:
            data = json.load(f)
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
            if group.get("rank") is not None:  # GaLore: low-rank slots and the projector
                from .projection.step import init_projected_state

                init_projected_state(shadow, p, group)
            else:
                shadow._init_state(p, group, shadow._slots(group, p))
    return shadow.state_nbytes()


def estimate(
    model: torch.nn.Module,
    optimizer: str,
    state_bits: int,
    *,
    galore_rank: int | None = None,
    galore_target_modules: Any = "all-linear",
    **optimizer_kwargs: Any,
) -> MemoryEstimate:
    """Weights, gradients (one per trainable parameter, in its dtype) and optimizer state of training ``model``
    (meta or real) with ``optimizer`` (a name, see :mod:`lowmemopt.registry`) at ``state_bits``, optionally with
    GaLore groups of ``galore_rank`` over ``galore_target_modules``."""
    resolved = resolve(optimizer)
    named = list(model.named_parameters())
    trainable = [p for _, p in named if p.requires_grad]
    if galore_rank is not None:
        import lowmemopt

        if not hasattr(lowmemopt, "galore_param_groups"):
            raise NotImplementedError("GaLore is not available in this version of lowmemopt (no galore_param_groups)")
        params: Any = lowmemopt.galore_param_groups(model, target_modules=galore_target_modules, rank=galore_rank)
    else:
        params = trainable
    try:
        opt = instantiate(resolved.cls, params, **{**resolved.kwargs, **optimizer_kwargs, "state_bits": state_bits})
    except TypeError as e:
        raise TypeError(f"{resolved.cls.__name__}: {e}") from e
    return MemoryEstimate(
        optimizer=resolved.cls.__name__,
        state_bits=state_bits,
        galore_rank=galore_rank,
        params=sum(p.numel() for p in trainable),
        weights=sum(p.numel() * p.element_size() for _, p in named),
        grads=sum(p.numel() * p.element_size() for p in trainable),
        state=state_nbytes_after_first_step(opt),
    )


def default_state_bits(optimizer: str) -> int:
    """The ``state_bits`` an optimizer name implies: 8 for ``"adamw8bit"``, 32 for ``"adamw"``."""
    resolved = resolve(optimizer)
    probe = instantiate(resolved.cls, [torch.nn.Parameter(torch.zeros(1, device="meta"))], **resolved.kwargs)
    return probe.defaults["state_bits"]


_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}


def parse_bytes(text: str) -> int:
    """``"24GiB"`` -> 25769803776. Units: B; KiB/MiB/GiB/TiB and K/M/G/T (powers of 1024); KB/MB/GB/TB (1000)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size (e.g. 24GiB, 80GB, 16G, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """Human-readable binary size: ``1.50 GiB``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
