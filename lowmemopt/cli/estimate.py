"""``lowmemopt estimate``: memory of a model's training for each optimizer choice (``lowmemopt.estimate``), or one
traced step's peak (``lowmemopt.traced_step``, reported by ``lowmemopt.traced_report``)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
from typing import Any, Callable

from .noise import quiet_import_noise

__all__ = ["add_estimate"]

_ESTIMATE_DEFAULT_OPTIMIZERS = "adamw,lion,came,adafactor"


def add_estimate(subparsers: Any) -> None:
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
        "--proj-bits",
        type=int,
        choices=[32, 16, 8, 4],
        help="with --galore-rank: GaLore's bases stored at 32 (default), 16, 8 or 4 bits (the group key proj_bits)",
    )
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
    from ..model_presets import hub_ids, missing_config_message, preset
    from ..registry import unknown_names

    # what can be checked without torch first: a typo costs a fraction of a second, not the imports' seconds
    names = [n.strip() for n in args.optimizer.split(",") if n.strip()]
    found = None if os.path.exists(args.config) else preset(args.config)
    problem = "--optimizer: give at least one optimizer name" if not names else unknown_names(names)
    if problem is None and found is None and not os.path.exists(args.config):
        problem = missing_config_message(args.config)
    if problem is None and args.galore_rank is not None and args.galore_rank < 1:
        problem = f"--galore-rank must be >= 1, got {args.galore_rank}"
    if problem is None and args.proj_bits is not None and args.galore_rank is None:
        problem = "--proj-bits sets how GaLore's bases are stored: give --galore-rank R too"
    traced = args.measure or args.batch is not None or args.seq is not None
    if problem is None and traced:
        problem = _step_problem(args)
    if problem is None and importlib.util.find_spec("transformers") is None:
        problem = "it builds the model with transformers: pip install 'lowmemopt[hf]' (or pip install transformers)"
    if problem is not None:
        print(f"lowmemopt estimate: {problem}", file=sys.stderr)
        return 1
    source = f"preset {found[0]} (the published config of {hub_ids(found[0])[0]})" if found else args.config
    quiet_import_noise()
    from ..estimate import (
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
        if args.proj_bits is not None:
            opt_kwargs["proj_bits"] = args.proj_bits
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
            from ..traced_report import print_traced_steps

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
    if args.proj_bits is not None:
        print(f"GaLore's bases stored at {args.proj_bits} bits (--proj-bits)")
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
        from ..traced_report import HOW_TO

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
