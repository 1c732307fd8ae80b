"""The kernels' division by a shared divisor (``lowmemopt.kernels.divide``) against IEEE division, and the 8-bit
encoder that uses it against the reference codec on blocks at the ends of the fp32 range. Interpreted kernels: the
interpreter's fp32 products and fmas round once, as a GPU's do."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import interpreter_fma_rounds_once


from lowmemopt.kernels import runtime

pytestmark = pytest.mark.skipif(
    not runtime.INTERPRET, reason="needs TRITON_INTERPRET=1 (conftest sets it without CUDA)"
)
#: the Markstein quotients are IEEE's only with an fma that rounds once, as a GPU's (and Triton 3.9's interpreter's)
exact_fma = pytest.mark.skipif(
    runtime.INTERPRET and not interpreter_fma_rounds_once(),
    reason="this Triton's interpreter rounds tl.fma twice (before Triton 3.9): quotients "
    "cannot be compared bit for bit with IEEE division",
)
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from lowmemopt.kernels import divide  # noqa: E402

BLOCK = 64


@triton.jit
def _rows_kernel(x_ptr, s_ptr, q_ptr, pos_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = row * BLOCK + tl.arange(0, BLOCK)[None, :]
    s = tl.load(s_ptr + row + tl.arange(0, 1))
    x = tl.load(x_ptr + offs)
    tl.store(q_ptr + offs, divide.row_quotients(x, s, False))
    tl.store(pos_ptr + offs, divide.quotient_positive(x, s, False).to(tl.int8))


@triton.jit
def _shared_kernel(x_ptr, q_ptr, b, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    tl.store(q_ptr + offs, divide.div_by(x, b, divide.reciprocal(b)), mask=mask)


def rows(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quotients, positive) of ``x`` [R, BLOCK] by ``s`` [R] through the kernel."""
    q, pos = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int8)
    _rows_kernel[(x.shape[0],)](x.contiguous(), s.contiguous(), q, pos, BLOCK=x.shape[1])
    return q, pos.bool()


def f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def divisors(gen: torch.Generator, n: int) -> torch.Tensor:
    """Positive divisors over every binade (subnormals and the top binade included), mantissas random or all ones."""
    exps = torch.randint(0, 255, (n,), generator=gen)
    mant = torch.randint(0, 1 << 23, (n,), generator=gen)
    mant[::3] = (1 << 23) - 1 - mant[::3] % 4  # the divisors Newton's reciprocal finds hardest
    s = f32((exps << 23) | mant)
    return torch.where(s > 0, s, torch.tensor(1e-45))


@exact_fma
def test_row_quotients_equal_ieee_division_where_codes_can_tell():
    """Every quotient of magnitude >= 2^-30 equals ``x / s`` bit for bit, for divisors from the smallest subnormal to
    the largest float; smaller ones are within a few ulps of it, never of the other sign."""
    gen = torch.Generator().manual_seed(0)
    n_rows = 4096
    s = divisors(gen, n_rows)
    y = 2.0 ** (-40 * torch.rand(n_rows, BLOCK, generator=gen, dtype=torch.float64))
    y = y * torch.where(torch.rand(n_rows, BLOCK, generator=gen) < 0.5, -1.0, 1.0)
    y[:, :4] = torch.tensor([1.0, -1.0, 0.0, 2.0**-30])  # the extremes a block holds, and the threshold
    x = (s.double()[:, None] * y).float()  # |x| <= s: a block's values against its scale
    q, _ = rows(x, s)
    ref = x / s[:, None]
    exact = ref.abs() >= 2.0**-30
    assert exact.float().mean() > 0.7
    assert torch.equal(q[exact].view(torch.int32), ref[exact].view(torch.int32))
    small = ~exact
    assert ((q[small] - ref[small]).abs() <= 2.0**-50).all()
    assert (q[small] * ref[small] >= 0).all()


def test_quotient_positive_is_exact_at_half_the_smallest_subnormal():
    """``RN(x / s) > 0`` decided exactly where the quotient crosses 2^-150 (ties round to 0): divisors whose 2^-150
    multiple is normal (compared as patterns) and below (against floor(s / 2)), x a few ulps either side."""
    gen = torch.Generator().manual_seed(1)
    s = divisors(gen, 2048)
    s[:4] = torch.tensor([1.0, 2.0, 3.0, 2.0**24])  # floor(s / 2) exact: 2^-150 ties, the first normal multiple
    bound = s.double() * 2.0**-150  # the real x at which the quotient is exactly 2^-150
    near = torch.nextafter(bound.float(), torch.tensor(0.0)).view(torch.int32)[:, None]
    x = f32(torch.clamp(near + torch.arange(-2, BLOCK - 2)[None, :], min=0))
    x[:, -1] = 0.0
    x[:, -2] = -x[:, 0]
    q, pos = rows(x, s[:, None].expand(-1, 1).reshape(-1))
    ref = x / s[:, None]
    assert torch.equal(pos, ref > 0)
    assert pos.any(dim=1).all() and (~pos).any(dim=1).all()  # each row crosses the bound


def test_row_quotients_of_infinite_and_non_finite_values():
    """An infinite divisor gives 0 for finite x and NaN for infinite x, never positive; a NaN x gives NaN; as IEEE."""
    inf, nan = float("inf"), float("nan")
    x = torch.zeros(3, BLOCK)
    x[0, :4] = torch.tensor([1.0, -3e38, inf, -inf])
    x[1, :2] = torch.tensor([nan, 1e-30])
    x[2, :3] = torch.tensor([3e38, -1e-45, 1e-45])
    s = torch.tensor([inf, 1.0, 3e38])
    q, pos = rows(x, s)
    ref = x / s[:, None]
    assert torch.equal(q.isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert torch.equal(q[fin], ref[fin])
    assert not pos[0].any() and not pos[2, 1] and pos[2, 0] and not pos[2, 2]


@exact_fma
@pytest.mark.parametrize("b", [1.0, math.sqrt(1 - 0.999), math.sqrt(1 - 0.999**7), 0.7071, 1e-20, 0.0])
def test_div_by_equals_ieee_division(b):
    """``div_by`` is ``x / b`` bit for bit over square roots of every binade (Adam's ``sqrt(v) / sqrt(1 - beta2^t)``),
    zero, infinity and NaN, for the divisors the bias corrections take, one that overflows the largest roots, and 0."""
    gen = torch.Generator().manual_seed(2)
    v = f32(torch.randint(1, 0x7F800000, (1 << 16,), generator=gen))
    x = torch.cat([v.sqrt(), torch.tensor([0.0, float("inf"), float("nan"), 1.0, 2.0**-75])])
    out = torch.empty_like(x)
    _shared_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, b, x.numel(), BLOCK=1024)
    ref = x / torch.tensor(b, dtype=torch.float32)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


@pytest.mark.parametrize("name", ["pow2", "upow2"])
def test_encoder_codes_on_blocks_at_the_ends_of_the_range(name):
    """The 8-bit state encoder (one reciprocal per block) gives the codes and scales of the reference codec and of the
    brute-force specification for blocks of subnormals, of values near the largest float, spanning 2^150 (an element
    whose quotient rounds to 0 or to the smallest subnormal) and holding an infinity (its NaN quotient takes code 0,
    the others the code of 0)."""
    from lowmemopt.kernels import blockwise
    from lowmemopt.quant import quantize_blockwise
    from lowmemopt.quant.blockwise import quantize_blockwise_reference

    gen = torch.Generator().manual_seed(3)
    signed = name == "pow2"
    blocks = []
    for scale in (1e-45, 1e-40, 2.0**-126, 1e-20, 1.0, 1e20, 2.0**127, 3.4e38):
        b = torch.randn(BLOCK, generator=gen, dtype=torch.float64) * scale * 0.3
        b = b.clamp(-3.4e38, 3.4e38).float()
        b[0] = scale
        blocks.append(b if signed else b.abs())
    wide = torch.zeros(BLOCK)
    wide[0] = 3.0
    wide[1:9] = f32(torch.arange(1, 9))  # subnormal x: x / 3 is 2^-150-ish
    wide[9] = 2.0**-125
    blocks.append(wide)
    big = torch.full((BLOCK,), 2.0**100)
    big[1:6] = torch.tensor([2.0**-50, 2.0**-49, 1.5 * 2.0**-50, 1e-38, 2.0**-40])
    blocks.append(big)
    with_inf = torch.linspace(-1 if signed else 0, 1, BLOCK)
    with_inf[3] = float("inf")
    blocks.append(with_inf)
    x = torch.cat(blocks)
    codes, absmax = blockwise.quantize_blockwise_triton(x, name, BLOCK)
    for ref_codes, ref_absmax in (quantize_blockwise(x, name, BLOCK), quantize_blockwise_reference(x, name, BLOCK)):
        assert torch.equal(absmax, ref_absmax)
        assert torch.equal(codes, ref_codes), (codes != ref_codes).nonzero().flatten()[:10]
    if not signed:  # the positive values 2^150 below their block's scale keep a non-zero code
        assert int(codes[(len(blocks) - 3) * BLOCK + 9]) > 0
