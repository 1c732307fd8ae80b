"""The ``lowmemopt`` command.

    lowmemopt demo [--steps N] [--optimizers a,b] [--data PATH] [--out DIR]   train a small LLaMA, compare optimizers
    lowmemopt estimate CONFIG.json|PRESET [--optimizer a,b] [--state-bits 8]   memory of weights, grads and state
    lowmemopt bench [--full]                                                  step time and state vs other libraries
    lowmemopt inspect opt.safetensors|opt.pt [--params]                       metadata and summary of a state file
    lowmemopt tune [--device cuda:0]                                          measure the kernels' launch shape here

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and sets ``func`` (called with
the parsed arguments, returns the exit status); add it to ``_SUBCOMMANDS``. Only ``func`` imports torch and lowmemopt's
modules, so parsing (``lowmemopt --help``, a usage error) takes a fraction of a second; ``func`` checks what it can
(names, paths) before those imports (``estimate``: :mod:`.estimate`), and first drops the known noise other libraries
log while they are imported (:data:`.noise.IMPORT_NOISE`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

from .estimate import add_estimate
from .noise import quiet_import_noise

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lowmemopt`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="lowmemopt", description="Memory-efficient PyTorch optimizers: tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


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
    quiet_import_noise()
    from ..inspection import inspect

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


def _others_running(samples: int = 5, gap: float = 0.01) -> float:
    """How many other threads are running or waiting for a core now: the median over ``samples`` reads of Linux's
    ``procs_running`` less this process's own one (elsewhere the 1-minute load average)."""
    try:
        counts = []
        for i in range(samples):
            with open("/proc/stat") as f:
                line = next(x for x in f if x.startswith("procs_running"))
            counts.append(int(line.split()[1]) - 1)
            if i + 1 < samples:
                time.sleep(gap)
        return float(sorted(counts)[len(counts) // 2])
    except (OSError, StopIteration, ValueError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _openmp_wait_policy() -> str | None:
    """Unless the user chose a policy, and before torch (and its OpenMP runtime, which the native kernels share) is
    loaded: ``OMP_WAIT_POLICY=PASSIVE`` where other work leaves fewer free cores than the threads torch will run, else
    libgomp's default. Idle OpenMP threads spin before they sleep: on an idle machine that saves a wake-up per parallel
    region (the 100-step demo: 23 s against 40 s passive), on a busy one each region then waits for its threads to be
    scheduled (220 s against 49 s). Returns the policy set (None: none; also once torch is imported)."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        return None
    cores = os.cpu_count() or 1
    try:
        threads = min(cores, max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0] or cores)))
    except ValueError:
        threads = cores
    if cores - _others_running() >= threads - 0.5:  # a free core for every thread: spinning pays
        return None
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"


def _demo(args: argparse.Namespace) -> int:
    missing = [pkg for mod, pkg in _DEMO_NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(
            f"lowmemopt demo needs {', '.join(missing)}: pip install 'lowmemopt[demo]' "
            f"(or pip install {' '.join(missing)})",
            file=sys.stderr,
        )
        return 1
    quiet_import_noise()
    _openmp_wait_policy()
    import torch

    from .. import demo

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
    quiet_import_noise()
    import torch

    from .. import benchmark

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
    from ..kernels import runtime, tuning

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


_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_demo, add_estimate, _add_bench, _add_inspect, _add_tune]


if __name__ == "__main__":
    sys.exit(main())
