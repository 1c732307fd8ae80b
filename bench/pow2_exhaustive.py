"""Offline exactness check of the Triton pow2 encoder (``lowmemopt.kernels.pow2``) over every fp32 bit pattern.

Two parts, both on the CPU:

1. **Exhaustive emulation**: the encoder's integer arithmetic (the same class tables, clamps, wrapped uint32 add,
   shift, sign rules), vectorised in torch, over every fp32 bit pattern that a kernel can encode, in chunks: both
   signs, ``|y| <= 1`` (subnormals and zeros included) and the non-finite ones (2^31 + 2^24 patterns), against the
   reference encoder of :mod:`lowmemopt.quant.blockwise` (the 65536-bucket table, itself built from the brute-force
   rule) and, for ``|y| <= 1``, against the brute-force decision thresholds (``code = #{thresholds <= y}``). Scaled
   block values always lie in ``[-1, 1]`` (``y = x / scale``, ``scale >= max |x|``), so the chunks of finite
   ``|y| > 1`` are skipped unless ``--above-one`` is given (far above 1 the fp32 distances of the brute-force rule
   round equal, and the table's codes there are an artefact of that: they are counted, not compared).
2. **The Triton function itself** under the interpreter (``TRITON_INTERPRET=1``, set here) on a random sample: uniform
   random bit patterns and uniform random values in [-1, 1], against the table.

    cd /tmp && python /path/to/repo/bench/pow2_exhaustive.py                 # all 2^32 patterns, both maps
    cd /tmp && python /path/to/repo/bench/pow2_exhaustive.py --chunks 16 --sample 1000000   # a quick partial run

Prints the mismatch counts (all must be 0) and exits 1 if any is not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
os.environ["TRITON_INTERPRET"] = "1"  # before lowmemopt.kernels is imported: the kernels run interpreted on the CPU

import torch  # noqa: E402

from lowmemopt.cpu.codec import decision_thresholds  # noqa: E402
from lowmemopt.kernels import pow2  # noqa: E402
from lowmemopt.quant.maps import encode_table, is_signed_map  # noqa: E402

CHUNK_BITS = 20  # 2^20 patterns a chunk: temporaries of a few MiB, reused by the allocator


def emulate(u: torch.Tensor, name: str) -> torch.Tensor:
    """int64 codes of the fp32 bit patterns ``u`` (int32) by the arithmetic of :func:`pow2.pow2_code`."""
    classes = pow2.encode_classes(name)
    signed = is_signed_map(name)
    a = u & 0x7FFFFFFF
    neg = (u >> 31) & 1 if signed else torch.zeros_like(u)
    c = a.clamp(classes[0][0], 0x3F800000)
    add = torch.full_like(u, classes[0][1])
    shift = torch.full_like(u, classes[0][2])
    for lo, k_add, k_shift in classes[1:]:
        hit = c >= lo
        add = torch.where(hit, k_add, add)
        shift = torch.where(hit, k_shift, shift)
    code = (((c + neg).to(torch.int64) + (add.to(torch.int64) & 0xFFFFFFFF)) & 0xFFFFFFFF) >> shift
    if signed:
        code = torch.where(neg != 0, (254 - code).clamp_min(0), code)
        return torch.where(a < 0x7F800000, code, 0)
    return torch.where((u > 0) & (u < 0x7F800000), code, 0)


def table_codes(u: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The reference encoder (``lowmemopt.quant.blockwise.encode_rows``' lookup) on bit patterns ``u`` (int32)."""
    entry = packed[(u >> 16) & 0xFFFF]
    t = (u & 0xFFFF) ^ ((u >> 31) & 0xFFFF)
    return ((entry >> 17) + (t >= (entry & 0x1FFFF)).to(torch.int32)).to(torch.int64)


def to_bits(u: torch.Tensor) -> torch.Tensor:
    """int64 patterns in [0, 2^32) -> int32 (wrapped)."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def exhaustive(name: str, chunks: int, above_one: bool = False) -> dict:
    packed = encode_table(name).packed
    thr = decision_thresholds(name)[:255].contiguous()
    counts = dict(patterns=0, in_range=0, vs_table=0, vs_thresholds=0, above_one=0, above_one_vs_table=0)
    step = 1 << CHUNK_BITS
    total = 1 << (32 - CHUNK_BITS)
    # spread a partial run over the whole pattern space (every total/chunks-th chunk)
    for i in range(0, total, max(1, total // chunks)):
        exponent = (i * step >> 23) & 0xFF  # a chunk lies inside one exponent (2^23 patterns, a multiple of a chunk)
        if 127 <= exponent < 255 and not above_one:
            continue
        u = to_bits(torch.arange(i * step, (i + 1) * step, dtype=torch.int64))
        y = u.view(torch.float32)
        mine, ref = emulate(u, name), table_codes(u, packed)
        big = torch.isfinite(y) & (y.abs() > 1)
        ok = ~big
        counts["patterns"] += u.numel()
        counts["in_range"] += int(ok.sum())
        counts["vs_table"] += int(((mine != ref) & ok).sum())
        unit = y.abs() <= 1
        by_thr = torch.searchsorted(thr, y[unit], right=True)
        counts["vs_thresholds"] += int((mine[unit] != by_thr).sum())
        counts["above_one"] += int(big.sum())
        counts["above_one_vs_table"] += int(((mine != ref) & big).sum())
    return counts


def sample(name: str, n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    packed = encode_table(name).packed
    y = to_bits(torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)).view(torch.float32)
    unit = torch.rand(n, generator=gen) * 2 - 1
    unit = unit * torch.exp2(-torch.randint(0, 40, (n,), generator=gen).float())  # every binade of the map
    unit = unit if is_signed_map(name) else torch.cat([unit.abs(), unit])
    y = torch.cat([y[~(torch.isfinite(y) & (y.abs() > 1))], unit])
    got = pow2.codes(y, name).to(torch.int64)
    ref, emu = table_codes(y.view(torch.int32), packed), emulate(y.view(torch.int32), name)
    return dict(values=y.numel(), triton_vs_table=int((got != ref).sum()), triton_vs_emulation=int((got != emu).sum()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maps", default="pow2,upow2")
    parser.add_argument(
        "--chunks",
        type=int,
        default=1 << (32 - CHUNK_BITS),
        help=f"chunks of 2^{CHUNK_BITS} patterns to check (default: all {1 << (32 - CHUNK_BITS)})",
    )
    parser.add_argument("--sample", type=int, default=1 << 22, help="values for the interpreted Triton function")
    parser.add_argument("--above-one", action="store_true", help="also the chunks of finite |y| > 1 (counted only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    bad = 0
    for name in args.maps.split(","):
        t0 = time.time()
        c = exhaustive(name, args.chunks, args.above_one)
        t1 = time.time()
        print(
            f"{name}: {c['patterns']:,} bit patterns emulated ({t1 - t0:.0f} s): {c['in_range']:,} with |y| <= 1 "
            f"or non-finite -> {c['vs_table']} mismatches vs the reference table, {c['vs_thresholds']} vs the "
            f"brute-force thresholds (|y| <= 1); {c['above_one']:,} finite |y| > 1 (unreachable), "
            f"{c['above_one_vs_table']:,} of them coded differently from the table",
            flush=True,
        )
        s = sample(name, args.sample, seed=17)
        t2 = time.time()
        print(
            f"{name}: Triton pow2_code interpreted on {s['values']:,} sampled values ({t2 - t1:.0f} s): "
            f"{s['triton_vs_table']} mismatches vs the table, {s['triton_vs_emulation']} vs the emulation"
        )
        bad += c["vs_table"] + c["vs_thresholds"] + s["triton_vs_table"] + s["triton_vs_emulation"]
    print("PASS" if bad == 0 else f"FAIL: {bad} mismatches")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
