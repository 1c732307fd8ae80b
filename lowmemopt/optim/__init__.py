"""One module per algorithm: the user-facing class (reference signature) and its fp32 math as a pure function."""

from .adamw import Adam, AdamW
from .lamb import LAMB
from .lars import LARS
from .lion import Lion
from .sgd import SGD

__all__ = ["Adam", "AdamW", "LAMB", "LARS", "Lion", "SGD"]
