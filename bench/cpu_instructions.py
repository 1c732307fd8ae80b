"""Instructions per element of the native CPU kernels (``lowmemopt/cpu/csrc/``), counted by valgrind's callgrind:
a count that does not depend on what else the machine runs, unlike timings. Also, with ``--time``, each kernel's
fastest time per element on a parameter that fits in the L2 cache (its compute cost, without memory stalls).

Each configuration calls one kernel on a [1024, 1024] fp32 parameter (8-bit blocks of 256, 4-bit of 128, one
thread): once to fill the state, then once counted. The kernels are compiled into a small C driver
(``bench/cpu_kernel_driver.c``) for the chosen instruction set, so no Python runs under valgrind::

    python bench/cpu_instructions.py                    # avx2 and scalar, every configuration
    python bench/cpu_instructions.py --isa avx2 --only adam-q8 lion-q8
    python bench/cpu_instructions.py --time --isa avx512 avx2 scalar

Valgrind cannot run AVX-512 code: ``--isa avx512`` works with ``--time`` only. Needs ``valgrind`` and a C compiler.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from lowmemopt.cpu import build
from lowmemopt.cpu.codec import tables, tables4

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "adam-f32": "AdamW, fp32 state",
    "adam-q8": "AdamW, 8-bit state",
    "adam-q8-bf16": "AdamW, 8-bit state, bf16 parameter and gradient",
    "adam-q8-scan": "AdamW, 8-bit state, with the next gradient's finiteness check",
    "adam-q4": "AdamW, 4-bit state",
    "lion-q8": "Lion, 8-bit state",
    "sgd-q8": "SGD with momentum, 8-bit state",
    "f-torch-u": "AdafactorTorch: u = g rsqrt(max(r c / mean(r), eps1^2)) (its first C pass)",
    "f-torch-apply": "AdafactorTorch: p = fma(u, s, p decay) (its second C pass)",
    "f-afstep": "Adafactor step, no first moment (with RMS(p))",
    "f-afstep-q8": "Adafactor step, 8-bit first moment (with RMS(p))",
    "f-camestep-q8": "CAME step, 8-bit first moment",
    "f-afstep-check": "Adafactor step, no first moment, checking its own gradient",
    "f-camestep-q8-check": "CAME step, 8-bit first moment, checking its own gradient",
    "scan": "non-finite check alone (lmo_scan)",
}


def write_tables(path: Path) -> None:
    """The state maps' tables in the order the driver reads them (8-bit unsigned, signed; 4-bit unsigned, signed)."""
    with open(path, "wb") as f:
        for signed in (False, True):
            t = tables(signed)
            for x in (t.book, t.planes, t.packed):
                f.write(x.numpy().tobytes())
            f.write(bytes(t.pow2))
        for signed in (False, True):
            t = tables4(signed)
            for x in (t.book, t.thr, t.packed):
                f.write(x.numpy().tobytes())


def compile_driver(isa: str, out: Path, numel: int, counting: bool) -> None:
    """The driver for ``isa``; ``counting`` (under valgrind, which cannot run AVX-512): the compiler may not use
    AVX-512 for the scalar code either."""
    flags = [f for f in build.FLAGS if f not in ("-shared", "-fPIC")] + list(build.ISAS[isa][1])
    if counting and "-mno-avx512f" not in flags:
        flags.append("-mno-avx512f")
    cmd = [
        os.environ.get("CC", "cc"),
        *flags,
        f"-DN={numel}",
        f'-DKERNELS="{build.SOURCE}"',
        "-o",
        str(out),
        str(HERE / "cpu_kernel_driver.c"),
        "-lm",
    ]
    subprocess.run(cmd, check=True)


def count(binary: Path, config: str, tables_path: Path, numel: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                "--toggle-collect=cg_measure",
                str(binary),
                config,
                str(tables_path),
            ],
            check=True,
            capture_output=True,
        )
        m = re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(), re.M)
    return int(m.group(1)) / numel


def fastest(binary: Path, config: str, tables_path: Path, repeats: int) -> float:
    res = subprocess.run(
        [str(binary), config, str(tables_path), str(repeats)], check=True, capture_output=True, text=True
    )
    return float(res.stdout.split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", nargs="+", default=["avx2", "scalar"], choices=list(build.ISAS))
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS))
    ap.add_argument("--time", action="store_true", help="fastest ns per element of 2000 calls on 32K elements")
    args = ap.parse_args()
    have = build.cpu_isas()
    isas = [i for i in args.isa if i in have and (args.time or i != "avx512")]
    if not args.time and shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found")
    numel = 32768 if args.time else 1024 * 1024
    with tempfile.TemporaryDirectory() as tmp:
        tables_path = Path(tmp) / "tables.bin"
        write_tables(tables_path)
        binaries = {}
        for isa in isas:
            binaries[isa] = Path(tmp) / f"driver-{isa}"
            compile_driver(isa, binaries[isa], numel, not args.time)
        unit = "ns per element, fastest of 2000 calls" if args.time else "instructions per element"
        print(f"{unit}; one thread")
        print(f"| kernel | {' | '.join(isas)} |\n| --- |{' ---: |' * len(isas)}")
        for config in args.only or CONFIGS:
            if args.time:
                vals = [fastest(binaries[i], config, tables_path, 2000) for i in isas]
                cells = [f"{v:.3f}" for v in vals]
            else:
                cells = [f"{count(binaries[i], config, tables_path, numel):.1f}" for i in isas]
            print(f"| {CONFIGS[config]} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
