"""bench/profile_step.py: a small CPU run of its tables (the GPU run needs a GPU), its reading of the
profiler's events, and its parser of Nsight Compute's CSV."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_bench

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "profile_step.py"
SMALL = [
    "--device",
    "cpu",
    "--layers",
    "1",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "256",
    "--batch",
    "2",
    "--seq",
    "16",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--top",
    "4",
]


def test_cpu_run_prints_the_summary_and_operator_tables(tmp_path):
    pytest.importorskip("transformers")
    report = tmp_path / "profile.md"
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *SMALL,
            "--optimizers",
            "lowmemopt-adamw-8bit,lowmemopt-galore-adamw-8bit",
            "--markdown",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")
        for line in out.stdout.splitlines()
        if line.startswith("| lowmemopt-")
    }
    assert set(rows) == {"lowmemopt-adamw-8bit", "lowmemopt-galore-adamw-8bit"}
    for cells in rows.values():
        assert float(cells[2]) > 0 and float(cells[3]) > 0  # step wall ms, host CPU ms
        assert float(cells[9]) > 0  # aten operators per step
    # GaLore projects every matrix: more operators per step than the plain step
    assert float(rows["lowmemopt-galore-adamw-8bit"][9]) > float(rows["lowmemopt-adamw-8bit"][9])
    assert "### lowmemopt-galore-adamw-8bit: operators by calls" in out.stdout
    assert report.read_text().strip() == out.stdout.strip()


def test_summarize_counts_kernels_copies_syncs_and_operators():
    m = load_bench("profile_step")
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, device=cpu, us=0.0):
        return SimpleNamespace(name=name, device_type=device, self_device_time_total=us)

    events = [
        ev("aten::add_"),
        ev("aten::add_"),
        ev("aten::mul"),
        ev("cudaStreamSynchronize"),
        ev("_adam_kernel", cuda, 300.0),
        ev("_adam_kernel", cuda, 100.0),
        ev("vectorized_elementwise", cuda, 50.0),
        ev("Memcpy HtoD (Pinned -> Device)", cuda, 20.0),
        ev("Memcpy DtoH (Device -> Pinned)", cuda, 10.0),
    ]
    s = m.summarize(events, steps=2)
    assert s["kernels"]["_adam_kernel"] == (1.0, 200.0)
    assert s["launches"] == 1.5 and s["kernel_ms"] == pytest.approx(0.225)
    assert s["copies"]["h2d"] == (0.5, 10.0) and s["copies"]["d2h"] == (0.5, 5.0)
    assert s["syncs"] == 0.5 and s["op_calls"] == 1.5 and s["ops"]["aten::add_"] == 1.0


NCU_CSV = (
    "==PROF== Connected to process 123 (/usr/bin/python3)\n"
    '==PROF== Profiling "_adam_kernel" - 0: 0%....50%....100% - 5 passes\n'
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","dram__bytes.sum.per_second","dram__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"gpu__time_duration.sum","launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active"\n'
    '"","","","","","","","","","","","byte/second","%","nsecond","register/thread","%"\n'
    '"0","123","python3","h","_adam_kernel","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","2,412,345,678,901",'
    '"71.3","15,812","40","88.2"\n'
    '"1","123","python3","h","_adam_kernel","1","7","(128, 1, 1)","(16, 1, 1)","0","9.0","1,000,000,000,000",'
    '"20.5","9,000","40","30.0"\n'
    '"2","123","python3","h","_apply_kernel","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0","2,000,000,000,000",'
    '"60.0","4,000","64","70.0"\n'
)


def test_parse_ncu_csv_and_table():
    m = load_bench("profile_step")
    rows = m.parse_ncu_csv(NCU_CSV)
    assert [r["kernel"] for r in rows] == ["_adam_kernel", "_adam_kernel", "_apply_kernel"]
    assert rows[0]["duration"] == 15812 and rows[0]["dram %"] == 71.3 and rows[0]["registers"] == 40
    assert rows[0]["dram B/s"] == 2412345678901 and rows[2]["occupancy %"] == 70.0
    table = m.ncu_table(rows).splitlines()
    assert table[2].startswith("| `_adam_kernel` | 2 | 12.4 | 45.9 | 1706.2 | 59.1 | 40.0 |")  # means of 2 launches
    assert m.parse_ncu_csv("==ERROR== no kernels were profiled\n") == []


def test_ncu_command_profiles_one_step_of_the_row():
    m = load_bench("profile_step")
    cmd = m.ncu_command("lowmemopt-came-8bit", ["--layers", "2"], "out.csv", m.LOWMEMOPT_KERNELS, 7)
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    assert cmd[cmd.index("--nvtx-include") + 1] == m.NVTX_RANGE + "/"
    assert cmd[cmd.index("--launch-count") + 1] == "7" and cmd[cmd.index("--log-file") + 1] == "out.csv"
    assert cmd[-4:] == ["--layers", "2", "--ncu-worker", "lowmemopt-came-8bit"]
    assert m._strip_driver_args(["--ncu", "--optimizers", "a,b", "--layers", "2", "--markdown=x.md"]) == [
        "--layers",
        "2",
    ]
