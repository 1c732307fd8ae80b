"""lowmemopt: memory-efficient PyTorch optimizers (8/16/32-bit state) that drop in for torch.optim."""

from .aliases import Adam8bit, AdamW8bit, LAMB8bit, LARS8bit, Lion8bit
from .checkpoint import load_state, save_state
from .optim import LAMB, LARS, SGD, Adam, AdamW, Lion

__version__ = "0.1.0"

__all__ = [
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW8bit",
    "LAMB",
    "LAMB8bit",
    "LARS",
    "LARS8bit",
    "Lion",
    "Lion8bit",
    "SGD",
    "load_state",
    "save_state",
]
