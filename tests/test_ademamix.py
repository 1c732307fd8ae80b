"""AdEMAMix beyond the common suite (tests/optim_info.py): bitsandbytes' names and keywords, its warm-ups over a long
run against bitsandbytes, and state files converted between formats."""

from __future__ import annotations

import pytest
import torch
from helpers import clone_params, make_params, run

import lowmemopt

bnb_optim = pytest.importorskip("bitsandbytes.optim")
SHAPES = [(300,), (37, 53), (70, 91)]


def test_warm_ups_equal_bitsandbytes_past_their_end():
    """30 steps with t_alpha=20, t_beta3=10: alpha ramping then flat, beta3 rising then clamped; bit for bit."""
    kw = dict(lr=1e-2, betas=(0.9, 0.99, 0.999), alpha=4.0, t_alpha=20, t_beta3=10, weight_decay=0.05)
    ours, ref = make_params(SHAPES), make_params(SHAPES)
    run(lowmemopt.AdEMAMix(ours, **kw), ours, 30)
    run(bnb_optim.AdEMAMix(ref, **kw), ref, 30)
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)


def test_bitsandbytes_names_and_keywords():
    params = make_params(SHAPES)
    assert lowmemopt.AdEMAMix8bit(params).defaults["state_bits"] == 8
    assert lowmemopt.PagedAdEMAMix8bit(params).defaults["paged"] is True
    opt = lowmemopt.AdEMAMix(params, optim_bits=8, min_8bit_size=100, is_paged=True)
    assert (opt.defaults["state_bits"], opt.defaults["min_quant_numel"], opt.defaults["paged"]) == (8, 100, True)
    assert lowmemopt.AdEMAMix(params, optim_bits=32, state_bits=4).defaults["state_bits"] == 4  # (32: not given)
    with pytest.raises(ValueError, match="min_8bit_size=100 and min_quant_numel=50 disagree"):
        lowmemopt.AdEMAMix(params, min_8bit_size=100, min_quant_numel=50)


@pytest.mark.parametrize("dst_bits", [8, 4])
def test_state_file_converts_between_formats(tmp_path, dst_bits):
    """A 32-bit state file loads into an 8- or 4-bit AdEMAMix (each slot re-encoded) and steps on close to the
    32-bit run."""
    kw = dict(lr=1e-2, t_alpha=5, t_beta3=5, min_quant_numel=0)
    params = make_params(SHAPES)
    opt = lowmemopt.AdEMAMix(params, **kw)
    run(opt, params, 4)
    lowmemopt.save_state(opt, tmp_path / "s.safetensors")
    low = clone_params(params)
    opt_low = lowmemopt.AdEMAMix(low, state_bits=dst_bits, **kw)
    lowmemopt.load_state(opt_low, tmp_path / "s.safetensors")
    key = "codes" if dst_bits == 8 else "nibbles"
    assert all(f"{slot}.{key}" in opt_low.state[low[1]] for slot in ("exp_avg", "exp_avg_slow", "exp_avg_sq"))
    run(opt, params, 2, start=4)
    run(opt_low, low, 2, start=4)
    for p, q in zip(params, low):
        torch.testing.assert_close(p, q, rtol=0, atol=2 * 6 * 1e-2 * 0.1)  # a tenth of two steps of ~6 lr
