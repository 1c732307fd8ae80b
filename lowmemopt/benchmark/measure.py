"""Measurements: state bytes (each real storage once), host synchronizations per step, paired step timing, and one
optimizer's row (:func:`run_benchmark`)."""

from __future__ import annotations

import gc
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .models import fresh_params
from .optimizers import OPTIMIZERS


def _tensor_storages(obj, out: dict[tuple, int]) -> None:
    """Collect the real storages under ``obj`` (tensors, wrapper subclasses, containers) as {(device, ptr): nbytes}."""
    if isinstance(obj, torch.Tensor):
        if hasattr(type(obj), "__tensor_flatten__") and type(obj) is not torch.Tensor:
            # wrapper subclass (torchao's OptimState8bit holds codes, scale, qmap): count its inner tensors
            names, _ = obj.__tensor_flatten__()
            for name in names:
                _tensor_storages(getattr(obj, name), out)
            return
        storage = obj.untyped_storage()
        if storage.nbytes():
            out[(str(obj.device), storage.data_ptr())] = storage.nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensor_storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_storages(v, out)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state, each storage once (lowmemopt's own ``state_nbytes()``)."""
    if hasattr(optimizer, "state_nbytes"):
        return int(optimizer.state_nbytes())
    storages: dict[tuple, int] = {}
    for st in optimizer.state.values():
        _tensor_storages(st, storages)
    return sum(storages.values())


def drop_from_page_cache(path: str) -> None:
    """Write ``path`` out and drop its pages from the page cache (``POSIX_FADV_DONTNEED``; else a no-op)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: the warning torch's sync debug mode gives for each synchronization; its one-time notice when the mode is first set
#: ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations") is not one
SYNC_WARNING = "called a synchronizing CUDA operation"


def sync_messages(step: Callable[[], object]) -> list[str]:
    """torch's sync-debug warnings for one call of ``step`` (CUDA)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in seen if SYNC_WARNING in str(w.message)]


def host_syncs(step: Callable[[], object], device: torch.device) -> int | None:
    """Host synchronizations in one call of ``step`` on CUDA; None elsewhere."""
    return None if device.type != "cuda" else len(sync_messages(step))


def time_steps(
    step: Callable[[], object],
    *,
    steps: int,
    warmup: int,
    device: torch.device,
    max_step_s: float = 60.0,
    partner: Callable[[], object] | None = None,
    partner_times: list[float] | None = None,
) -> tuple[list[float], str]:
    """Call ``step`` ``warmup`` times, then time ``steps`` calls (device synchronized); returns (seconds, note).

    After the first call, one slower than ``max_step_s`` cuts the warm-up short and only one step is timed.
    ``partner`` (the baseline's step) is timed right after each timed step into ``partner_times``, so both see the
    same machine conditions.
    """

    def timed() -> float:
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        return time.perf_counter() - t0

    note = ""
    for i in range(warmup):
        dt = timed()
        if i >= 1 and dt > max_step_s:
            steps, note = 1, f"slow ({dt:.1f} s/step): {i + 1} warm-up + 1 timed step"
            break
    times: list[float] = []
    for i in range(steps):
        dt = timed()
        times.append(dt)
        if partner is not None:
            _sync(device)
            t0 = time.perf_counter()
            partner()
            _sync(device)
            if partner_times is not None:
                partner_times.append(time.perf_counter() - t0)
        first_call = warmup == 0 and i == 0
        if not first_call and dt > max_step_s and i + 1 < steps:
            note = f"slow ({dt:.1f} s/step): {warmup} warm-up + {i + 1} timed step(s)"
            break
    return times, note


@dataclass
class Result:
    """One optimizer's row."""

    name: str
    state_bytes: int | None = None
    bytes_per_param: float | None = None
    times_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    #: the baseline median this row's ratio is to: the baseline's steps timed alternately with this row's (paired), or
    #: the baseline row's median (unpaired, and the baseline row itself)
    baseline_s: float | None = None
    ratio: float | None = None  # median_s / baseline_s
    note: str = ""
    error: str = ""
    missing: str = ""  # an optional library that is not installed (the row did not run)
    host_syncs: int | None = None  # per step, on a CUDA device (:func:`host_syncs`)

    def to_dict(self) -> dict:
        return asdict(self)


def run_benchmark(
    name: str,
    reference: list[torch.Tensor],
    grads: list[torch.Tensor],
    *,
    steps: int,
    warmup: int,
    device: torch.device,
    lr: float = 1e-3,
    weight_decay: float = 1e-2,
    max_step_s: float = 60.0,
    factory: Callable[..., torch.optim.Optimizer] | None = None,
    partner: Callable[[], object] | None = None,
) -> Result:
    """One optimizer's row on fresh copies of ``reference``; exceptions go to ``Result.error``."""
    result = Result(name)
    n_params = sum(p.numel() for p in reference)
    params = optimizer = None
    try:
        params = fresh_params(reference, grads)
        optimizer = (factory or OPTIMIZERS[name])(params, lr=lr, weight_decay=weight_decay)
        partner_times: list[float] = []
        result.times_s, result.note = time_steps(
            optimizer.step,
            steps=steps,
            warmup=warmup,
            device=device,
            max_step_s=max_step_s,
            partner=partner,
            partner_times=partner_times,
        )
        result.median_s = statistics.median(result.times_s)
        result.host_syncs = host_syncs(optimizer.step, device)
        if result.host_syncs:
            result.note = _join(result.note, f"{result.host_syncs} host sync(s) per step")
        if partner_times:
            result.baseline_s = statistics.median(partner_times)
        result.state_bytes = state_bytes(optimizer)
        result.bytes_per_param = result.state_bytes / n_params
    except Exception as exc:  # noqa: BLE001 - a failing optimizer becomes a table row, not a crash
        if isinstance(exc, ModuleNotFoundError) and _optional_library(exc):
            result.missing = exc.name.split(".")[0]
            result.note = f"not installed ({result.missing}): {INSTALL_HINT}"
        else:
            result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        del optimizer, params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


#: how to install the libraries the other rows compare against
INSTALL_HINT = "pip install '.[bench]'"


def _optional_library(exc: ModuleNotFoundError) -> bool:
    """A missing module that is another library (a row's reference, not installed), not a part of lowmemopt."""
    return bool(exc.name) and exc.name.split(".")[0] != "lowmemopt"


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)
