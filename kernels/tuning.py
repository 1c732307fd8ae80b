"""Launch shapes measured on the GPU at hand: ``lowmemopt tune`` times the elementwise kernels' tile shapes and the
two 8-bit decodes and keeps the fastest in a cache file that :mod:`.runtime` reads.

What is tuned: the elements per program and warps per program of the elementwise passes (every algorithm's flat
tiles, the shape :func:`.runtime.tile_shape` gives), and how 8-bit codes are decoded (:func:`.runtime.q8_decode`:
the code-book gather or arithmetic on the code's bits). Both change speed only, never results (the same codes and
values: the tests compare them). The measurement is 8-bit AdamW (bf16 parameters and gradients, the end-to-end case)
over :data:`TILES` x :data:`WARPS` x :data:`DECODES`, the median of ``steps`` CUDA-event-timed steps each after a
warm-up step that compiles it.

The cache is JSON at ``$LOWMEMOPT_CACHE_DIR/tuning.json`` (default ``~/.cache/lowmemopt/tuning.json``), one entry per
GPU model, compute capability and Triton version (a new Triton may compile the kernels differently)::

    {"version": 1, "devices": {"NVIDIA H100 80GB HBM3|sm_90|triton 3.6.0":
        {"tile": 2048, "num_warps": 4, "decode": "table", "numel": ..., "measured": [...]}}}

Precedence, per device: a :data:`.runtime.TILE_SHAPES` entry set in code, then the cache, then the defaults
(``runtime.TILE``, ``runtime.NUM_WARPS``); for the decode, ``LOWMEMOPT_Q8_DECODE`` (or ``runtime.Q8_DECODE`` set in
code), then the cache, then ``"table"``. ``LOWMEMOPT_TUNING=0`` ignores the cache. A cache that cannot be read is
ignored with one warning; it is written whole to a temporary file and renamed, so a failed write never leaves half a
file.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from . import runtime

__all__ = ["TILES", "WARPS", "DECODES", "cache_path", "device_key", "tuned", "measure", "tune", "forget", "time_steps"]

#: candidate elements per program (rows of the 256-element quantization block: 4, 8 and 16 rows)
TILES = (1024, 2048, 4096)
WARPS = (4, 8)
DECODES = ("table", "arithmetic")
CACHE_VERSION = 1
#: the measurement's default size: 128M bf16 parameters (about 0.8 GB with gradients and 8-bit state)
DEFAULT_NUMEL = 1 << 27

_loaded: dict[str, Any] | None = None  # the cache file's devices, read once per process (forget() drops it)
_by_index: dict[int, dict[str, Any] | None] = {}


def cache_path() -> Path:
    """Where the tuned shapes are kept: ``$LOWMEMOPT_CACHE_DIR/tuning.json``, default ``~/.cache/lowmemopt``."""
    root = os.environ.get("LOWMEMOPT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lowmemopt")
    return Path(root) / "tuning.json"


def device_key(index: int) -> str:
    """The cache key of CUDA device ``index``: its name, compute capability and the Triton version."""
    import triton

    major, minor = runtime._capability(index)
    return f"{torch.cuda.get_device_name(index)}|sm_{major}{minor}|triton {triton.__version__}"


def forget() -> None:
    """Drop what this process read from the cache (the next lookup reads the file again)."""
    global _loaded
    _loaded = None
    _by_index.clear()


def _read(warn: bool = True) -> dict[str, Any]:
    """The cache file's ``devices``: empty if there is none, or if it cannot be read (then, with ``warn``, one
    warning)."""
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    else:
        devices = data.get("devices") if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None
        if isinstance(devices, dict):
            return devices
        problem = f"not a version {CACHE_VERSION} cache"
    if warn:
        warnings.warn(f"lowmemopt: ignoring the tuning cache {path} ({problem}); run `lowmemopt tune` to measure "
                      "again", RuntimeWarning, stacklevel=3)
    return {}


def _valid(entry: Any) -> bool:
    return (isinstance(entry, dict) and entry.get("tile") in TILES and entry.get("num_warps") in WARPS
            and entry.get("decode") in DECODES)


def tuned(index: int) -> dict[str, Any] | None:
    """The cached measurement of CUDA device ``index`` (``tile``, ``num_warps``, ``decode``), or None: none made for
    this GPU and Triton version, ``LOWMEMOPT_TUNING=0``, or no CUDA. Read once per process and device."""
    global _loaded
    if index in _by_index:
        return _by_index[index]
    entry = None
    if os.environ.get("LOWMEMOPT_TUNING", "1") != "0" and torch.cuda.is_available():
        if _loaded is None:
            _loaded = _read()
        entry = _loaded.get(device_key(index))
        if entry is not None and not _valid(entry):
            warnings.warn(f"lowmemopt: ignoring a malformed tuning entry for {device_key(index)} in {cache_path()}",
                          RuntimeWarning, stacklevel=2)
            entry = None
    _by_index[index] = entry
    return entry


def _problem(numel: int, device: torch.device, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Eight tensors of about ``numel`` elements in all (a LLaMA layer's mix of sizes), with gradients."""
    sizes = [3, 3, 1, 1, 8, 8, 8, 0.05]
    total = sum(sizes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = []
    for s in sizes:
        n = max(256, int(numel * s / total) // 256 * 256)
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(device=device, dtype=dtype))
        p.grad = (torch.randn(n, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    return params


def time_steps(opt: torch.optim.Optimizer, device: torch.device, steps: int, warmup: int = 1) -> float:
    """Median seconds of ``steps`` steps of ``opt`` (CUDA events on a GPU, the wall clock elsewhere) after ``warmup``
    untimed ones."""
    device = torch.device(device)
    for _ in range(warmup):
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(device: torch.device, numel: int = DEFAULT_NUMEL, steps: int = 20, dtype: torch.dtype = torch.bfloat16,
            progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Time 8-bit AdamW on ``device`` at every candidate (tile, warps, decode); one record each: ``tile``,
    ``num_warps``, ``decode``, ``seconds`` (median step), ``bytes_per_s`` (the step's ideal bytes over that), or
    ``error`` for a configuration that fails to compile or run. ``progress(record)`` is called as each is made.
    On the CPU (tests, under the Triton interpreter) the same loop runs, timed by the wall clock."""
    import lowmemopt

    params = _problem(numel, device, dtype)
    n = sum(p.numel() for p in params)
    size = torch.finfo(dtype).bits // 8
    ideal = n * (3 * size + 4) + 2 * 4 * (n // 256)  # p read + written, g read, 2 code bytes read + written, absmax
    records = []
    for decode in DECODES:
        for tile in TILES:
            for warps in WARPS:
                record: dict[str, Any] = dict(tile=tile, num_warps=warps, decode=decode)
                try:
                    with runtime.launch_shape((tile, warps), decode):
                        opt = lowmemopt.AdamW(params, lr=1e-4, weight_decay=0.0, state_bits=8, min_quant_numel=0)
                        seconds = time_steps(opt, device, steps)
                    record.update(seconds=seconds, bytes_per_s=ideal / seconds)
                except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a record, not the end
                    record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                records.append(record)
                if progress is not None:
                    progress(record)
    return records


def best(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest record that ran (ValueError if none did)."""
    ran = [r for r in records if "seconds" in r]
    if not ran:
        raise ValueError("no configuration ran: " + "; ".join(r.get("error", "?") for r in records[:3]))
    return min(ran, key=lambda r: r["seconds"])


def save(key: str, entry: dict[str, Any]) -> Path:
    """Write ``entry`` for device ``key`` into the cache (other devices' entries kept), atomically."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    devices = _read(warn=False)  # (none yet, or unreadable: replaced whole)
    devices[key] = entry
    fd, tmp = tempfile.mkstemp(prefix=".tuning.", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": CACHE_VERSION, "devices": devices}, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    forget()
    return path


def tune(device: torch.device, numel: int = DEFAULT_NUMEL, steps: int = 20, write: bool = True,
         progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure (:func:`measure`) on CUDA ``device``, pick the fastest and, with ``write``, keep it in the cache for
    this GPU model and Triton version: ``(entry, records)``."""
    if device.type != "cuda":
        raise ValueError(f"tuning measures a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    records = measure(torch.device("cuda", index), numel, steps, progress=progress)
    top = best(records)
    entry = dict(tile=top["tile"], num_warps=top["num_warps"], decode=top["decode"], numel=numel, steps=steps,
                 measured=records, when=time.strftime("%Y-%m-%d %H:%M:%S"))
    if write:
        save(device_key(index), entry)
    return entry, records
