"""The torch.compile fast path (lowmemopt.compiled) against the eager decode -> math -> encode composition."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import clone_params, make_params, run
from optim_info import OPTIMIZERS, STATEFUL

import lowmemopt.compiled as compiled
import lowmemopt.cpu as cpu
from lowmemopt.quant import dequantize_blockwise

ELEMENTWISE = [info for info in OPTIMIZERS if info.cls.algorithm.elementwise]
SHAPE = (300, 257)  # 77100 elements: >= MIN_NUMEL, 301 full blocks + a ragged 44-element tail


@pytest.fixture(autouse=True)
def _no_native_kernels(monkeypatch):
    """The native C kernels (lowmemopt.cpu) come first where they build; these tests are about the compiled path."""
    monkeypatch.setattr(cpu, "ENABLED", False)


def _run(info, bits, enabled, monkeypatch, dtype=torch.float32):
    monkeypatch.setattr(compiled, "ENABLED", enabled)
    params = make_params([SHAPE], dtype=dtype)
    opt = info.cls(params, state_bits=bits, **STATEFUL[info.name])
    run(opt, params, 6)
    return params[0].detach(), opt.state[params[0]]


@pytest.mark.parametrize("info", ELEMENTWISE, ids=repr)
@pytest.mark.parametrize("bits", [32, 16])
def test_compiled_matches_eager_dense(info, bits, monkeypatch):
    """fp32 state: equal to the eager path up to fp32 rounding (inductor fuses lerp into an FMA); bf16 state: that
    rounding may flip a bf16 rounding, a 0.4% change of one moment, so params agree to a small fraction of lr."""
    assert SHAPE[0] * SHAPE[1] >= compiled.MIN_NUMEL
    p_c, st_c = _run(info, bits, True, monkeypatch)
    p_e, st_e = _run(info, bits, False, monkeypatch)
    atol = 1e-6 if bits == 32 else 0.01 * STATEFUL[info.name]["lr"]
    torch.testing.assert_close(p_c, p_e, rtol=1e-6, atol=atol)
    for k, v in st_e.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(st_c[k].float(), v.float(), rtol=1e-2 if bits == 16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("info", ELEMENTWISE, ids=repr)
def test_compiled_matches_eager_8bit(info, monkeypatch):
    """q8 state: codes within one code step of the eager path's, scales and params close."""
    p_c, st_c = _run(info, 8, True, monkeypatch)
    p_e, st_e = _run(info, 8, False, monkeypatch)
    for k, v in st_e.items():
        if k.endswith(".codes"):
            diff = (st_c[k].int() - v.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (k, int(diff.max()))
        elif k.endswith(".absmax"):
            torch.testing.assert_close(st_c[k], v, rtol=2e-2, atol=1e-9)
    torch.testing.assert_close(p_c, p_e, rtol=0, atol=3 * STATEFUL[info.name]["lr"])


def test_compiled_path_really_runs(monkeypatch):
    """The fast path is taken for large CPU tensors, and succeeds."""
    monkeypatch.setattr(compiled, "ENABLED", True)
    results = []
    real = compiled.step_rows
    monkeypatch.setattr(compiled, "step_rows", lambda *a: results.append(real(*a)) or results[-1])
    params = make_params([SHAPE])
    info = ELEMENTWISE[0]
    opt = info.cls(params, state_bits=8, lr=1e-3, weight_decay=0.0, amsgrad=True, maximize=True)
    run(opt, params, 2)
    assert results and all(results)
    st = opt.state[params[0]]
    v = dequantize_blockwise(st["exp_avg_sq.codes"], st["exp_avg_sq.absmax"], "upow2", 256)
    assert torch.isfinite(v).all() and (v >= 0).all()


@pytest.mark.parametrize("name", ["AdamW", "SGD", "AdEMAMix"])  # (AdEMAMix: its warm-ups change every step too)
def test_lr_schedule_does_not_recompile(name, monkeypatch):
    """A changing lr (and AdamW's bias corrections, and the decay factor) compile nothing after the first step, also
    where dynamo guards on Python floats' values (``specialize_float=True``; torch 2.11 compiled 9 graphs for 8 steps
    here, torch 2.13 3: one more after the first change makes a float symbolic). Graphs: the math and the encode phase
    of this optimizer's key, compiled afresh here, and SGD's first step (``first_step``: the momentum buffer is copied,
    a branch)."""
    from optim_info import BY_NAME

    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_kernels", {})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    params = make_params([SHAPE])
    kwargs = dict(STATEFUL[name], lr=1e-3)
    opt = BY_NAME[name].cls(params, state_bits=8, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    with torch._dynamo.config.patch(specialize_float=True):
        for t in range(8):
            run(opt, params, 1, start=t)
            sched.step()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled.ENABLED and frames == 2 + (name == "SGD"), (
        f"{frames} graphs compiled for 8 steps with a changing lr"
    )


def test_encode_phase_failure_finishes_eagerly(monkeypatch):
    """If only the second (encode) graph fails, the chunk is finished eagerly: nothing is applied twice."""
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_warned", False)
    real = compiled._kernel

    def half_broken(key):
        run_math, _ = real(key)

        def fail(*args, **kwargs):
            raise RuntimeError("encode graph failed")

        return run_math, fail

    start = make_params([SHAPE])
    ref = clone_params(start)
    monkeypatch.setattr(compiled, "ENABLED", False)  # the eager reference: nothing compiled or warned before the step
    run(ELEMENTWISE[0].cls(ref, lr=1e-2, state_bits=8), ref, 2)
    x = clone_params(start)
    opt = ELEMENTWISE[0].cls(x, lr=1e-2, state_bits=8)
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_warned", False)
    monkeypatch.setattr(compiled, "_kernel", half_broken)
    with pytest.warns(RuntimeWarning, match="fast path unavailable"):
        run(opt, x, 1)
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_kernel", real)
    run(opt, x, 1, start=1)
    torch.testing.assert_close(x[0], ref[0], rtol=0, atol=1e-6)


def test_bf16_params_compiled(monkeypatch):
    p_c, _ = _run(ELEMENTWISE[0], 8, True, monkeypatch, dtype=torch.bfloat16)
    p_e, _ = _run(ELEMENTWISE[0], 8, False, monkeypatch, dtype=torch.bfloat16)
    assert p_c.dtype == torch.bfloat16
    torch.testing.assert_close(p_c.float(), p_e.float(), rtol=0, atol=0.05)


def test_unavailable_compiler_falls_back_to_eager(monkeypatch):
    """If torch.compile fails, lowmemopt warns once and the step still happens (eagerly), with the same result."""
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_warned", False)

    def broken(key):
        def fail(*args, **kwargs):
            raise RuntimeError("no C++ compiler")

        return fail, fail

    monkeypatch.setattr(compiled, "_kernel", broken)
    start = make_params([SHAPE])
    a, b = clone_params(start), clone_params(start)
    with pytest.warns(RuntimeWarning, match="fast path unavailable"):
        run(ELEMENTWISE[0].cls(a, lr=1e-2), a, 2)
    assert compiled.ENABLED is False
    run(ELEMENTWISE[0].cls(b, lr=1e-2), b, 2)
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("has_cc", [False, True])
def test_without_a_cxx_compiler_nothing_is_compiled_and_one_warning_at_most(has_cc, monkeypatch):
    """Without inductor's C++ compiler the compiled path is not tried (a failing compile costs ~10 s of the first
    step); without a C compiler either, lowmemopt.cpu's warning says it all, so this one stays silent."""
    import shutil

    import torch._inductor.cpp_builder as cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    def no_cxx():
        raise InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_cxx)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: real_which(cmd, *a, **k) if has_cc else None)
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_warned", False)
    monkeypatch.setattr(compiled, "_cxx", None)
    monkeypatch.setattr(compiled, "_kernel", lambda key: pytest.fail("a compile was tried"))
    big = torch.zeros(compiled.MIN_NUMEL)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not compiled.applies(big) and not compiled.applies(big)
        p = make_params([SHAPE])
        run(ELEMENTWISE[0].cls(p, lr=1e-2, state_bits=8), p, 1)
    said = [str(w.message) for w in seen if "torch.compile" in str(w.message)]
    assert said == (
        [
            "lowmemopt: torch.compile fast path unavailable (RuntimeError: no C++ compiler for inductor "
            "(InvalidCxxCompiler; set $CXX)); using eager steps"
        ]
        if has_cc
        else []
    ), said


@pytest.mark.parametrize("name", ["pow2", "upow2", "dynamic", "udynamic"])
def test_compiled_codec_equals_eager_codec(name, monkeypatch):
    """The compiled 8-bit codec (used for large tensors of non-elementwise optimizers) is bit-identical to eager."""
    from lowmemopt.quant import quantize_blockwise

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(compiled.MIN_NUMEL * 2 + 77, generator=gen) * torch.logspace(-8, 1, compiled.MIN_NUMEL * 2 + 77)
    x = x.abs() if name.startswith("u") else x
    monkeypatch.setattr(cpu, "ENABLED", False)  # the native codec would take the state maps first
    monkeypatch.setattr(compiled, "ENABLED", True)
    codes_c, absmax_c = quantize_blockwise(x, name)
    y_c = dequantize_blockwise(codes_c, absmax_c, name, 256)
    assert compiled._codec, "the compiled codec did not run"
    monkeypatch.setattr(compiled, "ENABLED", False)
    codes_e, absmax_e = quantize_blockwise(x, name)
    y_e = dequantize_blockwise(codes_e, absmax_e, name, 256)
    assert torch.equal(codes_c, codes_e) and torch.equal(absmax_c, absmax_e) and torch.equal(y_c, y_e)


def _unpack(state: dict, key: str, n: int) -> torch.Tensor:
    from lowmemopt.quant import q4

    return q4._unpack(state[key], n)


@pytest.mark.parametrize("info", ELEMENTWISE, ids=repr)
def test_compiled_matches_eager_4bit(info, monkeypatch):
    """q4 state through the compiled path (nibble rows decoded and packed in the graph): codes within one code step of
    the eager path's (inductor's fused multiply-adds move a value across a threshold now and then), few differing,
    scales and params close. The ragged last block is the eager path's in both runs."""
    results = []
    real = compiled.step_rows
    monkeypatch.setattr(compiled, "step_rows", lambda *a: results.append(real(*a)) or results[-1])
    p_c, st_c = _run(info, 4, True, monkeypatch)
    if info.name != "GaLoreAdamW":  # (its GaLore step runs the reference core on low-rank shapes)
        assert results and all(results), "the compiled path did not run"
    p_e, st_e = _run(info, 4, False, monkeypatch)
    n = SHAPE[0] * SHAPE[1]
    for k, v in st_e.items():
        if k.endswith(".nibbles"):
            diff = (_unpack(st_c, k, n).int() - _unpack(st_e, k, n).int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (k, int(diff.max()))
        elif k.endswith(".absmax"):
            torch.testing.assert_close(st_c[k], v, rtol=5e-2, atol=1e-9)
    torch.testing.assert_close(p_c, p_e, rtol=0, atol=3 * STATEFUL[info.name]["lr"])


@pytest.mark.parametrize("signed", [True, False], ids=["pow2x4", "upow2x4"])
def test_compiled_4bit_codec_equals_eager(signed, monkeypatch):
    """The compiled graphs' 4-bit codec (decode of nibble rows in phase 1, encode and pack in phase 2) is the eager
    q4 codec code for code: the same nibbles and scales from the same fp32 rows (an all-zero block, an outlier, -0),
    and the same decoded values."""
    from lowmemopt.quant import q4

    name, bs, nb = q4.map4_for(signed), 128, 64
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(nb, bs, generator=gen) * torch.logspace(-8, 1, nb * bs).view(nb, bs)
    x = x if signed else x.abs()
    x[3] = 0.0
    x[5, 7] = 1e5
    x[6, :3] = torch.tensor([-0.0, -0.0, 0.0]) if signed else torch.tensor([-0.0, -1e-3, -2.0])
    book, table = q4.code_book(name), q4.encode_table(name, "cpu")
    nibbles, absmax = torch.zeros(nb, bs // 2, dtype=torch.uint8), torch.zeros(nb)
    slot = ("m", "q4", signed, nibbles, absmax, book, table, x.clone())
    torch.compile(compiled._rows_encode, fullgraph=True)((slot,))
    ref_nibbles, ref_absmax = q4.quantize(x, name, bs)
    assert torch.equal(nibbles.view(-1), ref_nibbles) and torch.equal(absmax, ref_absmax)

    def decode(rows, scale):
        return compiled.decode_rows(compiled.unpack_nibble_rows(rows), scale, book)

    out = torch.compile(decode, fullgraph=True)(nibbles, absmax)
    assert torch.equal(out.view(-1), q4.dequantize(ref_nibbles, ref_absmax, nb * bs, name, bs))


def test_optimizers_with_other_constants_get_graphs_of_their_own(monkeypatch):
    """Two AdamWs with different betas / eps / weight decay in one process: each set of graph constants compiles its
    own graph, so the second equals its eager twin (sharing one graph made dynamo recompile the changed floats into
    symbolic inputs, and the second optimizer's parameters ended up to 0.09 away from the eager result)."""
    from optim_info import BY_NAME

    monkeypatch.setattr(compiled, "_kernels", {})
    info = BY_NAME["AdamW"]
    for kwargs in (dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))):
        results = []
        for enabled in (True, False):
            monkeypatch.setattr(compiled, "ENABLED", enabled)
            params = make_params([SHAPE])
            run(info.cls(params, state_bits=32, **kwargs), params, 4)
            results.append(params[0].detach())
        torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    assert len(compiled._kernels) == 2
