"""Muon (Jordan et al. 2024), matching ``torch.optim.Muon``; ``use_muon=False`` groups step as ``torch.optim.AdamW`` in
the same optimizer (KellerJordan's ``MuonWithAuxAdam``)::

    B <- mu B + (1 - mu) g;   U = g + mu (B - g) if nesterov, else B
    O = NS(U): X = U / max(||U||_F, eps);  k times (bf16):  A = X X^T;  X <- a X + (b A + c A A) X
    p <- p (1 - lr wd) - lr' O,   lr' = lr sqrt(max(1, rows / cols))   adjust_lr_fn None or "original"
                                  lr' = lr 0.2 sqrt(max(rows, cols))    "match_rms_adamw"

Batched orthogonalization and FSDP2: ``docs/muon.md#batches-and-fsdp2``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from ..checks import check_adam_group, check_betas, check_lr, check_nonneg, sqrt_of
from ..distributed.reduction import LOCAL, Reduction
from ..distributed.whole import map_whole
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm
from ..quant.formats import Slot
from .adamw import adam_math
from .muon_batches import BATCHES, INDEX, plan_batches
from .muon_math import ADJUST_LR_FNS, NS_COEFFICIENTS, adjusted_lr, momentum_input, orthogonalize

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["Muon", "MuonAlgorithm", "muon_param_groups"]


class MuonAlgorithm(Algorithm):
    """Muon for the step pipeline: the momentum and orthogonalized update of ``use_muon`` groups, AdamW for the
    others. One bound to an optimizer (``owner``) batches the step's orthogonalizations (:meth:`step_work`)."""

    elementwise = False  # the orthogonalization needs the whole matrix

    def __init__(self, owner: "Muon | None" = None) -> None:
        self._owner = None if owner is None else weakref.ref(owner)

    def slots(self, group, param):
        if group["use_muon"]:
            return {"momentum_buffer": Slot(signed=True)}
        return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}

    def step_scalars(self, group, step):
        if group["use_muon"]:
            return {}
        beta1, beta2 = group["betas"]
        return dict(bias_correction1=1 - beta1**step, bias_correction2_sqrt=sqrt_of(1 - beta2**step))

    def decay_factor(self, group):
        return 1 - group["lr"] * group["weight_decay"]

    def step_work(self, work, grad_mult=None):
        """The step's Muon matrices in batches of one shape, each batch orthogonalized at once when its first
        matrix steps (:func:`lowmemopt.optim.muon_batches.plan_batches`); the work is reordered so that a batch's
        matrices step one after another."""
        owner = None if self._owner is None else self._owner()
        if owner is None:
            return work
        return plan_batches(work, owner.state, grad_mult)

    def update(self, p, g, state, group, step, reduce: Reduction = LOCAL):
        if not group["use_muon"]:
            return adam_math(
                p,
                g,
                state,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled_weight_decay=True,
                amsgrad=False,
                maximize=False,
                **self.step_scalars(group, step),
            )
        u = momentum_input(g, state["momentum_buffer"], group["momentum"], group["nesterov"])
        batches = group.get(BATCHES)
        if batches is not None:
            o = batches.take(group[INDEX], u)
        else:
            o = map_whole([u], reduce, lambda mats: orthogonalize(mats, group), torch.bfloat16)[0]
        shape = (reduce.size(p, 0, 0), reduce.size(p, 1, 1))  # the whole matrix's
        return o, -adjusted_lr(group["lr"], group["adjust_lr_fn"], shape)


class Muon(LowMemOptimizer):
    """Muon with 32/16/8/4-bit momentum; same signature, defaults and 32-bit results as ``torch.optim.Muon`` (to
    the rounding of a batched bf16 iteration, where several matrices share a shape), plus AdamW groups.

    Every parameter of a group with ``use_muon=True`` (the default) must be a 2-D matrix: put embeddings, the output
    head, norms and biases in ``use_muon=False`` groups, which step as ``torch.optim.AdamW``;
    :func:`muon_param_groups` builds both from a model. An AdamW group's ``lr`` and ``weight_decay`` default to
    ``adamw_lr`` / ``adamw_weight_decay`` when given, else to the optimizer's ``lr`` / ``weight_decay``; its
    ``betas`` to ``adamw_betas`` (0.9, 0.95) and ``eps`` to ``adamw_eps`` (1e-10), ``MuonWithAuxAdam``'s.

    Storage keywords: ``state_bits`` (the momentum, and the AdamW groups' moments), ``block_size``, ``paged``... (see
    :class:`lowmemopt.optimizer.LowMemOptimizer`). GaLore groups (``rank``) are refused: Muon steps whole matrices."""

    algorithm = MuonAlgorithm()
    #: TrainingArguments' Adam settings go to the AdamW groups (lowmemopt.integrations.transformers)
    adam_keywords = {"betas": "adamw_betas", "eps": "adamw_eps"}
    #: an AdamW group's betas (its other keys are Muon's own: lowmemopt.group_keys)
    _extra_group_keys = frozenset({"betas"})
    #: the groups it is built on for a model (lowmemopt.registry.model_params: estimate, demo, Trainer)
    model_param_groups = staticmethod(lambda model: muon_param_groups(model))

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float | torch.Tensor | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float | None = None,
        **storage: Unpack[StorageOptions],
    ) -> None:
        adamw = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        self._adamw_defaults = {k: v for k, v in adamw.items() if v is not None}
        if adamw_lr is not None:
            check_lr(adamw_lr)
        check_betas(adamw_betas)
        check_nonneg("adamw_eps", adamw_eps)
        if adamw_weight_decay is not None:
            check_nonneg("adamw_weight_decay", adamw_weight_decay)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, list) else ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            use_muon=True,
        )
        super().__init__(params, defaults, **storage)

    def _attach(self) -> None:
        super()._attach()
        self.algorithm = MuonAlgorithm(self)  # batches the step's orthogonalizations (reads this optimizer's state)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_adamw_defaults"] = self._adamw_defaults
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and param_group.get("use_muon", True) is False:
            param_group = {**self.__dict__.get("_adamw_defaults", {}), **param_group}
        super().add_param_group(param_group)

    def _check_group(self, group):
        use_muon = group.get("use_muon", True)
        if not isinstance(use_muon, bool):
            raise TypeError(f"Invalid use_muon: expected a bool, got {type(use_muon).__name__}")
        if group.get("rank") is not None:
            raise ValueError(
                "Muon does not take GaLore groups (rank=...): it orthogonalizes whole matrices; leave "
                "rank out (its state is one momentum per matrix element, 1 byte at state_bits=8)"
            )
        if not use_muon:
            check_adam_group(group)
            return
        check_lr(group["lr"])
        check_nonneg("weight_decay value", group["weight_decay"])
        momentum = group["momentum"]
        check_nonneg("momentum", momentum)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"Invalid nesterov: expected a bool, got {type(group['nesterov']).__name__}")
        coefficients = group["ns_coefficients"]
        if (
            not isinstance(coefficients, (tuple, list))
            or len(coefficients) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in coefficients)
        ):
            raise ValueError(
                f"Invalid ns_coefficients: {coefficients!r} (Coefficients must be a tuple of exactly 3 values)"
            )
        check_nonneg("epsilon value", group["eps"])
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(
                f"Invalid ns_steps: {steps!r} (an int in [0, 100): Number of steps must be less than "
                "100 for computational efficiency)"
            )
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {group['adjust_lr_fn']} is not supported (None, "
                "'original' or 'match_rms_adamw')"
            )
        for p in group.get("params", ()):
            if p.dim() != 2:
                raise ValueError(
                    f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} in a "
                    "Muon group (use_muon=True). Put embeddings, the output head, norms and biases in groups "
                    "with use_muon=False (stepped as AdamW): lowmemopt.muon_param_groups(model) builds both"
                )


def muon_param_groups(
    model: torch.nn.Module | Iterable[torch.Tensor],
    exclude: Sequence[str] = ("lm_head",),
    *,
    muon: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`Muon`: the hidden matrices in a Muon group, every other trainable parameter in an
    AdamW group (``use_muon=False``).

    A model's hidden matrices are its trainable 2-D parameters except the weights of ``nn.Embedding`` /
    ``nn.EmbeddingBag`` modules, the output head (``model.get_output_embeddings()`` where the model has one, as a
    transformers model does, and weights tied to it) and parameters whose name contains one of ``exclude`` (or
    matches it whole as a regex). Given tensors instead of a model, every 2-D one is a hidden matrix (embeddings and
    the head cannot be told apart: pass the model). ``muon`` / ``adamw``: further keys of each group (``lr``,
    ``weight_decay``, ``betas``, ``state_bits``...). Empty groups are left out; frozen parameters
    (``requires_grad=False``) and repeats are skipped."""
    import re

    if isinstance(model, torch.nn.Module):
        named = list(model.named_parameters())
        skip = {
            id(p)
            for m in model.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            for p in m.parameters(recurse=False)
        }
        head = getattr(model, "get_output_embeddings", None)
        head = head() if callable(head) else None
        if isinstance(head, torch.nn.Module):
            skip.update(id(p) for p in head.parameters(recurse=False))
        for name, p in named:
            if any(e in name or re.fullmatch(e, name) for e in exclude):
                skip.add(id(p))
    else:
        named, skip = [("", p) for p in model], set()
    matrices, rest, seen = [], [], set()
    for _, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (matrices if p.dim() == 2 and id(p) not in skip else rest).append(p)
    groups = []
    if matrices:
        groups.append({**(muon or {}), "params": matrices, "use_muon": True})
    if rest:
        groups.append({**(adamw or {}), "params": rest, "use_muon": False})
    return groups
