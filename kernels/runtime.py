"""Where the kernels run and how they are launched: ``HAS_TRITON``; ``INTERPRET`` (``TRITON_INTERPRET=1`` before the
kernel modules are imported: the kernels run on CPU tensors, as CI tests them); ``ENABLED`` (``LOWMEMOPT_KERNELS=0``
turns them off); tile shapes and the 8-bit decode per device (``lowmemopt tune``: docs/kernels.md#benchmark).
"""

from __future__ import annotations

import functools
import os
import re

import torch

from . import tuning_cache

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "ENABLED",
    "TILE",
    "TILE_2D",
    "STATS_BLOCK",
    "NUM_WARPS",
    "TILE_SHAPES",
    "tile_shape",
    "rows_per_tile",
    "launch_settings",
    "fast_fp64",
    "device_ok",
    "cpu_interpreter",
    "Q8_DECODE",
    "q8_decode",
    "launch_shape",
    "TILE_LAYOUT",
    "column_tiles",
]

try:
    import triton

    HAS_TRITON = hasattr(triton, "jit")
except Exception:  # ImportError, or a broken install: the reference path still works
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ENABLED = os.environ.get("LOWMEMOPT_KERNELS", "1") != "0"

#: elements per program for elementwise passes: with 4 warps, 16 fp32 values per thread in flight, enough to
#: saturate HBM on A100/H100 class GPUs (8-bit AdamW at sm_90: 124 registers, four programs per SM). A 2-D tile row is
#: one quantization block for 8-bit state. The interpreter uses the same shapes, so that the tests run the code paths
#: the GPU runs (full tiles take an unmasked variant, the last tile of a tensor a masked one).
TILE = 2048
#: rows x columns of the 2-D tiles of the factored (Adafactor, CAME) reduction passes, and the vector width of their
#: per-row/column statistics pass
TILE_2D = (16, 128)
STATS_BLOCK = 1024
NUM_WARPS = 4
#: (elements per tile, warps per program) of the elementwise passes by CUDA compute capability ``(major, minor)``,
#: set in code (it wins over a tuned shape); a device with neither takes ``(TILE, NUM_WARPS)``. Entries are
#: measurements (``bench/fused_kernels.py --sweep``, ``lowmemopt tune``), never guesses: none yet.
TILE_SHAPES: dict[tuple[int, int], tuple[int, int]] = {}

#: how the elementwise kernels lay out an 8-bit state tile: ``"rows"`` ([ROWS, BLOCK], a quantization block per row)
#: or ``"columns"`` ([BLOCK, ROWS], a block per column). The same values either way; what differs is what the compiler
#: makes of the code-book and class-table gathers. Triton before 3.7 lays a gather out with its first axis fastest,
#: which only column tiles match (otherwise the whole tile goes through shared memory); 3.7 and later lay it out as
#: the contiguous accesses beside it, which row tiles match (docs/kernels.md, "Triton versions"). None
#: (``LOWMEMOPT_TILE_LAYOUT`` unset): chosen by the installed Triton's version. Read at each launch.
TILE_LAYOUT: str | None = os.environ.get("LOWMEMOPT_TILE_LAYOUT") or None

#: how the kernels decode 8-bit state codes: ``"table"`` gathers each code's value from the map's 1 KiB code book
#: (one dependent scalar load per element and slot after the codes arrive); ``"arithmetic"`` builds it from the
#: code's bits (:func:`.pow2.pow2_value`: a few integer operations, the same fp32 value for every code). Which is
#: faster is a GPU measurement. None (``LOWMEMOPT_Q8_DECODE`` unset): what ``lowmemopt tune`` measured on the device
#: (:func:`q8_decode`), else the table. Read at each launch (a change takes effect at the next step; each mode
#: compiles its own kernels).
Q8_DECODE: str | None = os.environ.get("LOWMEMOPT_Q8_DECODE") or None
if Q8_DECODE not in (None, "table", "arithmetic"):
    raise ValueError(f"LOWMEMOPT_Q8_DECODE={Q8_DECODE!r}: expected 'table' or 'arithmetic'")

#: a shape and decode forced for every device (:func:`launch_shape`: the tuner's measurements)
_forced: tuple[tuple[int, int], str] | None = None

_cpu_interpreter = False  # tests: route CPU tensors through the interpreted kernels (see cpu_interpreter())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _tuned(device: torch.device) -> dict | None:
    index = device.index
    if index is None:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
    return tuning_cache.tuned(index)  # (cached per device index: a launch asks this)


def tile_shape(device: torch.device | None = None) -> tuple[int, int]:
    """(elements per tile, num_warps) on ``device``: forced, configured, tuned or default."""
    if _forced is not None:
        return _forced[0]
    if device is not None and device.type == "cuda":
        if TILE_SHAPES:
            index = device.index if device.index is not None else torch.cuda.current_device()
            shape = TILE_SHAPES.get(_capability(index))
            if shape is not None:
                return shape
        entry = _tuned(device)
        if entry is not None:
            return entry["tile"], entry["num_warps"]
    return TILE, NUM_WARPS


def column_tiles(fmt: str) -> bool:
    """Whether a launch over ``fmt`` state lays its tiles out in columns (:data:`TILE_LAYOUT`; only ``"q8"``)."""
    if fmt != "q8":
        return False
    layout = TILE_LAYOUT or ("columns" if _triton_before(3, 7) else "rows")
    if layout not in ("rows", "columns"):
        raise ValueError(f"LOWMEMOPT_TILE_LAYOUT must be 'rows' or 'columns', got {layout!r}")
    return layout == "columns"


@functools.lru_cache(maxsize=None)
def _triton_before(major: int, minor: int) -> bool:
    if not HAS_TRITON:
        return False
    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return found is not None and (int(found[1]), int(found[2])) < (major, minor)


def q8_decode(device: torch.device | None = None) -> str:
    """How 8-bit codes are decoded on ``device``: forced, else ``LOWMEMOPT_Q8_DECODE``, else tuned, else ``"table"``."""
    if _forced is not None:
        return _forced[1]
    if Q8_DECODE is not None:
        return Q8_DECODE
    if device is not None and device.type == "cuda":
        entry = _tuned(device)
        if entry is not None:
            return entry["decode"]
    return "table"


class launch_shape:
    """Context manager: every launch inside takes ``shape`` (elements per tile, num_warps) and ``decode``."""

    def __init__(self, shape: tuple[int, int], decode: str = "table") -> None:
        if decode not in ("table", "arithmetic"):
            raise ValueError(f"decode must be 'table' or 'arithmetic', got {decode!r}")
        self.value = (tuple(shape), decode)

    def __enter__(self) -> "launch_shape":
        global _forced
        self._saved, _forced = _forced, self.value
        return self

    def __exit__(self, *exc) -> None:
        global _forced
        _forced = self._saved


def rows_per_tile(block: int, device: torch.device | None = None) -> int:
    """Rows of ``block`` elements per program on ``device`` (at least one)."""
    return max(1, tile_shape(device)[0] // block)


def launch_settings(block: int, device: torch.device, fmt: str | None) -> tuple[int, bool, bool]:
    """What a bucket's launches read at each launch, in one call: :func:`rows_per_tile`, :func:`column_tiles` of a
    tile launch's state format ``fmt`` (None: no tile launch, False) and :func:`fast_fp64`."""
    return rows_per_tile(block, device), fmt is not None and column_tiles(fmt), fast_fp64(device)


#: compute capabilities whose fp64 arithmetic runs at half the fp32 rate (the data-centre GPUs: P100, V100, A100, H100,
#: B200); the others (GeForce / RTX, L4 / L40, Jetson) run it at 1/32 to 1/64 of fp32, where a pass that sums fp64
#: products per element is compute-bound
FAST_FP64_CAPABILITIES = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})
#: tests: what the interpreter (CPU tensors) reports for :func:`fast_fp64`
INTERPRETER_FAST_FP64 = True


def fast_fp64(device: torch.device) -> bool:
    """Whether ``device`` runs fp64 fast enough for a memory-bound pass (picks CAME's instability passes)."""
    if device.type != "cuda":
        return INTERPRETER_FAST_FP64
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) in FAST_FP64_CAPABILITIES


def device_ok(device: torch.device) -> bool:
    """Whether a kernel can run on ``device``: CUDA with compiled kernels, or the CPU under :func:`cpu_interpreter`."""
    if not (HAS_TRITON and ENABLED):
        return False
    if device.type == "cuda":  # the interpreter cannot follow the launch tables' raw device addresses
        return not INTERPRET
    return device.type == "cpu" and INTERPRET and _cpu_interpreter


class cpu_interpreter:
    """Context manager (tests): send CPU tensors through the kernels under the Triton interpreter.

    Raises RuntimeError unless Triton imports and ``TRITON_INTERPRET=1`` was set before the kernels were imported.
    """

    def __enter__(self) -> "cpu_interpreter":
        global _cpu_interpreter
        if not HAS_TRITON:
            raise RuntimeError("lowmemopt.kernels: Triton is not installed")
        if not INTERPRET:
            raise RuntimeError(
                "lowmemopt.kernels: CPU tensors need the Triton interpreter; set TRITON_INTERPRET=1 before importing "
                "lowmemopt"
            )
        self._saved = _cpu_interpreter
        _cpu_interpreter = True
        return self

    def __exit__(self, *exc) -> None:
        global _cpu_interpreter
        _cpu_interpreter = self._saved
