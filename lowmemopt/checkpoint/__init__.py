"""Checkpoints: optimizer state in one safetensors file (no pickle), saved atomically, validated whole on load and
converted to the loading optimizer's formats::

    lowmemopt.save_state(opt, "opt.safetensors", model=model)
    report = lowmemopt.load_state(opt, "opt.safetensors", model=model)

Modules: :mod:`.layout` (the file), :mod:`.validation`, :mod:`.save`, :mod:`.load`. Docs: docs/state_format.md.
"""

from ..quant.convert import CheckpointError, convert_param_state
from .layout import FILE_FORMAT, FILE_VERSION
from .load import load_state
from .save import save_state
from .validation import LoadReport, read_metadata

__all__ = [
    "CheckpointError",
    "LoadReport",
    "FILE_FORMAT",
    "FILE_VERSION",
    "save_state",
    "load_state",
    "read_metadata",
    "convert_param_state",
]
