"""bench/host_overhead.py on the CPU (a subprocess: it stubs the kernel launches process-wide): its table, and the
LLaMA parameter list it steps."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "host_overhead.py"


def test_llama_shapes_have_tinyllamas_tensor_count():
    spec = importlib.util.spec_from_file_location("host_overhead_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shapes = module.llama_shapes(22, 64, 256)
    assert len(shapes) == 201  # TinyLlama-1.1B's tensor count: what host work scales with
    assert shapes.count((64, 64)) == 4 * 22 and shapes.count((64,)) == 2 * 22 + 1
    assert shapes[0] == shapes[-1] == (256, 64)


def test_cpu_run_prints_a_row_per_optimizer(tmp_path):
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--steps", "2", "--repeat", "1",
                          "--optimizers", "lowmemopt AdamW 8-bit,lowmemopt CAME 8-bit"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| lowmemopt")]
    assert [r.split("|")[1].strip() for r in rows] == ["lowmemopt AdamW 8-bit", "lowmemopt CAME 8-bit"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)
    assert "21 tensors" in out.stdout
