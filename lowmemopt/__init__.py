"""lowmemopt: memory-efficient PyTorch optimizers (4/8/16/32-bit state) that drop in for torch.optim."""

from .aliases import (
    Adafactor4bit,
    Adam4bit,
    AdamW4bit,
    CAME4bit,
    GaLoreAdamW4bit,
    LAMB4bit,
    LARS4bit,
    Lion4bit,
    PagedAdamW4bit,
    Adafactor8bit,
    Adam8bit,
    AdamW8bit,
    CAME8bit,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    LAMB8bit,
    LARS8bit,
    Lion8bit,
    PagedAdamW,
    PagedAdamW8bit,
)
from .checkpoint import load_state, save_state
from .optim import CAME, LAMB, LARS, SGD, Adafactor, AdafactorTorch, Adam, AdamW, Lion
from .per_layer import step_in_backward
from .projection import galore_param_groups

from .version import __version__

__all__ = [
    "Adafactor4bit",
    "Adam4bit",
    "AdamW4bit",
    "CAME4bit",
    "GaLoreAdamW4bit",
    "LAMB4bit",
    "LARS4bit",
    "Lion4bit",
    "PagedAdamW4bit",
    "Adafactor",
    "Adafactor8bit",
    "AdafactorTorch",
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW8bit",
    "CAME",
    "CAME8bit",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "LAMB",
    "LAMB8bit",
    "LARS",
    "LARS8bit",
    "Lion",
    "Lion8bit",
    "PagedAdamW",
    "PagedAdamW8bit",
    "SGD",
    "galore_param_groups",
    "load_state",
    "save_state",
    "step_in_backward",
]
