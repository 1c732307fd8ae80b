"""Reporting: the machine and library versions, the comparison table and progress lines."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch

from .measure import Result
from .optimizers import BASELINE


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_info(device: torch.device) -> dict[str, object]:
    """Versions, threads and hardware, for the report header and JSON."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": _load_average(),  # other work on the machine inflates and scatters the timings
        "device": str(device),
        "lowmemopt": _version("lowmemopt"),
        "bitsandbytes": _version("bitsandbytes"),
        "torchao": _version("torchao"),
        "transformers": _version("transformers"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _seconds(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def _per_param(r: Result) -> str:
    return "—" if r.bytes_per_param is None else f"{r.bytes_per_param:.3f}"


def print_table(results: list[Result], out=None) -> None:
    """Markdown table: optimizer | state bytes/param | median step (s) | baseline's median (s) | ratio | notes."""
    out = out or sys.stdout
    print(f"| optimizer | state bytes/param | median step (s) | {BASELINE} median (s) | ratio | notes |", file=out)
    print("| --- | ---: | ---: | ---: | ---: | --- |", file=out)
    for r in results:
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}x"
        note = f"FAILED: {r.error}" if r.error else r.note
        note = note.replace("|", "\\|")
        print(
            f"| {r.name} | {_per_param(r)} | {_seconds(r.median_s)} | {_seconds(r.baseline_s)} | {ratio} | {note} |",
            file=out,
        )


def progress_line(r: Result) -> str:
    """One optimizer's line on stderr once it has run: its median, state and note, rounded as in the table."""
    if r.error:
        return f"  {r.name}: FAILED: {r.error}"
    if r.missing:
        return f"  {r.name}: {r.note}"
    note = f" ({r.note})" if r.note else ""
    return f"  {r.name}: median {_seconds(r.median_s)} s, {_per_param(r)} bytes/param{note}"
