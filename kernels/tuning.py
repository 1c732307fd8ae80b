"""``lowmemopt tune``: time the elementwise kernels' tile shapes and the two 8-bit decodes on the GPU at hand (the
8-bit AdamW kernel launched as the Triton backend launches a bucket) and keep the fastest in the cache file that
:mod:`.runtime` reads (:mod:`.tuning_cache`). Speed only, never results; the cache and its precedence:
docs/kernels.md#benchmark."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

from . import runtime
from .tuning_cache import CACHE_VERSION, DECODES, TILES, WARPS, cache_path, device_key, forget, save, tuned

__all__ = [
    "TILES",
    "WARPS",
    "DECODES",
    "CACHE_VERSION",
    "cache_path",
    "device_key",
    "tuned",
    "save",
    "forget",
    "adamw_q8_state",
    "adamw_q8_step",
    "median_step_time",
    "measure",
    "best",
    "tune",
]

#: the measurement's default size: 128M bf16 parameters (about 0.8 GB with gradients and 8-bit state)
DEFAULT_NUMEL = 1 << 27
#: the 8-bit state's quantization block (the optimizers' default at 8 bits)
BLOCK_SIZE = 256
#: the measured step's param group: AdamW's defaults, no weight decay (``lowmemopt.AdamW(params, lr=1e-4,
#: weight_decay=0.0, state_bits=8)``), as the kernels read it
GROUP = dict(
    lr=1e-4,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    decoupled_weight_decay=True,
    amsgrad=False,
    maximize=False,
    bf16_update="nearest",
    block_size=BLOCK_SIZE,
)


def _problem(numel: int, device: torch.device, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Eight tensors of about ``numel`` elements in all (a LLaMA layer's mix of sizes) and their gradients."""
    sizes = [3, 3, 1, 1, 8, 8, 8, 0.05]
    total = sum(sizes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    params, grads = [], []
    for s in sizes:
        n = max(BLOCK_SIZE, int(numel * s / total) // BLOCK_SIZE * BLOCK_SIZE)
        params.append(torch.randn(n, generator=gen).to(device=device, dtype=dtype))
        grads.append((torch.randn(n, generator=gen) * 1e-3).to(device=device, dtype=dtype))
    return params, grads


def adamw_q8_state(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Fresh 8-bit AdamW state for each tensor, as the optimizer makes it before its first step: ``step`` 0 and zeroed
    ``exp_avg`` and ``exp_avg_sq`` slots in :data:`lowmemopt.quant.formats.Q8` (``.codes`` uint8, ``.absmax`` fp32
    per block of :data:`BLOCK_SIZE`)."""
    from lowmemopt.quant.formats import Q8

    from .adamw import slots

    states = []
    for p in params:
        state: dict[str, Any] = {"step": 0}
        for slot in slots(GROUP):
            Q8.init(state, slot, p.shape, p.device, BLOCK_SIZE)
        states.append(state)
    return states


def adamw_q8_step(
    params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, Any]]
) -> Callable[[], None]:
    """A function that takes the next 8-bit AdamW step of ``params`` (state ``states``, :func:`adamw_q8_state`) as the
    Triton backend steps a bucket: one :func:`.adamw.launch` on a :class:`.launch.Bucket` of the plain tensors, with
    :data:`GROUP`'s hyper-parameters and the step's bias corrections; then the step counts advance."""
    from .adamw import launch
    from lowmemopt.work.record import BucketRecord

    from .launch import Bucket, Update

    beta1, beta2 = GROUP["betas"]
    hyper = {
        k: GROUP[k] for k in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "amsgrad", "maximize")
    }

    def step() -> None:
        t = states[0]["step"] + 1
        kwargs = dict(hyper, bias_correction1=1 - beta1**t, bias_correction2_sqrt=math.sqrt(1 - beta2**t))
        launch(
            Update("", kwargs, BucketRecord.of(GROUP), 1.0, t, BLOCK_SIZE),
            Bucket(params, grads, states, "q8", BLOCK_SIZE, index_bases=[0] * len(params)),
        )
        for state in states:
            state["step"] = t

    return step


def median_step_time(step: Any, device: torch.device, steps: int, warmup: int = 1) -> float:
    """Median seconds of ``steps`` calls of ``step`` (a function of no arguments, or an optimizer: its ``step()``)
    after ``warmup`` untimed ones: CUDA events on a GPU, the wall clock elsewhere."""
    run = getattr(step, "step", step)
    device = torch.device(device)
    for _ in range(warmup):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(
    device: torch.device,
    numel: int = DEFAULT_NUMEL,
    steps: int = 20,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Time the 8-bit AdamW kernel (:func:`adamw_q8_step`, fresh state for each candidate) on ``device`` at every
    candidate (tile, warps, decode); one record each: ``tile``, ``num_warps``, ``decode``, ``seconds`` (median step),
    ``bytes_per_s`` (the step's ideal bytes over that), or ``error`` for a configuration that fails to compile or run.
    ``progress(record)`` is called as each is made. On the CPU (tests, under the Triton interpreter) the same loop
    runs, timed by the wall clock."""
    params, grads = _problem(numel, device, dtype)
    n = sum(p.numel() for p in params)
    size = torch.finfo(dtype).bits // 8
    # p read + written, g read, 2 code bytes read + written, absmax
    ideal = n * (3 * size + 4) + 2 * 4 * (n // BLOCK_SIZE)
    records = []
    for decode in DECODES:
        for tile in TILES:
            for warps in WARPS:
                record: dict[str, Any] = dict(tile=tile, num_warps=warps, decode=decode)
                states = None
                try:
                    with runtime.launch_shape((tile, warps), decode):
                        states = adamw_q8_state(params)
                        seconds = median_step_time(adamw_q8_step(params, grads, states), device, steps)
                    record.update(seconds=seconds, bytes_per_s=ideal / seconds)
                except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a record, not the end
                    record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                del states  # (freed before the next candidate's are made)
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


def tune(
    device: torch.device,
    numel: int = DEFAULT_NUMEL,
    steps: int = 20,
    write: bool = True,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure (:func:`measure`) on CUDA ``device``, pick the fastest and, with ``write``, keep it in the cache for
    this GPU model and Triton version: ``(entry, records)``."""
    if device.type != "cuda":
        raise ValueError(f"tuning measures a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    records = measure(torch.device("cuda", index), numel, steps, progress=progress)
    top = best(records)
    entry = dict(
        tile=top["tile"],
        num_warps=top["num_warps"],
        decode=top["decode"],
        numel=numel,
        steps=steps,
        measured=records,
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    if write:
        save(device_key(index), entry)
    return entry, records
