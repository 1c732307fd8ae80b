"""bench/galore_proj_dtype.py, CI-sized: the premise it checks (this CPU's bf16 matmul accumulates in fp32, as a GPU's
tensor cores do), a few steps of each run kind and the table it makes of them."""

from __future__ import annotations

import math

import pytest
from helpers import load_bench


def test_this_cpus_bf16_products_accumulate_in_fp32():
    """Each bf16 product equals the fp32 product of the same bf16 inputs rounded once (or is one bf16 step from it,
    where two fp32 sums in different orders straddle a rounding boundary); a sum kept in bf16 would be far worse."""
    for row in load_bench("galore_proj_dtype").check_bf16_products():
        assert row["steps"] <= 1 and row["equal"] >= 0.99, row
        assert row["err"] <= 2**-7 * 4 and row["bf16_acc_err"] > 5 * row["err"], row


def test_runs_and_table():
    pytest.importorskip("transformers")
    m = load_bench("galore_proj_dtype")
    # one thread: the study's runs, and on a busy machine much faster (two threads' SVDs wait on each other)
    runs = [
        m.train("adamw8bit", 4, seed, proj, steps=3, gap=2, tail=2, threads=1)
        for seed in (0, 1)
        for proj in m.PROJ_DTYPES
    ]
    assert all(r["finite"] and r["last"] < r["first"] + 1 and math.isfinite(r["heldout"]) for r in runs)
    fp32 = {r["seed"]: r for r in runs if r["proj"] == "float32"}
    bf16 = {r["seed"]: r for r in runs if r["proj"] == "param"}
    assert fp32[0]["first"] == bf16[0]["first"]  # the same weights and batch before the first step
    assert fp32[0]["last"] != bf16[0]["last"]  # then the products' rounding differs
    (row,) = m.summarize(runs)
    assert (row["optimizer"], row["rank"], row["seeds"]) == ("adamw8bit", 4, 2)
    diffs = [bf16[s]["last"] - fp32[s]["last"] for s in (0, 1)]
    assert row["last"]["diff"] == pytest.approx(sum(diffs) / 2)
    assert row["last"]["max_diff"] == pytest.approx(max(map(abs, diffs)))
    assert row["last"]["spread"] == pytest.approx(abs(fp32[0]["last"] - fp32[1]["last"]) / math.sqrt(2))
    assert row["last"]["within"] == (row["last"]["max_diff"] < row["last"]["spread"])
    assert m.table([row]).splitlines()[2].startswith("| GaLore AdamW 8-bit | 4 | 2 | ")
    last, held = m.pooled(runs)  # over every (rank, seed) pair: here one rank
    assert (last["figure"], last["pairs"], held["figure"]) == ("last", 2, "heldout")
    assert last["diff"] == pytest.approx(row["last"]["diff"]) and last["spread"] == pytest.approx(row["last"]["spread"])
    assert last["rms"] == pytest.approx(math.sqrt(sum(d * d for d in diffs) / 2))
    assert last["within"] == (last["rms"] < last["spread"])
    assert last["shift"] == (
        "none" if abs(last["diff"]) < 2 * last["se"] else "bf16 lower" if last["diff"] < 0 else "bf16 higher"
    )
    assert m.pooled_table([last, held]).splitlines()[3].startswith("| GaLore AdamW 8-bit | held-out | 2 | ")
