"""The argument checks of the torch.optim contract: what every lowmemopt optimizer's constructor, ``add_param_group``
and state-dict loads ask of hyper-parameters and storage options, with torch's errors and messages where torch has
them, and the normalisation of torch's scalar forms (one-element Tensor ``lr``, Tensor ``betas``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import paging, rounding

__all__ = [
    "one_element",
    "check_lr",
    "check_nonneg",
    "check_betas",
    "torch_scalars",
    "check_torch_flags",
    "check_adam_group",
    "sqrt_of",
    "check_positive",
    "check_eps_pair",
    "check_storage",
    "check_param",
]


def one_element(name: str, value: torch.Tensor) -> None:
    """torch.optim's rule for a hyper-parameter given as a Tensor: any shape, one element (torch's message)."""
    if value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element (got shape {tuple(value.shape)})")


def check_lr(lr: Any, required: bool = True) -> None:
    if lr is None and not required:
        return
    if isinstance(lr, torch.Tensor):
        one_element("lr", lr)
        if lr.device.type != "meta" and not bool(lr >= 0):  # (as torch: one read, at construction)
            raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
        return
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"Invalid learning rate: expected a number, got {type(lr).__name__}")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")


def check_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Invalid {name}: expected a number, got {type(value).__name__}")
    if not value >= 0.0:
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_betas(betas: Any, n: int = 2) -> None:
    """``n`` numbers in [0, 1); one-element Tensors are taken, as torch's Adam takes them (:func:`torch_scalars`)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != n:
        raise ValueError(f"Invalid betas: expected a tuple of {n} numbers, got {betas!r}")
    for i, b in enumerate(betas):
        b = _as_number(f"betas[{i}]", b)
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"Invalid beta parameter at index {i}: expected a number, got {type(b).__name__}")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} (must be in [0, 1))")


def torch_scalars(group: dict[str, Any]) -> None:
    """Put torch.optim's one-element Tensor hyper-parameters into the forms the step reads, in place: a Tensor ``lr``
    becomes its 0-dim view (a scheduler filling it in place is still seen); Tensor ``betas`` and ``weight_decay`` are
    read once as numbers. Raises torch's ValueErrors (more than one element; betas mixing Tensors and numbers).
    """
    for key in ("lr", "initial_lr"):  # (initial_lr: Lion's decoupled decay, torch's schedulers)
        if isinstance(group.get(key), torch.Tensor):
            one_element(key, group[key])
            _lr_view(group, key)
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and any(isinstance(b, torch.Tensor) for b in betas):
        if not all(isinstance(b, torch.Tensor) for b in betas):  # (torch's ValueError and message)
            both = "both" if len(betas) == 2 else "all"
            raise ValueError(f"betas must be either {both} floats or {both} Tensors (got {_types(betas)})")
        group["betas"] = tuple(_as_number(f"betas[{i}]", b) for i, b in enumerate(betas))
    group_wd = group.get("weight_decay")
    if isinstance(group_wd, torch.Tensor):
        group["weight_decay"] = _as_number("weight_decay", group_wd)


def _types(values: Any) -> str:
    return "(" + ", ".join(type(v).__name__ for v in values) + ")"


def _lr_view(group: dict[str, Any], key: str = "lr") -> None:
    """A one-element Tensor ``group[key]`` of another shape becomes its 0-dim view (shape only: no value is read)."""
    lr = group.get(key)
    if isinstance(lr, torch.Tensor) and lr.dim() != 0 and lr.numel() == 1:
        group[key] = lr.view(())


def _lr_views_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before each ``step()``: a Tensor lr that was set on a group after its checks (``group["lr"] =
    torch.tensor([1e-3])``, as torch allows) is held as its 0-dim view too, as :func:`torch_scalars` holds it."""
    for group in optimizer.param_groups:
        _lr_view(group)


def _as_number(name: str, x: Any) -> Any:
    """A one-element Tensor's value as a Python number (anything else as it is)."""
    if not isinstance(x, torch.Tensor):
        return x
    one_element(name, x)
    return x.item()


def check_torch_flags(foreach: Any, fused: Any, differentiable: Any) -> None:
    """torch.optim's implementation keywords (see :class:`LowMemOptimizer`): ``foreach`` and ``fused`` None or a
    bool, not both True; ``differentiable`` False."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"Invalid {name}: expected a bool or None, got {type(value).__name__}")
    if not isinstance(differentiable, bool):
        raise TypeError(f"Invalid differentiable: expected a bool, got {type(differentiable).__name__}")
    if differentiable:
        raise ValueError(
            "differentiable=True is not supported: lowmemopt's step runs under torch.no_grad() and "
            "writes parameters and (quantized) state in place, so autograd cannot differentiate through "
            "it; use torch.optim for a differentiable step"
        )
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_adam_group(group: dict[str, Any]) -> None:
    """The hyper-parameters every Adam-style group has (AdamW, the transformers-style AdamW, LAMB): ``lr``, ``eps`` >=
    0, two ``betas`` in [0, 1), ``weight_decay`` >= 0."""
    check_lr(group["lr"])
    check_nonneg("epsilon value", group["eps"])
    check_betas(group["betas"])
    check_nonneg("weight_decay value", group["weight_decay"])


def sqrt_of(x: Any) -> Any:
    """The correctly rounded square root of a step scalar: a number (``math.sqrt``), or a capturable step's tensor of
    them (one per tensor, on the device)."""
    return x.sqrt() if isinstance(x, torch.Tensor) else math.sqrt(x)


def check_positive(name: str, value: Any) -> None:
    check_nonneg(name, value)
    if not value > 0.0:
        raise ValueError(f"Invalid {name}: {value} (must be > 0)")


def check_eps_pair(eps: Any, first_optional: bool = False) -> None:
    """A pair of non-negative numbers (Adafactor, CAME); ``first_optional``: ``eps[0]`` may be None."""
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"Invalid eps: expected a tuple of 2 numbers, got {eps!r}")
    for i, e in enumerate(eps):
        if not (first_optional and i == 0 and e is None):
            check_nonneg(f"eps[{i}] (epsilon value)", e)


def check_storage(group: dict) -> None:
    bits = group["state_bits"]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (32, 16, 8, 4):
        raise ValueError(f"Invalid state_bits: {bits!r} (supported: 32, 16, 8, 4)")
    bs = group["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
        raise ValueError(f"Invalid block_size: {bs!r} (must be a power of two >= 16)")
    mq = group["min_quant_numel"]
    if isinstance(mq, bool) or not isinstance(mq, int) or mq < 0:
        raise ValueError(f"Invalid min_quant_numel: {mq!r} (must be an int >= 0)")
    paging.check_paging(group)
    rounding.check_mode(group.get("bf16_update", "nearest"))  # bf16 / fp16 parameters: nearest | stochastic | kahan
    capturable = group.get("capturable", False)
    if not isinstance(capturable, bool):
        raise TypeError(f"Invalid capturable: expected a bool, got {type(capturable).__name__}")
    if capturable and paging.tier_of(group) is not None:
        raise ValueError("capturable=True cannot page state: a captured step cannot move it between host and device")
    if capturable and group.get("bf16_update", "nearest") == "stochastic":
        raise ValueError(
            "capturable=True cannot round bf16 / fp16 parameters stochastically (each step's hash key is "
            "made on the host); use bf16_update='nearest' or 'kahan'"
        )
    if capturable and group.get("rank") is not None:
        raise ValueError(
            "capturable=True does not apply to GaLore param groups (a basis refresh runs an SVD that synchronizes)"
        )


def check_param(p: torch.Tensor, owner: str, index: int, group: int) -> None:
    """A parameter an optimizer can step (real floating point, no two elements in one memory location), else TypeError /
    ValueError; ``index``, ``group``: its place, for the message.
    """
    if p.is_complex():
        raise TypeError(
            f"{owner} does not support complex parameters (got {p.dtype}): optimize a real view instead, "
            "nn.Parameter(torch.view_as_real(z)), and use torch.view_as_complex(param) in the forward pass "
            "(torch.optim's Adam, AdamW and SGD step a complex parameter as exactly that view)"
        )
    if not p.is_floating_point():
        raise TypeError(f"{owner} needs floating-point parameters (got {p.dtype})")
    shared = [d for d, (n, s) in enumerate(zip(p.shape, p.stride())) if s == 0 and n > 1]
    if shared and p.numel():
        raise ValueError(
            f"{owner}: parameter {index} of param group {group} (shape {tuple(p.shape)}) has stride 0 in "
            f"dim {shared[0]}: its elements share memory (an expanded tensor), and a step updates each "
            "element in place. Give it memory of its own: nn.Parameter(t.clone()) or t.contiguous()"
        )
