"""The ``lowmemopt`` command.

    lowmemopt demo [--steps N] [--optimizers a,b] [--data PATH] [--out DIR]   train a small LLaMA, compare optimizers
    lowmemopt estimate CONFIG.json [--optimizer a,b] [--state-bits 8] ...     memory of weights, grads and state
    lowmemopt bench [--full]                                                  step time and state vs other libraries
    lowmemopt inspect opt.safetensors [--params]                              metadata and summary of a state file

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and sets ``func`` (called with
the parsed arguments, returns the exit status); add it to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Any, Callable, Sequence

from .quant.blockwise import num_blocks

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
        description="Print the metadata of a lowmemopt state file (lowmemopt.save_state) and a summary per format: "
        "slots, params, elements and bytes. Reads the header only.",
    )
    p.add_argument("path", help="a .safetensors file written by lowmemopt.save_state")
    p.add_argument("--params", action="store_true", help="also list every parameter: shape, step, slot formats")
    p.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError, read_metadata

    try:
        meta = read_metadata(args.path)
    except (CheckpointError, OSError) as e:
        print(f"lowmemopt inspect: {e}", file=sys.stderr)
        return 1
    print(_describe(args.path, meta, args.params))
    return 0


_BYTES = {"F32": 4, "BF16": 2, "U8": 1}


def _describe(path: str, meta: dict[str, Any], list_params: bool) -> str:
    size = os.path.getsize(path)
    params = meta["params"]
    keyed = "parameter names" if meta["keys"] == "names" else "group/index positions (saved without a model)"
    lines = [
        f"{path}: lowmemopt optimizer state, format_version {meta['format_version']} "
        f"(written by lowmemopt {meta.get('lowmemopt_version', '?')})",
        f"optimizer: {meta['optimizer']}    keys: {keyed}",
    ]
    if meta.get("sharding"):  # a per-rank file of a sharded optimizer (docs/distributed.md)
        shard = meta["sharding"]
        lines.append(f"sharded: rank {shard['rank']} of world size {shard['world_size']} (shapes are this rank's shards)")
    lines.append("param groups:")
    for g, group in enumerate(meta["param_groups"]):
        hyper = "  ".join(f"{k}={_short(v)}" for k, v in group.items() if k != "params")
        lines.append(f"  {g}: {len(group['params'])} params  {hyper}")
    steps = sorted({e["step"] for e in params.values() if e["step"] is not None})
    stateful = sum(1 for e in params.values() if e["step"] is not None)
    step_text = "no steps" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    lines.append(f"params: {len(params)} ({stateful} with state), {step_text}")

    rows: dict[str, list[int]] = {}  # format -> [slots, params, elements, bytes]
    names_by_format: dict[str, set[str]] = {}
    for name, entry in params.items():
        for slot, info in entry["slots"].items():
            quantized = info["format"] in ("q8", "q4")
            fmt = f"{info['format']} (block {info['block_size']})" if quantized else info["format"]
            row = rows.setdefault(fmt, [0, 0, 0, 0])
            codes = ".codes" if info["format"] == "q8" else ".nibbles"
            keys = [f"{name}/{slot}{codes}", f"{name}/{slot}.absmax"] if quantized else [f"{name}/{slot}"]
            row[0] += 1
            row[2] += _numel(info["shape"])
            row[3] += sum(_BYTES[meta["tensors"][k][0]] * _numel(meta["tensors"][k][1]) for k in keys)
            names_by_format.setdefault(fmt, set()).add(name)
    for fmt, names in names_by_format.items():
        rows[fmt][1] = len(names)
    lines.append(f"{'format':<16}{'slots':>7}{'params':>8}{'elements':>16}{'bytes':>16}")
    for fmt, (slots, nparams, elements, nbytes) in sorted(rows.items()):
        lines.append(f"{fmt:<16}{slots:>7}{nparams:>8}{elements:>16,}{nbytes:>16,}")
    total = sum(r[3] for r in rows.values())
    lines.append(f"{'total':<16}{sum(r[0] for r in rows.values()):>7}{stateful:>8}"
                 f"{sum(r[2] for r in rows.values()):>16,}{total:>16,}")
    ratio = f", {size / total:.3f}x the state bytes" if total else ""
    lines.append(f"file: {size:,} bytes (header {size - total:,}{ratio})")
    if list_params:
        lines.append("params:")
        for name, entry in params.items():
            slots = ", ".join(f"{s}={_slot_text(i)}" for s, i in entry["slots"].items()) or "no state"
            lines.append(f"  {name}  {tuple(entry['shape'])} {entry.get('dtype', '')}  step={entry['step']}  {slots}")
    return "\n".join(lines)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _slot_text(info: dict[str, Any]) -> str:
    if info["format"] not in ("q8", "q4"):
        return info["format"]
    blocks = num_blocks(_numel(info["shape"]), info["block_size"])
    return f"{info['format']}[{info['map']}, block {info['block_size']}, {blocks} blocks]"


def _short(value: Any) -> str:
    if isinstance(value, dict) and "__repr__" in value:
        return value["__repr__"]
    return repr(value) if isinstance(value, str) else str(value)


# ---------------------------------------------------------------------------------------------------------------------
# demo

_DEMO_NEEDS = {"transformers": "transformers", "matplotlib": "matplotlib", "tqdm": "tqdm"}


def _add_demo(subparsers: Any) -> None:
    from .demo import DEMO_CHOICES

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
    p.add_argument("--optimizers", default=",".join(DEMO_CHOICES),
                   help=f"comma-separated (default {','.join(DEMO_CHOICES)}); any lowmemopt optimizer name works "
                   "(lr 1e-3 unless --lr)")
    p.add_argument("--data", metavar="PATH", help="train on this text file instead of the standard library's source")
    p.add_argument("--out", metavar="DIR", default="lowmemopt-demo",
                   help="where to write demo.png and demo.json (default ./lowmemopt-demo)")
    p.add_argument("--lr", type=float, help="learning rate for every optimizer (default: each one's preset)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [pkg for mod, pkg in _DEMO_NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"lowmemopt demo needs {', '.join(missing)}: pip install 'lowmemopt[demo]' "
              f"(or pip install {' '.join(missing)})", file=sys.stderr)
        return 1
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
    except (ValueError, OSError) as e:
        print(f"lowmemopt demo: {e}", file=sys.stderr)
        return 1

    source = args.data or "the Python standard library's source"
    n_params = sum(p.numel() for p in demo._llama(args.seed).parameters())
    print(f"LLaMA-style byte-level LM, {n_params / 1e6:.2f}M parameters, on {data.numel():,} bytes of {source}; "
          f"{args.steps} steps of {args.batch} x {args.seq} bytes, {device}\n", flush=True)
    results = demo.compare(choices, args.steps, data=data, seed=args.seed, batch=args.batch, seq=args.seq,
                           device=device)
    print()
    print(demo.table(results))
    for r in results:
        if "skipped" in r:
            print(f"note: {r['label']} skipped: {r['skipped']}")
    print(f"\npeak memory: {_PEAK_NOTE[device.split(':')[0]]}")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    png = demo.plot(results, os.path.join(out, "demo.png"),
                    title=f"{n_params / 1e6:.1f}M-parameter LLaMA, {args.steps} steps on {os.path.basename(source)}")
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump(dict(steps=args.steps, batch=args.batch, seq=args.seq, device=device, data=source,
                       params=n_params, results=results), f, indent=1)
    print(f"wrote {png} and {os.path.join(out, 'demo.json')}")
    return 0


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
        "(median, as a ratio to torch's fused AdamW measured in the same run) and state bytes per parameter on a "
        "randomly initialised LLaMA (~11M parameters; --full: ~148M), with fixed gradients. Suites: 'step' (AdamW: "
        "lowmemopt 32/16/8-bit, torch fused/foreach, bitsandbytes, torchao) and 'factored' (Adafactor, CAME: "
        "lowmemopt, transformers, torch, came-pytorch, pytorch-optimizer). Libraries that are not installed show as "
        "failed rows. Needs transformers.",
    )
    p.add_argument("--suite", default="step,factored", help="comma-separated: step, factored (default both)")
    p.add_argument("--optimizers", help="comma-separated subset of the suites' row names (default all)")
    p.add_argument("--full", action="store_true", help="the ~148M-parameter model, 2 warm-up + 5 timed steps")
    p.add_argument("--steps", type=int, help="timed steps per optimizer (default 3; --full: 5)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-step-s", type=float, default=60.0,
                   help="an optimizer slower than this per step (after its first) is timed for 1 step only")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("lowmemopt bench needs transformers (its LLaMA model): pip install 'lowmemopt[bench]'", file=sys.stderr)
        return 1
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
    benchmark.quick(suites, preset="150m" if args.full else benchmark.QUICK["preset"], steps=steps, warmup=warmup,
                    device=args.device, names=names, max_step_s=args.max_step_s)
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
        "out its own state. Activations and framework overhead are not included.",
    )
    p.add_argument("config", help="a transformers config.json (needs the 'model_type' key)")
    p.add_argument("--optimizer", default=_ESTIMATE_DEFAULT_OPTIMIZERS,
                   help=f"optimizer name(s), comma-separated (default {_ESTIMATE_DEFAULT_OPTIMIZERS})")
    p.add_argument("--state-bits", type=int, choices=[32, 16, 8, 4], action="append",
                   help="state format(s); repeat for several (default: the name's own, e.g. 8 for adamw8bit, "
                   "else 32, 16, 8 and 4)")
    p.add_argument("--galore-rank", type=int, metavar="R", help="also estimate GaLore with rank R")
    p.add_argument("--galore-target", default="all-linear", metavar="MODULES",
                   help="GaLore's target modules: 'all-linear' (default), a regex, or comma-separated names "
                   "(e.g. attn,mlp)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of weights and gradients (default fp32)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="memory to fit in, e.g. 24GiB or 80GB (default: the CUDA device's, if there is one)")
    p.add_argument("--opt-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an optimizer keyword, e.g. beta1=0.9 or momentum=0.9 (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON (exact bytes) instead of a table")
    p.set_defaults(func=_estimate)


def _estimate(args: argparse.Namespace) -> int:
    from .estimate import DTYPES, default_state_bits, estimate, format_bytes, model_from_config, parse_bytes

    try:
        budget = parse_bytes(args.gpu_memory) if args.gpu_memory else _cuda_memory()
        if args.galore_rank is not None and args.galore_rank < 1:
            raise ValueError(f"--galore-rank must be >= 1, got {args.galore_rank}")
        opt_kwargs = dict(_key_value(kv) for kv in args.opt_arg)
        names = [n.strip() for n in args.optimizer.split(",") if n.strip()]
        if not names:
            raise ValueError("--optimizer: give at least one optimizer name")
        model = model_from_config(args.config, DTYPES[args.dtype])
        ranks = [None] if args.galore_rank is None else [None, args.galore_rank]
        target = args.galore_target if args.galore_target == "all-linear" or "," not in args.galore_target \
            else [t.strip() for t in args.galore_target.split(",") if t.strip()]
        rows = [estimate(model, name, bits, galore_rank=rank, galore_target_modules=target, **opt_kwargs)
                for name in names for bits in _bits_for(name, args.state_bits, default_state_bits)
                for rank in ranks]
    except (ValueError, TypeError, OSError, NotImplementedError) as e:
        print(f"lowmemopt estimate: {e}", file=sys.stderr)
        return 1

    if args.json:
        out = [dict(r._asdict(), total=r.total, fits=None if budget is None else r.total <= budget,
                    dtype=args.dtype, gpu_memory=budget) for r in rows]
        print(json.dumps(out, indent=2))
        return 0
    n = rows[0].params
    print(f"{type(model).__name__} from {args.config}: {n / 1e9:.3f}B trainable parameters, {args.dtype} "
          "weights and gradients")
    fits_head = f" fits in {format_bytes(budget)} |" if budget is not None else ""
    print(f"| optimizer | state | GaLore | weights | grads | optimizer state | total |{fits_head}")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |" + (" --- |" if budget is not None else ""))
    for r in rows:
        fits = (" yes |" if r.total <= budget else " no |") if budget is not None else ""
        print(f"| {r.optimizer} | {r.state_bits}-bit | {r.galore_rank or '—'} | {format_bytes(r.weights)} | "
              f"{format_bytes(r.grads)} | {format_bytes(r.state)} | {format_bytes(r.total)} |{fits}")
    print("Not included: activations, temporaries, CUDA context and allocator caching.")
    return 0


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


_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_demo, _add_estimate, _add_bench, _add_inspect]


if __name__ == "__main__":
    sys.exit(main())
