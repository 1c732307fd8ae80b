"""Block-wise 8-bit quantization: the fast encoder equals a brute-force nearest-code search code for code."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowmemopt.quant import (
    code_book,
    dequantize_blockwise,
    dynamic_map,
    nearest_code_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
)
from lowmemopt.quant.maps import POW2_BITS, encode_table, is_signed_map, pow2_map

MAPS = ["pow2", "upow2", "dynamic", "udynamic"]


def _data(name: str, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-9, 2, n).flip(0)[torch.randperm(n, generator=gen)]
    return x if is_signed_map(name) else x.abs()


def test_maps_equal_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(dynamic_map(True), F.create_dynamic_map(signed=True))
    assert torch.equal(dynamic_map(False), F.create_dynamic_map(signed=False))


@pytest.mark.parametrize("name", MAPS)
def test_maps_sorted_unique_in_range(name):
    book = code_book(name)
    assert book.numel() == 256 and torch.all(book[1:] > book[:-1])
    assert book.max() == 1.0 and (book.min() >= -1.0 if is_signed_map(name) else book.min() == 0.0)
    assert (book == 0).sum() == 1


@pytest.mark.parametrize("name", ["pow2", "upow2"])
def test_pow2_maps_are_floats_with_few_mantissa_bits(name):
    """Binade k ([2^-(k+1), 2^-k)) holds exactly 2^bits[k] codes, evenly spaced from its start: each code is a float
    whose mantissa has bits[k] significant bits. Signed: the negative side mirrors the positive one, without -1."""
    book, bits = pow2_map(is_signed_map(name)), POW2_BITS[name]
    pos = book[(book > 0) & (book < 1)]
    for k, b in enumerate(bits):
        lo, hi = 2.0 ** -(k + 1), 2.0**-k
        inside = pos[(pos >= lo) & (pos < hi)]
        assert torch.equal(inside, lo * (1 + torch.arange(2**b) / 2**b)), k
    assert pos.min() == 2.0 ** -len(bits)  # nothing below the lowest binade but 0
    if is_signed_map(name):
        assert torch.equal(-book[book < 0].flip(0), pos)


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("n,block", [(256 * 7, 256), (1000, 256), (4099, 64), (5, 256), (1, 16)])
def test_codes_equal_brute_force(name, n, block):
    x = _data(name, n)
    codes, absmax = quantize_blockwise(x, name, block)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, name, block)
    assert codes.dtype == torch.uint8 and absmax.dtype == torch.float32
    assert absmax.numel() == (n + block - 1) // block
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("name", MAPS)
def test_every_bucket_boundary_exact(name):
    """Values right at and around every decision point of the rounding rule (code midpoints, ties)."""
    book = code_book(name)
    mids = (book[1:] + book[:-1]) / 2
    around = torch.cat(
        [mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)), book]
    )
    if not is_signed_map(name):
        around = around[around >= 0]
    table = encode_table(name)
    bucket = torch.bitwise_right_shift(around.view(torch.int32), 16).bitwise_and(0xFFFF)
    fast = table.lo[bucket].long() + (around >= table.threshold[bucket]).long()
    assert torch.equal(fast, nearest_code_reference(around, name))


@pytest.mark.parametrize("name", MAPS)
def test_all_zero_blocks_and_ragged_tail(name):
    x = _data(name, 256 * 3 + 17)
    x[256:512] = 0  # an all-zero block
    x[-17:] = 0  # an all-zero ragged tail
    codes, absmax = quantize_blockwise(x, name, 256)
    assert absmax[1] == 0 and absmax[-1] == 0
    y = dequantize_blockwise(codes, absmax, name, 256)
    assert torch.all(y[256:512] == 0) and torch.all(y[-17:] == 0)
    assert torch.isfinite(y).all()


def test_non_contiguous_input():
    x = _data("dynamic", 64 * 96).view(64, 96)
    xt = x.t()
    assert not xt.is_contiguous()
    codes, absmax = quantize_blockwise(xt, "dynamic", 256)
    ref_codes, ref_absmax = quantize_blockwise(xt.contiguous(), "dynamic", 256)
    assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)


@pytest.mark.parametrize("name", ["upow2", "udynamic"])
def test_unsigned_map_never_flushes_to_zero(name):
    """An outlier next to tiny values: every non-zero value decodes to a non-zero value (no m/eps explosion)."""
    x = torch.full((256,), 1e-12)
    x[0] = 1e4
    x[1] = 0.0
    codes, absmax = quantize_blockwise(x, name, 256)
    y = dequantize_blockwise(codes, absmax, name, 256)
    assert y[1] == 0  # a true zero stays zero
    assert torch.all(y[2:] > 0)
    assert torch.all(y[2:] == code_book(name)[1] * 1e4)  # the smallest positive code


@pytest.mark.parametrize("name", ["pow2", "dynamic"])
def test_signed_map_keeps_sign_and_zero(name):
    x = torch.tensor([0.0, 1e-12, -1e-12, 3.0, -3.0] + [0.0] * 251)
    codes, absmax = quantize_blockwise(x, name, 256)
    y = dequantize_blockwise(codes, absmax, name, 256)
    assert y[0] == 0 and y[1] == 0 and y[2] == 0 and y[3] == 3.0
    torch.testing.assert_close(y[4], torch.tensor(-3.0), rtol=1e-6, atol=0)  # the scale covers the negative extreme


@pytest.mark.parametrize("name", MAPS)
def test_roundtrip_error_bound(name):
    """Error at most half the local code spacing (relative to the block scale: 2^-7 at the top binade of the pow2
    maps, 0.0035 / 0.0070 at the top decade of the dynamic ones), and the decoded value re-encodes to its code."""
    x = _data(name, 256 * 40, seed=3)
    codes, absmax = quantize_blockwise(x, name, 256)
    y = dequantize_blockwise(codes, absmax, name, 256)
    book = code_book(name)
    gap = (book[1:] - book[:-1]).view(-1)
    rel = ((y - x).abs().view(-1, 256) / absmax.unsqueeze(1)).max()
    assert rel <= gap.max() / 2 * (1 + 1e-5)
    scaled = x.view(-1, 256) / absmax.unsqueeze(1)
    c = codes.view(-1, 256).long()
    local = torch.where(scaled >= book[c], gap[c.clamp(max=254)], gap[(c - 1).clamp(min=0)])  # the gap x sits in
    ok = (scaled - book[c]).abs() <= local / 2 * (1 + 1e-5) + 1e-30
    if not is_signed_map(name):  # below half the smallest code: the floor (never the zero code), not the nearest
        ok |= (scaled < book[1] / 2) & (c == 1)
    assert torch.all(ok)
    # and the decoded value is the nearest code times absmax (idempotent re-encode)
    codes2, absmax2 = quantize_blockwise(y, name, 256)
    assert torch.equal(codes2, codes)
    torch.testing.assert_close(absmax2, absmax, rtol=2e-7, atol=0)


@pytest.mark.parametrize("name", ["pow2", "dynamic"])
def test_signed_scale_makes_negative_extreme_exact(name):
    """The signed maps stop at -0.984 (pow2) / -0.99297 (dynamic); the block scale is chosen so a negative extreme
    still round-trips (no shrink at every re-encode of a first moment)."""
    x = torch.zeros(256)
    x[0], x[1] = -2.0, 1.0
    codes, absmax = quantize_blockwise(x, name, 256)
    y = dequantize_blockwise(codes, absmax, name, 256)
    torch.testing.assert_close(y[0], torch.tensor(-2.0), rtol=1e-6, atol=0)
    m, g = torch.zeros(256), torch.zeros(256)
    m[0] = g[0] = -1.0
    for _ in range(50):  # an EMA sitting at its fixed point -1 must stay there
        m = dequantize_blockwise(*quantize_blockwise(0.9 * m + 0.1 * g, name, 256), name, 256)
    assert -1.0001 < m[0] < -0.9999


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=700),
    block=st.sampled_from([16, 64, 256]),
    name=st.sampled_from(MAPS),
)
def test_property_brute_force(data, block, name):
    x = torch.tensor(data, dtype=torch.float32)
    if not is_signed_map(name):
        x = x.abs()
    codes, absmax = quantize_blockwise(x, name, block)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, name, block)
    assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)


def test_dequantize_validates_inputs():
    codes, absmax = quantize_blockwise(torch.randn(1000), "dynamic", 256)
    with pytest.raises(ValueError, match="blocks"):
        dequantize_blockwise(codes, absmax, "dynamic", 128)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_blockwise(codes.int(), absmax, "dynamic", 256)
    with pytest.raises(ValueError, match="unknown quantization map"):
        quantize_blockwise(torch.randn(10), "nf4", 256)


def test_pow2_maps_quantize_real_adam_state_better_than_dynamic_maps():
    """The reason the state maps are pow2: on Adam state from a real training run (the byte MLP on text), the update
    m / (sqrt(v) + eps) rebuilt from 8-bit m and v is closer to the fp32 one than with bitsandbytes' dynamic maps
    (measured 0.0116 against 0.0138 relative L2 at 300 steps; 0.0128 against 0.0174 on a LLaMA at 600)."""
    import lowmemopt
    from lowmemopt import demo

    opts = []
    demo.train_bytes(lambda p: opts.append(lowmemopt.AdamW(p, lr=1e-3, weight_decay=0.01)) or opts[0], 120)
    states = [s for p, s in opts[0].state.items() if p.numel() >= 4096]
    assert states

    def update_error(signed_map: str, unsigned_map: str) -> float:
        err = ref = 0.0
        for s in states:
            m, v = s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)
            mq = dequantize_blockwise(*quantize_blockwise(m, signed_map), signed_map)
            vq = dequantize_blockwise(*quantize_blockwise(v, unsigned_map), unsigned_map)
            u, uq = m / (v.sqrt() + 1e-8), mq / (vq.sqrt() + 1e-8)
            err += float((uq - u).square().sum())
            ref += float(u.square().sum())
        return (err / ref) ** 0.5

    pow2, dynamic = update_error("pow2", "upow2"), update_error("dynamic", "udynamic")
    assert pow2 < 0.95 * dynamic, (pow2, dynamic)
