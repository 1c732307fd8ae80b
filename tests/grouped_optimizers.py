"""The common suite's builds of the optimizers that need their own param groups (tests/optim_info.py): Muon (2-D
tensors in Muon groups, the rest AdamW) and APOLLO (2-D tensors projected, the rest plain), from the suite's flat
lists of tensors of any shape, and their references built the same way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lowmemopt


def _split_for_muon(group: dict[str, Any]) -> list[dict[str, Any]]:
    """A param group without ``use_muon`` as the suite's Muon takes it: its 2-D tensors (or (name, tensor) pairs) in a
    Muon group, the others in an AdamW group (``use_muon=False``), as ``lowmemopt.muon_param_groups`` splits tensors."""
    params = group["params"]
    if "use_muon" in group or not isinstance(params, (list, tuple)):
        return [group]
    params = list(params)
    tensor = lambda p: p[1] if isinstance(p, tuple) else p  # noqa: E731
    matrices = [p for p in params if isinstance(tensor(p), torch.Tensor) and tensor(p).dim() == 2]
    rest = [p for p in params if not any(p is m for m in matrices)]
    parts = [dict(group, params=ps, use_muon=flag) for ps, flag in ((matrices, True), (rest, False)) if ps]
    return parts or [group]


class SuiteMuon(lowmemopt.Muon):
    """``lowmemopt.Muon`` as the common suite builds it from its flat lists of tensors of any shape: a param group
    without ``use_muon`` is split into its 2-D tensors (Muon) and the rest (AdamW). The same signature as Muon."""

    def add_param_group(self, param_group):
        for part in _split_for_muon(param_group):
            super().add_param_group(part)


class MuonReference:
    """The reference of ``lowmemopt.Muon`` on the suite's tensors: ``torch.optim.Muon`` on the 2-D ones,
    ``torch.optim.AdamW`` (lowmemopt.Muon's AdamW-group defaults: betas (0.9, 0.95), eps 1e-10, Muon's lr and weight
    decay unless ``adamw_*`` are given) on the others."""

    def __init__(self, params, **kw):
        groups = _split_for_muon({"params": list(params)})
        adamw = dict(
            lr=kw.pop("adamw_lr", kw.get("lr", 1e-3)),
            betas=kw.pop("adamw_betas", (0.9, 0.95)),
            eps=kw.pop("adamw_eps", 1e-10),
            weight_decay=kw.pop("adamw_weight_decay", kw.get("weight_decay", 0.1)),
        )
        self.optimizers = [
            torch.optim.Muon(g["params"], **kw)
            if g["use_muon"]
            else torch.optim.AdamW(g["params"], foreach=False, **adamw)
            for g in groups
        ]

    def step(self):
        for opt in self.optimizers:
            opt.step()


def _split_for_apollo(group: dict[str, Any], apollo: dict[str, Any]) -> list[dict[str, Any]]:
    """A param group without ``rank`` as the suite's APOLLO takes it: its 2-D tensors in a projected group with the
    keys ``apollo`` (rank, proj, scale_type, ...) and APOLLO's defaults for the rest, then the others in a plain group
    (each parameter's seed is its position in that order, in the reference too)."""
    params = group["params"]
    if "rank" in group or "apollo_rank" in group or not isinstance(params, (list, tuple)):
        return [group]
    params = list(params)
    tensor = lambda p: p[1] if isinstance(p, tuple) else p  # noqa: E731
    matrices = [p for p in params if isinstance(tensor(p), torch.Tensor) and tensor(p).dim() == 2]
    rest = [p for p in params if not any(p is m for m in matrices)]
    full = {**lowmemopt.optim.apollo.GROUP_DEFAULTS, **apollo}
    parts = [dict(group, params=ps, **extra) for ps, extra in ((matrices, full), (rest, {})) if ps]
    return parts or [group]


class SuiteAPOLLO(lowmemopt.APOLLOAdamW):
    """``lowmemopt.APOLLOAdamW`` as the common suite builds it from its flat lists of tensors: the 2-D ones in a
    projected group (the suite-only keyword ``apollo``: its keys; default rank 4), the rest plain."""

    def __init__(self, params, *args, apollo=None, **kwargs):
        self._suite_apollo = dict(rank=4) if apollo is None else apollo
        super().__init__(params, *args, **kwargs)

    def add_param_group(self, param_group):
        for part in _split_for_apollo(param_group, self.__dict__.get("_suite_apollo", dict(rank=4))):
            super().add_param_group(part)


def apollo_reference(params, apollo=None, **kw):
    apollo_torch = pytest.importorskip("apollo_torch")
    return apollo_torch.APOLLOAdamW(_split_for_apollo({"params": list(params)}, apollo or dict(rank=4)), **kw)
