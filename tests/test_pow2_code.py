"""The Triton arithmetic encoder / decoder of the pow2 state maps (lowmemopt.kernels.pow2) under the interpreter:
code for code equal to the brute-force nearest-code rule (lowmemopt.quant.maps) at every decision threshold +-3 ulp,
every binade edge, zeros of both signs, negatives in the unsigned map, non-finite values and random blocks; the
decoder over all 256 codes. ``bench/pow2_exhaustive.py`` runs the same check over every fp32 bit pattern with
``|y| <= 1`` or non-finite (scaled block values lie in [-1, 1])."""

from __future__ import annotations

import pytest
import torch

from lowmemopt.cpu.codec import decision_thresholds
from lowmemopt.kernels import runtime
from lowmemopt.quant.maps import code_book, encode_table, is_signed_map, nearest_code_reference

pytestmark = pytest.mark.skipif(
    not runtime.INTERPRET, reason="needs TRITON_INTERPRET=1 (conftest sets it without CUDA)"
)
MAPS = ["pow2", "upow2"]


def _ulps(x: torch.Tensor, k: int) -> torch.Tensor:
    direction = torch.full_like(x, float("inf") if k > 0 else float("-inf"))
    for _ in range(abs(k)):
        x = torch.nextafter(x, direction)
    return x


def _adversarial(name: str) -> torch.Tensor:
    """Every decision threshold, code and code midpoint, every binade edge 2^-k (both signs), each +-1..3 ulp; zeros,
    subnormals, the extremes and a little beyond, non-finite values; for the unsigned map the negatives of all of them
    too. (Scaled values lie in [-1, 1]; far above 1, around 1e6, fp32 distances to all codes round equal and the
    brute-force rule stops being a nearest-code rule, so no value there is compared.)"""
    book, thr = code_book(name), decision_thresholds(name)[:255]
    edges = torch.tensor([2.0**-k for k in range(0, 150)])
    vals = [thr, book, (book[1:] + book[:-1]) / 2, edges, -edges]
    vals += [_ulps(t, k) for t in (thr, book, edges, -edges) for k in (-3, -2, -1, 1, 2, 3)]
    vals.append(
        torch.tensor(
            [
                0.0,
                -0.0,
                1e-45,
                -1e-45,
                1e-40,
                1e-30,
                1.0,
                -1.0,
                1.5,
                -1.5,
                1e3,
                -1e3,
                2e-7,
                -2e-7,
                float("inf"),
                float("-inf"),
                float("nan"),
                -float("nan"),
            ]
        )
    )
    y = torch.cat(vals)
    return torch.cat([y, -y]) if not is_signed_map(name) else y


@pytest.mark.parametrize("table", [True, False], ids=["class-table", "compares"])
@pytest.mark.parametrize("name", MAPS)
def test_encoder_at_every_threshold_and_edge(name, table):
    """Both ways of finding a value's class: the kernels' gather from the class table and the compares."""
    from lowmemopt.kernels import pow2

    y = _adversarial(name)
    got = pow2.codes(y, name, table=table)
    want = nearest_code_reference(y, name)
    bad = got != want
    assert not bad.any(), (int(bad.sum()), y[bad][:8].tolist(), got[bad][:8].tolist(), want[bad][:8].tolist())
    # the reference table (the generic kernel path) agrees on the same values, non-finite ones included
    table = encode_table(name).packed
    u = y.view(torch.int32)
    entry = table[(u >> 16) & 0xFFFF]
    t = (u & 0xFFFF) ^ ((u >> 31) & 0xFFFF)
    assert torch.equal(got, (entry >> 17) + (t >= (entry & 0x1FFFF)).int())


@pytest.mark.parametrize("table", [True, False], ids=["class-table", "compares"])
@pytest.mark.parametrize("name", MAPS)
def test_encoder_on_random_blocks(name, table):
    """Random values over 30 binades, scaled into blocks as the kernels do (x / absmax): codes equal the brute force."""
    from lowmemopt.kernels import pow2

    gen = torch.Generator().manual_seed(17)
    n = 1 << 15
    x = torch.randn(n, generator=gen) * torch.logspace(-9, 0, n)[torch.randperm(n, generator=gen)]
    x = x.view(-1, 256)
    scale = x.abs().amax(dim=1, keepdim=True) * torch.rand(x.shape[0], 1, generator=gen).add(1.0)
    y = (x / scale).reshape(-1)
    y = y if is_signed_map(name) else y.abs()
    assert torch.equal(pow2.codes(y, name, table=table), nearest_code_reference(y, name))


@pytest.mark.parametrize("name", MAPS)
def test_unsigned_rules_and_signed_extremes(name):
    """upow2: -0, negatives and 0 take code 0, the smallest positive float the smallest code; pow2: -1 takes code 0
    (the map has no -1), 1 the top code, -0 the zero code."""
    from lowmemopt.kernels import pow2

    zero = int(torch.nonzero(code_book(name) == 0)[0])
    y = torch.tensor([0.0, -0.0, -1e-30, -1.0, 1e-45, 1.0])
    got = pow2.codes(y, name).tolist()
    if is_signed_map(name):
        assert got == [zero, zero, zero, 0, zero, 255]
    else:
        assert got == [0, 0, 0, 0, 1, 255]


@pytest.mark.parametrize("name", MAPS)
def test_decoder_gives_every_code_value(name):
    from lowmemopt.kernels import pow2

    values = pow2.values(torch.arange(256), name)
    assert torch.equal(values.view(torch.int32), code_book(name).view(torch.int32))
    # and the encoder inverts it: every code value encodes to its own code
    assert torch.equal(pow2.codes(values, name), torch.arange(256, dtype=torch.int32))


def test_class_tables():
    """6 classes per map, ascending, each with a shift that keeps 23 - shift mantissa bits; unknown maps refused."""
    from lowmemopt.kernels import pow2

    for name in MAPS:
        classes = pow2.encode_classes(name)
        assert len(classes) == pow2.NCLASSES
        starts = [c[0] for c in classes]
        assert starts == sorted(starts) and all(18 <= c[2] <= 24 for c in classes)
    with pytest.raises(ValueError, match="no bit encoder"):
        pow2.encode_classes("dynamic")


@pytest.mark.parametrize("name", MAPS)
def test_class_table_rows_are_the_classes_of_each_binade(name):
    """One int64 row per binade from the lowest class's to 1.0's: the class whose range holds the binade (compared
    against a scan of the class bounds), add in the low 32 bits, shift in the high ones."""
    from lowmemopt.kernels import pow2

    classes = [c for c in pow2.encode_classes(name) if c[0] != 0x7FFFFFFF]
    rows = pow2.class_table(name).tolist()
    e_lo = classes[0][0] >> 23
    assert len(rows) == 128 - e_lo
    for e, row in zip(range(e_lo, 128), rows):
        lo, add, shift = max((c for c in classes if c[0] <= e << 23), key=lambda c: c[0])
        assert (row >> 32, row & 0xFFFFFFFF) == (shift, add % 2**32)
    assert pow2.class_table(name) is pow2.class_table(name, "cpu")  # cached
