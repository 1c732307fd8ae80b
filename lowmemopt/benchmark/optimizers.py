"""The optimizer registries: name -> factory(params, lr, weight_decay). Imports happen inside the factories, so a
missing or broken library fails only its own rows. ``OPTIMIZERS``: AdamW against torch, bitsandbytes and torchao
(:data:`BASELINE`: torch's fused AdamW); ``FACTORED``: Adafactor and CAME; ``SUITES``: the two tables."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import sys
import warnings
from types import ModuleType
from typing import Callable

import torch


def quiet_import(name: str) -> ModuleType:
    """``importlib.import_module(name)`` without the notices some libraries print when imported (bitsandbytes: "Failed
    to load CPU gemm_4bit_forward from kernels-community ..."; torchao: "Failed to load ..._C_mxfp8...so" and a torch
    deprecation log line), which say nothing about the benchmark. If the import fails, what it printed is shown."""
    out = io.StringIO()
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:
        sys.stderr.write(out.getvalue())
        raise
    finally:
        logging.disable(logging.NOTSET)


def _lowmemopt_adamw(bits: int) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        import lowmemopt

        return lowmemopt.AdamW(params, lr=lr, weight_decay=weight_decay, state_bits=bits)

    return make


def _torch_adamw(impl: str) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **{impl: True})

    return make


def _bnb_adamw8bit(params, lr, weight_decay):
    bnb = quiet_import("bitsandbytes")
    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)


def _torchao_adamw8bit(params, lr, weight_decay):
    AdamW8bit = quiet_import("torchao.optim").AdamW8bit
    return AdamW8bit(params, lr=lr, weight_decay=weight_decay)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "lowmemopt-adamw-32bit": _lowmemopt_adamw(32),
    "lowmemopt-adamw-16bit": _lowmemopt_adamw(16),
    "lowmemopt-adamw-8bit": _lowmemopt_adamw(8),
    "torch-adamw-fused": _torch_adamw("fused"),
    "torch-adamw-foreach": _torch_adamw("foreach"),
    "bnb-adamw8bit": _bnb_adamw8bit,
    "torchao-adamw8bit": _torchao_adamw8bit,
}

#: Times are reported as ratios to this optimizer, measured in the same run.
BASELINE = "torch-adamw-fused"


def _lowmemopt(cls_name: str, bits: int, **fixed) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        import lowmemopt

        return getattr(lowmemopt, cls_name)(params, lr=lr, weight_decay=weight_decay, state_bits=bits, **fixed)

    return make


def _transformers_adafactor(**fixed) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=weight_decay, **fixed)

    return make


def _torch_adafactor(params, lr, weight_decay):
    return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)


def _came_pytorch(params, lr, weight_decay):
    from came_pytorch import CAME

    return CAME(params, lr=lr, weight_decay=weight_decay)


def _pytorch_optimizer_came(params, lr, weight_decay):
    from pytorch_optimizer import CAME

    return CAME(params, lr=lr, weight_decay=weight_decay)


_EXTERNAL_LR = dict(relative_step=False, scale_parameter=False)

#: The factored optimizers (``bench/factored.py``). Rows ending in ``-m`` keep Adafactor's first moment
#: (``beta1=0.9``): its only full-size state, so the only one 8 bits can shrink.
FACTORED: dict[str, Callable[..., torch.optim.Optimizer]] = {
    BASELINE: OPTIMIZERS[BASELINE],
    "transformers-adafactor": _transformers_adafactor(**_EXTERNAL_LR),
    "lowmemopt-adafactor-32bit": _lowmemopt("Adafactor", 32, **_EXTERNAL_LR),
    "transformers-adafactor-m": _transformers_adafactor(beta1=0.9, **_EXTERNAL_LR),
    "lowmemopt-adafactor-m-32bit": _lowmemopt("Adafactor", 32, beta1=0.9, **_EXTERNAL_LR),
    "lowmemopt-adafactor-m-8bit": _lowmemopt("Adafactor", 8, beta1=0.9, **_EXTERNAL_LR),
    "torch-adafactor": _torch_adafactor,
    "lowmemopt-adafactortorch-32bit": _lowmemopt("AdafactorTorch", 32),
    "came-pytorch": _came_pytorch,
    "pytorch-optimizer-came": _pytorch_optimizer_came,
    "lowmemopt-came-32bit": _lowmemopt("CAME", 32),
    "lowmemopt-came-8bit": _lowmemopt("CAME", 8),
}
#: FusedLAMB with Apex's global gradient-norm clip: one reduction on the device (GPU rows count host syncs: none)
OPTIMIZERS["lowmemopt-fusedlamb-8bit"] = _lowmemopt("FusedLAMB", 8, max_grad_norm=1.0)

#: The suites: (title, registry, extra library versions for the header).
SUITES: dict[str, tuple[str, dict[str, Callable[..., torch.optim.Optimizer]], tuple[str, ...]]] = {
    "step": ("Optimizer step benchmark", OPTIMIZERS, ()),
    "factored": ("Factored optimizers: step time and state", FACTORED, ("came-pytorch", "pytorch-optimizer")),
}
