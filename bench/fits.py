"""Will it fit: the traced peak of one training step of LLaMA-7B (GaLore's setting) and LLaMA-3-8B, per optimizer.

    cd /tmp && python /path/to/lowmemopt/bench/fits.py                   # the tables (7B and 8B), a few minutes
    cd /tmp && python /path/to/lowmemopt/bench/fits.py --json fits.json  # also the exact bytes
    cd /tmp && python /path/to/lowmemopt/bench/fits.py --quick           # a smoke run on a 10M-parameter LLaMA
    python bench/fits.py --e2e-json e2e_core.json   # traced against bench/e2e.py's torch.cuda.max_memory_allocated

Each row is :func:`lowmemopt.traced_step.trace_step` (what ``lowmemopt estimate --batch B --seq S`` prints): the
model's real forward, loss and backward traced on fake tensors, the optimizer's state laid out by the optimizer's own
code, the update's workspace by construction, counted as a CUDA device holds it (512-byte blocks). Nothing is
allocated; each 7B row takes seconds on a laptop CPU.

LLaMA-7B as the GaLore paper trains it: hidden 4096, 32 layers, intermediate 11008, vocab 32000 (the ``llama-2-7b``
preset), bf16 weights, batch 16 x 256 tokens, activation checkpointing, per-layer updates; GaLore (and APOLLO) on
the attention and MLP weights (``target_modules=["attn", "mlp"]``, as galore-torch's scripts), the embeddings and
LM head stepping as plain parameters. The paper's figure for 8-bit GaLore-Adam at rank 1024: 22.8 GB. LLaMA-3-8B:
the ``llama-3-8b`` preset, bf16, batch 1 x 2048 and 1 x 4096 tokens, checkpointing, per-layer updates.

``--e2e-json``: for each lowmemopt row of ``bench/e2e.py``'s JSON (the 1.1B LLaMA, measured on a GPU), the same step
traced (its model, batch, GaLore rank and per-layer updates from the JSON) against the row's
``torch.cuda.max_memory_allocated()``; goal: within 5% (:data:`E2E_TOLERANCE`). ``scripts/gpu-check`` runs it after
the e2e parts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

#: (label, registry name, state_bits, GaLore / APOLLO rank[, GaLore group keys]): the paper's rows, then lowmemopt's
#: cheaper settings
ROWS = [
    ("AdamW 32-bit", "adamw", 32, None),
    ("AdamW 8-bit", "adamw", 8, None),
    ("GaLore-AdamW 8-bit, rank 1024", "galore_adamw_8bit", 8, 1024),
    ("APOLLO-Mini 8-bit (rank 1)", "apolloadamw", 8, 1),
    ("Adafactor", "adafactor", 32, None),
    ("GaLore-AdamW 8-bit, rank 1024, 8-bit bases", "galore_adamw_8bit", 8, 1024, dict(proj_bits=8)),
    ("GaLore-AdamW 8-bit, rank 1024, 4-bit bases", "galore_adamw_8bit", 8, 1024, dict(proj_bits=4)),
    ("GaLore-AdamW 4-bit, rank 1024", "adamw", 4, 1024),
    ("GaLore-AdamW 4-bit, rank 1024, 4-bit bases", "adamw", 4, 1024, dict(proj_bits=4)),
    ("GaLore-AdamW 8-bit, rank 512", "galore_adamw_8bit", 8, 512),
    ("CAME 8-bit", "came", 8, None),
    ("AdamW 4-bit", "adamw", 4, None),
]
#: (model, preset, batch, seq, rows)
SETUPS = [
    ("LLaMA-7B", "llama-2-7b", 16, 256, ROWS),
    ("LLaMA-3-8B", "llama-3-8b", 1, 2048, ROWS[:5]),
    ("LLaMA-3-8B", "llama-3-8b", 1, 4096, ROWS[:5]),
]
QUICK = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=8000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def run(quick: bool = False) -> list[dict]:
    """Trace every row of :data:`SETUPS` (``quick``: the rows on a 10M-parameter LLaMA, batch 2 x 64); print the
    tables as they come; return one record per row."""
    from lowmemopt.estimate import format_bytes
    from lowmemopt.model_presets import preset
    from lowmemopt.traced_step import trace_step

    setups = [("LLaMA 10M", QUICK, 2, 64, ROWS)] if quick else [(m, preset(p)[1], b, s, r) for m, p, b, s, r in SETUPS]
    records = []
    for model, config, batch, seq, rows in setups:
        print(f"\n{model}, bf16 weights, batch {batch} x {seq} tokens, checkpointing, per-layer updates")
        print(
            "| optimizer | weights | gradients | optimizer state | activations | temporaries | update workspace "
            "| peak | peak (GB) | traced in |"
        )
        print("| --- |" + " ---: |" * 9)
        for label, name, bits, rank, *keys in rows:
            t = trace_step(
                config,
                name,
                bits,
                batch=batch,
                seq=seq,
                dtype=torch.bfloat16,
                galore_rank=rank,
                galore_target_modules=["attn", "mlp"],
                checkpointing=True,
                per_layer=True,
                **(keys[0] if keys else {}),
            )
            parts = [
                t.at_peak[k]
                for k in ("weights", "gradients", "optimizer state", "activations", "temporaries", "step workspace")
            ]
            print(
                f"| {label} | "
                + " | ".join(format_bytes(x) for x in parts)
                + f" | {format_bytes(t.peak)} | {t.peak / 1e9:.2f} | {t.seconds:.1f} s |",
                flush=True,
            )
            records.append(
                dict(
                    model=model,
                    batch=batch,
                    seq=seq,
                    label=label,
                    optimizer=name,
                    state_bits=bits,
                    rank=rank,
                    proj_bits=(keys[0] if keys else {}).get("proj_bits", 32),
                    peak=t.peak,
                    at_peak=t.at_peak,
                    seconds=t.seconds,
                )
            )
    return records


#: bench/e2e.py's lowmemopt rows as trace_step takes them: (registry name, state_bits, GaLore on attn / mlp, per-layer)
E2E_ROWS = {
    "lowmemopt-adamw-8bit": ("adamw", 8, False, False),
    "lowmemopt-adamw-8bit-capturable": ("adamw", 8, False, False),
    "lowmemopt-sgd-8bit": ("sgd", 8, False, False),
    "lowmemopt-lion-8bit": ("lion", 8, False, False),
    "lowmemopt-lamb-8bit": ("lamb", 8, False, False),
    "lowmemopt-lars-8bit": ("lars", 8, False, False),
    "lowmemopt-came-8bit": ("came", 8, False, False),
    "lowmemopt-galore-adamw-8bit": ("adamw", 8, True, False),
    "lowmemopt-galore-came-8bit": ("came", 8, True, False),
    "lowmemopt-adamw-8bit-per-layer": ("adamw", 8, False, True),
    "lowmemopt-came-8bit-per-layer": ("came", 8, False, True),
    "lowmemopt-galore-adamw-8bit-per-layer": ("adamw", 8, True, True),
}
#: e2e rows whose optimizer keywords change the state's layout
E2E_KWARGS = {"lowmemopt-sgd-8bit": dict(momentum=0.9), "lowmemopt-lars-8bit": dict(momentum=0.9)}
E2E_TOLERANCE = 0.05


def compare_e2e(paths: list[str]) -> tuple[list[str], bool]:
    """The markdown lines comparing each traced lowmemopt row of the e2e JSON files in ``paths`` (those that exist)
    with its measured device peak, and whether every compared row is within :data:`E2E_TOLERANCE`."""
    import os

    from lowmemopt.traced_step import trace_step

    lines = [
        "| e2e row | measured peak (GiB) | traced peak (GiB) | traced / measured | within 5% |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    ok, compared, seen = True, 0, set()
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            data = json.load(fh)
        a = data["args"]
        config = dict(
            model_type="llama",
            vocab_size=a["vocab"],
            hidden_size=a["hidden"],
            intermediate_size=a["intermediate"],
            num_hidden_layers=a["layers"],
            num_attention_heads=a["heads"],
            num_key_value_heads=a["kv_heads"],
            max_position_embeddings=max(2048, a["seq"]),
            tie_word_embeddings=False,
        )
        dtype = torch.bfloat16 if a["dtype"] == "bf16" else torch.float32
        for row in data["rows"]:
            name = row["name"]
            if name in seen or name not in E2E_ROWS or "peak_bytes" not in row:
                continue
            seen.add(name)
            if row.get("peak_kind") != "device":
                lines.append(f"| {name} | {row['peak_bytes'] / 2**30:.2f} (process RSS, not a device peak) | | | — |")
                continue
            opt, bits, galore, per_layer = E2E_ROWS[name]
            t = trace_step(
                config,
                opt,
                bits,
                batch=a["batch"],
                seq=a["seq"],
                dtype=dtype,
                galore_rank=a["rank"] if galore else None,
                galore_target_modules=["attn", "mlp"],
                per_layer=per_layer,
                device="cuda",
                **E2E_KWARGS.get(name, {}),
            )
            ratio = t.peak / row["peak_bytes"]
            good = abs(ratio - 1) <= E2E_TOLERANCE
            ok &= good
            compared += 1
            lines.append(
                f"| {name} | {row['peak_bytes'] / 2**30:.2f} | {t.peak / 2**30:.2f} | {ratio:.3f} | "
                f"{'PASS' if good else 'FAIL'} |"
            )
    if not compared:
        lines.append("| (no lowmemopt row with a device peak in " + ", ".join(paths) + ") | | | | — |")
    return lines, ok and compared > 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run on a 10M-parameter LLaMA")
    ap.add_argument("--json", metavar="PATH", help="also write the records (exact bytes) here")
    ap.add_argument(
        "--e2e-json",
        nargs="+",
        metavar="PATH",
        help="compare the traced peak of bench/e2e.py's lowmemopt rows with their measured device peak "
        "(the files that exist among PATH...)",
    )
    args = ap.parse_args(argv)
    if args.e2e_json:
        print("# Traced step peak against the measured one (bench/e2e.py's rows, torch.cuda.max_memory_allocated)\n")
        lines, ok = compare_e2e(args.e2e_json)
        print("\n".join(lines))
        print(
            f"\nTarget (traced within {E2E_TOLERANCE:.0%} of the measured peak on every row): "
            f"{'PASS' if ok else 'FAIL'}"
        )
        return 0
    start = time.perf_counter()
    records = run(args.quick)
    print(f"\n{len(records)} steps traced in {time.perf_counter() - start:.0f} s; 1 GiB = 2^30 bytes, 1 GB = 10^9.")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(torch=torch.__version__, records=records), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
