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

from dataclasses import dataclass, field
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import adamw, blockwise, factored, lamb, lars, lion, runtime, sgd, unproject
from .codec import BF16, FP32, KAHAN, NEAREST, Q4, Q8, STOCHASTIC

__all__ = ["SM90", "Variant", "VARIANTS", "signature", "tile", "tile4", "compile_variant"]

#: the target of the ahead-of-time compiles: sm_90 (H100), 32 threads per warp
SM90 = GPUTarget("cuda", 90, 32)

#: launch-table and lookup-table arguments: their pointer types (every other pointer argument is ``*fp32``)
POINTERS = {"units": "*i32", "table": "*i64", "lut_s": "*i32", "lut_u": "*i32", "lut": "*i32", "codes_ptr": "*u8",
            "nibbles_ptr": "*u8"}
#: CAME's fp64 row/column moment sums (and ``rsum`` / ``csum`` of the factors pass that reads them: ``MOMENTS``)
FP64_POINTERS = {"rmom", "cmom"}
FP32_POINTERS = {"c_ptr", "book_s", "book_u", "book", "sums", "rsum", "csum", "rfac", "cfac", "rfac2", "cfac2", "absmax_ptr",
                 "out_ptr", "x_ptr", "scal"}
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
    return {**dict(W=15, FMT=Q8, P_DTYPE=tl.bfloat16, G_DTYPE=tl.float32, ALIGNED=True,
                   ROWS=max(1, runtime.TILE // block), BLOCK=block), **flags}


def tile4(**flags: Any) -> dict[str, Any]:
    """:func:`tile` for 4-bit state (rows of :data:`Q4_BLOCK` elements)."""
    return tile(Q4_BLOCK, **{"FMT": Q4, **flags})


def _stats(fmt: int, qblock: int, **flags: Any) -> dict[str, Any]:
    """Constexprs of a 2-D tile kernel of the factored passes (``runtime.TILE_2D``)."""
    tr, bc = runtime.TILE_2D
    return {**dict(W=15, FMT=fmt, G_DTYPE=tl.float32, QBLOCK=qblock, TR=tr, BC=bc), **flags}


#: one entry per kernel and code path worth compiling: every kernel, each update mode and state format once
VARIANTS = [
    Variant("adam", adamw._adam_kernel, tile(AMSGRAD=True, MAXIMIZE=True, L2_DECAY=True, UPDATE=NEAREST)),
    Variant("adam-stochastic", adamw._adam_kernel,
            tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=STOCHASTIC, W=17)),
    Variant("adam-arith", adamw._adam_kernel,  # runtime.Q8_DECODE = "arithmetic": no code books
            tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=NEAREST, book_s=None, book_u=None)),
    # a capturable step: the step's scalars read per tensor from the device (lowmemopt.work.capture)
    Variant("adam-capturable", adamw._adam_kernel,
            tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=NEAREST, DEVICE_SCALARS=True)),
    # 8-bit tiles laid out [BLOCK, ROWS] (runtime.column_tiles: the default before Triton 3.7)
    Variant("adam-cols", adamw._adam_kernel,
            tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=NEAREST, COLS=True)),
    Variant("lion-cols", lion._lion_kernel, tile(UPDATE=NEAREST, COLS=True)),
    Variant("lamb-cols", lamb._lamb_kernel, tile(DECAY=True, TRUST=True, APPLY=True, COLS=True)),
    Variant("adam-fp32-state", adamw._adam_kernel,
            tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=NEAREST, FMT=FP32)),
    Variant("sgd", sgd._sgd_kernel,
            tile(MOMENTUM=True, NESTEROV=True, MAXIMIZE=False, DECAY=True, UPDATE=KAHAN, W=17, FMT=BF16)),
    # fp16 parameters: bf16_update's fp16 stochastic rounding and fp16 Kahan buffer (codec.store_param_as)
    Variant("lion-fp16-stochastic", lion._lion_kernel, tile(UPDATE=STOCHASTIC, W=17, P_DTYPE=tl.float16)),
    Variant("lion-fp16-kahan", lion._lion_kernel, tile(UPDATE=KAHAN, W=17, P_DTYPE=tl.float16)),
    Variant("lion", lion._lion_kernel, tile(UPDATE=NEAREST)),
    Variant("lamb", lamb._lamb_kernel, tile(DECAY=True, TRUST=True, APPLY=True)),
    Variant("lamb-capturable", lamb._lamb_kernel, tile(DECAY=True, TRUST=True, APPLY=True, DEVICE_SCALARS=True)),
    Variant("lars-norms", lars._lars_norms_kernel, tile()),
    Variant("lars", lars._lars_apply_kernel, tile(MOMENTUM=True, DECAY=True, TRUST=True)),
    Variant("stats", factored._stats_kernel, _stats(Q8, 256, G_DTYPE=tl.bfloat16, RESIDUAL=False)),
    Variant("stats-residual", factored._stats_kernel, _stats(Q8, 256, RESIDUAL=True)),
    Variant("moments", factored._moments_kernel, _stats(Q8, 256)),
    Variant("factors", factored._factors_kernel, dict(W=15, STAT=9, FB=runtime.STATS_BLOCK, MOMENTS=False)),
    Variant("factors-moments", factored._factors_kernel, dict(W=15, STAT=11, FB=runtime.STATS_BLOCK, MOMENTS=True)),
    Variant("factors-capturable", factored._factors_kernel,
            dict(W=15, STAT=9, FB=runtime.STATS_BLOCK, MOMENTS=False, DEVICE_SCALARS=True)),
    Variant("sumsq", factored._sumsq_kernel, tile(FACTORED=False, WIDE=False, SUM_P=True)),
    Variant("sumsq-factored", factored._sumsq_kernel, tile(FACTORED=True, WIDE=True, SUM_P=True)),
    # matrices of rows >= the tile's row (WIDE: the factor indices per segment), and narrower ones
    Variant("apply-came", factored._apply_kernel,
            tile(FACTORED=True, WIDE=True, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True)),
    Variant("apply-came-narrow", factored._apply_kernel,
            tile(FACTORED=True, WIDE=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True)),
    Variant("apply-adafactor", factored._apply_kernel,
            tile(FACTORED=False, WIDE=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True)),
    Variant("apply-adafactor-factored", factored._apply_kernel,
            tile(FACTORED=True, WIDE=True, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True)),
    Variant("apply-adafactor-capturable", factored._apply_kernel,
            tile(FACTORED=False, WIDE=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True,
                 DEVICE_SCALARS=True)),
    Variant("quantize", blockwise._quantize_kernel, dict(SIGNED=False, ROWS=runtime.TILE // 256, BLOCK=256, POW2=True)),
    Variant("quantize-table", blockwise._quantize_kernel,
            dict(SIGNED=True, ROWS=runtime.TILE // 256, BLOCK=256, POW2=False)),
    Variant("dequantize", blockwise._dequantize_kernel, dict(ROWS=runtime.TILE // 256, BLOCK=256)),
    # 4-bit state (block 128): nibble packing (reshape / split / join) and the 2-D nibble gathers
    Variant("adam-q4", adamw._adam_kernel, tile4(AMSGRAD=True, MAXIMIZE=False, L2_DECAY=False, UPDATE=NEAREST)),
    Variant("stats-q4", factored._stats_kernel, _stats(Q4, Q4_BLOCK, RESIDUAL=True)),
    Variant("moments-q4", factored._moments_kernel, _stats(Q4, Q4_BLOCK)),
    Variant("apply-came-q4", factored._apply_kernel,
            tile4(FACTORED=False, WIDE=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True)),
    Variant("quantize4", blockwise._quantize4_kernel, dict(SIGNED=True, ROWS=runtime.TILE // Q4_BLOCK, BLOCK=Q4_BLOCK)),
    Variant("dequantize4", blockwise._dequantize4_kernel, dict(ROWS=runtime.TILE // Q4_BLOCK, BLOCK=Q4_BLOCK)),
    # GaLore's apply pass after the batched product back: bf16 params, fp32 products, a decay per matrix
    Variant("unproject", unproject._apply_kernel,
            dict(W=3, P_DTYPE=tl.bfloat16, U_DTYPE=tl.float32, ALIGNED=True, ROWS=runtime.TILE // 256, BLOCK=256,
                 MATH=2, DECAY=True)),
]


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
