"""Checkpoints: optimizer state in one safetensors file, validated on load and converted between state formats.

    lowmemopt.save_state(opt, "opt.safetensors", model=model)       # keys: parameter names (positions without a model)
    report = lowmemopt.load_state(opt, "opt.safetensors", model=model)

The file holds every state tensor under ``<param>/<state key>`` (``lm_head.weight/exp_avg.codes``) and a JSON header
under the safetensors metadata key ``lowmemopt`` (format version, param groups' hyper-parameters, each param's shape,
step and per-slot format, and a CRC-32 of every tensor). No pickle is involved anywhere. See ``docs/state_format.md``.

Saving is atomic: the file is written next to its destination, fsynced, then renamed over it, so an interrupted save
leaves the previous checkpoint intact. Loading validates the whole file and plans every parameter before it changes
anything; the new state is built aside (the file memory-mapped and streamed in chunks, checksummed as it is read) and
swapped in at the end, so a bad file raises :class:`CheckpointError` and leaves the optimizer exactly as it was.

Conversion: each slot is loaded into the format the loading optimizer's param group asks for (``state_bits``,
``min_quant_numel``, ``block_size``) by :mod:`lowmemopt.quant.convert`, which ``LowMemOptimizer.load_state_dict`` uses
for in-memory state dicts too (lowmemopt, ``torch.optim``, bitsandbytes layouts).

Modules, by what they hold: :mod:`.layout` (the file: keys, per-rank names, atomic writing, opening, checksums),
:mod:`.validation` (the metadata against the tensors, the load plan against the optimizer), :mod:`.save` and
:mod:`.load`.
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
