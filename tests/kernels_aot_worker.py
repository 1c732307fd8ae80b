"""Subprocess half of the GPU-compile test: compile every lowmemopt kernel ahead of time for an NVIDIA target (sm_90)
with Triton's own compiler and ptxas, without a GPU, and print one JSON line per kernel variant:
``{"kernel": label, "ok": bool, "error": str, "v4": number of 128-bit global loads and stores}``.

Runs without ``TRITON_INTERPRET`` (the parent removes it), so the kernels are real ``JITFunction`` objects. Catches what
the interpreter cannot: code that the GPU compiler rejects (non-constexpr globals, type errors), and lost
vectorization in the unmasked (full-tile) variants. Usage: python kernels_aot_worker.py
"""

import json
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lowmemopt.kernels import adamw, codec, factored, lamb, lars, lion, sgd, unproject

POINTERS = {"units": "*i32", "table": "*i64", "lut_s": "*i32", "lut_u": "*i32", "lut": "*i32", "codes_ptr": "*u8",
            "nibbles_ptr": "*u8"}
FP64_POINTERS = {"rmom", "cmom"}
FP32_POINTERS = {"c_ptr", "book_s", "book_u", "book", "sums", "rsum", "csum", "rfac", "cfac", "rfac2", "cfac2", "absmax_ptr",
                 "out_ptr", "x_ptr"}
INTS = {"first_step": "i32", "numel": "i64"}


#: the state maps' encode tables: None at run time (codec.maps; the pow2 maps are encoded by arithmetic)
NONE_ARGS = {"lut_s": None, "lut_u": None}


def signature(fn, constexprs: dict) -> dict:
    sig = {}
    for p in fn.params:
        if p.is_constexpr or p.name in constexprs:
            sig[p.name] = "constexpr"
        elif p.name in POINTERS:
            sig[p.name] = POINTERS[p.name]
        elif p.name in FP64_POINTERS or (p.name in ("rsum", "csum") and constexprs.get("MOMENTS")):
            sig[p.name] = "*fp64"
        elif p.name in FP32_POINTERS:
            sig[p.name] = "*fp32"
        else:
            sig[p.name] = INTS.get(p.name, "fp32")  # hyper-parameters: runtime fp32 scalars
    return sig


def tile(**flags):
    return {**dict(W=15, FMT=2, P_DTYPE=tl.bfloat16, G_DTYPE=tl.float32, ALIGNED=True, ROWS=8, BLOCK=256), **flags}


VARIANTS = [
    ("adam", adamw._adam_kernel, tile(AMSGRAD=True, MAXIMIZE=True, L2_DECAY=True, UPDATE=codec.NEAREST)),
    ("adam-stochastic", adamw._adam_kernel, tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=codec.STOCHASTIC,
                                                 W=17)),
    ("adam-fp32-state", adamw._adam_kernel,
     {**tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=codec.NEAREST), "FMT": 0}),
    ("sgd", sgd._sgd_kernel,
     {**tile(MOMENTUM=True, NESTEROV=True, MAXIMIZE=False, DECAY=True, UPDATE=codec.KAHAN, W=17), "FMT": 1}),
    ("lion", lion._lion_kernel, tile(UPDATE=codec.NEAREST)),
    ("lamb", lamb._lamb_kernel, tile(DECAY=True, TRUST=True, APPLY=True)),
    ("lars-norms", lars._lars_norms_kernel, tile()),
    ("lars", lars._lars_apply_kernel, tile(MOMENTUM=True, DECAY=True, TRUST=True)),
    ("stats", factored._stats_kernel, dict(W=15, FMT=2, G_DTYPE=tl.bfloat16, QBLOCK=256, TR=16, BC=128,
                                           RESIDUAL=False)),
    ("stats-residual", factored._stats_kernel, dict(W=15, FMT=2, G_DTYPE=tl.float32, QBLOCK=256, TR=16, BC=128,
                                                    RESIDUAL=True)),
    ("moments", factored._moments_kernel, dict(W=15, FMT=2, G_DTYPE=tl.float32, QBLOCK=256, TR=16, BC=128)),
    ("factors", factored._factors_kernel, dict(W=15, STAT=9, FB=1024, MOMENTS=False)),
    ("factors-moments", factored._factors_kernel, dict(W=15, STAT=11, FB=1024, MOMENTS=True)),
    ("sumsq", factored._sumsq_kernel, tile(FACTORED=False, SUM_P=True)),
    ("apply-came", factored._apply_kernel, tile(FACTORED=True, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True)),
    ("apply-adafactor", factored._apply_kernel,
     tile(FACTORED=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True)),
    ("quantize", codec._quantize_kernel, dict(SIGNED=False, ROWS=8, BLOCK=256, lut=None)),
    ("quantize-table", codec._quantize_kernel, dict(SIGNED=True, ROWS=8, BLOCK=256)),
    ("dequantize", codec._dequantize_kernel, dict(ROWS=8, BLOCK=256)),
    # 4-bit state (FMT 3, block 128): nibble packing (reshape / split / join) and the 2-D nibble gathers
    ("adam-q4", adamw._adam_kernel,
     {**tile(AMSGRAD=True, MAXIMIZE=False, L2_DECAY=False, UPDATE=codec.NEAREST), "FMT": 3, "ROWS": 16, "BLOCK": 128}),
    ("stats-q4", factored._stats_kernel,
     dict(W=15, FMT=3, G_DTYPE=tl.float32, QBLOCK=128, TR=16, BC=128, RESIDUAL=True)),
    ("moments-q4", factored._moments_kernel, dict(W=15, FMT=3, G_DTYPE=tl.float32, QBLOCK=128, TR=16, BC=128)),
    ("apply-came-q4", factored._apply_kernel,
     {**tile(FACTORED=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True), "FMT": 3, "ROWS": 16,
      "BLOCK": 128}),
    ("quantize4", codec._quantize4_kernel, dict(SIGNED=True, ROWS=16, BLOCK=128)),
    ("dequantize4", codec._dequantize4_kernel, dict(ROWS=16, BLOCK=128)),
    # GaLore's apply pass after the batched product back: bf16 params, fp32 products, a decay per matrix
    ("unproject", unproject._apply_kernel, dict(W=3, P_DTYPE=tl.bfloat16, U_DTYPE=tl.float32, ALIGNED=True, ROWS=8,
                                                BLOCK=256, MATH=2, DECAY=True)),
]


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    for label, kernel, constexprs in VARIANTS:
        result = dict(kernel=label, ok=False, error="", v4=0)
        try:
            none = {} if constexprs.get("FMT") == 3 else NONE_ARGS  # 4-bit encodes through its table
            constexprs = {**{k: v for k, v in none.items() if k in kernel.arg_names}, **constexprs}
            src = ASTSource(fn=kernel, signature=signature(kernel, constexprs), constexprs=constexprs)
            compiled = triton.compile(src, target=target, options=dict(num_warps=4, enable_fp_fusion=False))
            result["v4"] = len(re.findall(r"(?:ld|st)\.global[\.\w]*\.v4", compiled.asm["ptx"]))
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            result["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
