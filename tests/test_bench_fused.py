"""bench/fused_kernels.py on a machine without a GPU: its byte accounting, its tile-shape grid, its refusal to time
the CPU reference path (``--sweep`` too), and that the tile shapes it sweeps give the kernels' results bit for bit
(interpreter): a per-GPU tile choice changes speed, never numbers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_params, set_grads

import lowmemopt
from lowmemopt.kernels import dispatch, runtime

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "fused_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fused_kernels_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ideal_bytes_per_dtype(bench):
    """fp32: p read + write 8, g 4, 8-bit m and v read + write 4 = 16; bf16 params and grads: 4 + 2 + 4 = 10."""
    assert bench.ideal_bytes("adamw-8", torch.float32) == 16
    assert bench.ideal_bytes("adamw-8", torch.bfloat16) == 10
    assert bench.ideal_bytes("adamw-32", torch.bfloat16) == 22
    assert all(bench.ideal_bytes(k, torch.bfloat16) == v - 6 for k, v in bench.IDEAL_BYTES.items())


def test_sweep_grid_holds_the_current_shape(bench):
    grid = bench.sweep_grid(256)
    assert (runtime.rows_per_tile(256), runtime.NUM_WARPS) in grid
    assert len(grid) == len(set(grid)) >= 10
    assert all(1 <= rows * 256 // (32 * warps) <= 64 for rows, warps in grid)


def test_tile_shape_per_capability(monkeypatch):
    """A capability listed in TILE_SHAPES takes its shape; others, CPU tensors and no device take (TILE, NUM_WARPS)."""
    monkeypatch.setattr(runtime, "_capability", lambda index: (9, 0) if index == 0 else (8, 0))
    monkeypatch.setattr(runtime, "TILE_SHAPES", {(9, 0): (4096, 8)})
    default = (runtime.TILE, runtime.NUM_WARPS)
    assert runtime.tile_shape(torch.device("cuda", 0)) == (4096, 8)
    assert runtime.rows_per_tile(256, torch.device("cuda", 0)) == 16
    assert runtime.tile_shape(torch.device("cuda", 1)) == default
    assert runtime.tile_shape(torch.device("cpu")) == runtime.tile_shape() == default
    assert runtime.rows_per_tile(256) == runtime.TILE // 256


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("extra", [[], ["--sweep", "--dtypes", "bf16"]])
def test_refuses_without_cuda(tmp_path, extra):
    out = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "10M", *extra], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stderr[-2000:]


def test_bad_dtype_is_a_usage_error(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--dtypes", "fp8"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--dtypes takes" in out.stderr, out.stderr[-2000:]


@pytest.mark.skipif(not runtime.INTERPRET, reason="needs TRITON_INTERPRET=1 (conftest sets it without CUDA)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swept_tile_shapes_give_identical_results(monkeypatch, dtype):
    """8-bit AdamW through the kernels with the default tile and with swept ones (1 and 4 rows of a block per
    program, other warp counts): parameters, codes and absmax bit-identical after 2 steps."""
    shapes = [(40, 100), (5000,), (3, 7)]

    def run(tile: int, warps: int):
        monkeypatch.setattr(runtime, "TILE", tile)
        monkeypatch.setattr(runtime, "NUM_WARPS", warps)
        params = make_params(shapes, dtype=dtype)
        opt = lowmemopt.AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=8, min_quant_numel=0)
        before = dispatch.stats.get(("adam", "q8"), 0)
        with runtime.cpu_interpreter():
            for t in range(2):
                set_grads(params, t)
                opt.step()
        assert dispatch.stats.get(("adam", "q8"), 0) > before  # the kernels ran
        return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()
                                                       if isinstance(v, torch.Tensor)} for p in params]

    base_p, base_s = run(runtime.TILE, runtime.NUM_WARPS)
    for tile, warps in ((256, 1), (1024, 8)):
        got_p, got_s = run(tile, warps)
        assert all(torch.equal(a, b) for a, b in zip(got_p, base_p)), (tile, warps)
        for a, b in zip(got_s, base_s):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (tile, warps)
