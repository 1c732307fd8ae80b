"""``lowmemopt inspect``: describe a state file (a ``save_state`` file from its header, or a ``torch.save`` state
dict): its metadata, a summary per state format, and with ``--params`` every parameter.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

__all__ = ["inspect"]


def inspect(path: str, list_params: bool = False) -> int:
    """Print the description of the state file at ``path``; returns the exit status (1 for a file that is not one)."""
    from .checkpoint import CheckpointError, read_metadata
    from .checkpoint.sniff import TRUNCATED_ADVICE, file_kind

    try:
        kind, what = file_kind(path)
        if kind in ("torch", "torch-legacy", "pickle"):
            text = _describe_torch_file(path, list_params)
        elif kind == "torch-truncated":
            raise ValueError(f"{path}: {what}; {TRUNCATED_ADVICE}")
        elif kind not in ("safetensors", "unknown"):
            cure = "a model's config.json is what `lowmemopt estimate` reads" if kind == "json" else _EXPECTED
            raise ValueError(f"{path}: {what}, not an optimizer state file; {cure}")
        else:
            meta = read_metadata(path)
            try:
                text = _describe(path, meta, list_params)
            except (KeyError, TypeError, AttributeError, IndexError) as e:  # metadata this version does not know
                raise ValueError(f"{path}: metadata this lowmemopt cannot describe ({type(e).__name__}: {e})")
    except (CheckpointError, OSError, ValueError) as e:
        print(f"lowmemopt inspect: {e}", file=sys.stderr)
        return 1
    return _print(text)


def _print(text: str) -> int:
    """Print ``text``; a reader that stops early (``| head``) ends the output quietly, with status 0."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's last flush at exit goes nowhere
    return 0


_EXPECTED = (
    "lowmemopt inspect reads a .safetensors file written by lowmemopt.save_state, or a torch.save file of "
    "optimizer.state_dict()"
)


def _describe_torch_file(path: str, list_params: bool) -> str:
    """A summary of each optimizer ``state_dict()`` in a ``torch.save`` file; ValueError otherwise."""
    import pickle
    import re
    import zipfile

    import torch

    by_name = not os.fspath(path).endswith(".safetensors")  # torch.load reads those names as safetensors: pass the file
    try:
        with open(path, "rb") as fh:
            obj = torch.load(
                path if by_name else fh,
                map_location="cpu",
                weights_only=True,
                mmap=by_name and zipfile.is_zipfile(path),
            )
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines() if line.strip()]
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else repr(e))
        damaged = "" if isinstance(e, pickle.UnpicklingError) else ", truncated or corrupt?"
        raise ValueError(
            f"{path}: a torch.save file that torch.load(weights_only=True) cannot read "
            f"({type(e).__name__}: {reason}{damaged}); {_EXPECTED}"
        ) from None
    found = (
        [("", obj)]
        if _is_state_dict(obj)
        else [(k, v) for k, v in obj.items() if _is_state_dict(v)]
        if isinstance(obj, dict)
        else []
    )
    if not found:
        raise ValueError(f"{path}: a torch.save file holding {_what(obj)}, not an optimizer state_dict(); {_EXPECTED}")
    return "\n\n".join(_describe_state_dict(path, key, sd, list_params) for key, sd in found)


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list)


def _what(obj: Any) -> str:
    import torch

    if isinstance(obj, dict):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return f"{len(obj)} tensors (a model's state_dict()?)"
        keys = list(obj)
        return f"a dict with keys {keys[:8]}" + (" ..." if len(keys) > 8 else "")
    return f"a {type(obj).__name__}"


def _describe_state_dict(path: str, key: str, sd: dict[str, Any], list_params: bool) -> str:
    version = sd.get("lowmemopt_format")
    state, groups = sd["state"], sd["param_groups"]
    where = f" (key {key!r})" if key else ""
    kind = (
        f"lowmemopt state, state_dict format version {version}"
        if version is not None
        else "bitsandbytes state"
        if any("state1" in s or "__bnb_optimizer_quant_state__" in s for s in state.values())
        else "no lowmemopt format version: torch.optim or another library's state"
    )
    lines = [f"{path}{where}: optimizer state_dict() saved with torch.save ({kind})", "param groups:"]
    group_of = {}
    for g, group in enumerate(groups):
        group_of.update({i: g for i in group.get("params", [])})
        hyper = "  ".join(f"{k}={_short(v)}" for k, v in group.items() if k != "params")
        lines.append(f"  {g}: {len(group.get('params', []))} params  {hyper}")
    steps = sorted({int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s})
    step_text = "no steps" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    n_params = sum(len(group.get("params", [])) for group in groups)
    lines.append(f"params: {n_params} ({len(state)} with state), {step_text}")
    rows: dict[str, list[int]] = {}
    names_by_format: dict[str, set[Any]] = {}
    listing = []
    for pid, st in state.items():
        if not isinstance(st, dict):
            continue
        block = groups[group_of[pid]].get("block_size", 256) if pid in group_of else 256
        slots = []
        for fmt, slot, elements, nbytes in _state_slots(st, block):
            row = rows.setdefault(fmt, [0, 0, 0, 0])
            row[0] += 1
            row[2] += elements
            row[3] += nbytes
            names_by_format.setdefault(fmt, set()).add(pid)
            slots.append(f"{slot}={fmt} ({elements:,})")
        step = st.get("step")
        listing.append(
            f"  {pid}  group {group_of.get(pid, '?')}  step={'-' if step is None else int(step)}  "
            f"{', '.join(slots) or 'no state'}"
        )
    for fmt, names in names_by_format.items():
        rows[fmt][1] = len(names)
    lines += _table_lines(rows, len(state))
    total = sum(r[3] for r in rows.values())
    if not key:
        size = os.path.getsize(path)
        lines.append(f"file: {size:,} bytes" + (f" ({size / total:.3f}x the state bytes)" if total else ""))
    if list_params:
        lines += ["params (by state_dict id; elements in parentheses):"] + listing
    return "\n".join(lines)


def _state_slots(st: dict[str, Any], block: int) -> list[tuple[str, str, int, int]]:
    """(format, slot, elements, bytes) of one parameter's state: lowmemopt, dense, bitsandbytes or GaLore slots."""
    import torch

    st = dict(st)
    st.update(st.pop("__bnb_optimizer_quant_state__", None) or {})
    tensors = {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"}
    out, used = [], set()
    for k, t in tensors.items():
        if k.endswith(".codes"):
            slot = k[: -len(".codes")]
            absmax = tensors.get(slot + ".absmax")
            nbytes = t.nbytes + (absmax.nbytes if absmax is not None else 0)
            out.append((f"q8 (block {block})", slot, t.numel(), nbytes))
            used.update((k, slot + ".absmax"))
        elif k.startswith("state") and k[5:].isdigit() and t.dtype == torch.uint8:  # bitsandbytes 8-bit
            extra = [tensors[x] for x in (f"absmax{k[5:]}", f"qmap{k[5:]}") if x in tensors]
            out.append(("bitsandbytes q8", k, t.numel(), t.nbytes + sum(x.nbytes for x in extra)))
            used.update((k, f"absmax{k[5:]}", f"qmap{k[5:]}"))
    for k, t in tensors.items():
        if k in used or k in ("unorm_vec", "gnorm_vec"):
            continue
        dtype = str(t.dtype)
        fmt = "GaLore projector" if k.startswith("galore.") else _DTYPE_NAMES.get(dtype, dtype.replace("torch.", ""))
        out.append((fmt, k, t.numel(), t.nbytes))
    return out


_DTYPE_NAMES = {"torch.float32": "fp32", "torch.float64": "fp64", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def _table_lines(rows: dict[str, list[int]], stateful: int) -> list[str]:
    lines = [f"{'format':<18}{'slots':>7}{'params':>8}{'elements':>16}{'bytes':>16}"]
    for fmt, (slots, nparams, elements, nbytes) in sorted(rows.items()):
        lines.append(f"{fmt:<18}{slots:>7}{nparams:>8}{elements:>16,}{nbytes:>16,}")
    lines.append(
        f"{'total':<18}{sum(r[0] for r in rows.values()):>7}{stateful:>8}"
        f"{sum(r[2] for r in rows.values()):>16,}{sum(r[3] for r in rows.values()):>16,}"
    )
    return lines


_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "U8": 1}


def _describe(path: str, meta: dict[str, Any], list_params: bool) -> str:
    size = os.path.getsize(path)
    params = meta["params"]
    keyed = "parameter names" if meta["keys"] == "names" else "group/index positions (saved without a model)"
    lines = [
        f"{path}: lowmemopt optimizer state file, file format version {meta['format_version']} "
        f"(written by lowmemopt {meta.get('lowmemopt_version', '?')})",
        f"optimizer: {meta['optimizer']}    keys: {keyed}",
    ]
    if meta.get("sharding"):  # a per-rank file of a sharded optimizer (docs/distributed.md)
        shard = meta["sharding"]
        lines.append(
            f"sharded: rank {shard['rank']} of world size {shard['world_size']} (shapes are this rank's shards)"
        )
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
    lines += _table_lines(rows, stateful)
    total = sum(r[3] for r in rows.values())
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
    from .quant.blockwise import num_blocks

    if info["format"] not in ("q8", "q4"):
        return info["format"]
    blocks = num_blocks(_numel(info["shape"]), info["block_size"])
    return f"{info['format']}[{info['map']}, block {info['block_size']}, {blocks} blocks]"


def _short(value: Any) -> str:
    if isinstance(value, dict) and "__repr__" in value:
        return value["__repr__"]
    return repr(value) if isinstance(value, str) else str(value)
