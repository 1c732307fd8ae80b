"""Benchmarks of optimizer step time and state size against the libraries lowmemopt replaces, measured in the same run:
models, fixed gradients, the optimizer registries (``OPTIMIZERS``: AdamW against torch, bitsandbytes and torchao;
``FACTORED``: Adafactor and CAME against transformers, torch, came-pytorch and pytorch-optimizer), state-size and timing
helpers, and table output.

Installed with the package so that ``lowmemopt bench`` (:func:`quick`) runs anywhere; the scripts in the repository's
``bench/`` folder (``step.py``, ``factored.py``: the full-size runs, see ``bench/README.md``) are thin front ends to
:func:`script_main`. The other libraries are imported inside their factories: a missing one fails only its own rows.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

import torch

__all__ = [
    "BASELINE", "FACTORED", "LLAMA_PRESETS", "OPTIMIZERS", "Result", "build_llama", "fixed_grads", "fresh_params",
    "host_syncs", "machine_info", "parse_bench_args", "print_table", "progress_line", "quick", "run_benchmark",
    "run_rows", "run_suite", "script_main", "state_bytes", "time_steps",
]

# ---------------------------------------------------------------------------------------------------------------------
# models and gradients

#: LLaMA shapes (SwiGLU MLP, untied embeddings). "150m" is GaLore's LLaMA-130M layout with 14 instead of 12 layers
#: (148.3M parameters; 12 layers give 134.1M); "10m" is a quick configuration with the same kinds of tensors.
LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "150m": dict(
        hidden_size=768, num_hidden_layers=14, intermediate_size=2048, num_attention_heads=12, vocab_size=32000
    ),
    "10m": dict(
        hidden_size=256, num_hidden_layers=6, intermediate_size=688, num_attention_heads=4, vocab_size=12000
    ),
}


def build_llama(preset: str = "150m", device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised fp32 ``LlamaForCausalLM`` of the given preset (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_PRESETS[preset])
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float32)


def fixed_grads(model: torch.nn.Module, mode: str = "random", seed: int = 0) -> list[torch.Tensor]:
    """One gradient per parameter of ``model``, made once and reused for every optimizer.

    ``mode="random"``: ``1e-3 * N(0, 1)`` of each parameter's shape (fast; step time does not depend on the values).
    ``mode="backward"``: one forward/backward of the language-model loss on a random batch of 2 x 128 tokens.
    """
    params = list(model.parameters())
    if mode == "random":
        gen = torch.Generator(device=params[0].device).manual_seed(seed)
        return [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype).mul_(1e-3) for p in params]
    if mode == "backward":
        torch.manual_seed(seed)
        tokens = torch.randint(0, model.config.vocab_size, (2, 128), device=params[0].device)
        model.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        model.zero_grad(set_to_none=True)
        return grads
    raise ValueError(f"unknown gradient mode {mode!r} (random, backward)")


def fresh_params(reference: Iterable[torch.Tensor], grads: Iterable[torch.Tensor]) -> list[torch.nn.Parameter]:
    """New leaf parameters holding copies of ``reference``, each with its (shared, read-only) gradient attached."""
    params = []
    for ref, g in zip(reference, grads):
        p = torch.nn.Parameter(ref.detach().clone())
        p.grad = g
        params.append(p)
    return params


# ---------------------------------------------------------------------------------------------------------------------
# optimizer registry: name -> factory(params, lr, weight_decay). Imports happen inside the factories, so a missing or
# broken library fails only its own rows.


def _lowmemopt_adamw(bits: int) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        import lowmemopt

        return lowmemopt.AdamW(params, lr=lr, weight_decay=weight_decay, state_bits=bits)

    return make


def _torch_adamw(impl: str) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **{impl: True})

    return make


def _bnb_adamw8bit(params, lr, weight_decay):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)


def _torchao_adamw8bit(params, lr, weight_decay):
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=lr, weight_decay=weight_decay)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "lowmemopt-adamw-32bit": _lowmemopt_adamw(32),
    "lowmemopt-adamw-16bit": _lowmemopt_adamw(16),
    "lowmemopt-adamw-8bit": _lowmemopt_adamw(8),
    "torch-adamw-fused": _torch_adamw("fused"),
    "torch-adamw-foreach": _torch_adamw("foreach"),
    "bnb-adamw8bit": _bnb_adamw8bit,
    "torchao-adamw8bit": _torchao_adamw8bit,
}

#: Times are reported as ratios to this optimizer, measured in the same run.
BASELINE = "torch-adamw-fused"


def _lowmemopt(cls_name: str, bits: int, **fixed) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        import lowmemopt

        return getattr(lowmemopt, cls_name)(params, lr=lr, weight_decay=weight_decay, state_bits=bits, **fixed)

    return make


def _transformers_adafactor(**fixed) -> Callable[..., torch.optim.Optimizer]:
    def make(params, lr, weight_decay):
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=weight_decay, **fixed)

    return make


def _torch_adafactor(params, lr, weight_decay):
    return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)


def _came_pytorch(params, lr, weight_decay):
    from came_pytorch import CAME

    return CAME(params, lr=lr, weight_decay=weight_decay)


def _pytorch_optimizer_came(params, lr, weight_decay):
    from pytorch_optimizer import CAME

    return CAME(params, lr=lr, weight_decay=weight_decay)


_EXTERNAL_LR = dict(relative_step=False, scale_parameter=False)

#: The factored optimizers (``bench/factored.py``). Rows ending in ``-m`` keep Adafactor's first moment
#: (``beta1=0.9``): its only full-size state, so the only one 8 bits can shrink.
FACTORED: dict[str, Callable[..., torch.optim.Optimizer]] = {
    BASELINE: OPTIMIZERS[BASELINE],
    "transformers-adafactor": _transformers_adafactor(**_EXTERNAL_LR),
    "lowmemopt-adafactor-32bit": _lowmemopt("Adafactor", 32, **_EXTERNAL_LR),
    "transformers-adafactor-m": _transformers_adafactor(beta1=0.9, **_EXTERNAL_LR),
    "lowmemopt-adafactor-m-32bit": _lowmemopt("Adafactor", 32, beta1=0.9, **_EXTERNAL_LR),
    "lowmemopt-adafactor-m-8bit": _lowmemopt("Adafactor", 8, beta1=0.9, **_EXTERNAL_LR),
    "torch-adafactor": _torch_adafactor,
    "lowmemopt-adafactortorch-32bit": _lowmemopt("AdafactorTorch", 32),
    "came-pytorch": _came_pytorch,
    "pytorch-optimizer-came": _pytorch_optimizer_came,
    "lowmemopt-came-32bit": _lowmemopt("CAME", 32),
    "lowmemopt-came-8bit": _lowmemopt("CAME", 8),
}
#: FusedLAMB with Apex's global gradient-norm clip: one reduction on the device (GPU rows count host syncs: none)
OPTIMIZERS["lowmemopt-fusedlamb-8bit"] = _lowmemopt("FusedLAMB", 8, max_grad_norm=1.0)

#: The suites: (title, registry, extra library versions for the header).
SUITES: dict[str, tuple[str, dict[str, Callable[..., torch.optim.Optimizer]], tuple[str, ...]]] = {
    "step": ("Optimizer step benchmark", OPTIMIZERS, ()),
    "factored": ("Factored optimizers: step time and state", FACTORED, ("came-pytorch", "pytorch-optimizer")),
}


# ---------------------------------------------------------------------------------------------------------------------
# measurements


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
    """Bytes of optimizer state.

    lowmemopt optimizers report their own (``optimizer.state_nbytes()``). For others, every tensor in
    ``optimizer.state`` is counted by its storage, each storage once: tensor subclasses are opened to the tensors
    they hold, and tensors shared between parameters (bitsandbytes' quantization maps) count once.
    """
    if hasattr(optimizer, "state_nbytes"):
        return int(optimizer.state_nbytes())
    storages: dict[tuple, int] = {}
    for st in optimizer.state.values():
        _tensor_storages(st, storages)
    return sum(storages.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: the warning torch's sync debug mode gives for each synchronization; its one-time notice when the mode is first set
#: ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations") is not one
SYNC_WARNING = "called a synchronizing CUDA operation"


def host_syncs(step: Callable[[], object], device: torch.device) -> int | None:
    """Host synchronizations in one call of ``step`` on a CUDA device, counted by torch's sync debug mode (its
    :data:`SYNC_WARNING`s); None on other devices (nothing to synchronize with)."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in seen)


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
    """Call ``step`` ``warmup`` times, then time it ``steps`` times (``time.perf_counter``, device synchronized).

    The first call (state allocation, compilation) is never judged; after it, if a call takes longer than
    ``max_step_s``, the rest of the warm-up is skipped and only one step is timed. Returns (timed seconds, note).

    ``partner`` (the baseline's step): timed right after each timed step, its times appended to ``partner_times``.
    Alternating the two exposes both to the same machine conditions, so their ratio stays put when other work on a
    shared machine slows everything down for a while.
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
    """Build optimizer ``name`` (``factory``, default ``OPTIMIZERS[name]``) on fresh copies of ``reference``, time its
    steps and measure its state. ``partner``: the baseline's step, timed alternately with this one's
    (:func:`time_steps`); its median becomes ``Result.baseline_s``.

    Any exception (import, construction, step) is caught and recorded in ``Result.error``. Memory is released
    before returning.
    """
    result = Result(name)
    n_params = sum(p.numel() for p in reference)
    params = optimizer = None
    try:
        params = fresh_params(reference, grads)
        optimizer = (factory or OPTIMIZERS[name])(params, lr=lr, weight_decay=weight_decay)
        partner_times: list[float] = []
        result.times_s, result.note = time_steps(
            optimizer.step, steps=steps, warmup=warmup, device=device, max_step_s=max_step_s, partner=partner,
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


# ---------------------------------------------------------------------------------------------------------------------
# reporting


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
    """Markdown table: optimizer | state bytes/param | median step (s) | the baseline's median it is compared with (s)
    | ratio (the two medians' quotient) | notes."""
    out = out or sys.stdout
    print(f"| optimizer | state bytes/param | median step (s) | {BASELINE} median (s) | ratio | notes |", file=out)
    print("| --- | ---: | ---: | ---: | ---: | --- |", file=out)
    for r in results:
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}x"
        note = f"FAILED: {r.error}" if r.error else r.note
        note = note.replace("|", "\\|")
        print(f"| {r.name} | {_per_param(r)} | {_seconds(r.median_s)} | {_seconds(r.baseline_s)} | {ratio} | {note} |",
              file=out)


def progress_line(r: Result) -> str:
    """One optimizer's line on stderr once it has run: its median, state and note, rounded as in the table."""
    if r.error:
        return f"  {r.name}: FAILED: {r.error}"
    if r.missing:
        return f"  {r.name}: {r.note}"
    note = f" ({r.note})" if r.note else ""
    return f"  {r.name}: median {_seconds(r.median_s)} s, {_per_param(r)} bytes/param{note}"


def run_suite(
    names: Sequence[str],
    registry: dict[str, Callable[..., torch.optim.Optimizer]],
    *,
    preset: str,
    steps: int,
    warmup: int,
    device: torch.device,
    grads: str = "random",
    max_step_s: float = 60.0,
    paired: bool = True,
    out=None,
    measured: dict[str, Result] | None = None,
) -> tuple[list[Result], dict[str, object]]:
    """Build the ``preset`` model once, make one set of ``grads``, run each optimizer ``names[i]`` of ``registry`` on
    fresh copies (:func:`run_benchmark`) and set each result's ratio to :data:`BASELINE`. Prints the model and
    settings to ``out`` and progress to stderr; returns the results and a description of the model.

    ``paired`` (default): a second :data:`BASELINE` optimizer on its own copies stays alive, and each optimizer's
    timed steps alternate with baseline steps; the ratio is to those. Else the ratio is to the baseline's own row.
    ``measured``: rows already measured in this run on the same model (:func:`run_rows`)."""
    out = out or sys.stdout  # looked up per call: a default bound at import would miss a redirected stdout
    model = build_llama(preset, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"- model: LlamaForCausalLM {LLAMA_PRESETS[preset]}, fp32, {n_params / 1e6:.1f}M parameters "
          f"in {len(list(model.parameters()))} tensors", file=out)
    print(f"- gradients: {grads} (the same for every optimizer); warm-up {warmup}, timed {steps} steps, "
          "median reported", file=out)
    print(f"- ratio: each row's median over the {BASELINE} median in that row, the median of baseline steps timed "
          "alternately with the row's steps (paired)\n" if paired else
          f"- ratio: each row's median over the {BASELINE} row's median\n", file=out, flush=True)
    fixed = fixed_grads(model, mode=grads)
    reference = [p.detach() for p in model.parameters()]
    del model

    def run_one(name: str, partner: Callable[[], object] | None) -> Result:
        return run_benchmark(name, reference, fixed, steps=steps, warmup=warmup, device=device, max_step_s=max_step_s,
                             factory=registry[name], partner=partner)

    baseline = registry.get(BASELINE) if paired else None
    results = run_rows(names, run_one, baseline, reference, fixed, device, measured=measured)
    return results, {"preset": preset, "config": LLAMA_PRESETS[preset], "n_params": n_params}


def run_rows(
    names: Sequence[str],
    run_one: Callable[[str, Callable[[], object] | None], Result],
    baseline: Callable[..., torch.optim.Optimizer] | None,
    reference: list[torch.Tensor],
    grads: list[torch.Tensor],
    device: torch.device,
    measured: dict[str, Result] | None = None,
) -> list[Result]:
    """``run_one(name, partner)`` for each name, with progress on stderr, then each result's ratio to
    :data:`BASELINE`. ``baseline`` (its factory; None: unpaired): a second baseline optimizer on fresh copies of
    ``reference`` stays alive and its ``step`` is every other row's ``partner`` (:func:`time_steps`), so ratios are to
    baseline steps timed alternately with the row's; unpaired, to the baseline row's median. Each result's
    ``baseline_s`` is the median its ratio is to (the baseline row's: its own).

    ``measured``: name -> a result measured earlier in this run on the same model and gradients (the baseline row
    shared by two suites): that row is not run again, so every table of the run shows the same measurement."""
    measured = measured or {}
    partner = None
    if baseline is not None and any(n != BASELINE and n not in measured for n in names):
        partner = baseline(fresh_params(reference, grads), lr=1e-3, weight_decay=1e-2)
        time_steps(partner.step, steps=0, warmup=2, device=device)
    results = []
    for name in names:
        if name in measured:
            r = replace(measured[name], note=_join(measured[name].note, "the same measurement as above"))
            print(f"  {name}: measured above, median {_seconds(r.median_s)} s", file=sys.stderr, flush=True)
            results.append(r)
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r = run_one(name, None if name == BASELINE or partner is None else partner.step)
        print(progress_line(r), file=sys.stderr, flush=True)
        results.append(r)
    del partner
    gc.collect()
    base = next((r.median_s for r in results if r.name == BASELINE), None)
    for r in results:
        if r.name == BASELINE or r.baseline_s is None:
            r.baseline_s = r.median_s if r.name == BASELINE else base
        if r.baseline_s and r.median_s is not None:
            r.ratio = r.median_s / r.baseline_s
    return results


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def script_main(suite: str, argv: list[str] | None = None, description: str | None = None) -> int:
    """``bench/step.py`` and ``bench/factored.py``: parse the shared options, run the suite, print its table (and
    write ``--json``)."""
    title, registry, extra_versions = SUITES[suite]
    args = parse_bench_args(description or title, registry, argv)
    device = torch.device(args.device)
    preset = "10m" if args.small else "150m"
    info = machine_info(device)
    for dist in extra_versions:
        info[dist.replace("-", "_")] = _version(dist)
    print(f"## {title}\n")
    for key, value in info.items():
        print(f"- {key}: {value}")
    results, model = run_suite(args.names, registry, preset=preset, steps=args.steps, warmup=args.warmup,
                               device=device, grads=args.grads, max_step_s=args.max_step_s, paired=not args.unpaired)
    print_table(results)
    info["load_avg_1m_end"] = _load_average()
    print(f"\nload average (1 min) at start {info['load_avg_1m']}, at end {info['load_avg_1m_end']} "
          f"(torch uses {info['torch_threads']} threads; a higher load means contended timings)")
    if args.json:
        payload = {
            "machine": info,
            "model": model,
            "settings": {"steps": args.steps, "warmup": args.warmup, "grads": args.grads, "baseline": BASELINE,
                         "paired": not args.unpaired,
                         "lr": 1e-3, "weight_decay": 1e-2},
            "results": [r.to_dict() for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


#: ``lowmemopt bench``'s default: the ~11M-parameter model, fewer steps
QUICK = dict(preset="10m", steps=3, warmup=2)  # 2 warm-ups: the CPU fast path compiles on steps 1 and 2


def quick(
    suites: Sequence[str] = ("step", "factored"),
    *,
    preset: str = QUICK["preset"],
    steps: int = QUICK["steps"],
    warmup: int = QUICK["warmup"],
    device: str | torch.device = "cpu",
    names: Sequence[str] | None = None,
    max_step_s: float = 60.0,
    out=None,
) -> dict[str, list[Result]]:
    """``lowmemopt bench``: each suite on the ``preset`` model (default the ~11M-parameter one, 2 warm-up and 3 timed
    steps), printing a comparison table per suite. ``names`` restricts the optimizers (the baseline always runs)."""
    out = out or sys.stdout
    device = torch.device(device)
    info = machine_info(device)
    print("## lowmemopt bench\n", file=out)
    for key, value in info.items():
        print(f"- {key}: {value}", file=out)
    tables = {}
    measured: dict[str, Result] = {}  # the baseline row, measured once and shown in every suite's table
    for suite in suites:
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
        title, registry, _ = SUITES[suite]
        chosen = [n for n in registry if names is None or n in names or n == BASELINE]
        print(f"\n### {title}\n", file=out)
        results, _ = run_suite(chosen, registry, preset=preset, steps=steps, warmup=warmup, device=device,
                               max_step_s=max_step_s, out=out, measured=measured)
        print_table(results, out=out)
        tables[suite] = results
        measured.update({r.name: r for r in results if r.name == BASELINE and r.median_s is not None})
    print(f"\nload average (1 min) at start {info['load_avg_1m']}, at end {_load_average()} "
          f"(torch uses {info['torch_threads']} threads; a higher load means contended timings)", file=out)
    return tables


def parse_bench_args(description: str, choices: Iterable[str], argv: list[str] | None = None) -> argparse.Namespace:
    """The options every bench script shares; ``choices``: the optimizer names ``--optimizers`` may pick from.
    Sets ``args.names`` (the chosen names, with the baseline first)."""
    choices = list(choices)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--optimizers",
        default=",".join(choices),
        help="comma-separated subset of: " + ", ".join(choices) + f"\n({BASELINE} is always run: it is the baseline)",
    )
    parser.add_argument("--small", action="store_true", help="~11M-parameter model instead of ~148M, for a quick run")
    parser.add_argument("--grads", choices=["random", "backward"], default="random",
                        help="fixed gradients: random normal (default) or one forward/backward on random tokens")
    parser.add_argument("--max-step-s", type=float, default=60.0,
                        help="an optimizer slower than this per step (after its first) is timed for 1 step only")
    parser.add_argument("--unpaired", action="store_true",
                        help="ratios to the baseline's own row, instead of to baseline steps timed alternately with "
                             "each optimizer's (which needs a second copy of the model's parameters and AdamW state)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown:
        parser.error(f"unknown optimizer(s) {', '.join(unknown)}; choose from {', '.join(choices)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    args.names = names
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    return args
