"""The ``lowmemopt`` command.

    lowmemopt demo [--steps N] [--optimizers a,b] [--data PATH] [--out DIR]   train a small LLaMA, compare optimizers
    lowmemopt estimate CONFIG.json|PRESET [--optimizer a,b] [--state-bits 8]   memory of weights, grads and state
    lowmemopt bench [--full]                                                  step time and state vs other libraries
    lowmemopt inspect opt.safetensors|opt.pt [--params]                       metadata and summary of a state file
    lowmemopt tune [--device cuda:0]                                          measure the kernels' launch shape here

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and sets ``func`` (called with
the parsed arguments, returns the exit status); add it to ``_SUBCOMMANDS``. Only ``func`` imports torch and lowmemopt's
modules, so parsing (``lowmemopt --help``, a usage error) takes a fraction of a second; ``func`` checks what it can
(names, paths) before those imports, and first drops the known noise other libraries log while they are imported
(:data:`_IMPORT_NOISE`).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import logging
import os
import sys
from typing import Any, Callable, Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lowmemopt`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="lowmemopt", description="Memory-efficient PyTorch optimizers: tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


#: log records that other libraries print while they are imported and that say nothing about a lowmemopt command,
#: as (logger, text in the message): torchao (imported by transformers' model code when it is installed, as the test
#: and bench extras install it) cannot load its optional CUDA / mxfp8 extensions built for another torch, and registers
#: enums with torch's pytree in a way torch now calls deprecated. Only these two, only in the command: a library's
#: other messages, and lowmemopt used from Python, are left alone.
_IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _DropImportNoise(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


def _quiet_import_noise() -> None:
    """Drop :data:`_IMPORT_NOISE` from the loggers that print it (before the imports that would print it)."""
    for name, text in _IMPORT_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) and f.text == text for f in logger.filters):
            logger.addFilter(_DropImportNoise(text))


# ---------------------------------------------------------------------------------------------------------------------
# inspect


def _add_inspect(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="print a state file's metadata and a per-format summary",
        description="Print the metadata of a lowmemopt state file (lowmemopt.save_state; reads the header only) or "
        "of a torch.save file of optimizer.state_dict() (lowmemopt's, torch.optim's or bitsandbytes'; loaded with "
        "weights_only=True), and a summary per format: slots, params, elements and bytes.",
    )
    p.add_argument(
        "path",
        help="a .safetensors file written by lowmemopt.save_state, or a torch.save file of "
        "optimizer.state_dict() (also one level down in a dict, as {'opt': opt.state_dict(), ...})",
    )
    p.add_argument("--params", action="store_true", help="also list every parameter: shape, step, slot formats")
    p.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    _quiet_import_noise()
    from .inspection import inspect

    return inspect(args.path, args.params)


# ---------------------------------------------------------------------------------------------------------------------
# demo

_DEMO_NEEDS = {"transformers": "transformers", "matplotlib": "matplotlib", "tqdm": "tqdm"}

#: ``lowmemopt demo``'s default output folder, in the current directory
DEMO_OUT = "lowmemopt-demo-output"
#: ``lowmemopt demo``'s default optimizers: the keys of ``lowmemopt.demo.DEMO_CHOICES`` (that module imports torch)
DEMO_CHOICES = ("adamw", "adamw8bit", "came8bit", "galore_came8bit")


def _add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small LLaMA-style model with a few optimizers; print memory, speed and loss; plot them",
        description="Train a small LLaMA-style byte-level language model (1.9M parameters, built from a config, "
        "random init) on offline text (by default the source of Python's standard library) with each optimizer: "
        "same init, same batches. Prints state memory, peak memory, step time and final loss, and writes a PNG of "
        "the loss curves and memory plus the numbers as JSON. Needs transformers, matplotlib and tqdm "
        "(pip install 'lowmemopt[demo]').",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps per optimizer (default 300)")
    p.add_argument(
        "--optimizers",
        default=",".join(DEMO_CHOICES),
        help=f"comma-separated (default {','.join(DEMO_CHOICES)}); any lowmemopt optimizer name works "
        "(lr 1e-3 unless --lr)",
    )
    p.add_argument("--data", metavar="PATH", help="train on this text file instead of the standard library's source")
    p.add_argument(
        "--out",
        metavar="DIR",
        default=DEMO_OUT,
        help=f"where to write demo.png and demo.json (default ./{DEMO_OUT}, which ignores itself in git)",
    )
    p.add_argument("--lr", type=float, help="learning rate for every optimizer (default: each one's preset)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)


def _passive_openmp() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` for this process unless the user chose a policy, before torch (and its OpenMP
    runtime, which the native kernels share) is loaded: by default idle OpenMP threads spin, and on a machine busy
    with other work the demo then took 6.7-9x the wall time and 6-7x the CPU time (docs/cpu_kernels.md, "A busy
    machine"). Too late once torch is imported: then nothing is changed."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _demo(args: argparse.Namespace) -> int:
    missing = [pkg for mod, pkg in _DEMO_NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(
            f"lowmemopt demo needs {', '.join(missing)}: pip install 'lowmemopt[demo]' "
            f"(or pip install {' '.join(missing)})",
            file=sys.stderr,
        )
        return 1
    _quiet_import_noise()
    _passive_openmp()
    import torch

    from . import demo

    try:
        if args.steps < 1 or args.batch < 1 or args.seq < 2:
            raise ValueError("--steps and --batch must be >= 1 and --seq >= 2")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available")
        choices = [demo.choice(n, args.lr) for n in args.optimizers.split(",") if n.strip()]
        if not choices:
            raise ValueError("--optimizers: give at least one optimizer name")
        data = demo.file_bytes(args.data) if args.data else demo.stdlib_bytes()
        out = _demo_out_dir(args.out)  # before training: an unwritable folder fails now, not after the run
    except (ValueError, OSError) as e:
        print(f"lowmemopt demo: {e}", file=sys.stderr)
        return 1

    source = args.data or "the Python standard library's source"
    n_params = sum(p.numel() for p in demo._llama(args.seed).parameters())
    print(
        f"LLaMA-style byte-level LM, {n_params / 1e6:.2f}M parameters, on {data.numel():,} bytes of {source}; "
        f"{args.steps} steps of {args.batch} x {args.seq} bytes, {device}; output to {out}\n",
        flush=True,
    )
    results = demo.compare(
        choices, args.steps, data=data, seed=args.seed, batch=args.batch, seq=args.seq, device=device
    )
    print()
    print(demo.table(results))
    print(
        "(the progress bars show one step's loss; \"final loss\" is the mean of the last 20 steps' losses, "
        '"held-out loss" the loss on 64 fixed windows of the data, the same for every optimizer)'
    )
    for r in results:
        if "skipped" in r:
            print(f"note: {r['label']} skipped: {r['skipped']}")
    print(f"\npeak memory: {_PEAK_NOTE[device.split(':')[0]]}")
    png = demo.plot(
        results,
        os.path.join(out, "demo.png"),
        title=f"{n_params / 1e6:.1f}M-parameter LLaMA, {args.steps} steps on {os.path.basename(source)}; "
        "each optimizer with its own settings (legend)",
    )
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump(
            dict(
                steps=args.steps,
                batch=args.batch,
                seq=args.seq,
                device=device,
                data=source,
                params=n_params,
                results=results,
            ),
            f,
            indent=1,
        )
    print(f"\nwrote the plot to {png}\n  and the numbers to {os.path.join(out, 'demo.json')}")
    return 0


def _demo_out_dir(out: str) -> str:
    """Make the output folder; the default one, when made here, gets a ``.gitignore`` of ``*`` (as pytest does for its
    cache) so that a run inside any git checkout leaves no untracked files."""
    path = os.path.abspath(out)
    new = not os.path.isdir(path)
    os.makedirs(path, exist_ok=True)
    if new and os.path.normpath(out) == DEMO_OUT:
        with open(os.path.join(path, ".gitignore"), "w") as f:
            f.write("# written by lowmemopt demo: its output stays out of git\n*\n")
    return path


_PEAK_NOTE = {
    "cpu": "memory in use (C heap) at its highest, sampled after forward, backward and step, above what was in use "
    "before the model was built: weights, gradients, optimizer state and activations",
    "cuda": "torch.cuda.max_memory_allocated above what was allocated before the model was built",
}


# ---------------------------------------------------------------------------------------------------------------------
# bench


def _add_bench(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="step time and state size against torch, bitsandbytes, torchao, transformers, came-pytorch (quick)",
        description="The quick version of the repository's bench/ suite (lowmemopt.benchmark): optimizer step time "
        "(median, and its ratio to the median of torch's fused AdamW steps timed alternately with it, both in the "
        "row) and state bytes per parameter on a randomly initialised LLaMA (~11M parameters; --full: ~148M), with "
        "fixed gradients. Suites: 'step' (AdamW: lowmemopt 32/16/8-bit, torch fused/foreach, bitsandbytes, torchao) "
        "and 'factored' (Adafactor, CAME: lowmemopt, transformers, torch, came-pytorch, pytorch-optimizer). Rows of "
        "libraries that are not installed say so (pip install '.[bench]' installs them). Needs transformers.",
    )
    p.add_argument("--suite", default="step,factored", help="comma-separated: step, factored (default both)")
    p.add_argument("--optimizers", help="comma-separated subset of the suites' row names (default all)")
    p.add_argument("--full", action="store_true", help="the ~148M-parameter model, 2 warm-up + 5 timed steps")
    p.add_argument("--steps", type=int, help="timed steps per optimizer (default 3; --full: 5)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--max-step-s",
        type=float,
        default=60.0,
        help="an optimizer slower than this per step (after its first) is timed for 1 step only",
    )
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        print("lowmemopt bench needs transformers (its LLaMA model): pip install 'lowmemopt[bench]'", file=sys.stderr)
        return 1
    _quiet_import_noise()
    import torch

    from . import benchmark

    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    names = None if args.optimizers is None else [n.strip() for n in args.optimizers.split(",") if n.strip()]
    known = {n for _, registry, _ in benchmark.SUITES.values() for n in registry}
    problems = [f"unknown suite {s!r} (step, factored)" for s in suites if s not in benchmark.SUITES]
    problems += [f"unknown optimizer {n!r}" for n in names or () if n not in known]
    steps = args.steps if args.steps is not None else (5 if args.full else benchmark.QUICK["steps"])
    warmup = args.warmup if args.warmup is not None else (2 if args.full else benchmark.QUICK["warmup"])
    if steps < 1 or warmup < 0:
        problems.append("--steps must be >= 1 and --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append("--device cuda: CUDA is not available")
    if problems or not suites:
        print(f"lowmemopt bench: {'; '.join(problems) or 'no suite given'}", file=sys.stderr)
        if names and any("optimizer" in p for p in problems):
            print(f"known optimizers: {', '.join(sorted(known))}", file=sys.stderr)
        return 1
    benchmark.quick(
        suites,
        preset="150m" if args.full else benchmark.QUICK["preset"],
        steps=steps,
        warmup=warmup,
        device=args.device,
        names=names,
        max_step_s=args.max_step_s,
    )
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# estimate

_ESTIMATE_DEFAULT_OPTIMIZERS = "adamw,lion,came,adafactor"


def _add_estimate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="memory of weights, gradients and optimizer state for a model config and optimizer choice",
        description="Bytes of weights, gradients and optimizer state of training the model a transformers "
        "config.json describes, for each optimizer x state format (and GaLore), and whether the total fits. The "
        "model is built on the meta device (nothing is allocated); the state figure is exact: each optimizer lays "
        "out its own state. With --batch and --seq, one whole training step (forward, loss, backward, the update) "
        "is traced on fake tensors instead, and its peak is reported with what is live at that moment: weights, "
        "gradients, optimizer state, activations, temporaries and the update's workspace. When an optimizer does "
        "not fit --gpu-memory less --margin as asked, the cheapest changes that do fit are listed (state bits, "
        "GaLore rank, paged state and per-layer updates; traced: checkpointing, per-layer updates, state bits and "
        "the batch).",
    )
    p.add_argument(
        "config",
        help="a transformers config.json on disk (needs the 'model_type' key; nothing is "
        "downloaded), or a preset: llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, llama-3-70b (short: "
        "llama-7b, llama-8b, llama-13b; their Hub ids, e.g. meta-llama/Llama-2-7b-hf, work too)",
    )
    p.add_argument(
        "--optimizer",
        default=_ESTIMATE_DEFAULT_OPTIMIZERS,
        help=f"optimizer name(s), comma-separated (default {_ESTIMATE_DEFAULT_OPTIMIZERS})",
    )
    p.add_argument(
        "--state-bits",
        type=int,
        choices=[32, 16, 8, 4],
        action="append",
        help="state format(s); repeat for several (default: the name's own, e.g. 8 for adamw8bit, "
        "else 32, 16, 8 and 4; a traced step: the name's own only)",
    )
    p.add_argument("--galore-rank", type=int, metavar="R", help="also estimate GaLore with rank R")
    p.add_argument(
        "--galore-target",
        default="all-linear",
        metavar="MODULES",
        help="GaLore's target modules: 'all-linear' (default), a regex, or comma-separated names (e.g. attn,mlp)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of weights and gradients (default: the config's torch_dtype, else fp32)",
    )
    p.add_argument(
        "--bf16-update",
        choices=["nearest", "stochastic", "kahan"],
        help="how bf16 / fp16 weights are updated (kahan: +2 bytes per bf16 / fp16 parameter of state)",
    )
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="memory to fit in: 24GiB, '24 GiB', 24 (a number alone is GiB) or 80GB (10^9 bytes) "
        "(default: the CUDA device's, if there is one)",
    )
    p.add_argument(
        "--opt-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an optimizer keyword, e.g. beta1=0.9 or momentum=0.9 (repeatable)",
    )
    p.add_argument("--batch", type=int, metavar="B", help="trace one training step of B sequences (with --seq)")
    p.add_argument("--seq", type=int, metavar="S", help="tokens per sequence of the traced step (with --batch)")
    p.add_argument("--checkpointing", action="store_true", help="traced step: activation checkpointing on")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="traced step: per-layer updates inside backward (lowmemopt.step_in_backward)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="trace the step (the default when --batch and --seq are given; needs them)",
    )
    p.add_argument(
        "--margin",
        default="1GiB",
        metavar="SIZE",
        help="memory kept free of what is counted: the CUDA context and the allocator's slack "
        "(default 1GiB; a number alone is GiB)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (exact bytes) instead of a table")
    p.set_defaults(func=_estimate)


def _estimate(args: argparse.Namespace) -> int:
    from .model_presets import hub_ids, missing_config_message, preset
    from .registry import unknown_names

    # what can be checked without torch first: a typo costs a fraction of a second, not the imports' seconds
    names = [n.strip() for n in args.optimizer.split(",") if n.strip()]
    found = None if os.path.exists(args.config) else preset(args.config)
    problem = "--optimizer: give at least one optimizer name" if not names else unknown_names(names)
    if problem is None and found is None and not os.path.exists(args.config):
        problem = missing_config_message(args.config)
    if problem is None and args.galore_rank is not None and args.galore_rank < 1:
        problem = f"--galore-rank must be >= 1, got {args.galore_rank}"
    traced = args.measure or args.batch is not None or args.seq is not None
    if problem is None and traced:
        problem = _step_problem(args)
    if problem is None and importlib.util.find_spec("transformers") is None:
        problem = "it builds the model with transformers: pip install 'lowmemopt[hf]' (or pip install transformers)"
    if problem is not None:
        print(f"lowmemopt estimate: {problem}", file=sys.stderr)
        return 1
    source = f"preset {found[0]} (the published config of {hub_ids(found[0])[0]})" if found else args.config
    _quiet_import_noise()
    from .estimate import (
        DTYPES,
        cheapest_fits,
        config_dtype,
        default_state_bits,
        estimate,
        format_bytes,
        model_from_config,
        parse_bytes,
    )

    try:
        budget = _gpu_memory(args.gpu_memory, parse_bytes) if args.gpu_memory else _cuda_memory()
        margin = _gpu_memory(args.margin, parse_bytes)
        opt_kwargs = dict(_key_value(kv) for kv in args.opt_arg)
        if args.bf16_update:
            opt_kwargs["bf16_update"] = args.bf16_update
        config = found[1] if found else args.config
        dtype, dtype_note = args.dtype, ""
        if dtype is None:
            dtype = config_dtype(config)
            dtype_note = " (the config's torch_dtype)" if dtype else " (the config names no torch_dtype; see --dtype)"
            dtype = dtype or "fp32"
        model = model_from_config(config, DTYPES[dtype])
        ranks = [None] if args.galore_rank is None else [None, args.galore_rank]
        target = (
            args.galore_target
            if args.galore_target == "all-linear" or "," not in args.galore_target
            else [t.strip() for t in args.galore_target.split(",") if t.strip()]
        )
        if traced:
            from .traced_report import print_traced_steps

            return print_traced_steps(
                args,
                names,
                config,
                source,
                model,
                DTYPES[dtype],
                dtype + dtype_note,
                target,
                budget,
                margin,
                opt_kwargs,
            )
        rows_of = {
            name: [
                estimate(model, name, bits, galore_rank=rank, galore_target_modules=target, **opt_kwargs)
                for bits in _bits_for(name, args.state_bits, default_state_bits)
                for rank in ranks
            ]
            for name in names
        }
        rows = [r for name in names for r in rows_of[name]]
        fits_of = {}  # name -> the cheapest combinations that fit, for a name none of whose rows fits
        if budget is not None:
            for name, its_rows in rows_of.items():
                if all(r.total > budget - margin for r in its_rows):
                    asked = [args.galore_rank] if args.galore_rank is not None else None
                    fits_of[name] = cheapest_fits(
                        model,
                        name,
                        budget - margin,
                        state_bits=[32, 16, 8, 4]
                        if max(r.state_bits for r in its_rows) == 32
                        else sorted({r.state_bits for r in its_rows}),
                        ranks=asked,
                        galore_target_modules=target,
                        **opt_kwargs,
                    )
    except (ValueError, TypeError, OSError, NotImplementedError) as e:
        print(f"lowmemopt estimate: {e}", file=sys.stderr)
        return 1

    if args.json:
        out = [
            dict(
                r._asdict(),
                total=r.total,
                fits=None if budget is None else r.total <= budget - margin,
                dtype=dtype,
                gpu_memory=budget,
                margin=margin,
                cheapest_fits=[dict(f._asdict(), total=f.total) for f in fits_of.get(name, [])],
            )
            for name in names
            for r in rows_of[name]
        ]
        print(json.dumps(out, indent=2))
        return 0
    n = rows[0].params
    print(
        f"{type(model).__name__} from {source}: {n / 1e9:.3f}B trainable parameters, {dtype}{dtype_note} "
        "weights and gradients"
    )
    fits_head = f" fits in {format_bytes(budget)} less {format_bytes(margin)} |" if budget is not None else ""
    print(f"| optimizer | state | GaLore | weights | grads | optimizer state | total |{fits_head}")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |" + (" --- |" if budget is not None else ""))
    for r in rows:
        fits = (" yes |" if r.total <= budget - margin else " no |") if budget is not None else ""
        print(
            f"| {r.optimizer} | {r.state_bits}-bit | {r.galore_rank or '—'} | {format_bytes(r.weights)} | "
            f"{format_bytes(r.grads)} | {format_bytes(r.state)} | {format_bytes(r.total)} |{fits}"
        )
    print(
        "Not included: activations and temporaries (give --batch and --seq to trace a whole step), the CUDA "
        f"context and allocator caching (--margin {format_bytes(margin)} is kept free for them). 1 GiB = 2^30 bytes."
    )
    for name, fits in fits_of.items():
        optimizer = rows_of[name][0].optimizer
        if not fits:
            print(
                f"\n{optimizer} does not fit in {format_bytes(budget)} with any combination of state bits, GaLore "
                f"rank, paged state and per-layer updates (the weights alone: {format_bytes(rows[0].weights)})."
            )
            continue
        print(
            f"\n{optimizer} does not fit in {format_bytes(budget)} less a {format_bytes(margin)} margin as asked; "
            "the cheapest combinations that do (fewest changes first):"
        )
        print("| state | GaLore | paged | per-layer | weights | grads | optimizer state | total |")
        print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
        for r in fits:
            print(
                f"| {r.state_bits}-bit | {r.galore_rank or '—'} | {'yes' if r.paged else 'no'} | "
                f"{'yes' if r.per_layer else 'no'} | {format_bytes(r.weights)} | {format_bytes(r.grads)} | "
                f"{format_bytes(r.state)} | {format_bytes(r.total)} |"
            )
    if any(fits_of.values()):
        from .traced_report import HOW_TO

        print(
            "state: state_bits=N; GaLore rank R: lowmemopt.galore_param_groups(model, rank=R) as the params; paged: "
            "paged=True (state in host RAM except what the device has room for; page_budget_bytes=0 guarantees the "
            "device holds only 3 buckets of state at a time); per-layer: "
            "lowmemopt.step_in_backward(model, opt) (each gradient applied and freed inside backward(); no "
            f"global-norm clipping). {HOW_TO}"
        )
    return 0


def _step_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the traced step's arguments, if anything (checked before the slow imports)."""
    if args.batch is None or args.seq is None:
        return "tracing a step needs both --batch B and --seq S (e.g. --batch 16 --seq 256)"
    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    return None


#: a size above this, given as a number without a unit (GiB), is surely a count of bytes typed without its "B"
_LARGEST_GIB = 2**20


def _gpu_memory(text: str, parse_bytes: Callable[..., int]) -> int:
    """``--gpu-memory``: a size with a unit, or a number of GiB."""
    size = parse_bytes(text, "GiB")
    if size > _LARGEST_GIB * 2**30:
        raise ValueError(
            f"--gpu-memory {text}: a number without a unit is GiB, and that is more than 1 PiB; "
            f"write {text.strip()}B for bytes or add a unit (24GiB, '24 GB')"
        )
    return size


def _bits_for(name: str, asked: list[int] | None, default_state_bits: Callable[[str], int]) -> list[int]:
    """--state-bits if given; else the name's own bits ("adamw8bit": 8), or all four for a plain name."""
    if asked:
        return list(dict.fromkeys(asked))
    bits = default_state_bits(name)
    return [32, 16, 8, 4] if bits == 32 else [bits]


def _cuda_memory() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--opt-arg expects KEY=VALUE, got {text!r}")
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip()  # a bare string


# ---------------------------------------------------------------------------------------------------------------------
# tune


def _add_tune(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="measure the fused kernels' fastest launch shape on this GPU and keep it (lowmemopt.kernels.tuning)",
        description="Times 8-bit AdamW (bf16 parameters) on this GPU at every candidate tile shape (elements and warps "
        "per program) and 8-bit decode (code-book gather or arithmetic), prints the table, and keeps the fastest in "
        "the tuning cache ($LOWMEMOPT_CACHE_DIR/tuning.json, default ~/.cache/lowmemopt), which the kernels then use "
        "on this GPU model with this Triton version. Speed only: results are the same at every shape. About a minute "
        "on an H100. LOWMEMOPT_TUNING=0 ignores the cache.",
    )
    p.add_argument("--device", default="cuda", help="the CUDA device to measure (default: the current one)")
    p.add_argument("--numel", type=int, help="parameters in the measurement (default 2^27, about 0.8 GB in all)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median; default 20)")
    p.add_argument("--no-save", action="store_true", help="measure and print only; keep the cache as it is")
    p.add_argument("--json", metavar="PATH", help="also write every measurement here")
    p.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        print(f"lowmemopt tune: --device {args.device!r}: {exc}", file=sys.stderr)
        return 2
    if device.type != "cuda" or not torch.cuda.is_available():
        print(
            f"lowmemopt tune: needs a CUDA device (got {args.device}; CUDA available: "
            f"{torch.cuda.is_available()}). There is nothing to tune on the CPU.",
            file=sys.stderr,
        )
        return 2
    from .kernels import runtime, tuning

    if not runtime.HAS_TRITON or runtime.INTERPRET:
        print(
            "lowmemopt tune: needs Triton's compiled kernels (Triton installed, TRITON_INTERPRET unset)",
            file=sys.stderr,
        )
        return 2
    numel = args.numel if args.numel is not None else tuning.DEFAULT_NUMEL
    if numel < 4096 or args.steps < 1:
        print("lowmemopt tune: --numel must be >= 4096 and --steps >= 1", file=sys.stderr)
        return 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    print(f"{tuning.device_key(index)}: 8-bit AdamW, {numel / 1e6:.0f}M bf16 parameters, median of {args.steps} steps")
    print("| elements / program | warps | decode | step (ms) | GB/s |")
    print("| ---: | ---: | --- | ---: | ---: |")

    def row(r: dict) -> None:
        if "error" in r:
            print(f"| {r['tile']} | {r['num_warps']} | {r['decode']} | — | failed: {r['error'][:80]} |", flush=True)
        else:
            print(
                f"| {r['tile']} | {r['num_warps']} | {r['decode']} | {1e3 * r['seconds']:.3f} | "
                f"{r['bytes_per_s'] / 1e9:.0f} |",
                flush=True,
            )

    try:
        entry, records = tuning.tune(
            torch.device("cuda", index), numel, args.steps, write=not args.no_save, progress=row
        )
    except ValueError as exc:
        print(f"lowmemopt tune: {exc}", file=sys.stderr)
        return 1
    default = next(
        (
            r
            for r in records
            if "seconds" in r and (r["tile"], r["num_warps"], r["decode"]) == (runtime.TILE, runtime.NUM_WARPS, "table")
        ),
        None,
    )
    gain = f" ({default['seconds'] / tuning.best(records)['seconds']:.2f}x the default's speed)" if default else ""
    print(f"\nfastest: {entry['tile']} elements x {entry['num_warps']} warps, {entry['decode']} decode{gain}")
    print("not saved (--no-save)" if args.no_save else f"kept in {tuning.cache_path()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": tuning.device_key(index), "best": entry}, fh, indent=1)
    return 0


_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_demo, _add_estimate, _add_bench, _add_inspect, _add_tune]


if __name__ == "__main__":
    sys.exit(main())
