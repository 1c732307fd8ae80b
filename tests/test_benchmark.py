"""lowmemopt.benchmark's paired timing: the baseline's steps alternate with the measured optimizer's, and the ratio is
to those (no timing is asserted, only the pairing)."""

from __future__ import annotations

import io

import torch

from lowmemopt import benchmark


def test_partner_steps_alternate_with_timed_steps():
    calls: list[str] = []
    partner_times: list[float] = []
    times, note = benchmark.time_steps(lambda: calls.append("opt"), steps=4, warmup=2, device=torch.device("cpu"),
                                       partner=lambda: calls.append("base"), partner_times=partner_times)
    assert calls == ["opt", "opt"] + ["opt", "base"] * 4  # warm-up steps are not paired
    assert len(times) == 4 and len(partner_times) == 4 and note == ""


def test_run_suite_ratios_are_to_the_paired_baseline(monkeypatch):
    """Each non-baseline row gets ``baseline_s`` (the median of the baseline steps timed next to it) and its ratio is
    ``median_s / baseline_s``; unpaired, the ratio is to the baseline's own row and ``baseline_s`` stays None."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    monkeypatch.setattr(benchmark, "build_llama", lambda preset, device="cpu": model)
    monkeypatch.setitem(benchmark.LLAMA_PRESETS, "tiny", {})
    registry = {
        benchmark.BASELINE: benchmark.OPTIMIZERS[benchmark.BASELINE],
        "lowmemopt-adamw-8bit": benchmark.OPTIMIZERS["lowmemopt-adamw-8bit"],
    }
    names = list(registry)
    for paired in (True, False):
        results, _ = benchmark.run_suite(names, registry, preset="tiny", steps=3, warmup=1, device=torch.device("cpu"),
                                         paired=paired, out=io.StringIO())
        base, other = results
        assert not base.error and not other.error
        assert base.baseline_s is None and base.ratio == 1.0
        if paired:
            assert other.baseline_s is not None
            assert other.ratio == other.median_s / other.baseline_s
        else:
            assert other.baseline_s is None
            assert other.ratio == other.median_s / base.median_s
