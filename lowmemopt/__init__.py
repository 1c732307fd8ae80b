"""lowmemopt: memory-efficient PyTorch optimizers (4/8/16/32-bit state) that drop in for torch.optim."""

from . import aliases
from .aliases import *  # noqa: F403 - the drop-in names, listed once in aliases.__all__
from .checkpoint import load_state, save_state
from .optim import CAME, LAMB, LARS, SGD, Adafactor, AdafactorTorch, Adam, AdamW, Lion
from .per_layer import step_in_backward
from .projection import galore_param_groups

from .version import __version__

__all__ = aliases.__all__ + [
    "Adafactor",
    "AdafactorTorch",
    "Adam",
    "AdamW",
    "CAME",
    "LAMB",
    "LARS",
    "Lion",
    "SGD",
    "galore_param_groups",
    "load_state",
    "save_state",
    "step_in_backward",
]
