"""CAME: bit-exact with came_pytorch on 1-D..4-D shapes, the confidence term on factored params only, a clear error for
a missing lr, and exact state bytes. The common suite (tests/optim_info.py) covers the rest."""

from __future__ import annotations

import pytest
import torch
from helpers import clone_params, make_params, run_with_reference

import lowmemopt

came_pytorch = pytest.importorskip("came_pytorch")

SHAPES = [(300,), (37, 53), (5, 7, 129), (8, 3, 5, 5)]


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99, 0.999)), dict(lr=3e-2, clip_threshold=0.5)],
    ids=["defaults", "weight_decay-betas", "clip"],
)
def test_bit_exact_with_came_pytorch(kwargs):
    params = make_params(SHAPES)
    ref_params = clone_params(params)
    ours, ref = lowmemopt.CAME(params, **kwargs), came_pytorch.CAME(ref_params, **kwargs)
    run_with_reference(ours, params, ref, ref_params, 20)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
        ours_state, ref_state = ours.state[p], ref.state[r]
        assert set(ours_state) == set(ref_state) - {"RMS"}
        for key, value in ours_state.items():
            if key != "step":
                assert torch.equal(value, ref_state[key]), key


def test_confidence_term_only_for_factored_params():
    """1-D: the step is lr * m (no instability statistics); 2-D: lr * m / sqrt(U) with fp32 row/column U."""
    vec, mat = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4, 6))
    opt = lowmemopt.CAME([vec, mat], lr=0.1)
    g = torch.linspace(-1.0, 1.0, 6)
    vec.grad, mat.grad = g.clone(), g.repeat(4, 1)
    opt.step()
    assert "exp_avg_res_row" not in opt.state[vec] and opt.state[mat]["exp_avg_res_row"].shape == (4,)
    torch.testing.assert_close(vec.detach(), -0.1 * opt.state[vec]["exp_avg"])
    assert not torch.allclose(mat.detach()[0], -0.1 * opt.state[mat]["exp_avg"][0])


def test_missing_lr_is_a_clear_error():
    with pytest.raises(TypeError, match="lr is required"):
        lowmemopt.CAME([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(TypeError, match="lr is required"):
        lowmemopt.CAME8bit([torch.nn.Parameter(torch.zeros(3))])


def test_came8bit_alias():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = lowmemopt.CAME8bit(p, lr=1e-3)
    assert isinstance(opt, lowmemopt.CAME) and opt.defaults["state_bits"] == 8 and opt.defaults["lr"] == 1e-3
    with pytest.raises(ValueError, match=r"CAME8bit has state_bits=8 \(its name\).*use CAME\(\.\.\., state_bits=16\)"):
        lowmemopt.CAME8bit(p, lr=1e-3, state_bits=16)
    assert lowmemopt.CAME8bit(p, lr=1e-3, state_bits=8).defaults["state_bits"] == 8


@pytest.mark.parametrize(
    "shape,bits,expected",
    [
        # m quantized (1 + 4/256 B/param) + 4 fp32 vectors (sq and res, row and col): 2 (R + C) x 4 B
        ((1024, 1024), 8, (1 << 20) + 4 * 4096 + 8 * 2048),  # 1.0313 B/param
        ((2048, 1024), 8, (2 << 20) + 4 * 8192 + 8 * 3072),  # 1.0273 B/param
        ((1024, 1024), 32, 4 * (1 << 20) + 8 * 2048),
        ((1024, 1024), 16, 2 * (1 << 20) + 8 * 2048),
        ((1 << 20,), 8, 2 * ((1 << 20) + 4 * 4096)),  # 1-D: m and the full second moment, both quantized
    ],
)
def test_state_bytes_exact(shape, bits, expected):
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = lowmemopt.CAME([p], lr=1e-3, state_bits=bits)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_nbytes() == expected
    for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"):
        if key in opt.state[p]:
            assert opt.state[p][key].dtype == torch.float32


def test_came8bit_bytes_per_param_on_llama_sized_matrices():
    """<= 1.03 B/param on the 150M LLaMA's MLP matrices (2048 x 768, 768 x 2048) and on 2048 x 1024. The fp32
    statistics add 8 (R + C) / (R C) B/param to the 8-bit first moment's 1 + 4/256, so the bound needs
    8 (R + C) / (R C) <= 0.0144: a 1024 x 1024 matrix has 1.0313 B/param (test_state_bytes_exact)."""
    for shape in [(2048, 768), (768, 2048), (2048, 1024)]:
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = lowmemopt.CAME8bit([p], lr=1e-3)
        p.grad = torch.ones_like(p)
        opt.step()
        assert opt.state_nbytes() / p.numel() <= 1.03, shape
