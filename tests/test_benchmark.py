"""lowmemopt.benchmark's paired timing: the baseline's steps alternate with the measured optimizer's, and the ratio is
to those (no timing is asserted, only the pairing); the table shows what each ratio divides; one run measures its
baseline once; missing libraries and progress lines."""

from __future__ import annotations

import io
import re

import pytest
import torch

from lowmemopt import benchmark


def test_partner_steps_alternate_with_timed_steps():
    calls: list[str] = []
    partner_times: list[float] = []
    times, note = benchmark.time_steps(
        lambda: calls.append("opt"),
        steps=4,
        warmup=2,
        device=torch.device("cpu"),
        partner=lambda: calls.append("base"),
        partner_times=partner_times,
    )
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
        results, _ = benchmark.run_suite(
            names,
            registry,
            preset="tiny",
            steps=3,
            warmup=1,
            device=torch.device("cpu"),
            paired=paired,
            out=io.StringIO(),
        )
        base, other = results
        assert not base.error and not other.error
        assert base.baseline_s == base.median_s and base.ratio == 1.0
        assert other.ratio == other.median_s / other.baseline_s
        if paired:
            assert len(other.times_s) == 3 and other.baseline_s not in (None, base.median_s)
        else:
            assert other.baseline_s == base.median_s


def _tiny(monkeypatch) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    monkeypatch.setattr(benchmark, "build_llama", lambda preset, device="cpu": model)
    monkeypatch.setitem(benchmark.LLAMA_PRESETS, "tiny", {})
    return model


def _rows(table: str) -> dict[str, list[str]]:
    """A printed table's rows by optimizer name: the cells after the name."""
    cells = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| optimizer") and "---" not in line
    ]
    return {c[0]: c[1:] for c in cells}


def test_each_rows_ratio_is_its_median_over_the_baseline_median_in_the_same_row(monkeypatch):
    """The table prints the baseline median each ratio divides by (for paired rows, that of the baseline steps timed
    alternately with the row's, not the baseline row's own), so no row's ratio contradicts its medians."""
    _tiny(monkeypatch)
    registry = {n: benchmark.OPTIMIZERS[n] for n in (benchmark.BASELINE, "lowmemopt-adamw-8bit", "torch-adamw-foreach")}
    results, _ = benchmark.run_suite(
        list(registry), registry, preset="tiny", steps=3, warmup=1, device=torch.device("cpu"), out=io.StringIO()
    )
    out = io.StringIO()
    benchmark.print_table(results, out=out)
    header = out.getvalue().splitlines()[0]
    assert "median step (s)" in header and f"{benchmark.BASELINE} median (s)" in header
    rows = _rows(out.getvalue())
    assert set(rows) == set(registry)
    for name, (_bpp, median, baseline, ratio, _note) in rows.items():
        assert float(ratio.rstrip("x")) == pytest.approx(float(median) / float(baseline), abs=0.011), name
    assert rows[benchmark.BASELINE][3] == "1.00x"


def test_quick_measures_the_baseline_once_for_every_table(monkeypatch):
    """Both suites' tables show one measurement of the baseline (same median, same step times), not two."""
    _tiny(monkeypatch)
    made = []

    def baseline(params, lr, weight_decay):
        made.append(1)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def sgd(params, lr, weight_decay):
        return torch.optim.SGD(params, lr=lr)

    def adam(params, lr, weight_decay):
        return torch.optim.Adam(params, lr=lr)

    suites = {
        "one": ("one", {benchmark.BASELINE: baseline, "sgd": sgd}, ()),
        "two": ("two", {benchmark.BASELINE: baseline, "adam": adam}, ()),
    }
    monkeypatch.setattr(benchmark, "SUITES", suites)
    out = io.StringIO()
    tables = benchmark.quick(["one", "two"], preset="tiny", steps=3, warmup=1, out=out)
    first, second = (next(r for r in tables[s] if r.name == benchmark.BASELINE) for s in ("one", "two"))
    assert first.times_s == second.times_s and first.median_s == second.median_s
    assert "the same measurement as above" in second.note
    assert made == [1, 1, 1]  # the baseline row once, and one alternating partner per suite
    medians = [
        line.split("|")[3].strip()
        for line in out.getvalue().splitlines()
        if line.startswith(f"| {benchmark.BASELINE} |")
    ]
    assert len(medians) == 2 and medians[0] == medians[1]


def test_a_missing_library_is_reported_as_not_installed(monkeypatch, capsys):
    """An optional library's row that cannot import says how to install it; a missing part of lowmemopt itself (a
    bug) stays a failure."""

    def missing(params, lr, weight_decay):
        import lowmemopt_no_such_library  # noqa: F401

    def broken(params, lr, weight_decay):
        raise ModuleNotFoundError("No module named 'lowmemopt.nothing'", name="lowmemopt.nothing")

    ref = [torch.zeros(4)]
    grads = [torch.zeros(4)]
    r = benchmark.run_benchmark("x", ref, grads, steps=1, warmup=0, device=torch.device("cpu"), factory=missing)
    assert not r.error and r.missing == "lowmemopt_no_such_library"
    assert r.note == "not installed (lowmemopt_no_such_library): pip install '.[bench]'"
    out = io.StringIO()
    benchmark.print_table([r], out=out)
    assert "FAILED" not in out.getvalue() and "not installed" in out.getvalue()
    assert benchmark.progress_line(r) == "  x: not installed (lowmemopt_no_such_library): pip install '.[bench]'"
    r = benchmark.run_benchmark("y", ref, grads, steps=1, warmup=0, device=torch.device("cpu"), factory=broken)
    assert r.error.startswith("ModuleNotFoundError") and not r.missing


def test_progress_lines_are_rounded_as_the_table():
    r = benchmark.Result(
        "opt", state_bytes=2031, bytes_per_param=2.0312345678, times_s=[0.0412345678], median_s=0.0412345678
    )
    assert benchmark.progress_line(r) == "  opt: median 0.04123 s, 2.031 bytes/param"
    r.note = "slow"
    assert benchmark.progress_line(r).endswith("bytes/param (slow)")
    assert not re.search(r"\d{6}", benchmark.progress_line(r))


def test_host_syncs_are_counted_on_cuda_only(monkeypatch):
    """``host_syncs`` counts the warnings of torch's sync debug mode during one step (not its one-time notice, which
    also speaks of synchronizing operations) and restores the mode; on the CPU there is nothing to count (None)."""
    import warnings

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
        )
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")
        warnings.warn("called a synchronizing CUDA operation")

    assert benchmark.host_syncs(step, torch.device("cuda")) == 2 and modes == ["warn", "default"]
    assert benchmark.host_syncs(step, torch.device("cpu")) is None


def test_fused_lamb_row_runs_with_its_clip(monkeypatch):
    model = _tiny(monkeypatch)
    ref = [p.detach() for p in model.parameters()]
    grads = [torch.randn_like(p) for p in ref]
    r = benchmark.run_benchmark("lowmemopt-fusedlamb-8bit", ref, grads, steps=2, warmup=1, device=torch.device("cpu"))
    assert not r.error and r.host_syncs is None and len(r.times_s) == 2


def test_anchor_libraries_are_imported_without_their_import_notices(tmp_path, monkeypatch, capsys):
    """bitsandbytes and torchao print notices when imported ("Failed to load CPU gemm_4bit_forward ...", "Failed
    to load ..._C_mxfp8...so", a torch log line) that say nothing about the benchmark: the bench imports them quietly,
    and still shows what a failing import printed."""
    import logging
    import types

    from lowmemopt.benchmark import optimizers

    (tmp_path / "noisy_anchor.py").write_text(
        "import logging, sys, warnings\nprint('Failed to load something')\nprint('more', file=sys.stderr)\n"
        "logging.getLogger('noisy').warning('W1202 a log line')\nwarnings.warn('a warning')\nvalue = 3\n"
    )
    (tmp_path / "broken_anchor.py").write_text("print('why it broke')\nraise ImportError('broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert optimizers.quiet_import("noisy_anchor").value == 3
    with pytest.raises(ImportError, match="broken"):
        optimizers.quiet_import("broken_anchor")
    out, err = capsys.readouterr()
    assert out == "" and err == "why it broke\n", (out, err)
    assert not logging.root.manager.disable  # (logging is back on)

    names = []
    make = lambda *a, **k: "opt"  # noqa: E731
    fake = types.SimpleNamespace(optim=types.SimpleNamespace(AdamW8bit=make), AdamW8bit=make)
    monkeypatch.setattr(optimizers, "quiet_import", lambda name: names.append(name) or fake)
    assert optimizers.OPTIMIZERS["bnb-adamw8bit"]([], 1e-3, 0.0) == "opt"
    assert optimizers.OPTIMIZERS["torchao-adamw8bit"]([], 1e-3, 0.0) == "opt"
    assert names == ["bitsandbytes", "torchao.optim"]
