"""Where the kernels can run, and how they are launched.

* ``HAS_TRITON``: Triton imports. Without it every step takes the reference path.
* ``INTERPRET``: ``TRITON_INTERPRET=1`` was set when this module was imported. Triton decides at decoration time
  (``@triton.jit``) whether a kernel is compiled or interpreted, so the variable must be set before anything imports
  ``lowmemopt.kernels``' kernel modules (the test suite sets it in ``tests/conftest.py`` on machines without CUDA).
  The interpreter runs the kernels on CPU tensors with numpy: that is how CI tests them.
* ``ENABLED``: ``LOWMEMOPT_KERNELS=0`` turns the fused path off (every step takes the reference path).

Launch shapes (tuning facts, not semantics): a program handles one *tile* of ``rows x block`` elements, where ``block``
is the quantization block size for 8-bit state (a row is one block: its absmax is a row reduction) and a whole tile
for dense state. 2048 elements per tile with 4 warps keeps 16 fp32 values per thread in flight, enough to saturate
HBM on A100/H100 class GPUs for these memory-bound kernels (124 registers per thread for 8-bit AdamW at sm_90: four
programs per SM). A GPU model may take another shape: a :data:`TILE_SHAPES` entry (by compute capability, set in
code), or the shape ``lowmemopt tune`` measured fastest on that GPU (:mod:`.tuning`, which keeps it in the cache file
that :mod:`.tuning_cache` reads); the shape changes speed only, never results.
"""

from __future__ import annotations

import functools
import os
import re

import torch

from . import tuning_cache

__all__ = [
    "HAS_TRITON", "INTERPRET", "ENABLED", "TILE", "TILE_2D", "STATS_BLOCK", "NUM_WARPS", "TILE_SHAPES", "tile_shape",
    "rows_per_tile", "fast_fp64", "device_ok", "cpu_interpreter", "Q8_DECODE", "q8_decode", "launch_shape",
    "TILE_LAYOUT", "column_tiles",
]

try:
    import triton

    HAS_TRITON = hasattr(triton, "jit")
except Exception:  # ImportError, or a broken install: the reference path still works
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ENABLED = os.environ.get("LOWMEMOPT_KERNELS", "1") != "0"

#: elements per program for elementwise passes. The interpreter uses the same shapes, so that the tests run the
#: code paths the GPU runs (full tiles take an unmasked variant, the last tile of a tensor a masked one).
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
    """``lowmemopt tune``'s measurement for CUDA ``device`` (:func:`.tuning_cache.tuned`), or None (none, or no
    CUDA)."""
    index = device.index
    if index is None:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
    return tuning_cache.tuned(index)  # (cached per device index: a launch asks this)


def tile_shape(device: torch.device | None = None) -> tuple[int, int]:
    """(elements per tile, num_warps) of the elementwise passes on ``device``: a shape :func:`launch_shape` forces,
    else its :data:`TILE_SHAPES` entry, else the shape ``lowmemopt tune`` measured on it, else
    ``(TILE, NUM_WARPS)``."""
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
    """Whether a launch over ``fmt`` state (``"q8"``, ``"q4"``, ``"bf16"``, ``"fp32"``) lays its tiles out in columns
    (:data:`TILE_LAYOUT`): only 8-bit state, whose tiles gather; the 4-bit kernels pack nibbles along rows."""
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
    """How the kernels on ``device`` decode 8-bit codes: a decode :func:`launch_shape` forces, else :data:`Q8_DECODE`
    (``LOWMEMOPT_Q8_DECODE``), else what ``lowmemopt tune`` measured on the device, else ``"table"``."""
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
    """Context manager: every launch inside takes ``shape`` (elements per tile, num_warps) and the 8-bit ``decode``,
    on every device (the tuner's measurements, :mod:`.tuning`)."""

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
    """Rows of ``block`` elements per program (at least one) on ``device`` (:func:`tile_shape`)."""
    return max(1, tile_shape(device)[0] // block)


#: compute capabilities whose fp64 arithmetic runs at half the fp32 rate (the data-centre GPUs: P100, V100, A100, H100,
#: B200); the others (GeForce / RTX, L4 / L40, Jetson) run it at 1/32 to 1/64 of fp32, where a pass that sums fp64
#: products per element is compute-bound
FAST_FP64_CAPABILITIES = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})
#: tests: what the interpreter (CPU tensors) reports for :func:`fast_fp64`
INTERPRETER_FAST_FP64 = True


def fast_fp64(device: torch.device) -> bool:
    """Does ``device`` run fp64 arithmetic at a rate that a memory-bound pass can afford (CUDA: its capability is in
    :data:`FAST_FP64_CAPABILITIES`)? Picks CAME's instability passes (:mod:`.factored`)."""
    if device.type != "cuda":
        return INTERPRETER_FAST_FP64
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) in FAST_FP64_CAPABILITIES


def device_ok(device: torch.device) -> bool:
    """Can a kernel run on tensors of ``device``? CUDA with compiled Triton kernels, or CPU under the interpreter when
    a test asked for it with :func:`cpu_interpreter`."""
    if not (HAS_TRITON and ENABLED):
        return False
    if device.type == "cuda":  # the interpreter cannot follow the launch tables' raw device addresses
        return not INTERPRET
    return device.type == "cpu" and INTERPRET and _cpu_interpreter


class cpu_interpreter:
    """Context manager (tests): send CPU tensors through the kernels, which the Triton interpreter runs on CPU.

    Raises RuntimeError unless Triton is importable and ``TRITON_INTERPRET=1`` was set before ``lowmemopt.kernels``
    was imported."""

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
