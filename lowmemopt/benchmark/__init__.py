"""Benchmarks of step time and state size against the libraries lowmemopt replaces, in the same run: the suites
(:func:`run_suite`), ``lowmemopt bench`` (:func:`quick`) and the entry point of ``bench/step.py`` and
``bench/factored.py`` (:func:`script_main`). Models in :mod:`.models`, registries in :mod:`.optimizers`, timing in
:mod:`.measure`, tables in :mod:`.report`; other libraries are imported by their rows only (bench/README.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from typing import Callable, Iterable, Sequence

import torch

from .measure import (
    SYNC_WARNING,
    Result,
    _join,
    drop_from_page_cache,
    host_syncs,
    run_benchmark,
    state_bytes,
    sync_messages,
    time_steps,
)
from .models import LLAMA_PRESETS, build_llama, fixed_grads, fresh_params
from .optimizers import BASELINE, FACTORED, OPTIMIZERS, SUITES
from .report import _load_average, _seconds, _version, machine_info, print_table, progress_line

__all__ = [
    "BASELINE",
    "FACTORED",
    "LLAMA_PRESETS",
    "OPTIMIZERS",
    "Result",
    "SYNC_WARNING",
    "build_llama",
    "drop_from_page_cache",
    "fixed_grads",
    "fresh_params",
    "host_syncs",
    "machine_info",
    "parse_bench_args",
    "print_table",
    "progress_line",
    "quick",
    "run_benchmark",
    "run_rows",
    "run_suite",
    "script_main",
    "state_bytes",
    "sync_messages",
    "time_steps",
]


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
    """Build the ``preset`` model once, make one set of ``grads`` and run each optimizer of ``names`` on fresh copies,
    with its ratio to :data:`BASELINE`.

    Args:
        paired: time each row's steps alternately with a live baseline optimizer's (else: to the baseline's row).
        measured: rows already measured in this run on the same model (:func:`run_rows`).

    Returns:
        The results and a description of the model (printed to ``out``; progress on stderr).
    """
    out = out or sys.stdout  # looked up per call: a default bound at import would miss a redirected stdout
    model = build_llama(preset, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"- model: LlamaForCausalLM {LLAMA_PRESETS[preset]}, fp32, {n_params / 1e6:.1f}M parameters "
        f"in {len(list(model.parameters()))} tensors",
        file=out,
    )
    print(
        f"- gradients: {grads} (the same for every optimizer); warm-up {warmup}, timed {steps} steps, median reported",
        file=out,
    )
    print(
        f"- ratio: each row's median over the {BASELINE} median in that row, the median of baseline steps timed "
        "alternately with the row's steps (paired)\n"
        if paired
        else f"- ratio: each row's median over the {BASELINE} row's median\n",
        file=out,
        flush=True,
    )
    fixed = fixed_grads(model, mode=grads)
    reference = [p.detach() for p in model.parameters()]
    del model

    def run_one(name: str, partner: Callable[[], object] | None) -> Result:
        return run_benchmark(
            name,
            reference,
            fixed,
            steps=steps,
            warmup=warmup,
            device=device,
            max_step_s=max_step_s,
            factory=registry[name],
            partner=partner,
        )

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
    """``run_one(name, partner)`` for each name, then each result's ratio to :data:`BASELINE`.

    ``baseline`` (a factory; None: unpaired): a live baseline on fresh copies of ``reference`` is every row's
    ``partner``, timed alternately with it. ``measured``: results measured earlier in this run, not run again.
    """
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


def script_main(suite: str, argv: list[str] | None = None, description: str | None = None) -> int:
    """``bench/step.py`` and ``bench/factored.py``: parse the shared options, run the suite, print its table."""
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
    results, model = run_suite(
        args.names,
        registry,
        preset=preset,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
        grads=args.grads,
        max_step_s=args.max_step_s,
        paired=not args.unpaired,
    )
    print_table(results)
    info["load_avg_1m_end"] = _load_average()
    print(
        f"\nload average (1 min) at start {info['load_avg_1m']}, at end {info['load_avg_1m_end']} "
        f"(torch uses {info['torch_threads']} threads; a higher load means contended timings)"
    )
    if args.json:
        payload = {
            "machine": info,
            "model": model,
            "settings": {
                "steps": args.steps,
                "warmup": args.warmup,
                "grads": args.grads,
                "baseline": BASELINE,
                "paired": not args.unpaired,
                "lr": 1e-3,
                "weight_decay": 1e-2,
            },
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
    """``lowmemopt bench``: each suite on ``preset``, a table per suite."""
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
        results, _ = run_suite(
            chosen,
            registry,
            preset=preset,
            steps=steps,
            warmup=warmup,
            device=device,
            max_step_s=max_step_s,
            out=out,
            measured=measured,
        )
        print_table(results, out=out)
        tables[suite] = results
        measured.update({r.name: r for r in results if r.name == BASELINE and r.median_s is not None})
    print(
        f"\nload average (1 min) at start {info['load_avg_1m']}, at end {_load_average()} "
        f"(torch uses {info['torch_threads']} threads; a higher load means contended timings)",
        file=out,
    )
    return tables


def parse_bench_args(description: str, choices: Iterable[str], argv: list[str] | None = None) -> argparse.Namespace:
    """The options every bench script shares; sets ``args.names`` (the chosen names, baseline first)."""
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
    parser.add_argument(
        "--grads",
        choices=["random", "backward"],
        default="random",
        help="fixed gradients: random normal (default) or one forward/backward on random tokens",
    )
    parser.add_argument(
        "--max-step-s",
        type=float,
        default=60.0,
        help="an optimizer slower than this per step (after its first) is timed for 1 step only",
    )
    parser.add_argument(
        "--unpaired",
        action="store_true",
        help="ratios to the baseline's own row, instead of to baseline steps timed alternately with "
        "each optimizer's (which needs a second copy of the model's parameters and AdamW state)",
    )
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
