"""The native CPU kernels (lowmemopt.cpu) against the pure PyTorch references: the 8-bit codec code for code against
the brute-force nearest-code search, and each fused optimizer kernel against the eager decode -> math -> encode
composition, bit for bit. Skipped where no C compiler can build them (the fallback test runs everywhere)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from helpers import clone_params, make_params, run, spy_native_steps
from optim_info import OPTIMIZERS, STATEFUL

import lowmemopt
import lowmemopt.compiled as compiled
import lowmemopt.cpu as cpu
from lowmemopt.cpu import build, elementwise, ffi
from lowmemopt.cpu.codec import decision_thresholds
from lowmemopt.quant import dequantize_blockwise, q4, quantize_blockwise_reference
from lowmemopt.quant.maps import code_book, is_signed_map, nearest_code_reference

ELEMENTWISE = [info for info in OPTIMIZERS if info.cls.algorithm.elementwise]
NATIVE = [
    info
    for info in ELEMENTWISE
    if isinstance(getattr(info.cls.algorithm.kernels, "native", None), elementwise.NativeKernel)
]
SHAPES = [(300, 257), (5000,), (3, 7)]  # full blocks + ragged tails, a 1-D vector, a tensor below one block


@pytest.fixture
def lib():
    if not cpu.available():
        pytest.skip(f"native CPU kernels unavailable: {build.build_error}")
    return build.library()


def _ulps(x: torch.Tensor, k: int) -> torch.Tensor:
    out = x
    direction = torch.full_like(x, float("inf") if k > 0 else float("-inf"))
    for _ in range(abs(k)):
        out = torch.nextafter(out, direction)
    return out


def _adversarial(name: str) -> torch.Tensor:
    """Values of a unit-scale block that stress the rounding rule: every decision threshold and its neighbours, every
    code and midpoint, every binade edge (the bit encoder's classes) and its neighbours, zeros of both signs,
    subnormals, the extremes."""
    book, thr = code_book(name), decision_thresholds(name)[:255]
    edges = torch.tensor([2.0**-k for k in range(0, 40)])
    vals = [thr, book, (book[1:] + book[:-1]) / 2, edges, -edges]
    vals += [_ulps(t, k) for t in (thr, edges, -edges) for k in (-3, -2, -1, 1, 2, 3)]
    vals.append(torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1e-30, 1.0, -1.0, book[0].item(), 2e-7, -2e-7]))
    y = torch.cat(vals)
    y = y[(y >= -1.0) & (y <= 1.0)]
    return y if is_signed_map(name) else y.abs()


def _encode(lib, x: torch.Tensor, signed: bool, bs: int):
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    absmax = torch.empty(x.numel() // bs)
    ffi.call(lib.lmo_encode, ffi.args_for(None, x, x.numel() // bs, bs, [ffi.slot_q8(codes, absmax, signed)]))
    return codes, absmax


@pytest.mark.parametrize("name", ["pow2", "upow2", "dynamic", "udynamic"])
def test_thresholds_are_the_rounding_rule(name):
    thr = decision_thresholds(name)[:255]
    assert torch.all(thr[1:] > thr[:-1])
    idx = torch.arange(255)
    assert torch.equal(nearest_code_reference(thr, name), idx + 1)
    assert torch.equal(nearest_code_reference(_ulps(thr, -1), name), idx)


@pytest.mark.parametrize("name", ["pow2", "upow2"])
def test_bit_encoder_at_every_threshold(lib, name):
    """Each adversarial value alone in a 16-element block with exact codes (1, book[0], zeros), so the block's scale is
    1. The bit encoder is monotone in |y| within a binade class: right at every threshold, the float below it and every
    class edge means right for every float (an offline run over every float in [book[0], 1] found no difference
    either)."""
    signed = is_signed_map(name)
    y = _adversarial(name)
    blocks = torch.zeros(y.numel(), 16)
    blocks[:, 0], blocks[:, 1], blocks[:, 2] = y, 1.0, code_book(name)[0]
    x = blocks.reshape(-1).contiguous()
    codes, absmax = _encode(lib, x, signed, 16)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, name, 16)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes), int((codes != ref_codes).sum())


@pytest.mark.parametrize("name", ["pow2", "upow2"])
@pytest.mark.parametrize("scale", [0.37, 3.1e-5, 7.77e3, 1.0 / 3.0])
def test_encoder_division_at_every_threshold_under_odd_scales(lib, name, scale):
    """Every decision threshold and its neighbours, scaled by a block scale that is not a power of two (so that
    ``x / absmax`` rounds): the codes equal the brute-force search on the same division."""
    signed = is_signed_map(name)
    y = _adversarial(name)
    blocks = torch.zeros(y.numel(), 16)
    blocks[:, 0], blocks[:, 1], blocks[:, 2] = y, 1.0, code_book(name)[0]
    x = (blocks * scale).reshape(-1).contiguous()
    codes, absmax = _encode(lib, x, signed, 16)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, name, 16)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes), int((codes != ref_codes).sum())


@pytest.mark.parametrize("name", ["pow2", "upow2"])
@pytest.mark.parametrize("bs", [16, 256, 4096])
def test_encode_equals_brute_force(lib, name, bs):
    """Code for code (and absmax for absmax) equal to the brute-force nearest-code search on random blocks over ten
    decades, an all-zero block and an outlier block; decoding equals the reference decoder."""
    signed = is_signed_map(name)
    gen = torch.Generator().manual_seed(bs)
    n = min(64 * bs, 1 << 16)
    x = torch.randn(n, generator=gen) * torch.logspace(-10, 0, n)[torch.randperm(n, generator=gen)]
    x = x if signed else x.abs()
    x.view(-1, bs)[1] = 0.0  # an all-zero block
    x.view(-1, bs)[2, 5] = 1e4  # an outlier
    if not signed:  # negative values and -0 in an unsigned slot take the zero code
        x.view(-1, bs)[3, :4] = torch.tensor([-0.0, -1e-3, -5.0, -1e-30])
    codes, absmax = _encode(lib, x, signed, bs)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, name, bs)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes), int((codes != ref_codes).sum())
    out = torch.empty_like(x)
    ffi.call(lib.lmo_decode, ffi.args_for(out, None, x.numel() // bs, bs, [ffi.slot_q8(codes, absmax, signed)]))
    assert torch.equal(out, dequantize_blockwise(ref_codes, ref_absmax, name, bs))


def _run_pair(info, bits, dtype, monkeypatch, steps=4, shapes=SHAPES):
    """(native, eager) runs of one optimizer from the same start."""
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params(shapes, dtype=dtype)
    out = []
    for native in (True, False):
        monkeypatch.setattr(cpu, "ENABLED", native)
        params = clone_params(start)
        opt = info.cls(params, state_bits=bits, **STATEFUL[info.name])
        run(opt, params, steps)
        out.append((params, opt))
    return out


@pytest.mark.parametrize("info", NATIVE, ids=repr)
@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_eager_composition(lib, info, bits, dtype, monkeypatch, correctly_rounded_sqrt):
    """Parameters and every state tensor bit-identical to the eager decode -> math -> encode path."""
    (p_n, opt_n), (p_e, opt_e) = _run_pair(info, bits, dtype, monkeypatch)
    for a, b in zip(p_n, p_e):
        assert a.dtype == dtype and torch.equal(a, b)
        sa, sb = opt_n.state[a], opt_e.state[b]
        assert set(sa) == set(sb)
        for k, v in sa.items():
            assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], (k, tuple(a.shape))


@pytest.mark.parametrize("variant", [dict(amsgrad=True, maximize=True, betas=(0.6, 0.99)), dict(weight_decay=0.1)])
def test_adam_variants(lib, variant, monkeypatch, correctly_rounded_sqrt):
    """amsgrad (three slots), maximize, lerp weights >= 0.5, L2 weight decay (Adam)."""
    info = next(i for i in NATIVE if i.cls is lowmemopt.Adam)
    monkeypatch.setitem(STATEFUL, info.name, dict(STATEFUL[info.name], lr=1e-2, **variant))
    (p_n, opt_n), (p_e, opt_e) = _run_pair(info, 8, torch.float32, monkeypatch)
    for a, b in zip(p_n, p_e):
        assert torch.equal(a, b)
        for k, v in opt_n.state[a].items():
            assert not isinstance(v, torch.Tensor) or torch.equal(v, opt_e.state[b][k]), k


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (lowmemopt.SignSGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01, maximize=True)),
        (lowmemopt.SignSGD, dict(lr=1e-2, weight_decay=0.01)),
        (lowmemopt.FusedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.05, wd_after_momentum=True)),
    ],
    ids=["signsgd-momentum-max", "signsgd-plain", "fusedsgd-wd-after-nesterov"],
)
@pytest.mark.parametrize("bits", [32, 8])
def test_sgd_flag_variants(lib, cls, kwargs, bits, monkeypatch):
    """lmo_sgd's SignSGD and weight-decay-after-momentum flags with dampened / Nesterov momentum, maximize and none:
    parameters and state bit-identical to the eager path (fp32 parameters at 32 bits, bf16 at 8), and the kernel
    really steps them."""
    dtype = torch.float32 if bits == 32 else torch.bfloat16
    done = spy_native_steps(monkeypatch)
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params([(64, 80), (33,)], dtype=dtype)
    runs = []
    for native in (True, False):
        monkeypatch.setattr(cpu, "ENABLED", native)
        params = clone_params(start)
        opt = cls(params, state_bits=bits, min_quant_numel=64, **kwargs)
        run(opt, params, 3)
        runs.append((params, opt))
    assert len(done) == 6 and all(done), done
    _assert_runs_identical(*runs[0], *runs[1], dtype)


def test_native_path_runs_and_tensor_lr_falls_back(lib, monkeypatch):
    """Large and small CPU parameters take the kernel (8-bit: the full blocks; fp32 state: every element); a 0-dim
    tensor lr is left to the torch path."""
    done = spy_native_steps(monkeypatch)
    monkeypatch.setattr(compiled, "ENABLED", False)
    params = make_params([(300, 257), (40,)])
    run(lowmemopt.AdamW(params, lr=1e-3, state_bits=8), params, 1)
    assert done == [300 * 257 // 256 * 256, 40]  # the 40-element vector keeps fp32 state (< min_quant_numel)
    done.clear()
    run(lowmemopt.AdamW(params, lr=torch.tensor(1e-3)), params, 1)
    assert done and not any(done)  # (each declined in the bucket, then again on the per-parameter path)


def _isa_library(isa: str):
    """The native library built for instruction set ``isa``; skips the test where this CPU (or compiler) lacks it."""
    if isa not in build.cpu_isas():
        pytest.skip(f"this CPU does not run {isa}")
    try:
        return build.compile_library(isa=isa)
    except RuntimeError as exc:
        pytest.skip(f"cannot build for {isa}: {exc}")


def _state_tensors(opt, p):
    return {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_vector_builds_equal_the_scalar_reference(lib, isa, monkeypatch, correctly_rounded_sqrt):
    """Each vector build (AVX-512, AVX2) gives the scalar C reference's codes (8- and 4-bit, signed and unsigned, at
    every decision threshold and its neighbours) and its steps (parameters and every state tensor), bit for bit:
    elementwise kernels at 32, 8 and 4 bits with fp32 / bf16 / fp16 parameters, and the factored passes (AdafactorTorch
    too). The default build equals the eager composition (the tests above), so every build does."""
    vec, ref = _isa_library(isa), _isa_library("scalar")
    assert (build.isa_of(vec), build.isa_of(ref)) == (isa, "scalar")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256 * 64, generator=gen) * torch.logspace(-9, 0, 256 * 64)
    for signed, name in ((True, "pow2"), (False, "upow2")):
        adv = _adversarial(name)
        v = torch.cat([x if signed else x.abs(), adv[: adv.numel() // 256 * 256]]).contiguous()
        assert all(torch.equal(a, b) for a, b in zip(_encode(vec, v, signed, 256), _encode(ref, v, signed, 256)))
    x4 = torch.cat([x[: 128 * 64], _adversarial4("pow2x4")[: 128 * 8]])
    x4 = x4[: x4.numel() // 128 * 128].contiguous()
    for signed in (True, False):
        v = x4 if signed else x4.abs()
        assert all(torch.equal(a, b) for a, b in zip(_encode4(vec, v, signed, 128), _encode4(ref, v, signed, 128)))
    adamw = next(i for i in NATIVE if i.cls is lowmemopt.AdamW)
    cases = [(adamw, 32, torch.float32), (adamw, 8, torch.bfloat16), (adamw, 4, torch.float16)]
    cases += [
        (i, 8, torch.float32)
        for i in NATIVE
        if i.cls in (lowmemopt.Lion, lowmemopt.SGD, lowmemopt.SignSGD, lowmemopt.FusedSGD)
    ]
    for info, bits, dtype in cases:
        results = []
        for library in (vec, ref):
            monkeypatch.setattr(build, "_lib", library)
            (p, opt), _ = _run_pair(info, bits, dtype, monkeypatch, steps=2, shapes=[(64, 80), (33,)])
            results.append([(q, _state_tensors(opt, q)) for q in p])
        for (pa, sa), (pb, sb) in zip(*results):
            assert torch.equal(pa, pb), (info.name, bits, dtype)
            assert all(torch.equal(v, sb[k]) for k, v in sa.items()), (info.name, bits, dtype)
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params([(256, 272)])
    factored = [
        (lowmemopt.CAME, dict(lr=1e-2, weight_decay=0.1)),
        (lowmemopt.Adafactor, dict(beta1=0.9)),
        (lowmemopt.AdafactorTorch, dict(weight_decay=0.1, maximize=True)),
    ]
    for cls, kwargs in factored:
        results = []
        for library in (vec, ref):
            monkeypatch.setattr(build, "_lib", library)
            params = clone_params(start)
            opt = cls(params, state_bits=8, **kwargs)
            run(opt, params, 2)
            results.append((params[0], _state_tensors(opt, params[0])))
        assert torch.equal(results[0][0], results[1][0]), cls.__name__
        assert all(torch.equal(v, results[1][1][k]) for k, v in results[0][1].items()), cls.__name__


def test_isa_is_chosen_by_the_cpu_and_can_be_forced(monkeypatch):
    """Unforced, the best instruction set the CPU runs is built; ``LOWMEMOPT_CPU_ISA`` forces one (a subprocess
    reports which it loaded); an unknown name is a ValueError that names the variable."""
    have = build.cpu_isas()
    assert have[-1] == "scalar" and have == [i for i in build.ISAS if i in have]
    code = "from lowmemopt.cpu import build; print(build.isa_of(build.library()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "LOWMEMOPT_CPU_ISA": "scalar"},
    )
    assert out.stdout.split()[-1] == "scalar", out.stderr[-2000:]
    if cpu.available() and build.requested_isa() is None:
        assert build.isa_of(build.library()) == have[0]
    monkeypatch.setenv("LOWMEMOPT_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="LOWMEMOPT_CPU_ISA"):
        build.requested_isa()
    with pytest.raises(ValueError, match="isa="):
        build.compile_library(isa="sse9")


def test_without_a_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    """No compiler: one RuntimeWarning, then the torch paths give the usual result."""
    monkeypatch.setenv("CC", "no-such-compiler-lowmemopt")
    monkeypatch.setenv("LOWMEMOPT_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(cpu, "_warned", False)
    monkeypatch.setattr(cpu, "ENABLED", True)
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params([(64, 80)])
    a, b = clone_params(start), clone_params(start)
    with pytest.warns(RuntimeWarning, match="native CPU kernels unavailable"):
        run(lowmemopt.AdamW(a, lr=1e-2, state_bits=8), a, 2)
    assert build.library() is None and "no C compiler" in build.build_error
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        monkeypatch.setattr(cpu, "ENABLED", False)
        run(lowmemopt.AdamW(b, lr=1e-2, state_bits=8), b, 2)
        monkeypatch.setattr(cpu, "ENABLED", True)
        assert not cpu.available()
    assert torch.equal(a[0], b[0])


def _copy_of_the_sources(tmp_path, monkeypatch):
    """The build's sources and headers copied to ``tmp_path / "csrc"``, and the build pointed at the copy."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    monkeypatch.setattr(build, "SOURCE", copy / build.SOURCE.name)
    monkeypatch.setattr(build, "UNITS", tuple(copy / p.name for p in build.UNITS))
    monkeypatch.setattr(build, "HEADERS", tuple(copy / p.name for p in build.HEADERS))
    return copy


def test_the_build_covers_every_source_and_header(tmp_path, monkeypatch):
    """Every file of csrc/ is the compiled source, a listed unit or a header; the source includes every unit, in their
    order; and a change to any file changes the build's key (the same files give the same key)."""
    import re

    copy = _copy_of_the_sources(tmp_path, monkeypatch)
    assert {p.name for p in copy.iterdir()} == {p.name for p in (build.SOURCE, *build.UNITS, *build.HEADERS)}
    assert re.findall(r'^#include "(.+)"$', build.SOURCE.read_text(), re.M) == [p.name for p in build.UNITS]
    base = build.source_key()
    for f in sorted(copy.iterdir()):
        text = f.read_bytes()
        f.write_bytes(text + b"\n/* changed */\n")
        assert build.source_key() != base, f.name
        f.write_bytes(text)
    assert build.source_key() == base


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    """compile_library caches by that key: after a header changes, it builds into a new cache entry (the compiler is
    not run here: each build it asks for is recorded)."""
    copy = _copy_of_the_sources(tmp_path, monkeypatch)
    monkeypatch.setenv("LOWMEMOPT_CACHE", str(tmp_path / "cache"))
    asked = []

    def compile_(cc, flags, out):
        asked.append(out)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(build, "_compile", compile_)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="not compiled"):
            build.compile_library(isa="scalar")
        (copy / "lmo.h").write_text((copy / "lmo.h").read_text() + "\n/* changed */\n")
    assert len(asked) == 4 and all(tmp_path / "cache" in out.parents for out in asked)
    assert not set(asked[:2]) & set(asked[2:])  # (two flag sets each: with OpenMP, without)


def test_environment_variable_disables():
    code = "import lowmemopt.cpu as c; print(c.ENABLED, c.available())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "LOWMEMOPT_CPU_KERNELS": "0"},
    )
    assert out.stdout.split() == ["False", "False"]


# -- 4-bit state (lowmemopt.quant.q4): ST_Q4 slots ------------------------------------------------------------------

Q4_MAPS = ("pow2x4", "upow2x4")


def _encode4(lib, x: torch.Tensor, signed: bool, bs: int):
    """The native codec alone on a 4-bit slot: fp32 rows of ``bs`` -> (nibbles, absmax)."""
    nibbles = torch.full((x.numel() // 2,), 0xAA, dtype=torch.uint8)  # (garbage: every byte must be written)
    absmax = torch.full((x.numel() // bs,), float("nan"))
    ffi.call(lib.lmo_encode, ffi.args_for(None, x, x.numel() // bs, bs, [ffi.slot_q4(nibbles, absmax, signed)]))
    return nibbles, absmax


def _adversarial4(name: str) -> torch.Tensor:
    """Every decision threshold of a 4-bit map and 3 floats either side, every code and mid point, every binade edge
    and its neighbours, zeros of both signs, subnormals, and (unsigned map) negative values."""
    book, thr = q4.code_book(name), q4.thresholds(name)
    edges = torch.tensor([2.0**-k for k in range(0, 40)])
    vals = [thr, book, (book[1:] + book[:-1]) / 2, edges, -edges]
    vals += [_ulps(t, k) for t in (thr, edges, -edges) for k in (-3, -2, -1, 1, 2, 3)]
    vals.append(torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1e-30, 1.0, book[0].item(), 2e-7, -2e-7]))
    y = torch.cat(vals)
    return y[(y >= book[0]) & (y <= 1.0)] if q4.is_signed(name) else y[(y >= -1.0) & (y <= 1.0)]


@pytest.mark.parametrize("name", Q4_MAPS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.1e-5, 7.77e3, 1.0 / 3.0])
def test_q4_encoder_at_every_threshold(lib, name, scale):
    """Each adversarial value alone in a 16-element block with exact codes (1, book[0], zeros), so that the block's
    scale is ``scale`` (not a power of two: ``x / absmax`` rounds): nibbles and absmax equal the eager codec's and the
    brute-force search's. The encoder counts thresholds (``code = #{t <= y}``), so right at every threshold and the
    float below it means right for every float (an offline run over every float of [book[0], 1] agreed too)."""
    signed = q4.is_signed(name)
    y = _adversarial4(name)
    blocks = torch.zeros(y.numel(), 16)
    blocks[:, 0], blocks[:, 1], blocks[:, 2] = y, 1.0, q4.code_book(name)[0] if signed else 0.0
    x = (blocks * scale).reshape(-1).contiguous()
    nibbles, absmax = _encode4(lib, x, signed, 16)
    ref_nibbles, ref_absmax = q4.quantize(x, name, 16)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(nibbles, ref_nibbles), int((nibbles != ref_nibbles).sum())
    brute, _ = q4.quantize_reference(x, name, 16)
    assert torch.equal(q4._unpack(nibbles, x.numel()), brute)


@pytest.mark.parametrize("name", Q4_MAPS)
@pytest.mark.parametrize("bs", [16, 128, 4096])
def test_q4_codec_equals_eager_codec(lib, name, bs):
    """Random blocks over ten decades, an all-zero block (absmax 0, decodes to 0), an outlier block, -0 and negatives
    in an unsigned slot (code 0, the smallest code): nibbles and absmax equal ``q4.quantize``; decoding equals
    ``q4.dequantize``."""
    signed = q4.is_signed(name)
    gen = torch.Generator().manual_seed(bs)
    n = min(64 * bs, 1 << 16)
    x = torch.randn(n, generator=gen) * torch.logspace(-10, 0, n)[torch.randperm(n, generator=gen)]
    x = x if signed else x.abs()
    x.view(-1, bs)[1] = 0.0
    x.view(-1, bs)[2, 5] = 1e4
    x.view(-1, bs)[3, :4] = torch.tensor([-0.0, -1e-3, -5.0, -1e-30]) if not signed else torch.tensor([-0.0] * 4)
    nibbles, absmax = _encode4(lib, x, signed, bs)
    ref_nibbles, ref_absmax = q4.quantize(x, name, bs)
    assert torch.equal(absmax, ref_absmax) and absmax[1] == 0
    assert torch.equal(nibbles, ref_nibbles), int((nibbles != ref_nibbles).sum())
    out = torch.full_like(x, float("nan"))
    ffi.call(lib.lmo_decode, ffi.args_for(out, None, n // bs, bs, [ffi.slot_q4(nibbles, absmax, signed)]))
    assert torch.equal(out, q4.dequantize(ref_nibbles, ref_absmax, n, name, bs))
    assert bool((out.view(-1, bs)[1] == 0).all())


#: full blocks + a ragged tail (even, and odd: the last byte's high nibble), a vector below one block of quantized
#: state (fp32 state), and one exactly at whole blocks (4-bit blocks are 128)
SHAPES4 = [(300, 257), (4099,), (3, 7), (8, 128)]


def _assert_runs_identical(p_n, opt_n, p_e, opt_e, dtype=None):
    for a, b in zip(p_n, p_e):
        assert (dtype is None or a.dtype == dtype) and torch.equal(a, b), tuple(a.shape)
        sa, sb = opt_n.state[a], opt_e.state[b]
        assert set(sa) == set(sb)
        for k, v in sa.items():
            assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], (k, tuple(a.shape))


@pytest.mark.parametrize("info", NATIVE, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_eager_composition_4bit(lib, info, dtype, monkeypatch, correctly_rounded_sqrt):
    """4-bit state: parameters, nibbles and scales bit-identical to the eager path over 4 steps (AdamW, Adam with
    amsgrad, SGD with nesterov momentum, Lion), the ragged last blocks on the eager path in both runs."""
    (p_n, opt_n), (p_e, opt_e) = _run_pair(info, 4, dtype, monkeypatch, shapes=SHAPES4)
    assert "exp_avg.nibbles" in opt_n.state[p_n[0]] or "momentum_buffer.nibbles" in opt_n.state[p_n[0]]
    assert opt_n.state[p_n[1]][next(k for k in opt_n.state[p_n[1]] if k.endswith(".nibbles"))][-1] < 16  # odd n
    _assert_runs_identical(p_n, opt_n, p_e, opt_e, dtype)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (lowmemopt.Adam, dict(lr=1e-2, amsgrad=True, maximize=True, betas=(0.6, 0.99))),
        (lowmemopt.Adam, dict(lr=1e-2, weight_decay=0.1)),
        (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)),
        (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, maximize=True)),
    ],
    ids=["adam-amsgrad-max", "adam-l2", "sgd-momentum", "sgd-nesterov"],
)
def test_4bit_variants(lib, cls, kwargs, monkeypatch, correctly_rounded_sqrt):
    """amsgrad (three 4-bit slots), maximize, lerp weights >= 0.5, L2 weight decay, dampened and nesterov momentum."""
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params(SHAPES4[:2])
    runs = []
    for native in (True, False):
        monkeypatch.setattr(cpu, "ENABLED", native)
        params = clone_params(start)
        opt = cls(params, state_bits=4, **kwargs)
        run(opt, params, 4)
        runs.append((params, opt))
    _assert_runs_identical(*runs[0], *runs[1])


def test_native_4bit_path_really_runs(lib, monkeypatch):
    """A 4-bit parameter's full blocks take the kernel (and its ragged last block the eager path); a block size the
    kernels cannot take (above their 4096-element row buffers) leaves the whole parameter to the eager path."""
    done = spy_native_steps(monkeypatch)
    monkeypatch.setattr(compiled, "ENABLED", False)
    params = make_params([(300, 257), (40,)])
    opt = lowmemopt.AdamW(params, lr=1e-3, state_bits=4)
    run(opt, params, 1)
    assert opt.state[params[0]]["exp_avg.nibbles"].numel() == 300 * 257 // 2
    assert done == [300 * 257 // 128 * 128, 40]  # the 40-element vector keeps fp32 state (< min_quant_numel)
    done.clear()
    run(lowmemopt.AdamW(params, lr=1e-3, state_bits=4, block_size=8192), params, 1)
    assert sorted(set(done)) == [0, 40] and done.count(40) == 1


# -- the factored optimizers (lowmemopt.cpu.factored) ------------------------------------------------------------------

FACTORED_SHAPES = [(300, 272), (520, 256), (37, 53)]  # two native (>= 2^16 elements, 16 | columns), one eager


def _factored_pair(cls, kwargs, bits, monkeypatch, steps, dtype=torch.float32):
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params(FACTORED_SHAPES, dtype=dtype)
    out = []
    for native in (True, False):
        monkeypatch.setattr(cpu, "ENABLED", native)
        params = clone_params(start)
        opt = cls(params, state_bits=bits, **kwargs)
        run(opt, params, steps)
        out.append((params, opt))
    return out


FACTORED_VARIANTS = [
    (lowmemopt.Adafactor, dict()),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01, clip_threshold=0.5)),
    (lowmemopt.Adafactor, dict(lr=1e-2, relative_step=False, scale_parameter=False, weight_decay=0.01)),
    (lowmemopt.CAME, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.AdafactorTorch, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.AdafactorTorch, dict(maximize=True, d=1.5, eps=(1e-3, 1e-3), beta2_decay=-0.5)),
]


@pytest.mark.parametrize("cls,kwargs", FACTORED_VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_factored_native_equals_eager_32bit(lib, cls, kwargs, monkeypatch):
    """32-bit state: parameters and statistics equal the eager path to fp32 rounding (the row / column means and the
    RMS are summed in another order; AdafactorTorch's are torch's own: bit for bit); the parameter the native path
    skips (37 x 53) stays bit-identical."""
    calls = []
    real = cpu.step_factored
    monkeypatch.setattr(cpu, "step_factored", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    (p_n, opt_n), (p_e, opt_e) = _factored_pair(cls, kwargs, 32, monkeypatch, steps=6)
    assert calls[:3] == [True, True, False]
    for a, b in zip(p_n, p_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for k, v in opt_n.state[a].items():
            if isinstance(v, torch.Tensor):  # relative to the tensor's scale: a moment near 0 has no relative precision
                w = opt_e.state[b][k]
                assert float((v - w).abs().max()) <= 1e-5 * float(w.abs().max()), k
                assert cls is not lowmemopt.AdafactorTorch or torch.equal(v, w), k
        assert cls is not lowmemopt.AdafactorTorch or torch.equal(a, b)
    assert torch.equal(p_n[2], p_e[2])


@pytest.mark.parametrize("cls,kwargs", FACTORED_VARIANTS[1:2] + FACTORED_VARIANTS[3:4], ids=["Adafactor-m", "CAME"])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_factored_native_low_bit(lib, cls, kwargs, bits, monkeypatch):
    """bf16 / q8 / q4 first moment (the q4 one stepped natively too): after one step equal to the eager path to fp32
    rounding, with at most a rare one-step difference of the stored moment (a value at a rounding boundary); over more
    steps the trajectories stay close."""
    (p_n, opt_n), (p_e, opt_e) = _factored_pair(cls, kwargs, bits, monkeypatch, steps=1)
    for a, b in zip(p_n, p_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        sa, sb = opt_n.state[a], opt_e.state[b]
        if "exp_avg.codes" in sa or "exp_avg.nibbles" in sa:
            if bits == 4:
                n = a.numel()
                ca, cb = q4._unpack(sa["exp_avg.nibbles"], n), q4._unpack(sb["exp_avg.nibbles"], n)
            else:
                ca, cb = sa["exp_avg.codes"], sb["exp_avg.codes"]
            diff = (ca.int() - cb.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        else:
            ma, mb = sa["exp_avg"].float(), sb["exp_avg"].float()
            assert ((ma - mb).abs() > 1e-6 * mb.abs().max()).float().mean() < 1e-3
    (p_n, _), (p_e, _) = _factored_pair(cls, kwargs, bits, monkeypatch, steps=5)
    start = make_params(FACTORED_SHAPES)
    from helpers import trajectory_error

    assert trajectory_error(p_n, p_e, start) < 0.02


def test_factored_native_steps_small_matrices_with_quantized_state(lib, monkeypatch):
    """A 192 x 192 matrix (the demo LLaMA's attention weights: 36,864 elements, below MIN_NUMEL) with an 8-bit first
    moment is stepped by the native factored kernel (on a small model the eager path's torch calls per matrix made
    CAME 8-bit's step ~3x AdamW 8-bit's), close to the eager path; at 32 bits it stays eager, bit for bit."""
    from lowmemopt.cpu import factored

    assert factored.QUANT_MIN_NUMEL <= 192 * 192 < factored.MIN_NUMEL
    monkeypatch.setattr(compiled, "ENABLED", False)
    calls = []
    real, real_bucket = cpu.step_factored, factored.step_bucket
    monkeypatch.setattr(cpu, "step_factored", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])

    def bucket(*a, **k):  # the steps after the first (state made: each its gradient's check); 32-bit: not taken
        done = real_bucket(*a, **k)
        calls.extend(done or [factored.NOT_APPLIED])
        return done

    monkeypatch.setattr(factored, "step_bucket", bucket)
    start = make_params([(192, 192)])
    for bits, native in ((8, True), (32, False)):
        out = []
        for on in (True, False):
            monkeypatch.setattr(cpu, "ENABLED", on)
            params = clone_params(start)
            calls.clear()
            run(lowmemopt.CAME(params, lr=1e-2, state_bits=bits), params, 3)
            out.append(params[0])
            if on:
                assert calls and all(c == native for c in calls), (bits, calls)
        if native:
            torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out[0], out[1])


@pytest.mark.parametrize(
    "bad",
    [(3, 5, float("nan")), (-1, -1, float("inf")), (0, 0, 1.4e19)],
    ids=["nan", "inf-last-element", "squares-sum-overflows"],
)
@pytest.mark.parametrize(
    "cls,kwargs,bits",
    [
        (lowmemopt.Adafactor, {}, 32),
        (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01), 8),
        (lowmemopt.CAME, dict(lr=1e-2, weight_decay=0.1), 8),
        (lowmemopt.CAME, dict(lr=1e-2), 4),
    ],
    ids=["Adafactor", "Adafactor-m-8", "CAME-8", "CAME-4"],
)
def test_factored_step_is_its_own_nonfinite_check(lib, cls, kwargs, bits, bad, monkeypatch):
    """Adafactor's and CAME's native step checks its own gradient in its first pass (no separate read of it): a NaN,
    an Inf or elements whose squares' sum overflows fp32 leave that parameter, every state tensor and its step count
    exactly as they were (counted and warned about as any skip), while the others step as they would have; a clean
    gradient steps exactly as with the separate check (the native step without it)."""
    from lowmemopt.cpu import factored

    monkeypatch.setattr(compiled, "ENABLED", False)
    outcomes, scanned = [], []
    real_step, real_bucket, real_scan = cpu.step_factored, factored.step_bucket, cpu.grad_is_finite
    monkeypatch.setattr(
        cpu,
        "step_factored",
        lambda *a, **k: outcomes.append((k.get("check", False), real_step(*a, **k))) or outcomes[-1][1],
    )

    def bucket(*a, **k):  # the steps that check their gradients: one bucket, in order
        done = real_bucket(*a, **k)
        outcomes.extend((True, o) for o in done)
        return done

    monkeypatch.setattr(factored, "step_bucket", bucket)
    monkeypatch.setattr(cpu, "grad_is_finite", lambda g: scanned.append(g.numel()) or real_scan(g))
    start = make_params(FACTORED_SHAPES)
    runs = []
    for poison in (False, True):
        params = clone_params(start)
        opt = cls(params, state_bits=bits, **kwargs)
        run(opt, params, 2)
        before = [p.detach().clone() for p in params]
        state_before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[params[1]].items()}
        torch.manual_seed(5)
        for p in params:
            p.grad = torch.randn(p.shape) * 1e-2
        if poison:  # two elements (1.4e19: each square is finite in fp32, their sum is not)
            params[1].grad[bad[0], bad[1]] = params[1].grad[bad[0], bad[1] - 1] = bad[2]
        outcomes.clear()
        scanned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert scanned == [37 * 53]  # only the parameter too small for the native step is checked apart
        assert [o for o in outcomes if o[1] != factored.NOT_APPLIED] == [
            (True, factored.STEPPED),
            (True, factored.SKIPPED if poison else factored.STEPPED),
        ]
        runs.append((params, opt, before, state_before, [str(w.message) for w in caught]))
    (clean, clean_opt, _, _, _), (params, opt, before, state_before, messages) = runs
    assert opt.nonfinite_skips == 1 and any("NaN/Inf" in m for m in messages)
    assert torch.equal(params[1], before[1])
    for k, v in opt.state[params[1]].items():
        assert torch.equal(v, state_before[k]) if isinstance(v, torch.Tensor) else v == state_before[k], k
    for i in (0, 2):
        assert torch.equal(params[i], clean[i])
        for k, v in opt.state[params[i]].items():
            w = clean_opt.state[clean[i]][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k
    # the check changes nothing of a clean step: the native step without it (an up-front check) gives the same bits
    monkeypatch.setattr(cpu, "step_factored", lambda *a, **k: real_step(*a, **{**k, "check": False}))
    from lowmemopt import pipeline

    monkeypatch.setattr(pipeline, "checks_itself", lambda *a: False)
    plain = clone_params(start)
    plain_opt = cls(plain, state_bits=bits, **kwargs)
    run(plain_opt, plain, 2)
    torch.manual_seed(5)
    for p in plain:
        p.grad = torch.randn(p.shape) * 1e-2
    plain_opt.step()
    for a, b in zip(plain, clean):
        assert torch.equal(a, b)


def test_factored_native_same_bits_on_any_thread_count(lib, monkeypatch):
    """The one-call steps add their sums per fixed row segment and the segments in order: 1 and 3 threads give the
    same parameters and state, bit for bit (Adafactor with RMS(p) and an 8-bit first moment, CAME)."""
    monkeypatch.setattr(compiled, "ENABLED", False)
    start = make_params([(520, 256)])
    threads = torch.get_num_threads()
    for cls, kwargs in (
        (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
        (lowmemopt.CAME, dict(lr=1e-2, weight_decay=0.1)),
    ):
        results = []
        for n in (1, 3):
            torch.set_num_threads(n)
            try:
                params = clone_params(start)
                opt = cls(params, state_bits=8, **kwargs)
                run(opt, params, 2)
            finally:
                torch.set_num_threads(threads)
            results.append((params[0], _state_tensors(opt, params[0])))
        assert torch.equal(results[0][0], results[1][0]), cls.__name__
        assert all(torch.equal(v, results[1][1][k]) for k, v in results[0][1].items()), cls.__name__


def test_factored_native_bf16_params(lib, monkeypatch):
    (p_n, _), (p_e, _) = _factored_pair(lowmemopt.CAME, dict(lr=1e-2), 32, monkeypatch, steps=3, dtype=torch.bfloat16)
    for a, b in zip(p_n, p_e):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0.02)


@pytest.mark.parametrize(
    "cls,ref,kwargs",
    [
        (lowmemopt.Adafactor, "transformers.optimization:Adafactor", dict(beta1=0.9, weight_decay=0.01)),
        (lowmemopt.CAME, "came_pytorch:CAME", dict(lr=1e-2, weight_decay=0.01)),
        (lowmemopt.AdafactorTorch, "torch.optim:Adafactor", dict(lr=1e-2, weight_decay=0.01)),
    ],
)
def test_factored_native_matches_reference(lib, cls, ref, kwargs):
    """The native path against the reference library over 20 steps, to fp32 rounding (as the common parity test)."""
    module, name = ref.split(":")
    ref_cls = getattr(pytest.importorskip(module), name)
    params = make_params(FACTORED_SHAPES[:1])
    ref_params = clone_params(params)
    ours, theirs = cls(params, **kwargs), ref_cls(ref_params, **kwargs)
    from helpers import run_with_reference

    run_with_reference(ours, params, theirs, ref_params, 20)
    torch.testing.assert_close(params[0], ref_params[0], rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------------------------------------------------------------
# the non-finite gradient check, native and pipelined (lowmemopt.optimizer._CpuFiniteChecks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 31, 32, 16384, 16385, 100_003])
def test_native_finite_check_equals_torch_check(lib, dtype, n):
    """``cpu.grad_is_finite``: the same verdict as the torch check (``_finite_flags``) for clean gradients and a NaN or
    an Inf anywhere (the vector loop, the zero-padded tail, a later 16K piece). A finite element whose square
    overflows fp32 (it would make a second moment Inf) fails it too: the fp32 sum of squares overflows (torch's norm
    rescales some short vectors and may call one such element finite)."""
    from lowmemopt.pipeline.finite import host_flags as _finite_flags

    gen = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=gen).to(dtype)
    cases = [base]
    for pos in {0, n // 2, n - 1}:
        for bad in (float("nan"), float("inf"), float("-inf")):
            g = base.clone()
            g[pos] = bad
            cases.append(g)
    for g in cases:
        assert cpu.grad_is_finite(g) == _finite_flags([g])[0]
    if dtype != torch.float16:  # fp16 cannot hold 3e19
        g = base.clone()
        g[n - 1] = 3e19  # finite, but its square overflows fp32
        assert cpu.grad_is_finite(g) is False
    assert cpu.grad_is_finite(base.view(-1)[::2] if n > 1 else base.t()) in (None, True)  # non-contiguous: not done
    assert cpu.grad_is_finite(torch.randn(64, 64, generator=gen).t()) is None


def _runs_with_a_nan(shapes, bad, where, monkeypatch):
    """8-bit AdamW from one start, two steps, then a step with fresh gradients: once clean, once with a NaN at flat
    index ``where`` of parameter ``bad``'s gradient. Per run: (params, optimizer, values before the step, ``bad``'s
    state before it, the step's warning messages, the sizes of the gradients checked on their own)."""
    alone = []
    real = cpu.grad_is_finite
    monkeypatch.setattr(compiled, "ENABLED", False)
    monkeypatch.setattr(cpu, "grad_is_finite", lambda g: alone.append(g.numel()) or real(g))
    start = make_params(shapes)
    runs = []
    for poison in (False, True):
        params = clone_params(start)
        opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8)
        run(opt, params, 2)
        before = [p.detach().clone() for p in params]
        state_before = {k: v.clone() for k, v in opt.state[params[bad]].items() if isinstance(v, torch.Tensor)}
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + i))
        if poison:
            params[bad].grad.view(-1)[where] = float("nan")
        alone.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        runs.append((params, opt, before, state_before, [str(w.message) for w in caught], list(alone)))
    return runs


@pytest.mark.parametrize("where", [7, -1], ids=["first-piece", "last-piece"])
@pytest.mark.parametrize("bad", [0, 1, 2, 3])
def test_pipelined_finite_check_skips_exactly_the_bad_parameter(lib, bad, where, monkeypatch):
    """The bucket's native call checks each gradient (in 64K-element pieces, read among the previous parameter's
    rows); a NaN in any parameter (the first, one after a parameter too small for rows of its own, one of several
    pieces, the last one) and in any piece skips that parameter, state and values unchanged, and the others step as
    they would have without it. No gradient needs a check of its own (a separate pass before the step)."""
    shapes = [(300, 256), (40,), (520, 300), (5000,)]  # 2, 1, 3 and 1 scan pieces
    (clean, _, _, _, _, alone_clean), (params, opt, before, state_before, messages, alone) = _runs_with_a_nan(
        shapes, bad, where, monkeypatch
    )
    assert alone_clean == alone == []  # all of them checked inside the bucket's call
    assert opt.nonfinite_skips == 1 and any("NaN/Inf" in m for m in messages)
    assert torch.equal(params[bad], before[bad])
    for k, v in state_before.items():
        assert torch.equal(opt.state[params[bad]][k], v), k
    for i in range(len(shapes)):
        if i != bad:
            assert torch.equal(params[i], clean[i])


@pytest.mark.parametrize("where", [7, -1], ids=["first-piece", "last-piece"])
@pytest.mark.parametrize("bad", [1, 2, 3])
def test_per_parameter_kernels_check_the_next_gradient(lib, bad, where, monkeypatch):
    """With one native call per parameter (the bucket off), each kernel sums the squares of the next parameter's
    gradient while it steps (pieces spread over its row chunks, more pieces than chunks when the next gradient is
    larger): a NaN in any piece skips exactly that parameter, and only the first gradient is checked on its own (and
    the one after a skipped parameter)."""
    from lowmemopt.pipeline import native

    monkeypatch.setattr(native, "takes", lambda plan: False)
    shapes = [(40, 64), (520, 300), (300, 256), (5000,)]  # the 2nd gradient: 3 pieces beside 1 row chunk
    (clean, _, _, _, _, alone_clean), (params, opt, before, state_before, _, alone) = _runs_with_a_nan(
        shapes, bad, where, monkeypatch
    )
    assert alone_clean == [40 * 64]
    assert alone == ([40 * 64] if bad == 3 else [40 * 64, params[bad + 1].numel()]), alone
    assert opt.nonfinite_skips == 1 and torch.equal(params[bad], before[bad])
    for k, v in state_before.items():
        assert torch.equal(opt.state[params[bad]][k], v), k
    assert all(torch.equal(params[i], clean[i]) for i in range(len(shapes)) if i != bad)


def test_a_cpu_step_imports_no_kernels_package():
    """From a source tree (``kernels/`` is installed as ``lowmemopt.kernels`` and absent here), lowmemopt imports and
    steps CPU parameters: nothing on the CPU path imports the Triton kernels package at module level."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import torch, lowmemopt\n"
        "p = torch.nn.Parameter(torch.randn(300)); p.grad = torch.randn(300)\n"
        "lowmemopt.AdamW([p], lr=1e-3, state_bits=8, min_quant_numel=0).step()\n"
        "import sys; print(lowmemopt.__file__, 'lowmemopt.kernels' in sys.modules)"
    )
    # the source tree is the working folder, which PYTHONSAFEPATH (set by scripts/gpu-check) would leave off sys.path
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    path, imported = out.stdout.split()
    assert Path(path).resolve() == root / "lowmemopt" / "__init__.py" and imported == "False"


@pytest.mark.parametrize(
    "case",
    [
        ("AdamW", 32, torch.float32, {}),
        ("AdamW", 8, torch.float32, {}),
        ("AdamW", 4, torch.float32, {}),
        ("AdamW", 16, torch.bfloat16, dict(bf16_update="stochastic")),
        ("AdamW", 8, torch.bfloat16, dict(bf16_update="kahan")),
        ("Lion", 8, torch.float32, {}),
        ("SGD", 8, torch.float32, dict(momentum=0.9)),
        ("SignSGD", 32, torch.float32, {}),
    ],
    ids=lambda c: f"{c[0]}-{c[1]}-{str(c[2])[6:]}-{c[3].get('bf16_update', '')}",
)
def test_bucket_equals_one_call_per_parameter(lib, case, monkeypatch):
    """The bucket's one native call (lowmemopt.pipeline.native) steps every parameter exactly as one call per
    parameter does: values, state and step counts bit for bit, through a step where one gradient has a NaN (that
    parameter skipped, its fresh state dropped on the first step), with ragged last blocks and with row chunks of
    every size (a bucket's chunks shrink towards its end); and it is the bucket that steps them (one call per
    step)."""
    from lowmemopt.cpu import elementwise
    from lowmemopt.pipeline import native

    name, bits, dtype, kw = case
    monkeypatch.setattr(compiled, "ENABLED", False)
    shapes = [(300, 256), (5000,), (40,), (129, 33), (1024, 1024)]  # (the last: row chunks beyond 16K elements)
    start = make_params(shapes, dtype=dtype)
    runs = []
    for bucket in (True, False):
        calls = []
        real = elementwise.step_many
        monkeypatch.setattr(elementwise, "step_many", lambda *a: calls.append(len(a[1])) or real(*a))
        monkeypatch.setattr(native, "takes", native.takes if bucket else (lambda plan: False))
        torch.manual_seed(0)  # (stochastic rounding's seeds)
        params = clone_params(start)
        opt = getattr(lowmemopt, name)(params, lr=1e-2, state_bits=bits, min_quant_numel=64, **kw)
        skipped = []
        for it in range(4):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * it + i)).to(dtype)
            if it in (0, 2):
                params[it // 2 + 1].grad.view(-1)[3] = float("nan")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
            skipped.append(opt.nonfinite_skips)
        assert skipped == [1, 1, 2, 2] and opt.state[params[1]]["step"] == 3
        assert calls == ([len(shapes) - 1] + [len(shapes)] * 3 if bucket else []), calls  # (a fresh bad one: before)
        runs.append((params, opt))
    (a, opt_a), (b, opt_b) = runs
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        sa, sb = opt_a.state[x], opt_b.state[y]
        assert sa.keys() == sb.keys()
        for k, v in sa.items():
            assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], k
