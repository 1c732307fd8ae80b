"""lowmemopt: memory-efficient PyTorch optimizers (4/8/16/32-bit state) that drop in for torch.optim.

The public names are imported on first use (PEP 562), so the ``lowmemopt`` command parses its arguments without
importing torch; ``from lowmemopt import AdamW`` and ``import *`` work as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .version import __version__  # noqa: F401 (lowmemopt.__version__)

#: the public names besides the optimizer classes and drop-in aliases (which start with a capital letter)
_FUNCTIONS = {
    "allow_group_keys": "group_keys",
    "galore_param_groups": "projection",
    "load_state": "checkpoint",
    "save_state": "checkpoint",
    "step_in_backward": "per_layer",
    "muon_param_groups": "optim",
    "apollo_param_groups": "optim",
}
_CLASSES = [
    "Adafactor",
    "AdafactorTorch",
    "Adam",
    "AdamW",
    "CAME",
    "CPUAdam",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "LAMB",
    "LARS",
    "Lion",
    "SGD",
    "SignSGD",
]
_CLASSES += ["AdEMAMix", "AdamMini", "Muon", "APOLLOAdamW"]
#: the communication-compressed optimizers (docs/onebit.md), by module; built on real parameters they need an
#: initialized process group (``requires_process_group``, read by ``lowmemopt.registry``)
_MODULE_CLASSES = {
    "OnebitAdam": "optim.onebit",
    "ZeroOneAdam": "optim.zero_one_adam",
    "OnebitLAMB": "optim.onebit_lamb",
    "OnebitLamb": "optim.onebit_lamb",
}


def _load() -> None:
    from . import aliases, optim

    names: dict[str, Any] = {n: getattr(aliases, n) for n in aliases.__all__}
    names.update({n: getattr(optim, n) for n in _CLASSES})
    names.update({n: getattr(importlib.import_module(f".{m}", __name__), n) for n, m in _MODULE_CLASSES.items()})
    names.update({n: getattr(importlib.import_module(f".{m}", __name__), n) for n, m in _FUNCTIONS.items()})
    public = _CLASSES + list(_MODULE_CLASSES) + list(_FUNCTIONS)
    names["__all__"] = aliases.__all__ + sorted(public, key=lambda n: (n[0].islower(), n))
    globals().update(names)


def __getattr__(name: str) -> Any:
    if name == "__all__" or name[:1].isupper() or name in _FUNCTIONS:
        _load()
        if name in globals():
            return globals()[name]
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule: lowmemopt.quant, ``from .. import cpu``
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    _load()
    return sorted(globals())
