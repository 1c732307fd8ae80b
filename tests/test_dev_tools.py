"""The maintainers' tools for a refactor, CI-sized: ``bench/walk.py`` counts a step's walk between the layers,
``scripts/compare-trees`` compares two source trees bit for bit (here the tree with itself, and with a planted
change), ``scripts/time-trees`` times their CPU step, paired (its output only: timings are not asserted)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch
from helpers import load_bench

import lowmemopt

ROOT = Path(__file__).resolve().parent.parent


def test_walk_counts_climbs_and_returns():
    walk = load_bench("walk")
    stops = [
        (0, "", "lowmemopt.pipeline.run"),
        (1, "lowmemopt.pipeline", "lowmemopt.quant.formats.format_of"),
        (1, "lowmemopt.pipeline", "lowmemopt.optim.came.update"),  # a climb: optim lies above the pipeline
        (1, "lowmemopt.pipeline", "lowmemopt.quant.formats.format_of"),
    ]  # a return to a module left
    assert walk.count(stops) == {"stops": 4, "climbs": 1, "returns": 1}


def test_walk_of_a_native_cpu_step():
    walk = load_bench("walk")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 96)) for _ in range(3)]
    opt = lowmemopt.AdamW(params, lr=1e-3, state_bits=8)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    stops = walk.walk(opt.step)
    assert stops[0] == (0, "", "lowmemopt.optimizer.step")
    counts = walk.count(stops)
    assert 0 < counts["climbs"] <= 8 and counts["stops"] > 10, counts


def test_compare_trees_finds_a_planted_difference(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.so", "build", "*.egg-info"))
    args = [
        sys.executable,
        str(ROOT / "scripts" / "compare-trees"),
        "--optimizers",
        "AdamW",
        "--bits",
        "32",
        "--features",
        "plain",
        "--params",
        "fp32",
        "--backends",
        "eager",
    ]
    same = subprocess.run([*args, str(ROOT), str(tree)], capture_output=True, text=True, timeout=600)
    assert same.returncode == 0 and "1 of 1 identical" in same.stdout, same.stdout + same.stderr
    math = tree / "lowmemopt" / "optim" / "adamw.py"  # a planted change: eps added twice
    math.write_text(
        math.read_text().replace(
            "denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)",
            "denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps).add_(eps)",
        )
    )
    planted = subprocess.run([*args, str(ROOT), str(tree)], capture_output=True, text=True, timeout=600)
    assert planted.returncode == 1 and "0 of 1 identical" in planted.stdout, planted.stdout + planted.stderr


def test_time_trees_prints_a_paired_row():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "time-trees"),
            str(ROOT),
            str(ROOT),
            "--rounds",
            "1",
            "--optimizers",
            "Lion 8-bit",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    row = [line for line in out.stdout.splitlines() if line.startswith("| Lion 8-bit |")]
    assert len(row) == 1 and float(row[0].split("|")[4]) > 0, out.stdout
