"""8- and 4-bit optimizer state against 32 bits on a real small training run, several seeds: Muon, APOLLO, APOLLO-Mini.

    cd /tmp && python /path/to/lowmemopt/bench/lowbit_training.py   # Muon, small LLaMA, 200 steps, seeds 0-2
    python /path/to/lowmemopt/bench/lowbit_training.py --model demo --steps 300   # the demo's 1.9M-parameter LLaMA

The model is :mod:`lowmemopt.demo`'s LLaMA (``--model demo``: ``LLAMA_BYTES``, 1.9M parameters; ``small``, the default:
the same with hidden size 96, MLP 256 and 2 layers, 0.16M parameters, whose Newton-Schulz steps are ~30x cheaper on a
CPU, where bf16 matrix products are slow), randomly initialised, trained on the Python standard library's source with
the same batches for every run of a seed; the figure is the final model's loss on fixed
held-out windows (:func:`lowmemopt.demo.heldout_loss`), each low-bit run against its 32-bit twin of the same seed.
Prints a Markdown table: held-out loss per seed and bit width, the gap to 32 bits per seed, its mean, and the state
bytes per parameter of the optimized matrices.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

import lowmemopt
from lowmemopt.demo import _fit, _llama

#: name -> (what it builds from the model at state_bits, its label); hyper-parameters for the demo LLaMA
OPTIMIZERS: dict[str, tuple[Callable[[torch.nn.Module, int], torch.optim.Optimizer], str]] = {
    # Keller Jordan's settings for the hidden matrices (lr 0.02, momentum 0.95, Nesterov); AdamW at lr 2e-3 for the
    # embeddings, the head and the norms
    "muon": (
        lambda model, bits: lowmemopt.Muon(
            lowmemopt.muon_param_groups(model), lr=0.02, weight_decay=0.01, adamw_lr=2e-3, state_bits=bits
        ),
        "Muon",
    ),
    # APOLLO at a quarter of the hidden size, and APOLLO-Mini (rank 1, tensor-wise, scale 128), on every Linear weight
    # (the embedding, head and norms as AdamW); low-rank moments quantized from 256 elements (the small model's
    # 96 x 24 moments are below the default 4096)
    "apollo": (
        lambda model, bits: lowmemopt.APOLLOAdamW(
            lowmemopt.apollo_param_groups(model, rank=24, update_proj_gap=50),
            lr=2e-3,
            weight_decay=0.01,
            state_bits=bits,
            min_quant_numel=256,
        ),
        "APOLLO (rank 24)",
    ),
    "apollo_mini": (
        lambda model, bits: lowmemopt.APOLLOAdamW(
            lowmemopt.apollo_param_groups(model, rank=1, scale_type="tensor", scale=128.0, update_proj_gap=50),
            lr=2e-3,
            weight_decay=0.01,
            state_bits=bits,
            min_quant_numel=64,
        ),
        "APOLLO-Mini",
    ),
}


#: model configs (overrides of lowmemopt.demo.LLAMA_BYTES)
MODELS = {"demo": {}, "small": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2)}


def train(name: str, bits: int, steps: int, seed: int, model_name: str = "small") -> dict[str, Any]:
    """One run: the LLaMA ``model_name`` of ``seed`` trained ``steps`` steps with ``name`` at ``bits``."""
    build, _ = OPTIMIZERS[name]
    model = _llama(seed, MODELS[model_name])
    holder = {}

    def make(params):
        holder["opt"] = build(model, bits)
        return holder["opt"]

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return model(input_ids=windows, labels=windows).loss

    r = _fit(model, loss_of, make, steps, seed, 8, 64, None)
    opt = holder["opt"]
    first = next(g for g in opt.param_groups if g.get("use_muon") or g.get("apollo_rank"))["params"]  # the matrices
    r["group_bytes_per_param"] = sum(
        v.numel() * v.element_size() for p in first for v in opt.state[p].values() if isinstance(v, torch.Tensor)
    ) / sum(p.numel() for p in first)
    return r


def table(name: str, results: dict[tuple[int, int], dict[str, Any]], seeds: list[int], bits: list[int]) -> str:
    label = OPTIMIZERS[name][1]
    lines = [
        f"| {label} | " + " | ".join(f"seed {s}" for s in seeds) + " | mean gap | B / param (matrices) |",
        "| --- |" + " ---: |" * (len(seeds) + 2),
    ]
    for b in bits:
        cells, gaps = [], []
        for s in seeds:
            loss = results[(b, s)]["heldout"]
            ref = results[(32, s)]["heldout"]
            gap = 100 * (loss - ref) / ref
            cells.append(f"{loss:.4f}" + ("" if b == 32 else f" ({gap:+.2f}%)"))
            gaps.append(gap)
        mean = "—" if b == 32 else f"{sum(gaps) / len(gaps):+.2f}%"
        per = results[(b, seeds[0])]["group_bytes_per_param"]
        lines.append(f"| {b}-bit | " + " | ".join(cells) + f" | {mean} | {per:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="muon", help=f"comma-separated: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--bits", default="32,8,4")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    bits = sorted({32, *(int(b) for b in args.bits.split(","))}, reverse=True)
    for name in args.optimizers.split(","):
        results = {}
        for s in seeds:
            for b in bits:
                results[(b, s)] = train(name, b, args.steps, s, args.model)
                print(f"  {name} {b}-bit seed {s}: held-out {results[(b, s)]['heldout']:.4f}", file=sys.stderr)
        print(f"\n{OPTIMIZERS[name][1]}, {args.model} LLaMA, {args.steps} steps: held-out loss (gap to 32 bits)\n")
        print(table(name, results, seeds, bits))


if __name__ == "__main__":
    main()
