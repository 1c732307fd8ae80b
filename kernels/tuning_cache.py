"""The tuning cache: the launch shapes ``lowmemopt tune`` measured, one entry per GPU model, compute capability and
Triton version in ``$LOWMEMOPT_CACHE_DIR/tuning.json``::

    {"version": 1, "devices": {"NVIDIA H100 80GB HBM3|sm_90|triton 3.6.0":
        {"tile": 2048, "num_warps": 4, "decode": "table", "numel": ..., "measured": [...]}}}

:mod:`.runtime` reads it, :mod:`.tuning` writes it; it imports neither, nor Triton. Policy: docs/kernels.md#benchmark.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["TILES", "WARPS", "DECODES", "CACHE_VERSION", "cache_path", "device_key", "tuned", "save", "forget"]

#: candidate elements per program (rows of the 256-element quantization block: 4, 8 and 16 rows)
TILES = (1024, 2048, 4096)
WARPS = (4, 8)
DECODES = ("table", "arithmetic")
CACHE_VERSION = 1

_loaded: dict[str, Any] | None = None  # the cache file's devices, read once per process (forget() drops it)
_by_index: dict[int, dict[str, Any] | None] = {}


def cache_path() -> Path:
    """Where the tuned shapes are kept: ``$LOWMEMOPT_CACHE_DIR/tuning.json``, default ``~/.cache/lowmemopt``."""
    root = os.environ.get("LOWMEMOPT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lowmemopt")
    return Path(root) / "tuning.json"


def device_key(index: int) -> str:
    """The cache key of CUDA device ``index``: its name, compute capability and the Triton version."""
    import triton

    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)}|sm_{major}{minor}|triton {triton.__version__}"


def forget() -> None:
    """Drop what this process read from the cache (the next lookup reads the file again)."""
    global _loaded
    _loaded = None
    _by_index.clear()


def _read(warn: bool = True) -> dict[str, Any]:
    """The cache file's ``devices``: empty if none or unreadable (then, with ``warn``, one warning)."""
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
        warnings.warn(
            f"lowmemopt: ignoring the tuning cache {path} ({problem}); run `lowmemopt tune` to measure again",
            RuntimeWarning,
            stacklevel=3,
        )
    return {}


def _valid(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and entry.get("tile") in TILES
        and entry.get("num_warps") in WARPS
        and entry.get("decode") in DECODES
    )


def tuned(index: int) -> dict[str, Any] | None:
    """The cached measurement of CUDA device ``index``, or None; read once per process."""
    global _loaded
    if index in _by_index:
        return _by_index[index]
    entry = None
    if os.environ.get("LOWMEMOPT_TUNING", "1") != "0" and torch.cuda.is_available():
        if _loaded is None:
            _loaded = _read()
        entry = _loaded.get(device_key(index))
        if entry is not None and not _valid(entry):
            warnings.warn(
                f"lowmemopt: ignoring a malformed tuning entry for {device_key(index)} in {cache_path()}",
                RuntimeWarning,
                stacklevel=2,
            )
            entry = None
    _by_index[index] = entry
    return entry


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
