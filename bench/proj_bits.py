"""GaLore's bases stored at ``proj_bits`` 16, 8 and 4 against fp32, on a real training run: the final and held-out
loss of each width beside the fp32 run of the same seed, against the seed-to-seed spread.

    cd /tmp && python /path/to/lowmemopt/bench/proj_bits.py --jobs 2 --json study.json   # the study
    cd /tmp && python /path/to/lowmemopt/bench/proj_bits.py --quick                      # a smoke run, seconds
    cd /tmp && python /path/to/lowmemopt/bench/proj_bits.py --summarize study.json       # its table again

Model and data: :mod:`lowmemopt.demo`'s LLaMA-style byte LM (hidden 192, 4 layers, 1.9M parameters, fp32), freshly
initialised per seed, trained on the standard library's source (the same batches for every run of a seed). GaLore
on the attention and MLP weights (28 matrices) at ``--ranks``, ``update_proj_gap=--gap`` (75: bases made at steps 0,
75, 150 and 225 of 300), ``scale=1.0``; AdamW 8-bit (lr 2e-3, weight decay 0.01), as in ``lowmemopt demo``. Every
(rank, seed) trains once per ``proj_bits``: the runs share the initial weights and the batches, so a difference from
the fp32 run of the seed is the stored basis' rounding alone.

Figures: ``last N`` (the mean training loss of the last ``--tail`` steps) and ``held-out`` (the final model's loss on
fixed windows, :func:`lowmemopt.demo.heldout_loss`). Per (rank, proj_bits): the mean over seeds, the paired
difference from fp32 (mean and largest magnitude over seeds), the fp32 runs' seed-to-seed standard deviation, and
``within noise``: the largest paired difference is below that spread for both figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from galore_proj_dtype import galore_run, paired_figures, run_in_processes

WIDTHS = (32, 16, 8, 4)
OPTIMIZER = ("AdamW", dict(lr=2e-3, weight_decay=0.01, state_bits=8))


def train(rank: int, seed: int, bits: int, steps: int, gap: int, tail: int, threads: int = 1) -> dict:
    """One run: a fresh LLaMA of seed ``seed``, GaLore AdamW 8-bit at ``rank`` with ``proj_bits=bits``, on ``threads``
    threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(rank, seed, bits, steps, gap, tail)
    finally:
        torch.set_num_threads(before)


def _train(rank: int, seed: int, bits: int, steps: int, gap: int, tail: int) -> dict:
    from lowmemopt.demo import _llama

    cls, kw = OPTIMIZER
    run = galore_run(_llama(seed), cls, kw, rank, gap, steps, seed, tail, proj_bits=bits)
    return dict(rank=rank, seed=seed, bits=bits, steps=steps, **run)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (rank, proj_bits < 32): per figure (``last``, ``heldout``) the mean over seeds, the paired
    differences from the fp32 run of each seed (mean, largest magnitude), the fp32 runs' seed-to-seed standard
    deviation and ``within`` (largest difference < that spread; False with fewer than two seeds)."""
    by: dict[int, dict[int, dict[int, dict]]] = {}
    for r in runs:
        by.setdefault(r["rank"], {}).setdefault(r["seed"], {})[r["bits"]] = r
    rows = []
    for rank, seeds in sorted(by.items()):
        for bits in WIDTHS[1:]:
            paired = [s for s in seeds.values() if 32 in s and bits in s]
            if not paired:
                continue
            row = dict(rank=rank, bits=bits, seeds=len(paired))
            for fig in ("last", "heldout"):
                row[fig] = paired_figures([s[32][fig] for s in paired], [s[bits][fig] for s in paired])
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The Markdown table of :func:`summarize`'s rows."""
    out = [
        "| rank | proj_bits | seeds | last-N fp32 | last-N | minus fp32 (mean / max) | seed spread | held-out fp32 "
        "| held-out | minus fp32 (mean / max) | seed spread | within noise |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        last, held = r["last"], r["heldout"]
        within = "yes" if last["within"] and held["within"] else "no"
        out.append(
            f"| {r['rank']} | {r['bits']} | {r['seeds']} | {last['fp32']:.4f} | {last['value']:.4f} "
            f"| {last['diff']:+.4f} / {last['max_diff']:.4f} | {last['spread']:.4f} | {held['fp32']:.4f} "
            f"| {held['value']:.4f} | {held['diff']:+.4f} / {held['max_diff']:.4f} | {held['spread']:.4f} "
            f"| {within} |"
        )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--bits", default="32,16,8,4", help="proj_bits to run (32 is the baseline: always run)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gap", type=int, default=75, help="update_proj_gap (default 75: 4 bases in 300 steps)")
    ap.add_argument("--tail", type=int, default=50, help="the last N steps whose mean loss is reported")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (default 1); each run has one thread")
    ap.add_argument("--quick", action="store_true", help="a smoke run: rank 8, seeds 0 and 1, 12 steps")
    ap.add_argument("--json", help="write the runs (after each one) and the rows here")
    ap.add_argument("--summarize", metavar="JSON", help="print the table of the runs in this --json file, run nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.seeds, args.steps, args.gap, args.tail = "8", "0,1", 12, 5, 4
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.bits = sorted({32, *(int(b) for b in args.bits.split(","))}, reverse=True)
    if set(args.bits) - set(WIDTHS):
        ap.error(f"--bits: each of {', '.join(map(str, WIDTHS))}")
    if args.steps < 1 or not 1 <= args.tail <= args.steps:
        ap.error("need --steps >= 1 and 1 <= --tail <= --steps")
    return args


def report(runs: list[dict], settings: dict, seconds: float) -> str:
    seeds = sorted({r["seed"] for r in runs})
    text = (
        f"GaLore AdamW 8-bit, {settings['steps']} steps, batch 8 x 64 bytes, fp32 parameters, update_proj_gap "
        f"{settings['gap']}, scale 1.0, seeds {','.join(map(str, seeds))}; last-N: mean of the last "
        f"{settings['tail']} steps; {seconds:.0f} s"
    )
    return f"{table(summarize(runs))}\n\n{text}\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            saved = json.load(f)
        print(report(saved["runs"], saved["settings"], saved["seconds"]))
        return 0
    # seed-major: a study cut short still has every rank and width at its first seeds
    jobs = [(r, s, b) for s in args.seeds for r in args.ranks for b in args.bits]
    runs: list[dict] = []
    t0 = time.perf_counter()
    for r in run_in_processes(train, [(*job, args.steps, args.gap, args.tail) for job in jobs], args.jobs):
        runs.append(r)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(dict(runs=runs, settings=vars(args), seconds=time.perf_counter() - t0), out, indent=1)
        print(
            f"[{len(runs)}/{len(jobs)} {time.perf_counter() - t0:6.0f}s] rank {r['rank']} seed {r['seed']} "
            f"proj_bits={r['bits']}: last-{args.tail} {r['last']:.4f}, held-out {r['heldout']:.4f} "
            f"({r['seconds']:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    print(report(runs, vars(args), time.perf_counter() - t0))
    return 0 if all(r["finite"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
