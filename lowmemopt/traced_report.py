"""The table ``lowmemopt estimate --batch B --seq S`` prints: one traced training step per optimizer and state format
(:func:`lowmemopt.traced_step.trace_step`), its peak and breakdown, and the cheapest changes that fit."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

__all__ = ["HOW_TO", "print_traced_steps"]

#: where a pip user reads how to apply a suggestion (the docstrings ship with the package)
HOW_TO = (
    "Details: python -m pydoc lowmemopt.galore_param_groups; python -m pydoc lowmemopt.step_in_backward; "
    "python -m pydoc lowmemopt.AdamW (state_bits, paged)."
)


def print_traced_steps(
    args: argparse.Namespace,
    names: list[str],
    config: Any,
    source: str,
    model: Any,
    dtype: Any,
    dtype_text: str,
    target: Any,
    budget: int | None,
    margin: int,
    opt_kwargs: dict,
) -> int:
    """``lowmemopt estimate --batch B --seq S``: trace one training step per optimizer x state format (x GaLore),
    print the peaks and their breakdown, and for an optimizer none of whose rows fits, the cheapest changes that do
    (:func:`lowmemopt.traced_step.cheaper_steps`)."""
    from .estimate import default_state_bits, format_bytes
    from .registry import resolve_optimizer
    from .traced_step import cheaper_steps, trace_step

    common = dict(
        batch=args.batch, seq=args.seq, dtype=dtype, galore_target_modules=target, device="cuda", **opt_kwargs
    )
    rows_of: dict[str, list[Any]] = {}
    fits_of: dict[str, list[Any]] = {}
    for name in names:
        galore_name = resolve_optimizer(name).galore
        ranks = [args.galore_rank] if galore_name or args.galore_rank is None else [None, args.galore_rank]
        if galore_name and args.galore_rank is None:
            raise_text = f"{name} runs in GaLore groups: give --galore-rank R"
            print(f"lowmemopt estimate: {raise_text}", file=sys.stderr)
            return 1
        bits = list(dict.fromkeys(args.state_bits)) if args.state_bits else [default_state_bits(name)]
        try:
            rows_of[name] = [
                trace_step(
                    config, name, b, galore_rank=r, checkpointing=args.checkpointing, per_layer=args.per_layer, **common
                )
                for b in bits
                for r in ranks
            ]
            if budget is not None and all(r.peak > budget - margin for r in rows_of[name]):
                first = rows_of[name][0]
                fits_of[name] = cheaper_steps(
                    config,
                    name,
                    first.state_bits,
                    budget=budget - margin,
                    checkpointing=args.checkpointing,
                    per_layer=args.per_layer,
                    galore_rank=first.galore_rank,
                    **common,
                )
        except (ValueError, TypeError, NotImplementedError) as e:
            print(f"lowmemopt estimate: {e}", file=sys.stderr)
            return 1
    parts = ("weights", "gradients", "optimizer state", "activations", "temporaries", "step workspace")
    if args.json:

        def row(r: Any, fits: list[Any] | None) -> dict[str, Any]:
            out = dict(
                r._asdict(),
                total=r.peak,
                dtype=dtype_text.split()[0],
                gpu_memory=budget,
                margin=margin,
                fits=None if budget is None else r.peak <= budget - margin,
            )
            if fits is not None:
                out["cheapest_fits"] = [row(f, None) for f in fits]
            return out

        print(json.dumps([row(r, fits_of.get(name, [])) for name in names for r in rows_of[name]], indent=2))
        return 0
    first = rows_of[names[0]][0]
    how = (
        ", ".join(
            x
            for x in ("checkpointing" if args.checkpointing else "", "per-layer updates" if args.per_layer else "")
            if x
        )
        or "no checkpointing"
    )
    seconds = sum(r.seconds for rs in rows_of.values() for r in rs)
    print(
        f"{type(model).__name__} from {source}: {first.params / 1e9:.3f}B trainable parameters, {dtype_text} "
        f"weights and gradients"
    )
    print(
        f"One training step, batch {args.batch} x {args.seq} tokens, {how}; traced on fake tensors "
        f"({seconds:.1f} s). The peak, and what is live at that moment:"
    )
    if getattr(args, "proj_bits", None) is not None:
        print(f"GaLore's bases stored at {args.proj_bits} bits (--proj-bits)")
    fits_head = f" fits in {format_bytes(budget)} less {format_bytes(margin)} |" if budget is not None else ""
    print("| optimizer | state | GaLore | " + " | ".join(parts) + f" | peak |{fits_head}")
    print("| --- | --- | --- |" + " ---: |" * (len(parts) + 1) + (" --- |" if budget is not None else ""))
    for name in names:
        for r in rows_of[name]:
            print(_step_row(r, parts, budget, margin, format_bytes))
    print(
        "Counted as a CUDA device holds it (allocations in 512-byte blocks). Not counted: the CUDA context and the "
        f"allocator's free cached blocks (--margin {format_bytes(margin)} is kept for them). 1 GiB = 2^30 bytes."
    )
    for name, fits in fits_of.items():
        optimizer = rows_of[name][0].optimizer
        if not fits:
            print(
                f"\n{optimizer} does not fit in {format_bytes(budget)} less {format_bytes(margin)} with "
                "checkpointing, per-layer updates, fewer state bits or a smaller batch; try --galore-rank, "
                "a shorter --seq, or paged state (without --batch, the layout estimate lists those)."
            )
            continue
        print(
            f"\n{optimizer} does not fit in {format_bytes(budget)} less {format_bytes(margin)} as asked; changes "
            "that do (fewest first):"
        )
        print("| state | batch | checkpointing | per-layer | peak | spare |")
        print("| --- | ---: | --- | --- | ---: | ---: |")
        for f in fits:
            print(
                f"| {f.state_bits}-bit | {f.batch} | {'yes' if f.checkpointing else 'no'} | "
                f"{'yes' if f.per_layer else 'no'} | {format_bytes(f.peak)} | "
                f"{format_bytes(budget - margin - f.peak)} |"
            )
        print(
            "checkpointing: model.gradient_checkpointing_enable(); per-layer: lowmemopt.step_in_backward(model, "
            f"opt); state: state_bits=N. {HOW_TO}"
        )
    return 0


def _step_row(r: Any, parts: tuple[str, ...], budget: int | None, margin: int, format_bytes: Callable) -> str:
    fits = ("yes |" if r.peak <= budget - margin else "no |") if budget is not None else ""
    cells = " | ".join(format_bytes(r.at_peak[p]) for p in parts)
    return f"| {r.optimizer} | {r.state_bits}-bit | {r.galore_rank or '—'} | {cells} | {format_bytes(r.peak)} | {fits}"
