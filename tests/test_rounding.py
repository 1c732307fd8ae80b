"""bf16_update: stochastic rounding and Kahan compensation of bf16 and fp16 parameters (lowmemopt.rounding).

The reference is :mod:`lowmemopt.rounding`; the eager path, the native C kernels and the Triton kernels (interpreted
on CPU) must give the same 16-bit patterns, and the same Kahan buffer."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import interpreter_fma_rounds_once, load_bench

import lowmemopt
from lowmemopt import cpu, rounding
from lowmemopt.pipeline.backends import update_flat
from lowmemopt.work.record import BucketRecord

BF16, FP16 = torch.bfloat16, torch.float16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


def _step(opt, backend: str) -> None:
    """``opt.step()``; on the Triton kernels (the CPU interpreter) for ``backend == "triton"``."""
    from lowmemopt.kernels import runtime

    if backend == "triton":
        with runtime.cpu_interpreter():
            opt.step()
    else:
        opt.step()


# ---------------------------------------------------------------------------------------------------------------------
# the pure functions


def test_bad_mode_is_rejected():
    p = torch.nn.Parameter(torch.zeros(4, dtype=BF16))
    with pytest.raises(ValueError, match="Invalid bf16_update: 'round'"):
        lowmemopt.AdamW([p], bf16_update="round")
    opt = lowmemopt.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="supported: 'nearest', 'stochastic', 'kahan'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "bf16_update": None})
    assert opt.param_groups[0]["bf16_update"] == "nearest"


def test_hash_matches_its_integer_definition():
    key = rounding.step_key(123456789, 7)
    lo = (1 << 32) - 5  # indices wrap mod 2^32
    got = rounding.random_bits(key, lo, 10).tolist()
    want = [rounding._mix_int(((i & rounding.M32) ^ key)) >> 16 for i in range(lo, lo + 10)]
    assert got == want
    assert rounding.step_key(1, 1) != rounding.step_key(1, 2) != rounding.step_key(2, 2)


def test_stochastic_round_picks_a_neighbour_and_is_chunk_invariant():
    torch.manual_seed(0)
    x = torch.randn(5000) * torch.logspace(-30, 30, 5000)
    key = rounding.step_key(99, 3)
    y = rounding.stochastic_round(x, key).float()
    trunc = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # toward zero; the other neighbour is away from it
    away = torch.nextafter(trunc.to(BF16), (x.sign() * math.inf).to(BF16)).float()
    exact = trunc == x
    assert torch.all((y == trunc) | (y == away))
    assert torch.equal(y[exact], x[exact])
    assert 0.2 < (y == away).float().mean() < 0.8  # both neighbours happen
    parts = torch.cat([rounding.stochastic_round(x[a : a + 777], key, a) for a in range(0, 5000, 777)])
    assert torch.equal(_bits(parts), _bits(rounding.stochastic_round(x, key)))


def test_stochastic_round_special_values():
    big = torch.tensor(3.3961e38)  # above the largest bf16 (3.3895e38): may round up to inf, never to NaN
    x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-41, -1e-41])
    for key in range(50):
        y = rounding.stochastic_round(x, key)
        assert _bits(y)[:2].tolist() == [0x7FC0, 0x7FC0]
        assert y[2:4].tolist() == [math.inf, -math.inf] and y[4:6].tolist() == [0.0, 0.0]
        assert torch.signbit(y[5]) and not torch.isnan(y[2:]).any()
        r = rounding.stochastic_round(torch.stack([big, -big]), key)
        assert not torch.isnan(r).any() and r.abs().min() >= 3.3895e38


@pytest.mark.parametrize("value", [1.0 + 2**-9, -3.0 - 2**-7 * 0.3, 1e-3 * (1 + 2**-8 * 0.9)])
def test_stochastic_round_is_unbiased(value):
    # many elements and many steps of one value between two bf16 neighbours: the mean is the value
    x = torch.full((4096,), value)
    means = torch.stack([rounding.stochastic_round(x, rounding.step_key(5, s), 0).double().mean() for s in range(25)])
    lo = x.to(BF16).double()[0]
    gap = abs(float(torch.nextafter(torch.tensor(value, dtype=BF16), torch.tensor(0.0, dtype=BF16)) - lo.to(BF16)))
    gap = max(gap, abs(float(lo) - value) * 2)  # the neighbour gap (either side)
    n = x.numel() * len(means)
    se = gap * 0.5 / math.sqrt(n)  # a Bernoulli of p <= 1 times the gap
    assert abs(means.mean().item() - value) < 5 * se + 1e-12, (means.mean().item(), value, se)


def test_kahan_round_carries_what_rounding_lost():
    # 1000 updates of ~1e-4 (each below half a bf16 ulp at 1.0: 2^-8 = 0.0039)
    g = torch.Generator().manual_seed(0)
    updates = torch.rand(1000, 1000, generator=g) * 2e-4
    p = torch.ones(1000, dtype=BF16)
    c = torch.zeros_like(p)
    near = p.clone()
    for u in updates:
        p, c = rounding.kahan_round(p, p.float() + u, c)
        near = (near.float() + u).to(BF16)
    want = 1.0 + updates.double().sum(0)
    # the buffer is bf16 (its own rounding: <= 2^-9 of |c| <= 2^-8 per step): within 0.5% of the sum of updates
    assert ((p.double() + c.double() - want).abs() / (want - 1)).max() < 5e-3
    assert (p.double() - want).abs().max() <= 2**-7  # the parameter itself within one bf16 ulp of the exact sum
    assert torch.all(near == 1.0)  # round-to-nearest lost every update


def _fp16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 values either side of each ``x`` (|x| <= 65504): toward zero, away from it (equal where exact)."""
    near = x.to(FP16)
    trunc = torch.where(near.float().abs() > x.abs(), torch.nextafter(near, torch.zeros_like(near)), near)
    away = torch.where(trunc.float() == x, trunc, torch.nextafter(trunc, (x.sign() * math.inf).to(FP16)))
    return trunc.float(), away.float()


def test_fp16_stochastic_round_picks_a_neighbour_and_is_chunk_invariant():
    torch.manual_seed(0)
    x = torch.randn(6000) * torch.logspace(-9, 4.7, 6000)  # subnormals (< 6.1e-5) through 5e4
    x = x[x.abs() <= 65504]
    key = rounding.step_key(99, 3)
    y = rounding.stochastic_round(x, key, dtype=FP16)
    assert y.dtype == FP16
    trunc, away = _fp16_neighbours(x)
    assert torch.all((y.float() == trunc) | (y.float() == away))
    sub = x.abs() < 2**-14
    for part in (sub, ~sub):  # both neighbours happen, in the subnormal and the normal range
        assert 0.2 < (y.float() == away)[part & (trunc != away)].float().mean() < 0.8
    parts = torch.cat([rounding.stochastic_round(x[a : a + 777], key, a, FP16) for a in range(0, x.numel(), 777)])
    assert torch.equal(_bits(parts), _bits(y))


@pytest.mark.parametrize(
    "value",
    [
        1.0 + 2**-12,
        -3.0 - 2**-9 * 0.3,
        1e-3 * (1 + 2**-8 * 0.9),
        2.0**-14 + 2**-30,
        40000.3,
        3e-5,
        -1.3e-7,
        2.0**-14 - 2**-27,
        1e-9,
    ],
)
def test_fp16_stochastic_round_is_unbiased_over_every_random_value(value):
    # all 2^16 values of the random bits: the mean of the roundings is the value exactly in the normal range, and
    # within 2^-16 of a subnormal ulp (2^-40) below it in magnitude for a subnormal result
    x = torch.full((1 << 16,), value)
    bits = x.view(torch.int32).to(torch.int64) & rounding.M32
    h = rounding._fp16_stochastic_bits(x, bits, torch.arange(1 << 16))
    y = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(FP16).double()
    trunc, away = _fp16_neighbours(x[:1])
    assert set(y.unique().tolist()) <= {trunc.item(), away.item()}
    err = y.mean().item() - float(x[0])
    if abs(value) >= 2**-14:
        assert err == 0.0
    else:
        assert -(2**-40) < math.copysign(1, value) * err <= 0.0
    # the hash's bits over many elements and steps: the same mean within a few standard errors
    means = torch.stack(
        [rounding.stochastic_round(x[:4096], rounding.step_key(5, s), 0, FP16).double().mean() for s in range(25)]
    )
    se = abs(away.item() - trunc.item()) * 0.5 / math.sqrt(4096 * 25)
    assert abs(means.mean().item() - float(x[0])) < 5 * se + 2**-40


def test_fp16_stochastic_round_special_values():
    # past 65504: as round to nearest (65504 below 65520, Inf from it); NaN stays NaN; zeros keep their sign; the
    # smallest subnormal and the least normal are exact; a value below 2^-40 rounds to zero
    x = torch.tensor(
        [
            65504.0,
            65505.0,
            65519.99,
            65520.0,
            7e4,
            -65519.0,
            -65521.0,
            math.inf,
            -math.inf,
            math.nan,
            0.0,
            -0.0,
            2.0**-24,
            -(2.0**-14),
            2.0**-41,
            1e-45,
            3.4e38,
        ]
    )
    want = x.to(FP16)
    for key in range(50):
        y = rounding.stochastic_round(x, rounding.step_key(key, 1), 0, FP16)
        assert torch.equal(_bits(y[:9]), _bits(want[:9])) and torch.isnan(y[9])
        assert torch.equal(_bits(y[10:14]), _bits(want[10:14]))
        assert y[14:16].tolist() == [0.0, 0.0] and y[16].item() == math.inf
    big = torch.full((4096,), 65500.0)  # between 65472 and 65504: both, never Inf
    y = rounding.stochastic_round(big, 7, 0, FP16)
    assert set(y.tolist()) == {65472.0, 65504.0}


def test_fp16_kahan_round_carries_what_rounding_lost():
    # 1000 updates of ~1e-4 at 1.0 (half an fp16 ulp there: 2^-11 = 4.9e-4), and at 0.01 (the buffer is subnormal)
    g = torch.Generator().manual_seed(0)
    updates = torch.rand(1000, 1000, generator=g) * 2e-4
    for start, rel in ((1.0, 2e-3), (0.01, 2e-3)):
        p = torch.full((1000,), start, dtype=FP16)
        c = torch.zeros_like(p)
        near = p.clone()
        for u in updates:
            p, c = rounding.kahan_round(p, p.float() + u, c)
            near = (near.float() + u).to(FP16)
        assert c.dtype == FP16
        want = p.new_tensor(start, dtype=torch.float64) + updates.double().sum(0)
        total = want - float(torch.tensor(start, dtype=FP16))
        assert ((p.double() + c.double() - want).abs() / total).max() < rel
        ulp = 2.0 ** (math.floor(math.log2(want.max())) - 10)
        assert (p.double() - want).abs().max() <= ulp  # within an fp16 ulp of the exact sum
        if start == 1.0:
            assert torch.all(near == 1.0)  # round-to-nearest lost every update


# ---------------------------------------------------------------------------------------------------------------------
# the optimizers: eager / native C / Triton give the same bits


CASES = [
    (lowmemopt.SGD, dict(lr=1e-3, momentum=0.9, weight_decay=0.05)),
    (lowmemopt.Lion, dict(lr=1e-4, weight_decay=0.1)),
    (lowmemopt.AdamW, dict(lr=1e-4, weight_decay=0.1)),
]


def _run(cls, kw, mode, backend, monkeypatch, n=2048 + 64 + 13, steps=2, state_bits=32, paged=False, dtype=BF16):
    monkeypatch.setattr(cpu, "ENABLED", backend == "native")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, dtype=dtype))
    opt = cls([p], bf16_update=mode, state_bits=state_bits, min_quant_numel=0, paged=paged, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(n, generator=g).to(dtype)
        _step(opt, backend)
    return p, opt


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
def test_backends_bit_identical(cls, kw, mode, dtype, monkeypatch):
    from lowmemopt.kernels import dispatch, runtime

    if not (runtime.HAS_TRITON and runtime.INTERPRET):
        pytest.skip("needs TRITON_INTERPRET=1")
    ref, ropt = _run(cls, kw, mode, "eager", monkeypatch, dtype=dtype)
    before = sum(dispatch.stats.values())
    tri, topt = _run(cls, kw, mode, "triton", monkeypatch, dtype=dtype)
    assert sum(dispatch.stats.values()) > before  # the fused kernel really ran
    nat, nopt = _run(cls, kw, mode, "native", monkeypatch, dtype=dtype)
    near, _ = _run(cls, kw, "nearest", "eager", monkeypatch, dtype=dtype)
    assert not torch.equal(_bits(ref), _bits(near))
    # (an interpreter whose tl.fma rounds twice, before Triton 3.9, cannot give the kernels' bits: native C only)
    for p, opt in ((tri, topt), (nat, nopt))[0 if interpreter_fma_rounds_once() else 1 :]:
        assert torch.equal(_bits(p), _bits(ref))
        if mode == "kahan":
            assert torch.equal(_bits(opt.state[p][rounding.KAHAN]), _bits(ropt.state[ref][rounding.KAHAN]))
            assert ropt.state[ref][rounding.KAHAN].abs().max() > 0
            assert opt.state[p][rounding.KAHAN].dtype == dtype
        else:
            assert opt.state[p][rounding.SEED] == ropt.state[ref][rounding.SEED]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_8bit_state_native_and_eager_agree(mode, dtype, monkeypatch):
    # q8: the native kernel does the full blocks, the eager path the ragged rest at its element offset
    a, _ = _run(lowmemopt.AdamW, dict(lr=1e-4), mode, "eager", monkeypatch, n=4096 + 100, state_bits=8, dtype=dtype)
    b, _ = _run(lowmemopt.AdamW, dict(lr=1e-4), mode, "native", monkeypatch, n=4096 + 100, state_bits=8, dtype=dtype)
    assert torch.equal(_bits(a), _bits(b))


def _fp16_edge_case(mode, backend, monkeypatch, library=None):
    """SGD on two fp16 parameters whose results cross every fp16 case, two steps: ``small`` (lr 2^-10: updates of a
    fraction of an ulp, from subnormals through 1e3, zeros, the least normal) and ``top`` (lr 1: +-65504 moved away
    from zero by up to 40, past the largest fp16 and past 65520)."""
    from lowmemopt.cpu import build

    monkeypatch.setattr(cpu, "ENABLED", backend == "native")
    if library is not None:
        monkeypatch.setattr(build, "_lib", library)
    torch.manual_seed(0)  # the stochastic seed is drawn from torch's generator
    gen = torch.Generator().manual_seed(3)
    n = 4096 + 77
    p0 = torch.randn(n, generator=gen) * torch.logspace(-8, 3, n)  # 1e-8 (subnormal: below 6.1e-5) .. 1e3
    p0[:16] = 0.0
    p0[16:32] = 2.0**-14
    ulp = torch.where(p0.abs() < 2**-14, torch.tensor(2.0**-24), 2.0 ** (torch.floor(torch.log2(p0.abs())) - 10))
    small = torch.nn.Parameter(p0.to(FP16))
    g_small = (-torch.randn(n, generator=gen) * ulp * 0.7 * 2**10).to(FP16)  # a fraction of an ulp per step, mostly
    top = torch.nn.Parameter((65504.0 * torch.randn(64, generator=gen).sign()).to(FP16))
    g_top = (-top.detach().float().sign() * torch.rand(64, generator=gen) * 20).to(FP16)  # to 65544 in two steps
    opt = lowmemopt.SGD([{"params": [small]}, {"params": [top], "lr": 1.0}], lr=2**-10, bf16_update=mode)
    for _ in range(2):
        small.grad, top.grad = g_small.clone(), g_top.clone()
        _step(opt, backend)
    return torch.cat([small.detach(), top.detach()]), opt, (small, top)


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_fp16_edge_cases_bit_identical_across_backends_and_builds(mode, monkeypatch):
    """eager = native C (each vector build this CPU runs, and the scalar one) = Triton (interpreted), bit for bit,
    on parameters crossing fp16's subnormal, normal and overflow cases."""
    from lowmemopt.cpu import build
    from lowmemopt.kernels import runtime

    ref, ropt, rparams = _fp16_edge_case(mode, "eager", monkeypatch)
    assert torch.isinf(ref[-64:]).any() and (ref[-64:].abs() == 65504).any()
    assert ((ref != 0) & (ref.abs() < 2**-14)).sum() > 100
    results = []
    monkeypatch.setattr(cpu, "ENABLED", True)
    if cpu.available():
        for isa in build.cpu_isas():
            results.append((isa, _fp16_edge_case(mode, "native", monkeypatch, build.compile_library(isa=isa))))
        monkeypatch.setattr(build, "_lib", None)
    if runtime.HAS_TRITON and runtime.INTERPRET and interpreter_fma_rounds_once():
        results.append(("triton", _fp16_edge_case(mode, "triton", monkeypatch)))
    assert results or pytest.skip("no native kernels and no Triton interpreter")
    for name, (p, opt, params) in results:
        assert torch.equal(_bits(p), _bits(ref)), name
        if mode == "kahan":
            for q, r in zip(params, rparams):
                assert torch.equal(_bits(opt.state[q][rounding.KAHAN]), _bits(ropt.state[r][rounding.KAHAN])), name


class _Shard:
    """A stand-in for a sharded parameter's reductions: its local elements are ``lo ..`` of the whole parameter."""

    distributed = True

    def __init__(self, lo: int) -> None:
        self.lo = lo

    def flat_offset(self) -> int:
        return self.lo

    def element_index(self, lo, n, device="cpu"):
        return self.lo + lo

    def agree(self, value):
        return value


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["eager", "native", "triton"])
def test_a_shard_rounds_as_its_part_of_the_whole_parameter(backend, dtype, monkeypatch):
    # stochastic rounding hashes an element's index in the whole parameter: a shard [lo, hi) stepped with its offset
    # (FSDP2: Reduction.flat_offset; the pipeline's Item.index_base) gets the whole parameter's bits there
    from lowmemopt.kernels import dispatch, runtime
    from lowmemopt.pipeline import _plain_item
    from lowmemopt.work.items import Update

    if backend == "triton" and not (runtime.HAS_TRITON and runtime.INTERPRET):
        pytest.skip("needs TRITON_INTERPRET=1")
    n, lo, hi = 3000, 1100, 2600
    whole, wopt = _run(lowmemopt.AdamW, dict(lr=1e-4), "stochastic", "eager", monkeypatch, n=n, steps=1, dtype=dtype)
    seed = wopt.state[whole][rounding.SEED]
    torch.manual_seed(0)
    start = torch.randn(n, dtype=dtype)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    monkeypatch.setattr(cpu, "ENABLED", backend == "native")
    for shifted in (True, False):
        shard = torch.nn.Parameter(start[lo:hi].clone())
        shard.grad = grad[lo:hi].clone()
        opt = lowmemopt.AdamW([shard], lr=1e-4, bf16_update="stochastic")
        group = opt.param_groups[0]
        if backend == "triton":
            with runtime.cpu_interpreter():
                item = _plain_item(opt._plan(), shard, group)
                item.state[rounding.SEED] = seed
                item.index_base = lo if shifted else 0
                update = Update(
                    "adam", opt.algorithm.math_kwargs(group, 1), item.record, opt.algorithm.decay_factor(group), 1, 256
                )
                assert dispatch.step_triton(opt.algorithm.kernels, [item], lambda it, step: update) == []
        else:
            state = opt._init_state(shard, group, opt._slots(group, shard))
            state[rounding.SEED] = seed
            state["step"] = 1
            update_flat(
                opt.algorithm,
                shard,
                shard.data.view(-1),
                shard.grad.view(-1),
                state,
                opt._slots(group, shard),
                BucketRecord.of(group),
                1,
                opt.algorithm.decay_factor(group),
                _Shard(lo if shifted else 0),
            )
        same = torch.equal(_bits(shard), _bits(whole[lo:hi]))
        assert same == shifted, f"shifted={shifted}"


def test_which_params_it_applies_to():
    # bf16 and fp16 take the group's mode (so the compiled path, which rounds to nearest only, leaves them to the
    # eager / native / Triton paths); fp32 always rounds to nearest
    record = BucketRecord.of({"bf16_update": "kahan"})  # (the param group's options, resolved once per step)
    assert [record.rounding_of(torch.zeros(1, dtype=d)) for d in (BF16, FP16, torch.float32)] == [
        "kahan",
        "kahan",
        "nearest",
    ]
    assert [rounding.applied("kahan", torch.zeros(1, dtype=d)) for d in (BF16, FP16, torch.float32)] == [
        "kahan",
        "kahan",
        "nearest",
    ]
    assert BucketRecord.of({}).rounding_of(torch.zeros(1, dtype=FP16)) == "nearest"  # the default is unchanged
    with pytest.raises(TypeError, match="dtype"):
        rounding.stochastic_round(torch.zeros(2), 1, dtype=torch.float32)


@pytest.mark.parametrize("native", [False, True])
def test_fp16_gradient_with_a_norm_past_65504_is_finite(native, monkeypatch):
    # the non-finite check takes the norm in fp32 on every path: an fp16 norm would overflow and skip the step
    monkeypatch.setattr(cpu, "ENABLED", native)
    p = torch.nn.Parameter(torch.zeros(4, dtype=FP16))
    q = torch.nn.Parameter(torch.zeros(4, dtype=FP16))
    opt = lowmemopt.SGD([p, q], lr=2**-10)
    p.grad = torch.full((4,), -40960.0, dtype=FP16)  # norm 81920
    opt.step()  # one gradient
    assert p.tolist() == [40.0] * 4
    q.grad = torch.full((4,), math.inf, dtype=FP16)
    opt.step()  # two: p's is finite, q's is not
    assert p.tolist() == [80.0] * 4 and q.tolist() == [0.0] * 4


def test_fp32_params_ignore_it(monkeypatch):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(100))
    q = torch.nn.Parameter(p.detach().clone())
    o1, o2 = lowmemopt.AdamW([p], lr=1e-3), lowmemopt.AdamW([q], lr=1e-3, bf16_update="kahan")
    for _ in range(2):
        p.grad = q.grad = torch.ones(100)
        o1.step()
        o2.step()
    assert torch.equal(p, q) and set(o2.state[q]) == set(o1.state[p])


@pytest.mark.parametrize("bits", [8, 32])
def test_kahan_turned_on_after_steps(bits, monkeypatch):
    """``bf16_update`` set to "kahan" on a group that has stepped: the compensation buffer is made for the whole
    parameter, in its shape, before any part of it is stepped (the eager path steps a large tensor in chunks), and
    the three backends agree bit for bit."""
    from lowmemopt import compiled
    from lowmemopt.kernels import dispatch, runtime
    from lowmemopt.pipeline import backends

    monkeypatch.setattr(backends, "CHUNK_NUMEL", 4096)  # (small chunks: small tensors cross them)
    shape = (4096 // 64 + 3, 64)  # more than one chunk of the eager path

    monkeypatch.setattr(compiled, "ENABLED", False)  # (the first steps round to nearest: the reference, not it)

    def run(backend):
        monkeypatch.setattr(cpu, "ENABLED", backend == "native")
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(shape, dtype=BF16))
        opt = lowmemopt.AdamW([p], lr=1e-3, state_bits=bits)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            if step == 1:
                opt.param_groups[0]["bf16_update"] = "kahan"
            p.grad = torch.randn(shape, generator=g).to(BF16)
            _step(opt, backend)
        kahan = opt.state[p][rounding.KAHAN]
        assert kahan.shape == p.shape and kahan.dtype == BF16 and kahan.abs().max() > 0
        return p, kahan

    ref, ref_c = run("eager")
    runs = ["native"]
    if runtime.HAS_TRITON and runtime.INTERPRET and interpreter_fma_rounds_once():
        runs.append("triton")
    for backend in runs:
        before = sum(dispatch.stats.values())
        p, c = run(backend)
        assert backend != "triton" or sum(dispatch.stats.values()) > before  # the fused kernel really ran
        assert torch.equal(_bits(p), _bits(ref)) and torch.equal(_bits(c), _bits(ref_c)), backend


def test_a_flat_kahan_buffer_takes_the_fused_kernel(monkeypatch):
    """A Kahan buffer with the parameter's elements in another shape (flat: state saved by earlier versions, whose
    native CPU path made it so) is stepped by the Triton kernel, as the parameter-shaped one is, to the same bits."""
    from lowmemopt.kernels import dispatch, runtime

    if not (runtime.HAS_TRITON and runtime.INTERPRET and interpreter_fma_rounds_once()):
        pytest.skip("needs TRITON_INTERPRET=1 (and an interpreter whose tl.fma rounds once)")
    monkeypatch.setattr(cpu, "ENABLED", False)

    def run(flat):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(40, 64, dtype=BF16))
        opt = lowmemopt.AdamW([p], lr=1e-3, state_bits=8, bf16_update="kahan", min_quant_numel=0)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            p.grad = torch.randn(40, 64, generator=g).to(BF16)
            if step == 1 and flat:
                opt.state[p][rounding.KAHAN] = opt.state[p][rounding.KAHAN].reshape(-1).clone()
            before = sum(dispatch.stats.values())
            with runtime.cpu_interpreter():
                opt.step()
            assert sum(dispatch.stats.values()) > before, f"step {step} left the fused kernel"
        return p

    assert torch.equal(_bits(run(True)), _bits(run(False)))


def test_paged_matches_unpaged(monkeypatch):
    a, _ = _run(lowmemopt.AdamW, dict(lr=1e-4), "stochastic", "native", monkeypatch)
    b, opt = _run(lowmemopt.AdamW, dict(lr=1e-4), "stochastic", "native", monkeypatch, paged="cpu")
    assert torch.equal(_bits(a), _bits(b))
    c, _ = _run(lowmemopt.AdamW, dict(lr=1e-4), "kahan", "eager", monkeypatch)
    d, opt = _run(lowmemopt.AdamW, dict(lr=1e-4), "kahan", "eager", monkeypatch, paged="cpu")
    assert torch.equal(_bits(c), _bits(d))
    opt.close()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_resume_is_bit_exact(mode, dtype, tmp_path):
    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(300, dtype=dtype))
        return p, lowmemopt.AdamW([p], lr=1e-4, weight_decay=0.1, bf16_update=mode, state_bits=8, min_quant_numel=0)

    def steps(p, opt, k, start):
        for i in range(start, start + k):
            p.grad = torch.randn(300, generator=torch.Generator().manual_seed(i)).to(dtype)
            opt.step()

    p, opt = make()
    steps(p, opt, 3, 0)
    sd = _save(opt.state_dict(), tmp_path)  # (state_dict() holds the live tensors)
    lowmemopt.save_state(opt, tmp_path / "s.safetensors")
    saved = p.detach().clone()
    steps(p, opt, 3, 3)
    for how in ("state_dict", "file"):
        q, opt2 = make()
        torch.manual_seed(1234)  # a different generator state: the seed must come from the state
        with torch.no_grad():
            q.copy_(saved)
        if how == "state_dict":
            opt2.load_state_dict(torch.load(sd, weights_only=True))
        else:
            lowmemopt.load_state(opt2, tmp_path / "s.safetensors")
        key = rounding.SEED if mode == "stochastic" else rounding.KAHAN
        assert key in opt2.state[q]
        if mode == "kahan":
            assert opt2.state[q][key].dtype == dtype  # the buffer's dtype follows the parameter
        steps(q, opt2, 3, 3)
        assert torch.equal(_bits(q), _bits(p)), how


def _save(obj, tmp_path):
    path = tmp_path / "sd.pt"
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_galore_full_weight_is_compensated(dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 48, dtype=dtype))
    w0 = w.detach().clone()
    opt = lowmemopt.AdamW([{"params": [w], "rank": 4, "update_proj_gap": 50}], lr=1e-5, bf16_update="kahan")
    for i in range(5):
        w.grad = torch.randn(32, 48, generator=torch.Generator().manual_seed(i)).to(dtype)
        opt.step()
    c = opt.state[w][rounding.KAHAN]
    assert c.shape == w.shape and c.dtype == dtype and c.abs().max() > 0
    moved = (w.double() + c.double() - w0.double()).abs().max()
    assert moved > 0


# ---------------------------------------------------------------------------------------------------------------------
# training: bf16 weights reach the fp32-weights loss (bench/bf16_update.py)


def _bench():
    return load_bench("bf16_update")


def _check_training(r):
    ref = r["fp32"]["loss"]
    assert r["start"] - ref > 0.02 * ref  # the fine-tune moves the loss (the test could fail)
    for mode in ("stochastic", "kahan"):
        assert abs(r[mode]["loss"] / ref - 1) < 0.01, (mode, r)
    assert r["nearest"]["loss"] / ref - 1 > 0.01, r  # round-to-nearest loses the small updates


def test_training_reaches_fp32_loss():
    """A fine-tune of the byte MLP at lr 1e-4 (most updates below half a bf16 ulp), reduced."""
    _check_training(_bench().run("mlp", pre_steps=100, steps=100, lr=1e-4, batch=32))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_training_reaches_fp32_loss_full(kind):
    pytest.importorskip("transformers") if kind == "llama" else None
    _check_training(_bench().run(kind, pre_steps=300, steps=300, lr=1e-4 if kind == "mlp" else 3e-5))


def _fit(dtype, mode, steps=60, lr=1e-4):
    """AdamW on a least-squares problem from weights of size ~2 (fp16 ulp 2^-9, bf16 2^-6: most updates of lr are
    below half of it); ``mode`` None: torch's AdamW on fp32 weights (the fp32-master reference)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = x @ torch.randn(32, 8, generator=g)
    w = torch.nn.Parameter((torch.randn(32, 8, generator=g) * 2).to(FP16).to(dtype))
    start = w.detach().double().clone()
    opt = (
        torch.optim.AdamW([w], lr=lr, weight_decay=0.0, foreach=False)
        if mode is None
        else lowmemopt.AdamW([w], lr=lr, weight_decay=0.0, bf16_update=mode)
    )
    for _ in range(steps):
        idx = torch.randint(0, 256, (32,), generator=g)
        loss = ((x[idx] @ w.float() - y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach().double(), start


def test_fp16_weights_track_the_fp32_master_run():
    """fp16 weights without an fp32 master copy: how far each mode ends from the fp32 run, relative to how far that
    run moved. Measured (60 steps): nearest 0.97 (it lost nearly every update), stochastic 0.59, kahan 0.13 (the
    stochastic roundings' errors add up as a random walk, growing as the square root of the steps; Kahan's stays
    under an ulp)."""
    ref, start = _fit(torch.float32, None)
    moved = (ref - start).norm()
    gap = {mode: ((_fit(FP16, mode)[0] - ref).norm() / moved).item() for mode in ("nearest", "stochastic", "kahan")}
    assert gap["nearest"] > 0.8, gap
    assert gap["kahan"] < 0.25 and gap["kahan"] < gap["nearest"] / 4, gap
    assert gap["stochastic"] < 0.8, gap


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_estimate_counts_the_kahan_buffer(dtype):
    from lowmemopt.estimate import estimate

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    near = estimate(model, "adamw", 8, min_quant_numel=0).state
    assert estimate(model, "adamw", 8, min_quant_numel=0, bf16_update="kahan").state == near + 2 * n
    assert estimate(model, "adamw", 8, min_quant_numel=0, bf16_update="stochastic").state == near


def test_trainer_factory_passes_it_through():
    pytest.importorskip("transformers")
    from lowmemopt.integrations.transformers import optimizer

    _, config = optimizer("adamw", bf16_update="stochastic")
    assert config["optimizer_kwargs"]["bf16_update"] == "stochastic"
    with pytest.raises(ValueError, match="Invalid bf16_update"):
        optimizer("adamw", bf16_update="up")
