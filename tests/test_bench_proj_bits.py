"""bench/proj_bits.py, CI-sized: a few steps of each width and the table it makes of them."""

from __future__ import annotations

import math

import pytest
from helpers import load_bench


def test_runs_and_table():
    pytest.importorskip("transformers")
    m = load_bench("proj_bits")
    runs = [m.train(4, seed, bits, steps=3, gap=2, tail=2) for seed in (0, 1) for bits in (32, 4)]
    assert all(r["finite"] and r["last"] < r["first"] + 1 and math.isfinite(r["heldout"]) for r in runs)
    by = {(r["seed"], r["bits"]): r for r in runs}
    assert by[0, 32]["first"] == by[0, 4]["first"]  # the same weights and batch before the first step
    assert by[0, 32]["last"] != by[0, 4]["last"]  # then the stored basis' rounding differs
    (row,) = m.summarize(runs)
    assert (row["rank"], row["bits"], row["seeds"]) == (4, 4, 2)
    diffs = [by[s, 4]["last"] - by[s, 32]["last"] for s in (0, 1)]
    assert row["last"]["diff"] == pytest.approx(sum(diffs) / 2)
    assert row["last"]["max_diff"] == pytest.approx(max(map(abs, diffs)))
    assert row["last"]["spread"] == pytest.approx(abs(by[0, 32]["last"] - by[1, 32]["last"]) / math.sqrt(2))
    assert row["last"]["within"] == (row["last"]["max_diff"] < row["last"]["spread"])
    assert m.table([row]).splitlines()[2].startswith("| 4 | 4 | 2 | ")
    assert m.parse_args(["--bits", "8"]).bits == [32, 8]
