"""Fused Triton kernels on a GPU: optimizer step time of lowmemopt's kernels against bitsandbytes (AdamW8bit, Lion8bit,
LAMB8bit), torch's fused AdamW and torchao's AdamW8bit, at 10M to 1B parameters, with the achieved memory bandwidth as
a percentage of the device's measured device-to-device copy bandwidth (the roofline of these memory-bound steps).

    cd /tmp && python /path/to/repo/bench/fused_kernels.py                       # 10M, 100M, 1B; fp32 and bf16
    cd /tmp && python /path/to/repo/bench/fused_kernels.py --sizes 100M --dtypes bf16 --json kernels.json
    cd /tmp && python /path/to/repo/bench/fused_kernels.py --sweep --sizes 100M  # AdamW-8bit over tile shapes

Needs a CUDA GPU (it refuses to run without one). Run from outside the repository root (see bench/README.md).

Model: ``--sizes`` parameters as a transformer-like set of tensors of each ``--dtypes`` (fp32: fp32 parameters and
gradients; bf16: bf16 parameters and gradients, the end-to-end mixed-precision case): square ``h x h`` matrices (4 per
layer), ``h x 4h`` MLP matrices (2 per layer) and two ``h`` vectors per layer (norms: small tensors, fp32 state at
every ``state_bits``), so a launch covers hundreds of tensors of mixed sizes. Gradients are fixed random normals.

Bandwidth: each optimizer is credited with the bytes a single ideal pass moves per parameter (:func:`ideal_bytes`:
read p, g and the state, write p and the state; 8-bit state 1 byte per slot, 4-bit half a byte, absmax ignored;
2-byte parameters and gradients move 3 bytes less than fp32 ones), times the parameter count, divided by its median step
time: the achieved GB/s of each row, also as a % of the copy bandwidth (``2 x bytes / time`` of a large ``copy_``,
measured at the start of the same run). lowmemopt's multi-pass kernels move more than that (docs/kernels.md lists the
bytes per pass), which this metric charges them for.

Tile sweep (``--sweep``): lowmemopt's 8-bit AdamW over a grid of tile shapes, quantization blocks (rows) per program x
``num_warps`` (:mod:`lowmemopt.kernels.runtime`: the GPU's ``TILE_SHAPES`` entry, set for the run), and over the two
ways of decoding 8-bit codes (``runtime.Q8_DECODE``: the code-book gather, or arithmetic on the code's bits), for each
dtype and size, with the same GB/s columns; the best (shape, decode) per size and dtype is marked (the entry to add to
``TILE_SHAPES``, and whether to make arithmetic decoding the default). Results go to ``--json``.

Targets (the fused kernels' speed): 8-bit AdamW, Lion, SGD and LARS >= 70% of the copy bandwidth; CAME-8bit <= 1.3x
and LAMB-8bit <= 1.2x 8-bit AdamW's time; 8-bit AdamW <= 1.0x bitsandbytes AdamW8bit's time.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from typing import Callable

# This file shares its name with HuggingFace's ``kernels`` package (which bitsandbytes may import): keep its folder
# off sys.path so that such an import cannot find this script instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
LR, WD = 1e-3, 1e-2

#: bytes per parameter of one ideal pass with fp32 params and grads: p read + write 8, g read 4, state read + write
IDEAL_BYTES = {
    "adamw-32": 8 + 4 + 16,
    "adamw-16": 8 + 4 + 8,
    "adamw-8": 8 + 4 + 4,
    "lion-8": 8 + 4 + 2,
    "lamb-8": 8 + 4 + 4,
    "lars-8": 8 + 4 + 2,
    "sgd-8": 8 + 4 + 2,
    "came-8": 8 + 4 + 2,
    "adafactor-8": 8 + 4 + 2,
    "adafactor": 8 + 4,
    "adamw-4": 8 + 4 + 2,
}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: the sweep's grid: quantization blocks (rows of 256) per program, and warps per program
SWEEP_ROWS = (1, 2, 4, 8, 16, 32)
SWEEP_WARPS = (1, 2, 4, 8, 16)


def ideal_bytes(key: str, dtype: torch.dtype) -> int:
    """Bytes per parameter of one ideal pass of optimizer ``key`` with parameters and gradients of ``dtype``: the
    fp32 figure less 2 bytes per parameter access (read and write) and per gradient read for 2-byte dtypes."""
    size = torch.empty((), dtype=dtype).element_size()
    return IDEAL_BYTES[key] - 3 * (4 - size)


def sweep_grid(block: int = 256, max_per_thread: int = 64) -> list[tuple[int, int]]:
    """(rows, num_warps) shapes of the sweep whose tile gives every thread between 1 and ``max_per_thread`` elements
    (fewer leave threads idle, more spill registers)."""
    return [
        (rows, warps)
        for rows in SWEEP_ROWS
        for warps in SWEEP_WARPS
        if 1 <= rows * block // (32 * warps) <= max_per_thread
    ]


def _lowmemopt(cls: str, bits: int, **kw) -> Factory:
    def make(params):
        import lowmemopt

        return getattr(lowmemopt, cls)(params, lr=LR, weight_decay=WD, state_bits=bits, **kw)

    return make


def _bnb(cls: str) -> Factory:
    def make(params):
        import bitsandbytes as bnb

        return getattr(bnb.optim, cls)(params, lr=LR, weight_decay=WD)

    return make


def _torch_fused(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)


def _torchao(params):
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=LR, weight_decay=WD)


#: name -> (factory, IDEAL_BYTES key)
OPTIMIZERS: dict[str, tuple[Factory, str]] = {
    "lowmemopt-adamw-8bit": (_lowmemopt("AdamW", 8), "adamw-8"),
    "lowmemopt-adamw-4bit": (_lowmemopt("AdamW", 4), "adamw-4"),
    "lowmemopt-adamw-16bit": (_lowmemopt("AdamW", 16), "adamw-16"),
    "lowmemopt-adamw-32bit": (_lowmemopt("AdamW", 32), "adamw-32"),
    "lowmemopt-lion-8bit": (_lowmemopt("Lion", 8), "lion-8"),
    "lowmemopt-lamb-8bit": (_lowmemopt("LAMB", 8), "lamb-8"),
    "lowmemopt-lars-8bit": (_lowmemopt("LARS", 8, momentum=0.9), "lars-8"),
    "lowmemopt-sgd-8bit": (_lowmemopt("SGD", 8, momentum=0.9), "sgd-8"),
    "lowmemopt-came-8bit": (_lowmemopt("CAME", 8), "came-8"),
    "lowmemopt-adafactor-m-8bit": (
        _lowmemopt("Adafactor", 8, beta1=0.9, relative_step=False, scale_parameter=False),
        "adafactor-8",
    ),
    "lowmemopt-adafactor": (_lowmemopt("Adafactor", 32, relative_step=False, scale_parameter=False), "adafactor"),
    "bnb-adamw8bit": (_bnb("AdamW8bit"), "adamw-8"),
    "bnb-lion8bit": (_bnb("Lion8bit"), "lion-8"),
    "bnb-lamb8bit": (_bnb("LAMB8bit"), "lamb-8"),
    "torch-adamw-fused": (_torch_fused, "adamw-32"),
    "torchao-adamw8bit": (_torchao, "adamw-8"),
}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMBG")) * scale)


def model_shapes(n_params: int) -> list[tuple[int, ...]]:
    """A transformer-like layout of about ``n_params``: per layer 4 (h, h) + 2 (h, 4h) matrices and 2 (h,) vectors;
    h grows with the size (multiple of 64), 16-48 layers."""
    layers = 16 if n_params < 5e8 else 48
    h = max(64, int(math.sqrt(n_params / (12 * layers)) // 64 * 64))
    shapes: list[tuple[int, ...]] = []
    while sum(math.prod(s) for s in shapes) + 12 * h * h <= n_params:
        shapes += [(h, h)] * 4 + [(h, 4 * h)] * 2 + [(h,)] * 2
    return shapes


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), best of ``reps``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / best


def time_optimizer(
    factory: Factory, shapes, device, steps: int, warmup: int, dtype: torch.dtype = torch.float32
) -> tuple[float, int, str]:
    """Median step time (s), state bytes, and the kernel path taken (lowmemopt: launches per step)."""
    from lowmemopt.kernels.tuning import median_step_time

    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen, device=device).mul_(0.02).to(dtype))
        p.grad = torch.randn(s, generator=gen, device=device).mul_(1e-3).to(dtype)
        params.append(p)
    opt = factory(params)
    median = median_step_time(opt, device, steps, warmup)
    note = ""
    if hasattr(opt, "state_nbytes"):
        from lowmemopt.kernels import dispatch

        before = sum(dispatch.stats.values())
        opt.step()
        note = f"{sum(dispatch.stats.values()) - before} fused bucket(s)/step"
        state = int(opt.state_nbytes())
    else:
        state = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return median, state, note


def _row(name: str, t: float, state: int, n: int, ideal: int, bw: float, note: str) -> str:
    gbs = ideal * n / t
    return f"| {name} | {1e3 * t:.2f} | {state / n:.3f} | {ideal} | {gbs / 1e9:.0f} | {100 * gbs / bw:.0f}% | {note} |"


HEADER = (
    "| optimizer | median step (ms) | state B/param | ideal B/param | GB/s | % of copy bandwidth | notes |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
)


def run_optimizers(
    names: list[str], sizes: list[int], dtypes: list[str], device, bw: float, steps: int, warmup: int
) -> list[dict]:
    results = []
    for size in sizes:
        shapes = model_shapes(size)
        n = sum(math.prod(s) for s in shapes)
        for dname in dtypes:
            dtype = DTYPES[dname]
            print(f"### {n / 1e6:.0f}M {dname} parameters and gradients in {len(shapes)} tensors\n\n{HEADER}")
            rows = {}
            for name in names:
                factory, key = OPTIMIZERS[name]
                ideal = ideal_bytes(key, dtype)
                try:
                    t, state, note = time_optimizer(factory, shapes, device, steps, warmup, dtype)
                except Exception as exc:  # noqa: BLE001 - a failing optimizer is a row, not a crash
                    error = f"{type(exc).__name__}: {str(exc)[:120]}"
                    print(f"| {name} | — | — | {ideal} | — | — | FAILED: {error} |", flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                rows[name] = t
                results.append(
                    dict(
                        size=n,
                        tensors=len(shapes),
                        dtype=dname,
                        optimizer=name,
                        median_s=t,
                        state_bytes=state,
                        ideal_bytes_per_param=ideal,
                        gb_per_s=ideal * n / t / 1e9,
                        pct_copy_bandwidth=100 * ideal * n / t / bw,
                        note=note,
                    )
                )
                print(_row(name, t, state, n, ideal, bw, note), flush=True)
            print()
            _targets(rows, n, bw, dtype)
    return results


def _targets(rows: dict[str, float], n: int, bw: float, dtype: torch.dtype) -> None:
    """The fused kernels' performance targets, from this table's rows (those that ran)."""
    ours, bnb = rows.get("lowmemopt-adamw-8bit"), rows.get("bnb-adamw8bit")
    for name in ("lowmemopt-adamw-8bit", "lowmemopt-lion-8bit", "lowmemopt-sgd-8bit", "lowmemopt-lars-8bit"):
        if rows.get(name) is not None:
            pct = 100 * ideal_bytes(OPTIMIZERS[name][1], dtype) * n / rows[name] / bw
            print(f"- target {name} >= 70% of copy bandwidth: {pct:.0f}% -> {'PASS' if pct >= 70 else 'FAIL'}")
    if ours is not None and bnb is not None:
        print(f"- target 8-bit AdamW <= 1.0x bitsandbytes: {ours / bnb:.2f}x -> {'PASS' if ours <= bnb else 'FAIL'}")
    for name, limit in (("lowmemopt-came-8bit", 1.3), ("lowmemopt-lamb-8bit", 1.2)):
        if ours is not None and rows.get(name) is not None:
            ratio = rows[name] / ours
            print(f"- target {name} <= {limit}x 8-bit AdamW: {ratio:.2f}x -> {'PASS' if ratio <= limit else 'FAIL'}")
    print()


def run_sweep(sizes: list[int], dtypes: list[str], device, bw: float, steps: int, warmup: int) -> list[dict]:
    """lowmemopt's 8-bit AdamW at every tile shape of :func:`sweep_grid` (the device's ``runtime.TILE_SHAPES`` entry
    set for each, then restored) with each 8-bit decode (``runtime.Q8_DECODE``, restored after)."""
    from lowmemopt.kernels import runtime

    factory, key = OPTIMIZERS["lowmemopt-adamw-8bit"]
    saved = runtime.tile_shape(device)
    cap = tuple(torch.cuda.get_device_capability(device))
    entry, decode_saved, decode_now = runtime.TILE_SHAPES.get(cap), runtime.Q8_DECODE, runtime.q8_decode(device)
    block = 256  # lowmemopt's default block_size: one quantization block per tile row
    results = []
    try:
        for size in sizes:
            shapes = model_shapes(size)
            n = sum(math.prod(s) for s in shapes)
            for dname in dtypes:
                ideal = ideal_bytes(key, DTYPES[dname])
                print(
                    f"### tile sweep: 8-bit AdamW, {n / 1e6:.0f}M {dname} parameters in {len(shapes)} tensors "
                    f"(current: {saved[0] // block} rows x {saved[1]} warps, {decode_now} decode)\n"
                )
                print(
                    "| rows x block | num_warps | elements/thread | decode | median step (ms) | GB/s | "
                    "% of copy bandwidth |"
                )
                print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
                found = []
                for decode in ("table", "arithmetic"):
                    runtime.Q8_DECODE = decode
                    for rows, warps in sweep_grid(block):
                        runtime.TILE_SHAPES[cap] = (rows * block, warps)
                        shape = f"| {rows} x {block} | {warps} | {rows * block // (32 * warps)} | {decode} |"
                        try:
                            t, _, note = time_optimizer(factory, shapes, device, steps, warmup, DTYPES[dname])
                        except Exception as exc:  # noqa: BLE001 - a shape that fails to compile or run is a row
                            print(f"{shape} — | — | FAILED: {type(exc).__name__}: {str(exc)[:100]} |", flush=True)
                            continue
                        gbs = ideal * n / t
                        found.append((t, rows, warps, decode))
                        results.append(
                            dict(
                                size=n,
                                dtype=dname,
                                rows=rows,
                                block=block,
                                num_warps=warps,
                                decode=decode,
                                median_s=t,
                                gb_per_s=gbs / 1e9,
                                pct_copy_bandwidth=100 * gbs / bw,
                                note=note,
                            )
                        )
                        print(f"{shape} {1e3 * t:.3f} | {gbs / 1e9:.0f} | {100 * gbs / bw:.0f}% |", flush=True)
                if found:
                    t, rows, warps, decode = min(found)
                    print(
                        f"\n- best: {rows} rows x {warps} warps, {decode} decode (runtime.TILE_SHAPES[{cap}] = "
                        f"({rows * block}, {warps})): "
                        f"{1e3 * t:.3f} ms, {100 * ideal * n / t / bw:.0f}% of copy bandwidth\n"
                    )
    finally:
        runtime.Q8_DECODE = decode_saved
        if entry is None:
            runtime.TILE_SHAPES.pop(cap, None)
        else:
            runtime.TILE_SHAPES[cap] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,100M,1B", help="parameter counts (default 10M,100M,1B)")
    parser.add_argument(
        "--dtypes", default="fp32,bf16", help="parameter and gradient dtypes: fp32, bf16 (default: both)"
    )
    parser.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of: " + ", ".join(OPTIMIZERS)
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time lowmemopt's 8-bit AdamW over a grid of tile shapes (rows per program x num_warps) "
        "instead of the optimizer table",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles the kernels)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown optimizer(s): {', '.join(unknown)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes!r}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if not torch.cuda.is_available():
        print(
            "bench/fused_kernels.py needs a CUDA GPU: the fused Triton kernels run only on CUDA tensors "
            "(CPU tensors take lowmemopt's reference path; see bench/step.py for CPU timings).",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(
        f"## Fused kernel benchmark\n\n- GPU: {torch.cuda.get_device_name(device)} (capability "
        f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}), torch {torch.__version__}"
    )
    print(f"- device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s (the roofline)\n")
    if args.sweep:
        results = run_sweep(sizes, dtypes, device, bw, args.steps, args.warmup)
    else:
        results = run_optimizers(names, sizes, dtypes, device, bw, args.steps, args.warmup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    gpu=torch.cuda.get_device_name(device),
                    capability=torch.cuda.get_device_capability(device),
                    copy_bandwidth=bw,
                    sweep=args.sweep,
                    results=results,
                ),
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
