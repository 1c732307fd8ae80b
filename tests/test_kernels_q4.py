"""4-bit state in the fused Triton kernels (``FMT == Q4``) against the eager 4-bit path (:mod:`lowmemopt.quant.q4`).

Under the Triton interpreter on CPU tensors, as ``test_kernels.py``: the standalone codec kernels
(``quantize_blockwise4`` / ``dequantize_blockwise4``) equal ``q4.quantize`` / ``q4.dequantize`` code for code and bit
for bit (random blocks, ragged and odd sizes, all-zero blocks, outliers, negative values and -0 in unsigned blocks, the
values on both sides of every rounding threshold); every optimizer's fused 4-bit step equals the eager 4-bit step
within the 8-bit kernel tests' bounds (``helpers.assert_state_close``: codes within one step, at most 2% off; under the
interpreter none are), and the kernel really ran (``dispatch.stats`` counts ``(algorithm, "q4")``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_params_close, assert_state_close, clone_params, make_params, set_grads
from optim_info import BY_NAME, STATEFUL
from test_kernels import KERNEL_OPTIMIZERS, _sync, check_against_reference, compiled_kernels, interpreted

import lowmemopt
from lowmemopt.kernels import runtime
from lowmemopt.quant import q4

pytestmark = pytest.mark.skipif(not runtime.HAS_TRITON, reason="triton is not installed")

MAPS = ["pow2x4", "upow2x4"]


def _codes(nibbles: torch.Tensor) -> torch.Tensor:
    """Every nibble of ``nibbles`` as int64 codes, element order (an odd numel's padding nibble last)."""
    return torch.stack((nibbles & 15, nibbles >> 4), 1).reshape(-1).long()


def _assert_codec_exact(x: torch.Tensor, name: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from lowmemopt.kernels import blockwise

    nibbles, absmax = blockwise.quantize_blockwise4(x, name, block_size)
    ref_nibbles, ref_absmax = q4.quantize(x, name, block_size)
    what = (name, block_size, x.numel(), x.dtype)
    assert torch.equal(nibbles, ref_nibbles) and torch.equal(absmax, ref_absmax), what
    out = blockwise.dequantize_blockwise4(nibbles, absmax, x.numel(), name, block_size)
    assert torch.equal(out, q4.dequantize(ref_nibbles, ref_absmax, x.numel(), name, block_size)), what
    return nibbles, absmax


# ---------------------------------------------------------------------------------------------------------------------
# standalone codec kernels


@interpreted
@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_codec4_matches_reference_exactly(name, block_size):
    """Nibbles and absmax equal ``q4.quantize``'s (and the brute-force specification's codes); decoding equal:
    ragged last blocks, odd sizes, an all-zero block, outliers, tiny values, bf16 input; for the unsigned map also
    negative values and -0 (they take code 0)."""
    gen = torch.Generator().manual_seed(4)
    for n in (1, 2, 17, block_size, block_size + 1, 3 * block_size + 5, 1001):
        x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 6
        if name == "upow2x4":
            x = x.abs()
        x[: min(n, block_size)] = 0  # an all-zero block
        if n > block_size + 6:
            x[block_size + 3] = 1e4 if name == "upow2x4" else -1e4  # an outlier
            x[block_size + 4] = 1e-9  # a tiny value: the zero-free map keeps it non-zero
            if name == "upow2x4":
                x[block_size + 5] = -0.5  # a negative value in an unsigned block
                x[block_size + 6] = -0.0
        for inp in (x, x.bfloat16()):
            nibbles, absmax = _assert_codec_exact(inp, name, block_size)
            ref_codes, ref_absmax = q4.quantize_reference(inp, name, block_size)
            assert torch.equal(_codes(nibbles)[:n], ref_codes) and torch.equal(absmax, ref_absmax)
            if n % 2:
                assert int(nibbles[-1]) >> 4 == 0, "an odd numel leaves the last byte's high nibble 0"
    assert int(absmax[0]) == 0  # the all-zero block
    if name == "upow2x4":
        codes = _codes(nibbles)
        assert int(codes[block_size + 5]) == 0 and int(codes[block_size + 6]) == 0


@interpreted
@pytest.mark.parametrize("name", MAPS)
def test_codec4_rounds_at_the_thresholds(name):
    """The floats on both sides of every rounding threshold (``q4.thresholds``) take the specification's codes; the
    block holds 1.0, so its scale is 1 and the values are encoded as they are."""
    from lowmemopt.quant.q4 import nearest_code4_reference

    t = q4.thresholds(name)
    values = torch.cat(
        [
            t,
            torch.nextafter(t, torch.full_like(t, -1.0)),
            torch.nextafter(t, torch.full_like(t, 2.0)),
            q4.code_book(name),
            torch.zeros(1),
        ]
    )
    for x in (values, values[1:]):  # (both byte positions of each value)
        x = torch.cat([torch.ones(1), x])
        nibbles, absmax = _assert_codec_exact(x, name, 128)
        assert absmax.tolist() == [1.0]
        assert torch.equal(_codes(nibbles)[: x.numel()], nearest_code4_reference(x, name))


@interpreted
def test_codec4_bad_inputs():
    from lowmemopt.kernels import blockwise

    x = torch.randn(100)
    with pytest.raises(ValueError, match="unknown 4-bit map"):
        blockwise.quantize_blockwise4(x, "pow2")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        blockwise.quantize_blockwise4(x, "pow2x4", 100)
    with pytest.raises(TypeError, match="floating-point"):
        blockwise.quantize_blockwise4(torch.ones(10, dtype=torch.int32))
    nibbles, absmax = blockwise.quantize_blockwise4(x)
    assert nibbles.numel() == 50 and absmax.numel() == 1
    with pytest.raises(ValueError, match="nibbles must be uint8 with 50 bytes"):
        blockwise.dequantize_blockwise4(nibbles[:-1], absmax, 100)
    with pytest.raises(TypeError, match="absmax must be float32"):
        blockwise.dequantize_blockwise4(nibbles, absmax.double(), 100)
    with pytest.raises(ValueError, match="absmax has 2 blocks"):
        blockwise.dequantize_blockwise4(nibbles, torch.zeros(2), 100)
    empty, empty_absmax = blockwise.quantize_blockwise4(torch.zeros(0))
    assert empty.numel() == 0 and empty_absmax.numel() == 0
    assert blockwise.dequantize_blockwise4(empty, empty_absmax, 0).numel() == 0
    assert lowmemopt.kernels.quantize_blockwise4 is blockwise.quantize_blockwise4


# ---------------------------------------------------------------------------------------------------------------------
# every optimizer's fused 4-bit step against the eager 4-bit step


CASES = [(info, i) for info in KERNEL_OPTIMIZERS for i in range(len(info.variants))]


@interpreted
@pytest.mark.parametrize("info,variant", CASES, ids=[f"{i.name}-v{v}" for i, v in CASES])
def test_kernel4_matches_reference(info, variant):
    """Every flag variant of the optimizer table at 4-bit state, 3 steps, odd 1-D/2-D/3-D shapes (ragged blocks, odd
    numels, one tensor below min_quant_numel: fp32 state in its own bucket)."""
    from lowmemopt.kernels import dispatch
    from lowmemopt.optimizer import kernel_algorithm

    algorithm = kernel_algorithm(info.cls)
    before = dispatch.stats.get((algorithm, "q4"), 0)
    _, opt = check_against_reference(info.cls, info.variants[variant], 4)
    ran = dispatch.stats.get((algorithm, "q4"), 0) - before
    if any(k.endswith(".nibbles") for st in opt.state.values() for k in st):
        assert ran >= 3, "the 4-bit kernel did not run every step"
    else:  # no full-size slot (SGD / LARS without momentum)
        assert ran == 0 and not info.variants[variant].get("momentum")


@interpreted
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "LAMB", "LARS", "Adafactor", "CAME", "AdEMAMix"])
def test_kernel4_bf16_params(name):
    check_against_reference(BY_NAME[name].cls, STATEFUL[name], 4, steps=2, dtype=torch.bfloat16)


@interpreted
def test_kernel4_ragged_zero_outliers_and_full_tiles(monkeypatch):
    """4-bit AdamW, block 64, on an odd-sized tensor of two full 2048-element tiles (unmasked variant) and a ragged
    one (masked): an all-zero gradient block, an outlier; the odd tail's high nibble stays 0."""
    from lowmemopt.kernels import adamw

    masked = []
    real = adamw._adam_tile
    monkeypatch.setattr(
        adamw,
        "_adam_tile",  # (..., MASKED, COLS; the loss scale's gmul by keyword)
        lambda *a, **k: masked.append(bool(a[-2])) or real(*a, **k),
    )
    n = 2 * runtime.TILE + 5
    params = make_params([(n,)])
    ref_params = clone_params(params)
    kw = dict(lr=1e-2, state_bits=4, min_quant_numel=0, block_size=64)
    opt, ref = lowmemopt.AdamW(params, **kw), lowmemopt.AdamW(ref_params, **kw)
    for t in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(t)) * 1e-3
        g[64:128] = 0
        g[300] = 50.0
        if t:
            _sync(opt, params, ref, ref_params)
        params[0].grad, ref_params[0].grad = g.clone(), g.clone()
        with runtime.cpu_interpreter():
            opt.step()
        ref.step()
        assert_state_close(opt.state[params[0]], ref.state[ref_params[0]], f"step {t + 1}")
        assert_params_close(params, ref_params, 1e-2, True, f"step {t + 1}")
    assert masked == [False, False, True] * 3
    st = opt.state[params[0]]
    zero_code = int((q4.code_book("pow2x4") == 0).nonzero())
    assert float(st["exp_avg.absmax"][1]) == 0 and set(_codes(st["exp_avg.nibbles"][32:64]).tolist()) == {zero_code}
    assert int(st["exp_avg.nibbles"][-1]) >> 4 == 0 and int(st["exp_avg_sq.nibbles"][-1]) >> 4 == 0
    v = q4.dequantize(st["exp_avg_sq.nibbles"], st["exp_avg_sq.absmax"], n, "upow2x4", 64)
    assert float(v[256:320].min()) > 0  # the outlier's block: a small v never decodes to 0


@interpreted
def test_kernel4_mixed_formats_in_one_optimizer():
    """Groups at 4 and 8 bits: separate buckets, each launched with its own format's maps."""
    from lowmemopt.kernels import dispatch

    a, b = make_params([(300,), (33, 9)]), make_params([(300,), (33, 9)], seed=3)
    ra, rb = clone_params(a), clone_params(b)
    groups = lambda x, y: [dict(params=x, state_bits=4), dict(params=y, state_bits=8)]  # noqa: E731
    opt = lowmemopt.AdamW(groups(a, b), lr=1e-2, min_quant_numel=64)
    ref = lowmemopt.AdamW(groups(ra, rb), lr=1e-2, min_quant_numel=64)
    before = dict(dispatch.stats)
    for t in range(2):
        if t:
            _sync(opt, a + b, ref, ra + rb)
        set_grads(a + b, t)
        for p, r in zip(a + b, ra + rb):
            r.grad = p.grad.clone()
        with runtime.cpu_interpreter():
            opt.step()
        ref.step()
        for p, r in zip(a + b, ra + rb):
            assert_state_close(opt.state[p], ref.state[r], f"mixed step {t + 1}")
        assert_params_close(a + b, ra + rb, 1e-2, True, f"mixed step {t + 1}")
    for fmt in ("q4", "q8"):
        assert dispatch.stats.get(("adam", fmt), 0) - before.get(("adam", fmt), 0) == 2, fmt
    assert opt.param_groups[0]["block_size"] == 128 and "exp_avg.nibbles" in opt.state[a[0]]


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the compiled 4-bit codec against the CPU reference (skipped without CUDA)


@pytest.mark.gpu
@compiled_kernels
def test_gpu_codec4_matches_reference():
    from lowmemopt.kernels import blockwise

    x = torch.randn((1 << 20) + 1) * torch.rand((1 << 20) + 1) ** 6
    x[:128] = 0
    x[1000] = 1e4
    for name, inp in (("pow2x4", x), ("upow2x4", x.abs())):
        nibbles, absmax = blockwise.quantize_blockwise4(inp.cuda(), name)
        ref_nibbles, ref_absmax = q4.quantize(inp, name)
        assert torch.equal(nibbles.cpu(), ref_nibbles) and torch.equal(absmax.cpu(), ref_absmax)
        out = blockwise.dequantize_blockwise4(nibbles, absmax, inp.numel(), name)
        assert torch.equal(out.cpu(), q4.dequantize(ref_nibbles, ref_absmax, inp.numel(), name))
