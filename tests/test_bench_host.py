"""bench/host_overhead.py on the CPU (a subprocess: it stubs the kernel launches process-wide): its table, and the
LLaMA parameter list it steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_bench

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "host_overhead.py"


def test_llama_shapes_have_tinyllamas_tensor_count():
    shapes = load_bench("host_overhead").llama_shapes(22, 64, 256)
    assert len(shapes) == 201  # TinyLlama-1.1B's tensor count: what host work scales with
    assert shapes.count((64, 64)) == 4 * 22 and shapes.count((64,)) == 2 * 22 + 1
    assert shapes[0] == shapes[-1] == (256, 64)


def _bench_rows(tmp_path, *args: str) -> tuple[str, list[list[str]]]:
    """Run the script on the CPU (2 layers) with ``args``: its output, and the cells of its lowmemopt rows."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", "2", "--repeat", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [
        [c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines() if line.startswith("| lowmemopt")
    ]
    return out.stdout, rows


def test_cpu_run_prints_a_row_per_optimizer(tmp_path):
    stdout, rows = _bench_rows(tmp_path, "--steps", "2", "--optimizers", "lowmemopt AdamW 8-bit,lowmemopt CAME 8-bit")
    assert [r[:2] for r in rows] == [
        ["lowmemopt AdamW 8-bit", "step()"],
        ["lowmemopt AdamW 8-bit", "per-layer"],
        ["lowmemopt CAME 8-bit", "step()"],
        ["lowmemopt CAME 8-bit", "per-layer"],
    ]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert all(float(r[4]) > 0 for r in rows if r[1] == "per-layer")  # the ratio to step()
    assert "21 tensors" in stdout


def test_cpu_run_galore_per_layer(tmp_path):
    stdout, rows = _bench_rows(
        tmp_path, "--steps", "1", "--mode", "per-layer", "--galore", "4", "--optimizers", "lowmemopt AdamW 8-bit"
    )
    assert [r[:2] for r in rows] == [["lowmemopt AdamW 8-bit", "per-layer"]] and float(rows[0][2]) > 0
    assert "GaLore rank 4 on 14 matrices" in stdout


def test_cpu_run_per_layer_buckets(tmp_path):
    stdout, rows = _bench_rows(
        tmp_path, "--steps", "2", "--bucket-bytes", "4096", "--optimizers", "lowmemopt AdamW 8-bit"
    )
    assert [r[:2] for r in rows] == [["lowmemopt AdamW 8-bit", "step()"], ["lowmemopt AdamW 8-bit", "per-layer"]]
    assert all(float(r[2]) > 0 for r in rows) and "per-layer buckets of 4096 bytes" in stdout


_NO_KERNEL_RUNS = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import importlib.util
spec = importlib.util.spec_from_file_location("host_overhead_bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
import torch
import triton.runtime.interpreter as interpreter
from lowmemopt.kernels import runtime
from lowmemopt.projection import batched as galore_batched

bench._stub_launches()
galore_batched.BATCH_ON_CPU = True
ran = []
interpreter.GridExecutor.__call__ = lambda self, *a, **k: ran.append(self.fn.__name__)
with runtime.cpu_interpreter():
    params = bench.make_params(bench.llama_shapes(1, 16, 32), "cpu", torch.bfloat16)
    before = [p.detach().clone() for p in params]
    opt = bench.OPTIMIZERS["lowmemopt AdamW 8-bit"](bench.param_groups(params, 4))
    opt.step()
    opt.step()
assert not ran, ran
assert all(int(s["step"]) == 2 for s in opt.state.values()), "the host part of every step ran"
print("ok")
"""


def test_stubbed_launches_run_no_kernel_in_a_galore_step(tmp_path):
    # the CPU figures are the host's work only: a kernel that runs under the interpreter (GaLore's apply pass once
    # did) would count its interpreted arithmetic, seconds per step
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", _NO_KERNEL_RUNS, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
