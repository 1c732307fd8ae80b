"""Where one ``opt.step()`` spends its time: a torch.profiler breakdown of the end-to-end benchmark's optimizer step,
row by row, in the tables that tell why a step meets the performance targets or misses them (paging, GaLore, the
fused kernels: launches, copies and host time per step, the kernels that take the GPU time), and optionally Nsight
Compute's view of lowmemopt's kernels.

The model and rows are ``bench/e2e.py``'s (TinyLlama's layout, 1.1B parameters in bf16 by default; the same
optimizer factories). One forward and backward make real gradients; the optimizer then steps ``--warmup`` times on
them (state allocation, compiles) and ``--steps`` times under the profiler. Per row:

- **summary**: median ``opt.step()`` wall time (CUDA events on a GPU), the thread's CPU time per step (what the host
  spends: Python, dispatch, launches), GPU kernel time per step (the sum of every kernel's device time), kernel
  launches, host<->device copies (count and device time) and synchronizations per step, aten operators per step
  (``bench/paging.py`` reports the bytes a paged step moves and the bandwidth it reaches);
- **kernels**: the top ``--top`` kernels by device time per step (calls, ms and µs per call);
- **operators**: the top ``--top`` CPU operators by calls per step (a per-parameter loop shows here).

``--ncu``: re-runs each row under Nsight Compute (``ncu``, clocks left alone: ``--clock-control none``) for the
kernels of one step after the warm-up (an NVTX range marks it) whose names match ``--ncu-kernels``, and prints per
kernel its duration, DRAM throughput (% of peak and GB/s), achieved occupancy and registers per thread: the
memory-bound question in numbers. Needs ``ncu`` on
the PATH and access to the GPU's counters (a Firecracker machine; see /work/.library/device/KINDS.md).

    cd /tmp && python /path/to/lowmemopt/bench/profile_step.py                            # 1.1B, default rows
    python .../profile_step.py --optimizers lowmemopt-came-8bit --ncu                      # + Nsight Compute
    python .../profile_step.py --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 \\
        --vocab 256 --batch 2 --seq 16 --steps 2 --warmup 1                                 # seconds on a CPU
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Iterable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (the model, batches and optimizer rows)

DEFAULT_ROWS = (
    "torch-adamw-fused",
    "lowmemopt-adamw-8bit",
    "lowmemopt-came-8bit",
    "lowmemopt-galore-adamw-8bit",
    "lowmemopt-paged-adamw-8bit",
)
#: the names of lowmemopt's Triton kernels (``_<name>_kernel``), for ``--ncu``'s filter
LOWMEMOPT_KERNELS = r"regex:_(adam|sgd|lion|lamb|lars_norms|lars_apply|stats|factors|moments|sumsq|apply)_kernel"
#: Nsight Compute metrics: duration, DRAM bytes/s and % of peak, achieved occupancy, registers per thread
NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "dram__bytes.sum.per_second": "dram B/s",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "registers",
}
#: the NVTX range around the one step ncu profiles (warm-up steps and compiles stay outside it)
NVTX_RANGE = "lowmemopt-profiled-step"
_SYNC_EVENTS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
_COPY_KINDS = {"Memcpy HtoD": "h2d", "Memcpy DtoH": "d2h", "Memcpy DtoD": "d2d"}


# ---------------------------------------------------------------------------------------------------------------------
# one row: a profiled step


def _device_time_us(event: Any) -> float:
    """An event's own device time (µs) across torch versions (``self_device_time_total`` or the CUDA-named one)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def _is_kernel(event: Any) -> bool:
    """A device-side event (kernel or copy) of the profiler's flat event list."""
    kind = getattr(event, "device_type", None)
    return kind is not None and kind != torch.autograd.DeviceType.CPU


def summarize(events: Iterable[Any], steps: int) -> dict[str, Any]:
    """Per-step counts and times from the profiler's flat event list (``prof.events()``): kernels (name -> (calls,
    device µs)), copies by direction (count, device µs), synchronizations, aten operators by name, GPU kernel time."""
    kernels: dict[str, list[float]] = {}
    copies: dict[str, list[float]] = {"h2d": [0, 0.0], "d2h": [0, 0.0], "d2d": [0, 0.0]}
    ops: Counter = Counter()
    syncs = 0
    for e in events:
        name = e.name
        if _is_kernel(e):
            kind = next((k for prefix, k in _COPY_KINDS.items() if name.startswith(prefix)), None)
            if kind is not None:
                copies[kind][0] += 1
                copies[kind][1] += _device_time_us(e)
                continue
            entry = kernels.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += _device_time_us(e)
        elif name.startswith("aten::"):
            ops[name] += 1
        elif name in _SYNC_EVENTS:
            syncs += 1
    kernel_us = sum(t for _, t in kernels.values())
    return dict(
        kernels={k: (n / steps, t / steps) for k, (n, t) in kernels.items()},
        launches=sum(n for n, _ in kernels.values()) / steps,
        kernel_ms=kernel_us / steps / 1e3,
        copies={k: (n / steps, b / steps) for k, (n, b) in copies.items()},
        syncs=syncs / steps,
        ops={k: n / steps for k, n in ops.items()},
        op_calls=sum(ops.values()) / steps,
    )


def _warmed_up(name: str, args, warmup: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.device]:
    """Row ``name``'s model and optimizer with gradients made once (real ones, kept: every later step sees the same),
    stepped ``warmup`` times (state made, kernels compiled), the device synchronized. Raises ImportError when the
    row's library is missing."""
    device = torch.device(args.device)
    lr, factory = e2e.ROWS[name]
    model = e2e.build_model(args, device)
    opt = factory(model, lr, args)
    x = e2e.make_batches(args, 1)[0].to(device)
    model(input_ids=x, labels=x).loss.backward()
    for _ in range(warmup):
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, opt, device


def profile_row(name: str, args) -> dict[str, Any]:
    """Build the model and optimizer of row ``name``, make gradients once, step ``warmup`` times, then profile
    ``steps`` steps: the summary of :func:`summarize`, plus wall and thread CPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    try:
        model, opt, device = _warmed_up(name, args, args.warmup)
    except ImportError as exc:
        return dict(name=name, error=f"not installed ({exc.name or exc})")
    cuda = device.type == "cuda"
    walls, cpus = [], []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            c0 = time.thread_time()
            if cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                opt.step()
                stop.record()
                cpus.append(time.thread_time() - c0)
                torch.cuda.synchronize(device)
                walls.append(start.elapsed_time(stop) / 1e3)
            else:
                w0 = time.perf_counter()
                opt.step()
                walls.append(time.perf_counter() - w0)
                cpus.append(time.thread_time() - c0)
    out = summarize(prof.events(), args.steps)
    out.update(
        name=name,
        step_ms=statistics.median(walls) * 1e3,
        cpu_ms=statistics.median(cpus) * 1e3,
        n_params=sum(p.numel() for p in model.parameters()),
    )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Nsight Compute


def ncu_command(name: str, argv: list[str], report_csv: str, kernels: str, launches: int) -> list[str]:
    """The ``ncu`` command that re-runs this script's row ``name`` in a worker (warm-up steps, then one step in the
    NVTX range :data:`NVTX_RANGE`) and writes the metrics of up to ``launches`` matching kernels of that step as
    CSV."""
    worker = [sys.executable, os.path.abspath(__file__), *argv, "--ncu-worker", name]
    return [
        "ncu",
        "--clock-control",
        "none",
        "--target-processes",
        "all",
        "--nvtx",
        "--nvtx-include",
        f"{NVTX_RANGE}/",
        "--kernel-name",
        kernels,
        "--launch-count",
        str(launches),
        "--metrics",
        ",".join(NCU_METRICS),
        "--csv",
        "--page",
        "raw",
        "--log-file",
        report_csv,
        *worker,
    ]


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """Rows of ``ncu --csv --page raw`` output (a header line, a units line, then one line per kernel launch) as
    ``{"kernel", <NCU_METRICS label>: float}``; lines before the header (ncu's own log) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    out = []
    for rec in reader:
        if not rec.get("Kernel Name") or rec.get("ID", "").strip() == "":
            continue
        try:
            int(rec["ID"])
        except ValueError:  # the units line
            continue
        row: dict[str, Any] = {"kernel": rec["Kernel Name"]}
        for metric, label in NCU_METRICS.items():
            value = rec.get(metric)
            if value not in (None, "", "n/a"):
                row[label] = float(value.replace(",", ""))
        out.append(row)
    return out


def ncu_table(rows: list[dict[str, Any]]) -> str:
    """Per kernel name: launches, mean duration (µs), DRAM throughput (% of peak, GB/s), occupancy, registers."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r)
    lines = [
        "| kernel | launches | µs (mean) | DRAM % of peak | DRAM GB/s | occupancy % | registers |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def mean(rs, key, scale=1.0):
        vals = [r[key] * scale for r in rs if key in r]
        return f"{statistics.fmean(vals):.1f}" if vals else "—"

    for kernel, rs in sorted(by.items(), key=lambda kv: -sum(r.get("duration", 0) for r in kv[1])):
        lines.append(
            f"| `{kernel[:60]}` | {len(rs)} | {mean(rs, 'duration', 1e-3)} | {mean(rs, 'dram %')} | "
            f"{mean(rs, 'dram B/s', 1e-9)} | {mean(rs, 'occupancy %')} | {mean(rs, 'registers')} |"
        )
    return "\n".join(lines)


def _ncu_worker(name: str, args) -> None:
    """Under ncu: the row's warm-up steps, then one step inside :data:`NVTX_RANGE` (the only one ncu profiles)."""
    _, opt, device = _warmed_up(name, args, max(1, args.warmup))
    with torch.cuda.nvtx.range(NVTX_RANGE):
        opt.step()
    torch.cuda.synchronize(device)


def run_ncu(name: str, argv: list[str], args) -> str:
    if shutil.which("ncu") is None:
        return "ncu is not on the PATH: no Nsight Compute table"
    report = os.path.join(args.ncu_dir, f"{name}.csv")
    cmd = ncu_command(name, argv, report, args.ncu_kernels, args.ncu_launches)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"ncu timed out after {args.timeout:.0f} s: no Nsight Compute table for {name}"
    text = open(report).read() if os.path.exists(report) else proc.stdout
    rows = parse_ncu_csv(text)
    if not rows:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"ncu gave no kernel rows (exit {proc.returncode}): {' / '.join(tail)[:500]}"
    return ncu_table(rows)


# ---------------------------------------------------------------------------------------------------------------------
# tables


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| row | opt.step ms | host CPU ms | GPU kernel ms | launches | H2D copies (ms) | D2H copies (ms) | "
        "syncs | aten ops |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['name']} | {r['error']} | | | | | | | |")
            continue
        h2d, d2h = r["copies"]["h2d"], r["copies"]["d2h"]
        lines.append(
            f"| {r['name']} | {r['step_ms']:.2f} | {r['cpu_ms']:.2f} | {r['kernel_ms']:.2f} | "
            f"{r['launches']:.0f} | {h2d[0]:.0f} ({h2d[1] / 1e3:.2f}) | {d2h[0]:.0f} ({d2h[1] / 1e3:.2f}) | "
            f"{r['syncs']:.0f} | {r['op_calls']:.0f} |"
        )
    return "\n".join(lines)


def kernel_table(row: dict[str, Any], top: int) -> str:
    if not row["kernels"]:
        return "(no device kernels: a CPU run)"
    lines = ["| kernel | calls / step | ms / step | µs / call |", "| --- | ---: | ---: | ---: |"]
    ranked = sorted(row["kernels"].items(), key=lambda kv: -kv[1][1])[:top]
    for name, (calls, us) in ranked:
        lines.append(f"| `{name[:70]}` | {calls:.1f} | {us / 1e3:.3f} | {us / max(calls, 1e-9):.1f} |")
    return "\n".join(lines)


def op_table(row: dict[str, Any], top: int) -> str:
    lines = ["| operator | calls / step |", "| --- | ---: |"]
    for name, calls in sorted(row["ops"].items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name}` | {calls:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    e2e.add_model_args(ap, batch=1, seq=256)  # the batch and sequence of the one backward that makes the gradients
    ap.add_argument(
        "--optimizers",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated rows of bench/e2e.py (default: {','.join(DEFAULT_ROWS)})",
    )
    ap.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before profiling (state, compiles)")
    ap.add_argument("--top", type=int, default=12, help="rows of the kernel and operator tables")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per row's ncu run")
    ap.add_argument("--ncu", action="store_true", help="also profile lowmemopt's kernels with Nsight Compute")
    ap.add_argument("--ncu-kernels", default=LOWMEMOPT_KERNELS, help="ncu --kernel-name filter")
    ap.add_argument("--ncu-launches", type=int, default=20, help="kernel launches ncu profiles per row")
    ap.add_argument("--ncu-dir", default=".", help="where ncu's CSV files go")
    ap.add_argument("--markdown", default=None, help="also write the report here")
    ap.add_argument("--ncu-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [n for n in args.optimizers.split(",") if n and n not in e2e.ROWS]
    if unknown:
        ap.error(f"unknown optimizers {unknown}; known: {', '.join(e2e.ROWS)}")
    return args


def _strip_driver_args(argv: list[str]) -> list[str]:
    """``argv`` without the options that only the driver uses (so that workers get the model's options)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--ncu",):
            continue
        if a in ("--markdown", "--optimizers", "--ncu-worker"):
            skip = True
            continue
        if a.split("=")[0] in ("--markdown", "--optimizers"):
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.ncu_worker:
        _ncu_worker(args.ncu_worker, args)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_step.py: no CUDA device (use --device cpu for a small run on the CPU)", file=sys.stderr)
        return 2
    names = [n for n in args.optimizers.split(",") if n]
    rows, sections = [], []
    for name in names:
        t0 = time.perf_counter()
        try:
            row = profile_row(name, args)
        except Exception as exc:  # noqa: BLE001 - one row's failure is reported, the others still run
            row = dict(name=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        rows.append(row)
        status = row.get("error") or f"{row['step_ms']:.2f} ms"
        print(f"  {name}: {status} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if not row.get("error"):
            sections.append(
                f"### {name}: kernels by device time\n\n{kernel_table(row, args.top)}\n\n"
                f"### {name}: operators by calls\n\n{op_table(row, args.top)}"
            )
            if args.ncu:
                sections.append(f"### {name}: Nsight Compute\n\n{run_ncu(name, _strip_driver_args(argv), args)}")
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    n = rows[0].get("n_params") if rows else None
    head = (
        f"## opt.step() profile: LLaMA {args.layers} x {args.hidden}, {args.dtype}, "
        f"{'' if n is None else f'{n / 1e9:.2f}B parameters, '}{args.steps} profiled steps after {args.warmup}, "
        f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
    )
    report = "\n\n".join([head, summary_table(rows), *sections])
    print(report)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
