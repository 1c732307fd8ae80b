"""GaLore's projection products in bf16 against fp32 on a real training run: how far ``proj_dtype="param"`` (bf16
products, fp32 accumulation, as on a GPU's tensor cores) moves the loss from ``proj_dtype="float32"``, measured
against the seed-to-seed spread.

    cd /tmp && python /path/to/lowmemopt/bench/galore_proj_dtype.py --jobs 2 --json study.json   # the study
    cd /tmp && python /path/to/lowmemopt/bench/galore_proj_dtype.py --quick                      # a smoke run
    cd /tmp && python /path/to/lowmemopt/bench/galore_proj_dtype.py --optimizers came8bit --ranks 16,64
    cd /tmp && python /path/to/lowmemopt/bench/galore_proj_dtype.py --summarize study.json       # its tables again

The study (AdamW 8-bit, 4 ranks x 3 seeds x 2 dtypes = 24 runs of 300 steps) takes 7,200 training steps: about 20
minutes of one core, 88 minutes on a busy 2-core machine with ``--jobs 2``. The results: docs/galore.md.

Model and data: :mod:`lowmemopt.demo`'s LLaMA-style byte LM (``LLAMA_BYTES``: hidden 192, 4 layers, 1.9M parameters),
freshly initialised per seed and cast to **bf16** parameters, trained on the standard library's source (the same
batches for every run of a seed). GaLore on the attention and MLP weights (``target_modules=["attn", "mlp"]``: 28
matrices of 192x192, 192x512 and 512x192) at ``--ranks``, ``update_proj_gap=--gap`` (75: bases made at steps 0, 75,
150 and 225 of 300), ``scale=1.0`` (the demo's GaLore settings); embeddings, norms and the LM head step as plain
parameters. Optimizers: AdamW 8-bit (lr 2e-3) and CAME 8-bit (lr 2e-4), weight decay 0.01, as in ``lowmemopt demo``.
Every (optimizer, rank, seed) trains twice, once per ``proj_dtype``: the two runs share the initial weights and the
batches, so their difference is the products' rounding alone.

Figures: ``last N`` (the mean training loss of the last ``--tail`` steps) and ``held-out`` (the final model's loss on
fixed windows, :func:`lowmemopt.demo.heldout_loss`). Per (optimizer, rank): the mean over seeds at each dtype, the
paired difference ``bf16 - fp32`` (mean and largest magnitude over seeds) and the seed-to-seed spread (the sample
standard deviation over seeds of the fp32 runs); ``within noise`` there: the largest paired difference is smaller than
that spread, for both figures (with 2-3 seeds, a spread is a rough estimate). Then per optimizer and figure over every
(rank, seed) pair (:func:`pooled`): the mean difference and its standard error, the RMS difference and the pooled seed
spread, whether the RMS difference is below that spread (the rounding moves a run less than a change of seed), and
whether the mean difference is a systematic shift (2 standard errors from 0) and which way.

First the script checks the premise: that this CPU's bf16 matmul rounds as a GPU's tensor cores do (bf16 inputs, fp32
accumulation, one rounding of the result), by comparing ``a @ b`` in bf16 with the fp32 product of the same bf16
values rounded once (and showing what accumulating in bf16 would have cost).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing
import statistics
import sys
import time

import torch

#: optimizer name -> (lowmemopt class, keyword arguments): the demo's settings (lowmemopt.demo.DEMO_CHOICES)
OPTIMIZERS = {
    "adamw8bit": ("AdamW", dict(lr=2e-3, weight_decay=0.01, state_bits=8)),
    "came8bit": ("CAME", dict(lr=2e-4, weight_decay=0.01, state_bits=8)),
}
LABELS = {"adamw8bit": "GaLore AdamW 8-bit", "came8bit": "GaLore-CAME 8-bit"}
PROJ_DTYPES = ("float32", "param")
TARGETS = ["attn", "mlp"]


def check_bf16_products(seed: int = 0) -> list[dict]:
    """Does a bf16 matmul here round as fp32 accumulation would (the fp32 product of the same bf16 inputs, rounded
    once to bf16)? For GaLore's shapes (a 192x512 gradient against a rank-64 basis, both sides) and a long inner
    dimension. Each row: the shape, the fraction of elements equal to the once-rounded fp32 product, the largest
    distance from it in bf16 steps among the products of at least 1/16 of the mean magnitude (1: the two fp32 sums, in
    different orders, fell on either side of a rounding boundary), and the largest error against the fp32 product
    (relative to its mean magnitude) of the bf16 result and of a sum accumulated in bf16 (what the products would cost
    without fp32 accumulation)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for m, k, n in [(64, 192, 512), (192, 512, 64), (512, 192, 64), (64, 8192, 64)]:
        a = torch.randn(m, k, generator=gen).bfloat16()
        b = torch.randn(k, n, generator=gen).bfloat16()
        exact = a.float() @ b.float()
        got = a @ b
        bf16_acc = torch.zeros(m, n, dtype=torch.bfloat16)
        for i in range(k):  # a sum rounded to bf16 after every term
            bf16_acc = bf16_acc + (a[:, i : i + 1].float() * b[i : i + 1].float()).bfloat16()
        steps = (got.view(torch.int16).int() - exact.bfloat16().view(torch.int16).int()).abs()  # same sign: steps
        scale = exact.abs().mean()
        # (where a sum cancels to far below the others, two fp32 orders differ by many of its own tiny bf16 steps)
        whole = exact.abs() >= scale / 16
        rows.append(
            dict(
                shape=(m, k, n),
                equal=float((steps == 0).float().mean()),
                steps=int(steps[whole].max()),
                err=float((got.float() - exact).abs().max() / scale),
                bf16_acc_err=float((bf16_acc.float() - exact).abs().max() / scale),
            )
        )
    return rows


def train(optimizer: str, rank: int, seed: int, proj: str, steps: int, gap: int, tail: int, threads: int) -> dict:
    """One run: a fresh bf16 LLaMA of seed ``seed``, GaLore ``optimizer`` at ``rank`` with ``proj_dtype=proj``, on
    ``threads`` threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(optimizer, rank, seed, proj, steps, gap, tail)
    finally:
        torch.set_num_threads(before)


def _train(optimizer: str, rank: int, seed: int, proj: str, steps: int, gap: int, tail: int) -> dict:
    from lowmemopt.demo import _llama

    cls, kw = OPTIMIZERS[optimizer]
    run = galore_run(_llama(seed).to(torch.bfloat16), cls, kw, rank, gap, steps, seed, tail, proj_dtype=proj)
    return dict(optimizer=optimizer, rank=rank, seed=seed, proj=proj, steps=steps, **run)


def galore_run(
    model: torch.nn.Module, cls: str, kw: dict, rank: int, gap: int, steps: int, seed: int, tail: int, **keys
) -> dict:
    """Train ``model`` (a :mod:`lowmemopt.demo` LLaMA) for ``steps`` with ``lowmemopt.<cls>(**kw)`` on GaLore groups
    of its attention and MLP weights (``rank``, ``update_proj_gap=gap``, scale 1.0, other group ``keys``), on the
    demo's batches of seed ``seed``: the first loss, the mean of the last ``tail``, the held-out loss, whether every
    loss was finite, and the seconds it took."""
    import lowmemopt
    from lowmemopt.demo import _fit

    def make(_params):
        groups = lowmemopt.galore_param_groups(model, TARGETS, rank=rank, update_proj_gap=gap, scale=1.0, **keys)
        return getattr(lowmemopt, cls)(groups, **kw)

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return model(input_ids=windows, labels=windows).loss

    t0 = time.perf_counter()
    r = _fit(model, loss_of, make, steps, seed, 8, 64, None)
    losses = r["losses"]
    return dict(
        first=losses[0],
        last=sum(losses[-tail:]) / len(losses[-tail:]),
        heldout=r["heldout"],
        finite=all(math.isfinite(x) for x in losses),
        seconds=time.perf_counter() - t0,
    )


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (optimizer, rank): per figure (``last``, ``heldout``) the mean over seeds at each dtype, the paired
    ``bf16 - fp32`` differences' mean and largest magnitude, the fp32 runs' seed-to-seed standard deviation, and
    ``within`` (largest paired difference < that spread; False with fewer than two seeds)."""
    by = {}
    for r in runs:
        by.setdefault((r["optimizer"], r["rank"]), {}).setdefault(r["seed"], {})[r["proj"]] = r
    rows = []
    for (opt, rank), seeds in by.items():
        paired = [s for s in seeds.values() if set(s) == set(PROJ_DTYPES)]
        if not paired:  # (a study under way: neither seed has both runs yet)
            continue
        row = dict(optimizer=opt, rank=rank, seeds=len(paired))
        for fig in ("last", "heldout"):
            row[fig] = paired_figures([s["float32"][fig] for s in paired], [s["param"][fig] for s in paired])
        rows.append(row)
    return sorted(rows, key=lambda r: (list(OPTIMIZERS).index(r["optimizer"]), r["rank"]))


def paired_figures(base: list[float], other: list[float]) -> dict:
    """One figure of paired runs (the same seeds' ``base`` and ``other`` values): their means (``fp32``, ``value``), the
    differences' mean and largest magnitude, the base runs' seed-to-seed standard deviation and ``within`` (largest
    difference < that spread; False with fewer than two seeds)."""
    diffs = [o - b for b, o in zip(base, other)]
    spread = statistics.stdev(base) if len(base) > 1 else float("nan")
    worst = max((abs(d) for d in diffs), default=float("nan"))
    return dict(
        fp32=statistics.fmean(base),
        value=statistics.fmean(other),
        diff=statistics.fmean(diffs),
        max_diff=worst,
        spread=spread,
        within=bool(worst < spread),
    )


def run_in_processes(fn, jobs: list[tuple], workers: int):
    """``fn(*job)`` of every job in ``workers`` spawned processes, yielded as each ends."""
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for f in cf.as_completed([pool.submit(fn, *job) for job in jobs]):
            yield f.result()


def pooled(runs: list[dict]) -> list[dict]:
    """Per optimizer and figure, over every (rank, seed) pair: the pairs' count, the mean ``bf16 - fp32`` difference and
    its standard error, the root mean square difference, and the pooled seed-to-seed spread (the root of the mean over
    ranks of the fp32 runs' variance over seeds). ``within``: the rounding moves a run less than a change of seed does
    (RMS difference < pooled spread); ``shift``: whether the mean difference is detectable (2 standard errors from 0)
    and which way: "none", "bf16 lower" or "bf16 higher"."""
    out = []
    for opt in OPTIMIZERS:
        by: dict[int, dict[int, dict]] = {}
        for r in runs:
            if r["optimizer"] == opt:
                by.setdefault(r["rank"], {}).setdefault(r["seed"], {})[r["proj"]] = r
        for fig in ("last", "heldout"):
            diffs, variances = [], []
            for seeds in by.values():
                paired = [s for s in seeds.values() if set(s) == set(PROJ_DTYPES)]
                diffs += [s["param"][fig] - s["float32"][fig] for s in paired]
                if len(paired) > 1:
                    variances.append(statistics.variance([s["float32"][fig] for s in paired]))
            if len(diffs) < 2 or not variances:
                continue
            mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
            rms, spread = math.sqrt(statistics.fmean(d * d for d in diffs)), math.sqrt(statistics.fmean(variances))
            shift = "none" if abs(mean) < 2 * se else "bf16 lower" if mean < 0 else "bf16 higher"
            out.append(
                dict(
                    optimizer=opt,
                    figure=fig,
                    pairs=len(diffs),
                    diff=mean,
                    se=se,
                    rms=rms,
                    spread=spread,
                    within=bool(rms < spread),
                    shift=shift,
                )
            )
    return out


def pooled_table(rows: list[dict]) -> str:
    """The Markdown table of :func:`pooled`'s rows."""
    names = {"last": "last-N", "heldout": "held-out"}
    out = [
        "| optimizer | figure | pairs | bf16 - fp32: mean ± s.e. | RMS | pooled seed spread | RMS < spread | "
        "systematic shift |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    out += [
        f"| {LABELS[r['optimizer']]} | {names[r['figure']]} | {r['pairs']} | {r['diff']:+.4f} ± {r['se']:.4f} "
        f"| {r['rms']:.4f} | {r['spread']:.4f} | {'yes' if r['within'] else 'no'} | {r['shift']} |"
        for r in rows
    ]
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    """The Markdown table of :func:`summarize`'s rows."""
    out = [
        "| optimizer | rank | seeds | last-N fp32 | last-N bf16 | bf16 - fp32 (mean / max) | seed spread | "
        "held-out fp32 | held-out bf16 | bf16 - fp32 (mean / max) | seed spread | within noise |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        last, held = r["last"], r["heldout"]
        within = "yes" if last["within"] and held["within"] else "no"
        out.append(
            f"| {LABELS[r['optimizer']]} | {r['rank']} | {r['seeds']} | {last['fp32']:.4f} | {last['value']:.4f} "
            f"| {last['diff']:+.4f} / {last['max_diff']:.4f} | {last['spread']:.4f} | {held['fp32']:.4f} "
            f"| {held['value']:.4f} | {held['diff']:+.4f} / {held['max_diff']:.4f} | {held['spread']:.4f} "
            f"| {within} |"
        )
    return "\n".join(out)


def check_table(rows: list[dict]) -> str:
    out = [
        "| m x k x n | equal to the fp32 product rounded once | at most (bf16 steps) | max error: bf16 matmul "
        "| max error: bf16 accumulation |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {' x '.join(map(str, r['shape']))} | {100 * r['equal']:.3f}% | {r['steps']} | "
            f"{r['err']:.2e} | {r['bf16_acc_err']:.2e} |"
        )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--optimizers", default="adamw8bit", help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gap", type=int, default=75, help="update_proj_gap (default 75: 4 bases in 300 steps)")
    ap.add_argument("--tail", type=int, default=50, help="the last N steps whose mean loss is reported")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (default 1); each run has one thread")
    ap.add_argument("--quick", action="store_true", help="a smoke run: AdamW 8-bit, rank 8, seeds 0 and 1, 12 steps")
    ap.add_argument("--json", help="write the runs (after each one), the rows and the premise check here")
    ap.add_argument("--summarize", metavar="JSON", help="print the tables of the runs in this --json file, run nothing")
    ap.add_argument("--markdown", help="write the tables here")
    args = ap.parse_args(argv)
    if args.quick:
        args.optimizers, args.ranks, args.seeds, args.steps, args.gap, args.tail = "adamw8bit", "8", "0,1", 12, 5, 4
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = sorted(set(args.optimizers) - set(OPTIMIZERS))
    if unknown:
        ap.error(f"unknown optimizer(s) {unknown}; expected some of {', '.join(OPTIMIZERS)}")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 1 or not 1 <= args.tail <= args.steps:
        ap.error("need --steps >= 1 and 1 <= --tail <= --steps")
    return args


def report(check: list[dict], runs: list[dict], args: argparse.Namespace, seconds: float) -> str:
    """The premise check's table, the study's table and its settings, as Markdown."""
    seeds = sorted({r["seed"] for r in runs})
    settings = (
        f"{args.steps} steps, batch 8 x 64 bytes, bf16 parameters, update_proj_gap {args.gap}, scale 1.0, "
        f"seeds {','.join(map(str, seeds))}; last-N: mean of the last {args.tail} steps; {seconds:.0f} s"
    )
    return f"{check_table(check)}\n\n{table(summarize(runs))}\n\n{pooled_table(pooled(runs))}\n\n{settings}\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            saved = json.load(f)
        print(report(saved["check"], saved["runs"], argparse.Namespace(**saved["settings"]), saved["seconds"]))
        return 0
    check = check_bf16_products()
    print(
        "bf16 products on this CPU (errors relative to the mean |exact product|):\n" + check_table(check) + "\n",
        flush=True,
    )
    # seed-major: a study cut short still has every rank at its first seeds
    jobs = [(o, r, s, p) for s in args.seeds for o in args.optimizers for r in args.ranks for p in PROJ_DTYPES]
    runs: list[dict] = []
    t0 = time.perf_counter()

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    dict(
                        check=check,
                        runs=runs,
                        rows=summarize(runs),
                        settings=vars(args),
                        seconds=time.perf_counter() - t0,
                    ),
                    f,
                    indent=1,
                )

    threads = 1  # per run: (two threads' SVDs wait on each other on a busy machine; --jobs uses the cores)
    args_of = [(o, r, s, p, args.steps, args.gap, args.tail, threads) for o, r, s, p in jobs]
    for r in run_in_processes(train, args_of, args.jobs):
        runs.append(r)
        save()
        print(
            f"[{len(runs)}/{len(jobs)} {time.perf_counter() - t0:6.0f}s] {r['optimizer']} rank {r['rank']} "
            f"seed {r['seed']} proj_dtype={r['proj']}: last-{args.tail} {r['last']:.4f}, held-out "
            f"{r['heldout']:.4f} ({r['seconds']:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    text = report(check, runs, args, time.perf_counter() - t0)
    print(text.split("\n\n", 1)[1])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0 if all(r["finite"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
