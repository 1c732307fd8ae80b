"""bench/fused_kernels.py on a machine without a GPU: its byte accounting, its tile-shape grid, its refusal to time
the CPU reference path (``--sweep`` too), and that the tile shapes it sweeps give the kernels' results bit for bit
(interpreter): a per-GPU tile choice changes speed, never numbers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_bench, make_params, set_grads

import lowmemopt
from lowmemopt.kernels import dispatch, runtime

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "fused_kernels.py"


@pytest.fixture(scope="module")
def bench():
    return load_bench("fused_kernels")


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
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "10M", *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stderr[-2000:]


def test_bad_dtype_is_a_usage_error(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--dtypes", "fp8"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
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
        return [p.detach().clone() for p in params], [
            {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params
        ]

    base_p, base_s = run(runtime.TILE, runtime.NUM_WARPS)
    for tile, warps in ((256, 1), (1024, 8)):
        got_p, got_s = run(tile, warps)
        assert all(torch.equal(a, b) for a, b in zip(got_p, base_p)), (tile, warps)
        for a, b in zip(got_s, base_s):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (tile, warps)


def test_kernel_targets(bench, capsys):
    """The PASS / FAIL lines: each 8-bit elementwise optimizer against 70% of the copy bandwidth, CAME against 1.3x and
    LAMB against 1.2x 8-bit AdamW's time, 8-bit AdamW against bitsandbytes."""
    n, bw = 10**9, 3e12
    assert bench.ideal_bytes("adamw-8", torch.bfloat16) == 10  # B/param: 10 GB per step, as the rows below take
    rows = {
        "lowmemopt-adamw-8bit": 10e9 / (0.75 * bw),
        "lowmemopt-lion-8bit": 8e9 / (0.5 * bw),
        "lowmemopt-came-8bit": 1.25 * 10e9 / (0.75 * bw),
        "lowmemopt-lamb-8bit": 1.25 * 10e9 / (0.75 * bw),
        "bnb-adamw8bit": 1.0,
    }
    bench._targets(rows, n, bw, torch.bfloat16)
    out = capsys.readouterr().out
    assert "lowmemopt-adamw-8bit >= 70% of copy bandwidth: 75% -> PASS" in out
    assert "lowmemopt-lion-8bit >= 70% of copy bandwidth: 50% -> FAIL" in out
    assert "lowmemopt-came-8bit <= 1.3x 8-bit AdamW: 1.25x -> PASS" in out
    assert "lowmemopt-lamb-8bit <= 1.2x 8-bit AdamW: 1.25x -> FAIL" in out
    assert "8-bit AdamW <= 1.0x bitsandbytes: 0.00x -> PASS" in out
    assert "sgd" not in out  # a row that did not run has no line


@pytest.mark.skipif(not runtime.INTERPRET, reason="needs TRITON_INTERPRET=1 (the kernels on CPU tensors)")
@pytest.mark.parametrize("bits", [8, 4])
def test_q8_decode_modes_are_bit_identical(bits, monkeypatch):
    """``runtime.Q8_DECODE = "arithmetic"`` (codes decoded from their bits, no code-book gather) gives the table's
    results bit for bit: every 8-bit kernel optimizer, 2 steps, params and state; 4-bit state keeps its books."""
    from lowmemopt.kernels import codec
    from optim_info import OPTIMIZERS, STATEFUL

    shapes = [(300,), (47, 53), (3, 5, 70)]
    for info in OPTIMIZERS:
        kernels = info.cls.algorithm.kernels
        if info.name not in STATEFUL or kernels is None or kernels.triton is None:
            continue
        runs = []
        for mode in ("table", "arithmetic"):
            monkeypatch.setattr(runtime, "Q8_DECODE", mode)
            books = codec.maps(torch.device("cpu"), "q8")[::2]
            assert (books == (None, None)) == (mode == "arithmetic")
            params = make_params(shapes, seed=2)
            opt = info.cls(params, state_bits=bits, min_quant_numel=64, **STATEFUL[info.name])
            dispatch.stats.clear()
            for t in range(2):
                set_grads(params, t)
                with runtime.cpu_interpreter():
                    opt.step()
            assert dispatch.stats, info.name
            runs.append((params, opt))
        (a, opt_a), (b, opt_b) = runs
        for p, q in zip(a, b):
            assert torch.equal(p, q), info.name
            for key, value in opt_a.state[p].items():
                other = opt_b.state[q][key]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (
                    info.name,
                    key,
                )
