"""8- and 4-bit state against 32-bit for AdEMAMix and Adam-mini: the loss of a real small training run, per seed.

    cd /tmp && python /path/to/lowmemopt/bench/state_bits_loss.py                       # 300 steps, seeds 0,1,2
    cd /tmp && python /path/to/lowmemopt/bench/state_bits_loss.py --family AdEMAMix --steps 100 --seeds 0
    cd /tmp && python /path/to/lowmemopt/bench/state_bits_loss.py --small --steps 200 --seeds 0,1   # 0.5M parameters

The run is :mod:`lowmemopt.demo`'s byte-level LLaMA (``LLAMA_BYTES``: 1.9M parameters, 4 heads, 2 KV heads) trained
from a fresh random initialisation on the Python standard library's source, the same batches for every optimizer
(``bench/fourbit.py``'s loop); the loss is the final model's on fixed held-out windows. Each 8- and 4-bit run is
compared with its 32-bit twin of the same seed; the gap table gives each seed's gap and the mean (docs/ademamix.md,
docs/adam_mini.md hold the measured tables).
"""

from __future__ import annotations

import argparse
import sys
import types

import torch
from fourbit import gap_table, state_bytes, table

import lowmemopt

BITS = (32, 8, 4)


def _ademamix(bits: int, steps: int, config: dict):
    # the paper's recipe: both warm-ups over the whole run
    return lambda p: lowmemopt.AdEMAMix(p, lr=1e-3, weight_decay=0.01, t_alpha=steps, t_beta3=steps, state_bits=bits)


#: ``--small``: a LLaMA of the same kinds of tensors at a quarter of the size (0.5M parameters), for busy machines
SMALL = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=344)


def _adam_mini(bits: int, steps: int, config: dict):
    """Adam-mini on the LLaMA's named parameters (the factory gets them in ``named_parameters()`` order)."""
    from lowmemopt.demo import LLAMA_BYTES, _llama

    names = [n for n, _ in _llama(0, config).named_parameters()]
    shape = lowmemopt.AdamMini.model_keywords(types.SimpleNamespace(**{**LLAMA_BYTES, **config}))
    return lambda p: lowmemopt.AdamMini(
        list(zip(names, p)), lr=1e-3, weight_decay=0.01, state_bits=bits, verbose=False, **shape
    )


FAMILIES = {"AdEMAMix": _ademamix, "Adam-mini": _adam_mini}


def optimizers(families: list[str], steps: int, config: dict) -> dict:
    return {f"{fam} {bits}-bit": FAMILIES[fam](bits, steps, config) for fam in families for bits in BITS}


def train(make, steps: int, seed: int, config: dict) -> dict:
    """One run of :func:`lowmemopt.demo.train_llama_bytes`, with the optimizer's state bytes at the end."""
    from lowmemopt.demo import train_llama_bytes

    holder = {}
    r = train_llama_bytes(lambda p: holder.setdefault("opt", make(p)), steps, seed=seed, config=config)
    r["state_bytes"] = state_bytes(holder["opt"])
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--family", action="append", choices=sorted(FAMILIES), help="optimizer family (repeatable; default: all)"
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--small", action="store_true", help=f"the smaller LLaMA ({SMALL})")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on shared cores more spin)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    families = args.family or list(FAMILIES)
    seeds = [int(s) for s in args.seeds.split(",")]
    config = SMALL if args.small else {}
    from lowmemopt.demo import LLAMA_BYTES, _llama

    numel = sum(p.numel() for p in _llama(0, config).parameters())
    per_seed = []
    for seed in seeds:
        rows = []
        for name, make in optimizers(families, args.steps, config).items():
            r = train(make, args.steps, seed, config)
            rows.append(
                dict(
                    name=name, heldout=r["heldout"], final=r["final"], state_bytes=r["state_bytes"], step_s=r["step_s"]
                )
            )
            print(f"  seed {seed} {name}: held-out {r['heldout']:.4f}", file=sys.stderr, flush=True)
        print(
            f"LLaMA {dict(LLAMA_BYTES, **config)}, {args.steps} steps, seed {seed}, {numel:,} parameters, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print(table(rows, numel))
        per_seed.append(rows)
    if len(seeds) > 1:
        print(gap_table(per_seed, seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
