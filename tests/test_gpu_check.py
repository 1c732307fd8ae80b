"""``scripts/gpu-check`` and its report (``bench/report.py``), and the end-to-end benchmark (``bench/e2e.py``), on CPU:
the check refuses cleanly without CUDA, the report is assembled from fixture outputs, and e2e runs a tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import load_bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu-check")


report = load_bench("report")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="6" time="12.5">
<testcase classname="tests.test_kernels" name="test_gpu_kernels_match_cpu_reference[bf16-16-Adafactor]" time="1.0">
  <failure message="AssertionError: Adafactor bits=16 step 2 exp_avg&#10;Mismatched elements: 1 / 4099">trace</failure>
</testcase>
<testcase classname="tests.test_compiled" name="test_lr_schedule_does_not_recompile[AdamW]" time="2.0">
  <failure message="AssertionError: 9 graphs compiled for 8 steps with a changing lr">trace</failure>
</testcase>
<testcase classname="tests.test_paging.TestResume" name="test_resume" time="0.5">
  <error message="fixture 'tmp_path' failed">trace</error>
</testcase>
<testcase classname="tests.test_quant" name="test_ok" time="0.1"/>
<testcase classname="tests.test_quant" name="test_ok2[x]" time="0.1"/>
<testcase classname="tests.test_cli" name="test_gpu_only" time="0.0"><skipped message="needs a CUDA device"/></testcase>
</testsuite></testsuites>
"""


def _fixture_work(tmp_path, bench_rc=0, with_xml=True):
    work = tmp_path / "work"
    work.mkdir()
    (work / "parts.tsv").write_text(
        "note\t-\t0\t0\tinstalled 3 wheel(s) from .whl into a temporary folder (offline)\n"
        'tests\tnot-slow\t1\t301\tpytest -m "not slow"\n'
        f"bench\tfused_kernels\t{bench_rc}\t42\tpython bench/fused_kernels.py --sizes 10M\n"
    )
    if with_xml:
        (work / "tests-not-slow.xml").write_text(JUNIT)
    (work / "tests-not-slow.log").write_text("... 3 failed, 2 passed, 1 skipped\n")
    (work / "bench-fused_kernels.md").write_text(
        "## Fused kernel benchmark\n\n### 10M parameters in 42 tensors\n\n| optimizer | median step (ms) |\n"
        "| --- | ---: |\n| lowmemopt-adamw-8bit | 0.11 |\n"
    )
    (work / "bench-fused_kernels.log").write_text(
        "Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n"
    )
    (work / "env.json").write_text(
        json.dumps(
            dict(
                gpu="NVIDIA H100 80GB HBM3",
                gpu_memory_gib=79.2,
                capability="9.0",
                sms=132,
                gpu_count=1,
                driver="580.159.04",
                torch="2.11.0+cu130",
                torch_cuda="13.0",
                triton="3.6.0",
                python="3.12.3",
                platform="Linux",
                cpu_count=16,
                lowmemopt="0.1.0",
                anchors={"bitsandbytes": "0.50.2", "torchao": None},
            )
        )
    )
    (work / "meta.json").write_text(
        json.dumps(
            dict(date="2026-11-23 10:00 UTC", commit="abc1234", mode="quick", command="scripts/gpu-check --quick")
        )
    )
    return work


def test_junit_counts_and_ids(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT)
    s = report.parse_junit(str(path))
    assert (s.tests, s.passed, s.failed, s.errors, s.skipped) == (6, 2, 2, 1, 1)
    assert s.failing == [
        (
            "tests/test_kernels.py::test_gpu_kernels_match_cpu_reference[bf16-16-Adafactor]",
            "AssertionError: Adafactor bits=16 step 2 exp_avg",
        ),
        (
            "tests/test_compiled.py::test_lr_schedule_does_not_recompile[AdamW]",
            "AssertionError: 9 graphs compiled for 8 steps with a changing lr",
        ),
        ("tests/test_paging.py::TestResume::test_resume", "fixture 'tmp_path' failed"),
    ]


def test_report_from_fixture_outputs(tmp_path):
    work = _fixture_work(tmp_path)
    text, tests_bad, bench_bad = report.assemble(str(work))
    assert tests_bad and not bench_bad
    expected_lines = [
        "# lowmemopt GPU check",
        "- commit: abc1234",
        "- mode: quick",
        "- result: **tests FAILED**",
        "- installed 3 wheel(s) from .whl into a temporary folder (offline)",
        "| GPU | NVIDIA H100 80GB HBM3, 79.2 GiB, compute capability 9.0, 132 SMs |",
        "| driver | 580.159.04 |",
        "| torch | 2.11.0+cu130 (CUDA 13.0) |",
        "| triton | 3.6.0 (before 3.7: 8-bit AdamW/SGD/Lion/LAMB/LARS take column tiles; the 4-bit and "
        'Adafactor/CAME kernels make shared-memory round trips; docs/kernels.md, "Triton versions") |',
        "| anchor libraries | bitsandbytes 0.50.2; torchao not installed (its rows are skipped) |",
        '| `pytest -m "not slow"` | exit 1 | 2 | 2 | 1 | 1 | 301 |',
        "- `tests/test_kernels.py::test_gpu_kernels_match_cpu_reference[bf16-16-Adafactor]`: AssertionError: "
        "Adafactor bits=16 step 2 exp_avg",
        "- `tests/test_paging.py::TestResume::test_resume`: fixture 'tmp_path' failed",
        "### fused_kernels",
        "`python bench/fused_kernels.py --sizes 10M`: ok, 42 s",
        "##### Fused kernel benchmark",  # the bench's own headings sit below the report's
        "###### 10M parameters in 42 tensors",
        "| lowmemopt-adamw-8bit | 0.11 |",
    ]
    lines = text.splitlines()
    for line in expected_lines:
        assert line in lines, line
    assert lines.index("## Environment") < lines.index("## Tests") < lines.index("## Benchmarks")
    assert "RuntimeError" not in text  # a benchmark that succeeded shows no log


def test_report_cautions_about_triton_before_3_7():
    """The kernels' 8- and 4-bit times on Triton 3.6 are not 3.7's (docs/kernels.md, "Triton versions")."""
    assert report._triton_row("3.6.0").startswith("3.6.0 (before 3.7:")
    assert report._triton_row("3.5.1+git9c2f1a").startswith("3.5.1+git9c2f1a (before 3.7:")
    for version in ("3.7.0", "3.9.0", "3.10.1", "4.0.0", None, "not installed"):
        assert report._triton_row(version) == version


def test_a_part_run_again_replaces_its_entry(tmp_path):
    """Two runs into one work folder (tests, then benchmarks; or a benchmark repeated): one row per part, the last."""
    work = _fixture_work(tmp_path, bench_rc=1)
    with open(work / "parts.tsv", "a") as fh:
        fh.write("bench\tfused_kernels\t0\t40\tpython bench/fused_kernels.py --sizes 10M\n")
    parts = report.read_parts(str(work))
    assert [(p.kind, p.name, p.rc) for p in parts] == [
        ("note", "-", 0),
        ("tests", "not-slow", 1),
        ("bench", "fused_kernels", 0),
    ]


def test_report_records_a_failed_benchmark_and_a_crashed_test_run(tmp_path):
    work = _fixture_work(tmp_path, bench_rc=124, with_xml=False)
    text, tests_bad, bench_bad = report.assemble(str(work))
    assert tests_bad and bench_bad
    assert '| `pytest -m "not slow"` | no result: exit 1 | — | — | — | — | 301 |' in text.splitlines()
    assert "`python bench/fused_kernels.py --sizes 10M`: exit 124 (timed out), 42 s" in text
    assert "RuntimeError: CUDA out of memory" in text  # the end of the failed benchmark's log
    assert "result: **tests FAILED; a benchmark failed (see below)**" in text
    out = tmp_path / "report.md"
    assert report.main(["assemble", str(work), "--out", str(out)]) == 1  # a failed test run: non-zero
    assert out.read_text() == text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_gpu_check_refuses_without_cuda(tmp_path):
    out = tmp_path / "r.md"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", SCRIPT, "--report", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "gpu-check: no CUDA GPU: torch" in proc.stderr and "sees no CUDA device" in proc.stderr
    assert not out.exists()  # nothing ran, nothing reported
    assert os.access(SCRIPT, os.X_OK)


def _check(*args, cwd, env=None, timeout=60):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_gpu_check_rejects_unknown_options(tmp_path):
    for args, message in (
        (["--bogus"], "unknown option --bogus"),
        (["--only", "fast"], "unknown part 'fast' (known: e2e_core fused_1b gpu_tests"),
        (["--with", "e2e,fast"], "unknown part 'fast'"),
        (["--deadline", "10m"], "--deadline takes whole seconds, got '10m'"),
        (["--workers", "many"], "--workers takes a whole number, got 'many'"),
        (["--caps", "gpu_tests=long"], "--caps takes NAME=SECONDS for known parts, got 'gpu_tests=long'"),
        (["--caps", "fast=10"], "--caps takes NAME=SECONDS for known parts, got 'fast=10'"),
        (["--only", "e2e", "--full"], "--only selects every part itself: not with --with or --full"),
    ):
        proc = _check(*args, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def _plan(tmp_path, *args) -> tuple[list[str], list[tuple[str, int, str]]]:
    """``--list``: (its header lines, [(part, cap, command)] in order)."""
    proc = _check("--list", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split("\t") for line in lines if not line.startswith("#")]
    return [line for line in lines if line.startswith("#")], [(n, int(cap), cmd) for n, cap, cmd in rows]


#: the default plan: one command under 9 minutes on an H100, in this order
DEFAULT_PLAN = ["e2e_core", "fused_1b", "gpu_tests", "profile_adamw"]


def test_the_default_plan_fits_one_command(tmp_path):
    """``--list`` prints the default plan without a GPU: the core end-to-end rows, the fused kernels at 1B, the GPU
    tests on several processes, a profile of one AdamW 8-bit step, in that order, each with a cap; the caps add up to
    less than the deadline, which leaves room under 9 minutes for the set-up and the report."""
    header, plan = _plan(tmp_path)
    assert [n for n, _, _ in plan] == DEFAULT_PLAN
    assert header == ["# deadline: 540 s for the whole check, report included"]
    caps = {n: cap for n, cap, _ in plan}
    assert sum(caps.values()) <= 540 - 20 - 20 and all(cap >= 30 for cap in caps.values())  # set-up, report
    commands = {n: cmd for n, _, cmd in plan}
    assert commands["e2e_core"] == (
        "python bench/e2e.py --optimizers core --steps 9 --warmup 3 --timeout 100 --json $WORK/e2e_core.json"
    )  # 12 steps a row
    assert commands["fused_1b"] == "python bench/fused_kernels.py --sizes 1B --dtypes bf16 --json $WORK/fused_1b.json"
    assert commands["gpu_tests"] == 'pytest -n 8 -m "gpu and not slow"'
    assert commands["profile_adamw"] == (
        "python bench/profile_step.py --optimizers lowmemopt-adamw-8bit --steps 1 --warmup 2"
    )
    e2e = load_bench("e2e")  # the rows e2e_core measures
    assert e2e.expand_rows("core") == [
        "torch-adamw-fused",
        "lowmemopt-adamw-8bit",
        "bnb-adamw8bit",
        "lowmemopt-came-8bit",
        "lowmemopt-paged-adamw-8bit",
        "bnb-paged-adamw8bit",
        "lowmemopt-galore-adamw-8bit",
        "galore-torch-adamw8bit",
    ]
    assert set(e2e.CORE_ROWS) <= set(e2e.ROWS)


def test_gpu_check_selects_parts(tmp_path):
    """``--with`` adds opt-in parts after the default plan, ``--only`` runs exactly the parts named and ``--full`` the
    whole suite and every benchmark, always in the plan's order (the sweep only when named); ``--skip-tests`` and
    ``--skip-bench`` leave those out; ``--caps``, ``--workers`` and ``--quick`` change the caps and commands; only the
    default plan has a deadline unless one is given."""
    header, plan = _plan(tmp_path, "--with", "sweep,tests")
    assert [n for n, _, _ in plan] == DEFAULT_PLAN + ["tests", "sweep"] and not header
    _, plan = _plan(tmp_path, "--only", "sweep,e2e,gpu_tests", "--caps", "gpu_tests=300,e2e=100", "--workers", "0")
    assert plan == [
        ("gpu_tests", 300, 'pytest -m "gpu and not slow"'),
        ("e2e", 100, "python bench/e2e.py --steps 10 --warmup 3 --json $WORK/e2e.json"),
        ("sweep", 900, "python bench/fused_kernels.py --sweep --sizes 100M --dtypes fp32,bf16 --json $WORK/sweep.json"),
    ]
    _, plan = _plan(tmp_path, "--full")
    assert [n for n, _, _ in plan] == [
        "tests",
        "gpu_slow_tests",
        "kernel_resources",
        "fused_kernels",
        "e2e",
        "fits_e2e",
        "paging",
        "galore",
        "host_overhead",
        "profile_step",
    ]
    _, plan = _plan(tmp_path, "--full", "--skip-tests")
    assert [n for n, _, _ in plan][:2] == ["kernel_resources", "fused_kernels"]
    _, plan = _plan(tmp_path, "--skip-bench", "--deadline", "300")
    assert [n for n, _, _ in plan] == ["gpu_tests"]
    header, plan = _plan(tmp_path, "--quick")
    assert header and "--layers 4" in dict((n, c) for n, _, c in plan)["e2e_core"]
    assert "--sizes 100M" in dict((n, c) for n, _, c in plan)["fused_1b"]


def test_e2e_bench_runs_tiny_on_cpu(tmp_path):
    """Two rows, each in its own process, on a 1-layer model: the table, ratios to torch's fused AdamW, JSON."""
    js = tmp_path / "e2e.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "bench", "e2e.py"),
        "--device",
        "cpu",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--intermediate",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--vocab",
        "64",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--optimizers",
        "lowmemopt-adamw-8bit,torch-adamw-fused,lowmemopt-adamw-8bit-per-layer",
        "--json",
        str(js),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(js.read_text())["rows"]}
    assert set(rows) == {"torch-adamw-fused", "lowmemopt-adamw-8bit", "lowmemopt-adamw-8bit-per-layer"}
    for r in rows.values():
        assert not r.get("error"), r
        assert r["opt_step_s"] > 0 and r["full_step_s"] >= r["opt_step_s"] and r["peak_bytes"] > 0
        assert len(r["opt_times_s"]) == 2 and torch.isfinite(torch.tensor(r["loss"]))
    # the per-layer row updated the weights inside backward: the same first loss, then its own (it trained)
    per_layer = rows["lowmemopt-adamw-8bit-per-layer"]
    assert per_layer["first_loss"] == rows["lowmemopt-adamw-8bit"]["first_loss"]
    assert per_layer["loss"] != per_layer["first_loss"] and "step_in_backward" in per_layer["note"]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[2].startswith("| torch-adamw-fused | 0.0003 |") and "| 1.00x |" in table[2]  # the baseline first
    assert table[3].startswith("| lowmemopt-adamw-8bit |")
    assert table[4].startswith("| lowmemopt-adamw-8bit-per-layer |") and table[4].endswith("compare the full step |")


def test_e2e_missing_library_row():
    e2e = load_bench("e2e")
    rows = [
        dict(
            name="torch-adamw-fused",
            lr=3e-4,
            peak_bytes=2**30,
            full_step_s=0.2,
            opt_step_s=0.01,
            loss=1.0,
            first_loss=5.0,
            peak_kind="device",
        ),
        dict(name="torchao-adamw8bit", error="not installed (torchao)"),
    ]
    table = e2e.markdown_table(rows, 10).splitlines()
    assert "peak device memory (GiB)" in table[0] and "loss after 10 steps" in table[0]
    assert (
        table[2]
        == "| torch-adamw-fused | 0.0003 | 1.00 | 1.00x | 200.0 | 1.00x | 10.00 | 1.00x | 1.000 (from 5.00) | |"
    )
    assert table[3] == "| torchao-adamw8bit | — | — | — | — | — | — | — | — | not installed (torchao) |"


def test_e2e_graph_row_needs_cuda():
    """The ``-graph`` row captures ``opt.step()`` in a CUDA graph: on the CPU its factory says why it cannot run; the
    ``-capturable`` row takes the same optimizer eagerly."""
    e2e = load_bench("e2e")
    lr, make = e2e.ROWS["lowmemopt-adamw-8bit-graph"]
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        make(torch.nn.Linear(4, 4), lr, None)
    lr, make = e2e.ROWS["lowmemopt-adamw-8bit-capturable"]  # eager: made; its step then needs the fused kernels
    opt = make(torch.nn.Linear(4, 4), lr, None)
    assert opt.param_groups[0]["capturable"] and isinstance(opt.param_groups[0]["lr"], torch.Tensor)


def test_e2e_target_verdicts():
    """The performance targets on opt.step(): judged on a GPU run where both rows ran, shown unjudged on a CPU run,
    left out where a row is missing or failed."""
    e2e = load_bench("e2e")
    rows = [
        dict(name="torch-adamw-fused", opt_step_s=0.010),
        dict(name="lowmemopt-adamw-8bit", opt_step_s=0.012),
        dict(name="lowmemopt-adamw-8bit-graph", opt_step_s=0.008),
        dict(name="bnb-adamw8bit", opt_step_s=0.030),
        dict(name="galore-torch-adamw8bit", error="not installed (galore_torch)"),
        dict(name="lowmemopt-galore-adamw-8bit", opt_step_s=0.05),
    ]
    lines = e2e.target_lines(rows, gpu=True)
    assert lines == [
        "- fused 8-bit step: lowmemopt-adamw-8bit opt.step() <= 1.0x torch-adamw-fused: 1.20x -> FAIL",
        "- fused 8-bit step: lowmemopt-adamw-8bit-graph opt.step() <= 1.0x torch-adamw-fused: 0.80x -> PASS",
        "- fused 8-bit step: lowmemopt-adamw-8bit opt.step() <= 0.5x bnb-adamw8bit: 0.40x -> PASS",
    ]
    assert all(line.endswith("not judged (CPU)") for line in e2e.target_lines(rows, gpu=False))


def test_e2e_targets_names_the_rows_the_targets_compare():
    """``--optimizers targets``: the baseline first, then every row a target compares, each once; mixed with names,
    nothing twice; an unknown name is refused."""
    e2e = load_bench("e2e")
    rows = e2e.target_rows()
    assert rows[0] == e2e.BASELINE and len(rows) == len(set(rows))
    assert set(rows) == {e2e.BASELINE} | {n for _, name, anchor, _ in e2e.TARGETS for n in (name, anchor)}
    assert set(rows) <= set(e2e.ROWS)
    assert {"bnb-paged-adamw8bit", "galore-torch-adamw8bit", "lowmemopt-adamw-8bit-graph"} <= set(rows)
    assert e2e.expand_rows("lowmemopt-lion-8bit,targets,torch-adamw-fused,") == ["lowmemopt-lion-8bit", *rows]
    assert e2e.parse_args(["--optimizers", "targets"]).optimizers.split(",") == rows
    with pytest.raises(SystemExit):
        e2e.parse_args(["--optimizers", "targets,bogus"])


def test_gpu_check_e2e_rows(tmp_path):
    """``--e2e-rows`` reaches bench/e2e.py as ``--optimizers``; a misspelt row is refused before anything runs
    (before the CUDA check: here, on a CPU)."""
    proc = _check("--list", "--only", "e2e", "--e2e-rows", "targets", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout
        == "e2e\t1800\tpython bench/e2e.py --steps 10 --warmup 3 --optimizers targets --json $WORK/e2e.json\n"
    )
    env = dict(os.environ, PYTHON=sys.executable)
    proc = _check("--skip-tests", "--e2e-rows=targets,lowmemopt-adamw-9bit", cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--e2e-rows: unknown row(s) lowmemopt-adamw-9bit; known: targets, core, torch-adamw-fused" in proc.stderr


WHEELS = os.path.join(REPO, "scripts", "gpu-wheels")


def _wheels(*args, cwd):
    return subprocess.run(["bash", WHEELS, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_gpu_wheels_lists_what_it_would_fetch(tmp_path):
    """``--list``: every package gpu-check's runs import and the device image lacks, for the device's Python, with the
    pip command; nothing fetched."""
    proc = _wheels("--list", "--dest", str(tmp_path / "w"), "--python-version", "3.13", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {name: (kind, cmd) for name, kind, cmd in (line.split("\t") for line in proc.stdout.splitlines())}
    assert set(rows) == {
        "bitsandbytes",
        "torchao",
        "galore-torch",
        "came-pytorch",
        "lion-pytorch",
        "pytorch-optimizer",
        "colossalai",
    }
    kind, cmd = rows["bitsandbytes"]
    assert kind == "binary" and "--only-binary=:all: --python-version 3.13" in cmd and "--no-deps" in cmd
    assert cmd.endswith(f"-d {tmp_path / 'w'} bitsandbytes")
    assert rows["colossalai"][0] == "from source" and "pip wheel --no-deps" in rows["colossalai"][1]
    assert not (tmp_path / "w").exists()
    assert os.access(WHEELS, os.X_OK)


def test_gpu_wheels_checks_the_carry_budget(tmp_path):
    """``--check`` adds the wheels to the working tree that travels with them and refuses a sum over the budget."""
    dest = tmp_path / "w"
    dest.mkdir()
    (dest / "a-1.0-py3-none-any.whl").write_bytes(b"x" * (3 << 20))
    proc = _wheels("--check", "--dest", str(dest), "--budget", "64", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "3.00 MiB  a-1.0-py3-none-any.whl" in proc.stdout and "of 64 MiB" in proc.stdout
    assert "ready" in proc.stderr
    proc = _wheels("--check", "--dest", str(dest), "--budget", "2", cwd=tmp_path)
    assert proc.returncode == 1 and "over the budget" in proc.stderr
    proc = _wheels("--check", "--dest", str(tmp_path / "empty"), cwd=tmp_path)
    assert proc.returncode == 1 and "no wheels in" in proc.stderr
    for bad, message in (
        (["--budget", "lots"], "--budget takes whole MiB"),
        (["--python-version", "312"], "--python-version takes X.Y"),
        (["--bogus"], "unknown option"),
    ):
        proc = _wheels(*bad, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


FAKE_PYTHON = (
    """#!/usr/bin/env bash
# a stand-in interpreter: a GPU for gpu-check's CUDA check, pytest-xdist, lowmemopt installed from the checkout, an
# empty environment (a quick start), a pytest that hangs until Ctrl-C (then writes its JUnit file and exits as pytest
# does when interrupted); everything else goes to the real interpreter
case "$*" in
  *torch.cuda.is_available*) echo "Stand-in GPU"; exit 0 ;;
  *"import xdist"*) exit 0 ;;
  *"import lowmemopt, lowmemopt.kernels"*) echo "{repo}/lowmemopt/__init__.py"; exit 0 ;;
  *"report.py env"*) echo "{}"; exit 0 ;;
  *"-m pytest"*)
    junit=""; prev=""
    for a in "$@"; do [ "$prev" = --junitxml ] && junit=$a; prev=$a; done
    echo "$*" >> "{calls}"
    trap 'kill $sleeper 2>/dev/null; printf "%s" "<testsuites><testsuite tests=\\"1\\" failures=\\"0\\" """
    """errors=\\"0\\" \\
skipped=\\"0\\"><testcase classname=\\"t\\" name=\\"ok\\"/></testsuite></testsuites>" > "$junit"; \\
echo "1 passed (interrupted)"; exit 2' INT
    sleep 600 & sleeper=$!
    wait $sleeper; exit 0 ;;
  *) exec "{python}" "$@" ;;
esac
"""
)


def _stand_in(tmp_path, script: str) -> None:
    fake = tmp_path / "python"
    fake.write_text(
        script.replace("{python}", sys.executable).replace("{calls}", str(tmp_path / "calls")).replace("{repo}", REPO)
    )
    fake.chmod(0o755)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_gpu_check_deadline_interrupts_a_part_and_keeps_its_results(tmp_path):
    """``--deadline``: a part that would run past it is interrupted with SIGINT in time for the report (pytest still
    writes what it has), a part with too little time left is not started and says so, and the whole check ends
    within the deadline. The paths are relative (the parts run in other folders: they must still mean the same)."""
    _stand_in(tmp_path, FAKE_PYTHON)
    keep = tmp_path / "keep"
    proc = _check(
        "--python",
        "./python",
        "--only",
        "gpu_tests,gpu_slow_tests",
        "--deadline",
        "60",
        "--report",
        "r.md",
        "--keep",
        "keep",
        cwd=tmp_path,
        timeout=150,
    )
    parts = [line.split("\t") for line in (keep / "parts.tsv").read_text().splitlines()]
    elapsed = [float(seconds) for kind, _, _, seconds, _ in parts if kind == "tests"]
    report = (tmp_path / "r.md").read_text()
    assert proc.returncode == 1, proc.stderr  # a part that timed out is not a passed check
    assert (tmp_path / "calls").read_text().count("-m pytest") == 1  # the second part was never started
    assert 'pytest -n 8 -m "gpu and not slow"' in report and "exit 124 (timed out)" in report
    assert (keep / "tests-gpu_tests.xml").exists()  # written on the interrupt: the results it had are in the report
    assert 'not run: pytest -n 8 -m "gpu and slow"' in report and "of the 60 s deadline were left" in report
    assert len(elapsed) == 1 and 30 <= elapsed[0] <= 45  # its limit: 60 s less the report's 20 less the start
    lines = report.splitlines()
    assert '| gpu_tests | `pytest -n 8 -m "gpu and not slow"` | 150 | ' in report
    assert any(
        line.startswith("| gpu_tests |") and line.endswith("| cut at its cap: exit 124 (timed out) |") for line in lines
    )
    assert (
        '| gpu_slow_tests | `pytest -n 8 -m "gpu and slow"` | 900 | — | not run (too little of the deadline left) |'
        in lines
    )


#: a stand-in for the default plan's parts: e2e runs past its cap; the fused kernels print a table; pytest writes its
#: results and summary, starts a process and then does not exit; the profile leaves a process running when it ends
FAKE_PLAN = (
    """#!/usr/bin/env bash
case "$*" in
  *torch.cuda.is_available*) echo "Stand-in GPU"; exit 0 ;;
  *"import xdist"*) exit 0 ;;
  *"import lowmemopt, lowmemopt.kernels"*) echo "{repo}/lowmemopt/__init__.py"; exit 0 ;;
  *"report.py env"*) echo "{}"; exit 0 ;;
  *bench/e2e.py*) echo "e2e $*" >> "{calls}"; echo "| e2e | first row |"; sleep 3001 ;;
  *bench/fused_kernels.py*) echo "fused $*" >> "{calls}"; echo "| fused | 1B |" ;;
  *"-m pytest"*)
    echo "pytest $*" >> "{calls}"
    junit=""; prev=""
    for a in "$@"; do [ "$prev" = --junitxml ] && junit=$a; prev=$a; done
    printf '%s' '<testsuites><testsuite tests="1" failures="0" errors="0" skipped="0">"""
    """<testcase classname="t" name="ok"/></testsuite></testsuites>' > "$junit"
    sleep 3002 &
    echo "1 passed in 0.01s"
    sleep 3003 ;;
  *bench/profile_step.py*) echo "profile $*" >> "{calls}"; (sleep 3004 &); echo "| profile | one step |" ;;
  *) exec "{python}" "$@" ;;
esac
"""
)


def _running(marker: str) -> bool:
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout.splitlines()
    return any(line.strip() == f"sleep {marker}" for line in ps)


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("bash", "timeout", "ps")), reason="needs bash, timeout, ps")
def test_gpu_check_runs_the_plan_in_order_and_caps_each_part(tmp_path):
    """The default plan on a stand-in GPU: the parts in order; one past its cap is cut and the others still run; a
    pytest that has written its results and summary but does not exit is stopped after the grace (its results stand)
    and the report says so; processes a part leaves behind are ended (they would hold the GPU or the output) and noted;
    the report's plan table gives each part's cap, time and result."""
    _stand_in(tmp_path, FAKE_PLAN)
    env = dict(os.environ, GPU_CHECK_EXIT_GRACE="2")
    proc = _check(
        "--python",
        "./python",
        "--caps",
        "e2e_core=4",
        "--report",
        "r.md",
        "--keep",
        "keep",
        cwd=tmp_path,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    calls = [line.split()[0] for line in (tmp_path / "calls").read_text().splitlines()]
    assert calls == ["e2e", "fused", "pytest", "profile"]
    assert "-n 8 -m gpu and not slow" in (tmp_path / "calls").read_text()
    report = (tmp_path / "r.md").read_text()
    lines = report.splitlines()
    assert lines.index("## Plan") < lines.index("## Environment")
    table = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and " | `" in line}
    # (its time in whole seconds: the cap, or one more where the cut and the clock's second boundary fall apart)
    assert re.search(r"\| 4 \| [45] \| cut at its cap: exit 124 \(timed out\) \|$", table["e2e_core"]), table[
        "e2e_core"
    ]
    assert re.search(r"\| 70 \| \d+ \| ok \|$", table["fused_1b"]), table["fused_1b"]
    assert table["gpu_tests"].endswith("| ok |") and table["profile_adamw"].endswith("| ok |")
    assert "| e2e | first row |" in report and "| profile | one step |" in report  # the output each part had
    assert "gpu_tests: pytest wrote its results and summary but had not exited 2 s later; stopped" in report
    assert "profile_adamw left 1 process(es) running after it ended; stopped" in report
    assert '| `pytest -n 8 -m "gpu and not slow"` | passed | 1 | 0 | 0 | 0 |' in report
    for marker in ("3001", "3002", "3003", "3004"):
        assert not _running(marker), marker


def test_e2e_interrupted_keeps_the_verdicts_of_the_rows_done(monkeypatch, capsys, tmp_path):
    """An e2e run cut short (Ctrl-C, gpu-check's deadline) still prints the targets of the rows it finished, says
    which rows did not run, keeps its JSON, and exits 130."""
    e2e = load_bench("e2e")
    done = {"torch-adamw-fused": 0.010, "lowmemopt-adamw-8bit": 0.008}

    def row(name, argv, timeout):
        if name not in done:
            raise KeyboardInterrupt
        return dict(
            name=name,
            lr=3e-4,
            peak_bytes=2**20,
            full_step_s=0.1,
            opt_step_s=done[name],
            loss=1.0,
            first_loss=2.0,
            peak_kind="rss",
        )

    monkeypatch.setattr(e2e, "_subprocess_row", row)
    js = tmp_path / "e.json"
    assert e2e.main(["--device", "cpu", "--optimizers", "targets", "--json", str(js)]) == 130
    out = capsys.readouterr().out
    rest = e2e.target_rows()[2:]
    assert f"Interrupted after 2 of {len(rest) + 2} rows; not run: {', '.join(rest)}" in out
    assert (
        "- fused 8-bit step: lowmemopt-adamw-8bit opt.step() <= 1.0x torch-adamw-fused: 0.80x -> not judged (CPU)"
        in out
    )
    assert [r["name"] for r in json.loads(js.read_text())["rows"]] == list(done)
