"""Every fused kernel's compile-time variants, and how to compile one ahead of time for an NVIDIA GPU without a GPU.

Triton's compiler and ptxas run on the CPU: :func:`compile_variant` turns a :class:`Variant` into the PTX and cubin a
GPU of :data:`SM90` (H100) would run. One table, two users: the GPU-compile test (``tests/test_kernels.py``: every
variant compiles, the full-tile ones keep 128-bit accesses and do not spill) and ``bench/kernel_resources.py`` (the
registers, spills, occupancy and memory instructions of each variant). Compiling needs real ``JITFunction`` objects:
run it in a process started without ``TRITON_INTERPRET``.

Tile shapes follow :mod:`.runtime` (``TILE`` elements per program in ``TILE // block`` rows, ``NUM_WARPS``,
``TILE_2D``, ``STATS_BLOCK``), so the table compiles what the launchers launch by default.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import runtime
from .codec import BF16, FP32, KAHAN, NEAREST, Q4, Q8, STOCHASTIC  # noqa: F401 (read by compile_variants)

__all__ = ["SM90", "Variant", "VARIANTS", "signature", "stats", "tile", "tile4", "compile_variant"]

#: the target of the ahead-of-time compiles: sm_90 (H100), 32 threads per warp
SM90 = GPUTarget("cuda", 90, 32)

#: launch-table and lookup-table arguments: their pointer types (every other pointer argument is ``*fp32``)
POINTERS = {
    "units": "*i32",
    "table": "*i64",
    "lut_s": "*i32",
    "lut_u": "*i32",
    "lut": "*i32",
    "codes_ptr": "*u8",
    "nibbles_ptr": "*u8",
}
#: CAME's fp64 row/column moment sums (and ``rsum`` / ``csum`` of the factors pass that reads them: ``MOMENTS``)
FP64_POINTERS = {"rmom", "cmom"}
FP32_POINTERS = {
    "c_ptr",
    "book_s",
    "book_u",
    "book",
    "sums",
    "rsum",
    "csum",
    "rfac",
    "cfac",
    "rfac2",
    "cfac2",
    "absmax_ptr",
    "out_ptr",
    "x_ptr",
    "scal",
}
INTS = {"first_step": "i32", "numel": "i64"}
#: the encode tables of the dense formats: None (they have none); 8-bit state has the pow2 maps' int64 class tables
#: (:func:`.codec.maps`), 4-bit state its int32 bucket tables
NONE_ARGS = {"lut_s": None, "lut_u": None}
#: the 4-bit quantization block (the launchers' default for q4 state)
Q4_BLOCK = 128


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: its ``tl.constexpr`` values and ``num_warps``; ``label`` names it in reports."""

    label: str
    kernel: Any  # triton.JITFunction
    constexprs: dict[str, Any] = field(hash=False)
    num_warps: int = runtime.NUM_WARPS

    def tile(self) -> str:
        """The program's tile as text: ``ROWSxBLOCK`` (flat tiles), ``TRxBC`` (2-D tiles) or ``FB`` (vectors)."""
        c = self.constexprs
        if "ROWS" in c:
            return f"{c['ROWS']}x{c['BLOCK']}"
        if "TR" in c:
            return f"{c['TR']}x{c['BC']}"
        return str(c.get("FB", "-"))

    def elements(self) -> int | None:
        """Elements of the program's 2-D tile (flat ``ROWS x BLOCK`` or ``TR x BC``); None for vector programs."""
        c = self.constexprs
        if "ROWS" in c:
            return c["ROWS"] * c["BLOCK"]
        if "TR" in c:
            return c["TR"] * c["BC"]
        return None


def signature(kernel: Any, constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton's argument types of ``kernel``: ``constexpr`` for compile-time arguments, pointer types by name (the
    encode tables of 8-bit state maps, :func:`.pow2.class_table`, are int64), fp32 scalars for the hyper-parameters
    (runtime arguments, never constexpr)."""
    sig = {}
    class_tables = ("lut_s", "lut_u") if constexprs.get("FMT") == Q8 else ("lut",) if constexprs.get("POW2") else ()
    for p in kernel.params:
        if p.is_constexpr or p.name in constexprs:
            sig[p.name] = "constexpr"
        elif p.name in class_tables:
            sig[p.name] = "*i64"
        elif p.name in POINTERS:
            sig[p.name] = POINTERS[p.name]
        elif p.name in FP64_POINTERS or (p.name in ("rsum", "csum") and constexprs.get("MOMENTS")):
            sig[p.name] = "*fp64"
        elif p.name in FP32_POINTERS:
            sig[p.name] = "*fp32"
        else:
            sig[p.name] = INTS.get(p.name, "fp32")
    return sig


def tile(block: int = 256, **flags: Any) -> dict[str, Any]:
    """Constexprs of a flat-tile kernel at the default tile (``runtime.TILE`` elements in rows of ``block``), 8-bit
    state, bf16 parameters, fp32 gradients, 16-byte aligned tensors; ``flags`` add or override."""
    return {
        **dict(
            W=15,
            FMT=Q8,
            P_DTYPE=tl.bfloat16,
            G_DTYPE=tl.float32,
            ALIGNED=True,
            ROWS=max(1, runtime.TILE // block),
            BLOCK=block,
        ),
        **flags,
    }


def tile4(**flags: Any) -> dict[str, Any]:
    """:func:`tile` for 4-bit state (rows of :data:`Q4_BLOCK` elements)."""
    return tile(Q4_BLOCK, **{"FMT": Q4, **flags})


def stats(fmt: int, qblock: int, **flags: Any) -> dict[str, Any]:
    """Constexprs of a 2-D tile kernel of the factored passes (``runtime.TILE_2D``)."""
    tr, bc = runtime.TILE_2D
    return {**dict(W=15, FMT=fmt, G_DTYPE=tl.float32, QBLOCK=qblock, TR=tr, BC=bc), **flags}


def _collect() -> list[Variant]:
    """Every kernel module's ``compile_variants(this module)``, in the package's module order."""
    out: list[Variant] = []
    for info in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        if info.name == "variants":
            continue
        made = getattr(importlib.import_module(f".{info.name}", __package__), "compile_variants", None)
        if made is not None:
            out += made(sys.modules[__name__])
    return out


#: one entry per kernel and code path worth compiling (every kernel, each update mode and state format once), each
#: declared beside its kernel (``compile_variants`` in the kernel's module)
VARIANTS = _collect()


def compile_variant(variant: Variant, target: GPUTarget = SM90) -> Any:
    """``variant`` compiled by Triton for ``target`` (a ``CompiledKernel``: ``asm["ptx"]``, ``asm["cubin"]``,
    ``metadata``), with the launchers' options (no FP contraction). Dense formats get ``None`` encode tables (as at
    run time); 8-bit ones their class tables, 4-bit ones their bucket tables."""
    kernel = variant.kernel
    none = dict(NONE_ARGS) if variant.constexprs.get("FMT") in (FP32, BF16) else {}
    if not variant.constexprs.get("DEVICE_SCALARS"):
        none["scal"] = None  # (the ordinary launch: the step's scalars are arguments)
    constexprs = {**{k: v for k, v in none.items() if k in kernel.arg_names}, **variant.constexprs}
    src = ASTSource(fn=kernel, signature=signature(kernel, constexprs), constexprs=constexprs)
    return triton.compile(src, target=target, options=dict(num_warps=variant.num_warps, enable_fp_fusion=False))
