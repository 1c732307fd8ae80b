"""The ``lowmemopt`` command.

    lowmemopt inspect opt.safetensors [--params]     metadata and per-format summary of a state file

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and sets ``func`` (called with
the parsed arguments, returns the exit status); add it to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
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
            fmt = info["format"] if info["format"] != "q8" else f"q8 (block {info['block_size']})"
            row = rows.setdefault(fmt, [0, 0, 0, 0])
            keys = [f"{name}/{slot}"] if info["format"] != "q8" else [f"{name}/{slot}.codes", f"{name}/{slot}.absmax"]
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
    if info["format"] != "q8":
        return info["format"]
    blocks = num_blocks(_numel(info["shape"]), info["block_size"])
    return f"q8[{info['map']}, block {info['block_size']}, {blocks} blocks]"


def _short(value: Any) -> str:
    if isinstance(value, dict) and "__repr__" in value:
        return value["__repr__"]
    return repr(value) if isinstance(value, str) else str(value)


_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_inspect]


if __name__ == "__main__":
    sys.exit(main())
