"""One module per algorithm: the user-facing class (reference signature) and its fp32 math as a pure function."""

from .adafactor import Adafactor, AdafactorTorch
from .adam_mini import AdamMini
from .ademamix import AdEMAMix
from .adamw import Adam, AdamW, CPUAdam, FusedAdam
from .apollo import APOLLOAdamW, apollo_param_groups
from .came import CAME
from .hf_adamw import HFAdamW
from .lamb import LAMB, FusedLAMB
from .lars import LARS
from .lion import Lion
from .muon import Muon, muon_param_groups
from .sgd import SGD, FusedSGD
from .signsgd import SignSGD

__all__ = [
    "Adafactor",
    "AdafactorTorch",
    "Adam",
    "AdamW",
    "CAME",
    "CPUAdam",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "HFAdamW",
    "LAMB",
    "LARS",
    "Lion",
    "SGD",
    "SignSGD",
]
__all__ += ["AdEMAMix", "AdamMini", "Muon", "muon_param_groups", "APOLLOAdamW", "apollo_param_groups"]
