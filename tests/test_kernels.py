"""Fused Triton kernels (lowmemopt.kernels) against the reference composition decode -> fp32 math -> encode.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by CI and by ``conftest.py`` on
machines without CUDA): each test sends CPU tensors through them with ``runtime.cpu_interpreter()``. The reference is
the same optimizer's eager path (``lowmemopt.pipeline.step_param``) started from an exact copy of the kernel's params
and state, so every check is one step of decode -> math -> encode. Rules checked (docs/kernels.md):

* fp32 state and params: equal to fp32 rounding (a few ulps: torch's AVX-512 ``sqrt`` is not correctly rounded,
  atomics sum norms in another order);
* bf16 state: within one bf16 rounding step, or a few fp32 ulps of the slot's scale (``BF16_CANCEL`` x its largest
  value, before or after the step) where the new value is the small difference of two larger terms (``m' = b1 m +
  (1-b1) u`` with ``u`` a few ulps apart: the reductions' order, torch's rsqrt); 8-bit state: codes within one code
  step of the reference, and only a few of them off at all; absmax to fp32 rounding.

Shapes are tiny (the interpreter runs numpy per program). GPU tests at the end run the compiled kernels on CUDA
against the CPU reference; they skip without CUDA.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch
from helpers import assert_params_close, assert_state_close, clone_params, load_bench, make_params, set_grads
from optim_info import BY_NAME, OPTIMIZERS, STATEFUL

import lowmemopt
from lowmemopt.kernels import runtime
from lowmemopt.optim.adamw import AdamAlgorithm
from lowmemopt.optimizer import kernel_algorithm

pytestmark = pytest.mark.skipif(not runtime.HAS_TRITON, reason="triton is not installed")
interpreted = pytest.mark.skipif(
    not runtime.INTERPRET,
    reason="needs TRITON_INTERPRET=1 before lowmemopt.kernels is imported (conftest sets it without CUDA); "
    "on a GPU machine the gpu tests cover the kernels",
)


def _has_kernel(cls) -> bool:
    kernels = cls.algorithm.kernels if cls.algorithm is not None else None
    return kernels is not None and kernels.triton is not None


#: the table's optimizers that have kernels (AdafactorTorch and transformers-style AdamW take the reference path)
KERNEL_OPTIMIZERS = [info for info in OPTIMIZERS if runtime.HAS_TRITON and _has_kernel(info.cls)]
#: odd shapes: ragged last blocks, a 3-D (batched factored) tensor, one below min_quant_numel (fp32 state at 8 bits),
#: and one with a full 2048-element tile (the kernels' unmasked variant) besides its ragged last tile
SHAPES = [(300,), (47, 53), (3, 5, 70), (40,)]
MIN_QUANT = 64


def _launches(monkeypatch) -> list:
    """Record every kernel launch (the kernel's name)."""
    from lowmemopt.kernels.launch import Bucket

    seen = []
    real = Bucket.launch

    def launch(self, kernel, rows, counts, *args, **kwargs):
        if sum(counts):
            seen.append(getattr(kernel, "__name__", str(kernel)))
        return real(self, kernel, rows, counts, *args, **kwargs)

    monkeypatch.setattr(Bucket, "launch", launch)
    return seen


def _sync(src_opt, src_params, dst_opt, dst_params) -> None:
    """Make ``dst`` an exact copy of ``src`` (params and state; deep-copied, never shared)."""
    with torch.no_grad():
        for a, b in zip(src_params, dst_params):
            b.copy_(a)
    dst_opt.load_state_dict(copy.deepcopy(src_opt.state_dict()))


def _state_copy(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _lr(kwargs: dict) -> float:
    lr = kwargs.get("lr")
    return 1e-2 if lr is None else float(lr)


def check_against_reference(
    cls, kwargs, bits, *, steps=3, shapes=SHAPES, dtype=torch.float32, seed=0, opt_kwargs=None, lr_schedule=None
):
    """Step ``steps`` times with the kernels; before each step, a reference optimizer copies the kernel's params and
    state and takes the same step on the reference path. Returns (kernel params, kernel optimizer)."""
    opt_kwargs = dict(state_bits=bits, min_quant_numel=MIN_QUANT, **(opt_kwargs or {}))
    params = make_params(shapes, dtype=dtype, seed=seed)
    ref_params = clone_params(params)
    opt = cls(params, **kwargs, **opt_kwargs)
    ref = cls(ref_params, **kwargs, **opt_kwargs)
    for t in range(steps):
        if lr_schedule is not None:
            for o in (opt, ref):
                for g in o.param_groups:
                    g["lr"] = lr_schedule(t)
        if t:
            _sync(opt, params, ref, ref_params)
        set_grads(params, t, seed=seed + 1)
        for p, r in zip(params, ref_params):
            r.grad = p.grad.clone()
        start = [_state_copy(ref.state[r]) for r in ref_params]
        with runtime.cpu_interpreter():
            opt.step()
        ref.step()
        what = f"{cls.__name__} {kwargs} bits={bits} step {t + 1}"
        for p, r, st in zip(params, ref_params, start):
            assert_state_close(opt.state[p], ref.state[r], what, st)
        assert_params_close(params, ref_params, _lr(kwargs), bits < 32, what)
    return params, opt


# ---------------------------------------------------------------------------------------------------------------------
# block-wise codec kernels


@interpreted
@pytest.mark.parametrize("name", ["pow2", "upow2", "dynamic", "udynamic"])
@pytest.mark.parametrize("block_size", [64, 256])
def test_codec_matches_reference_exactly(name, block_size):
    """Codes and absmax equal :mod:`lowmemopt.quant`'s code for code: ragged last block, all-zero blocks, outliers,
    tiny values, bf16 input; decoding equal too."""
    from lowmemopt.kernels import blockwise
    from lowmemopt.quant import dequantize_blockwise, quantize_blockwise

    gen = torch.Generator().manual_seed(1)
    for n in (1, 17, block_size, 3 * block_size + 5, 1000):
        x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 6
        if name.startswith("u"):
            x = x.abs()
        x[: min(n, block_size)] = 0  # an all-zero block
        if n > block_size + 3:
            x[block_size + 3] = 1e4 if name.startswith("u") else -1e4  # an outlier
            x[block_size + 4] = 1e-9  # a value the unsigned map must not flush to 0
        for inp in (x, x.bfloat16()):
            codes, absmax = blockwise.quantize_blockwise_triton(inp, name, block_size)
            ref_codes, ref_absmax = quantize_blockwise(inp, name, block_size)
            assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax), (name, n, inp.dtype)
            out = blockwise.dequantize_blockwise_triton(codes, absmax, name, block_size)
            assert torch.equal(out, dequantize_blockwise(ref_codes, ref_absmax, name, block_size))
    if name.startswith("u"):
        assert int(codes[block_size + 4]) > 0


@interpreted
def test_codec_bad_inputs():
    from lowmemopt.kernels import blockwise

    x = torch.randn(100)
    with pytest.raises(ValueError, match="unknown quantization map"):
        blockwise.quantize_blockwise_triton(x, "linear")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        blockwise.quantize_blockwise_triton(x, "dynamic", 100)
    with pytest.raises(TypeError, match="floating-point"):
        blockwise.quantize_blockwise_triton(torch.ones(10, dtype=torch.int32))
    codes, absmax = blockwise.quantize_blockwise_triton(x)
    with pytest.raises(TypeError, match="codes must be uint8"):
        blockwise.dequantize_blockwise_triton(codes.int(), absmax)
    with pytest.raises(ValueError, match="absmax has 2 blocks"):
        blockwise.dequantize_blockwise_triton(codes, torch.zeros(2))


# ---------------------------------------------------------------------------------------------------------------------
# every optimizer's kernel against the reference composition


CASES = [(info, i, bits) for info in KERNEL_OPTIMIZERS for i in range(len(info.variants)) for bits in (32, 16, 8)]


@interpreted
@pytest.mark.parametrize("info,variant,bits", CASES, ids=[f"{i.name}-v{v}-{b}bit" for i, v, b in CASES])
def test_kernel_matches_reference(info, variant, bits, monkeypatch):
    """Every flag variant of the optimizer table, at 32/16/8-bit state, 3 steps (first-step flags, bias corrections),
    odd 1-D/2-D/3-D shapes, several tensors per launch."""
    seen = _launches(monkeypatch)
    check_against_reference(info.cls, info.variants[variant], bits)
    assert seen, "the kernel path did not run"


def _column_launches(monkeypatch) -> list:
    """Record every kernel launch's ``COLS`` flag (None for kernels that take none)."""
    from lowmemopt.kernels.launch import Bucket

    seen = []
    real = Bucket.launch

    def spy(self, kernel, *args, **meta):
        seen.append(meta.get("COLS"))
        return real(self, kernel, *args, **meta)

    monkeypatch.setattr(Bucket, "launch", spy)
    return seen


# (SGD and LARS without momentum keep no state: nothing to lay out)
COLUMN_CASES = [
    (info, i)
    for info in KERNEL_OPTIMIZERS
    if info.name in ("AdamW", "Adam", "SGD", "Lion", "LAMB", "LARS")
    for i, kw in enumerate(info.variants)
    if info.name not in ("SGD", "LARS") or kw.get("momentum", 0)
]


@interpreted
@pytest.mark.parametrize("info,variant", COLUMN_CASES, ids=[f"{i.name}-v{v}" for i, v in COLUMN_CASES])
def test_column_tiles_match_the_reference_and_row_tiles(info, variant, monkeypatch):
    """8-bit state in tiles laid out [BLOCK, ROWS] (``runtime.column_tiles``: the layout Triton before 3.7 compiles
    without shared-memory round trips) against the reference, and against row tiles: the same bits wherever a
    tile's arithmetic is elementwise and per block (LAMB's and LARS's tensor norms sum in another order)."""
    kwargs = info.variants[variant]
    monkeypatch.setattr(runtime, "TILE_LAYOUT", "rows")
    rows_params, rows_opt = check_against_reference(info.cls, kwargs, 8)
    seen = _column_launches(monkeypatch)
    monkeypatch.setattr(runtime, "TILE_LAYOUT", "columns")
    cols_params, cols_opt = check_against_reference(info.cls, kwargs, 8)
    assert True in seen, "no launch took column tiles"
    if info.name in ("LAMB", "LARS"):
        return
    for a, b in zip(rows_params, cols_params):
        assert torch.equal(a, b)
        for key, value in rows_opt.state[a].items():
            other = cols_opt.state[b][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


def test_column_tiles_choice(monkeypatch):
    """Column tiles for 8-bit state only, by Triton version unless ``LOWMEMOPT_TILE_LAYOUT`` says; a bad value is an
    error that names the variable."""
    monkeypatch.setattr(runtime, "TILE_LAYOUT", None)
    for before_3_7 in (True, False):
        monkeypatch.setattr(runtime, "_triton_before", lambda major, minor, b=before_3_7: b)
        assert runtime.column_tiles("q8") is before_3_7
        assert not any(runtime.column_tiles(fmt) for fmt in ("q4", "bf16", "fp32"))
    monkeypatch.setattr(runtime, "TILE_LAYOUT", "rows")
    assert not runtime.column_tiles("q8")
    monkeypatch.setattr(runtime, "TILE_LAYOUT", "columns")
    assert runtime.column_tiles("q8") and not runtime.column_tiles("q4")
    monkeypatch.setattr(runtime, "TILE_LAYOUT", "diagonal")
    with pytest.raises(ValueError, match="LOWMEMOPT_TILE_LAYOUT"):
        runtime.column_tiles("q8")


@interpreted
@pytest.mark.parametrize("name", ["Adafactor", "CAME"])
def test_bf16_first_moment_under_cancellation(name):
    """The H100 failure of ``test_gpu_kernels_match_cpu_reference[*-16-Adafactor]``, made certain on CPU: a bf16 first
    moment set to ``m = -(1-b1) u / b1``, so that ``m' = b1 m + (1-b1) u`` cancels to ~2^-9 of its terms and, for some
    elements, to far less. ``u`` is a few fp32 ulps apart between the kernel (correctly rounded sqrt, atomics) and the
    reference (torch's rsqrt, its own summation order); that absolute difference survives the cancellation, so those
    elements differ by more than one bf16 step of ``m'`` while both are right to a few ulps of the terms."""
    cls, kwargs = BY_NAME[name].cls, dict(STATEFUL[name])
    params = make_params([(8192,)], seed=5)
    ref_params = clone_params(params)
    opt = cls(params, state_bits=16, min_quant_numel=0, **kwargs)
    ref = cls(ref_params, state_bits=16, min_quant_numel=0, **kwargs)
    set_grads(ref_params, 0)
    ref.step()  # step 1 on the reference
    probe = cls(clone_params(ref_params), state_bits=16, min_quant_numel=0, **kwargs)
    probe.load_state_dict(copy.deepcopy(ref.state_dict()))
    probe.state[probe.param_groups[0]["params"][0]]["exp_avg"].zero_()
    set_grads(probe.param_groups[0]["params"], 1)
    probe.step()  # m' = (1-b1) u: u of step 2 from step 1's state
    b1 = kwargs.get("beta1", kwargs.get("betas", (0.9,))[0])
    m_prime = probe.state[probe.param_groups[0]["params"][0]]["exp_avg"].float()
    ref.state[ref_params[0]]["exp_avg"].copy_(-m_prime / b1)
    _sync(ref, ref_params, opt, params)
    set_grads(ref_params, 1)
    params[0].grad = ref_params[0].grad.clone()
    start = _state_copy(ref.state[ref_params[0]])
    with runtime.cpu_interpreter():
        opt.step()
    ref.step()
    r = ref.state[ref_params[0]]["exp_avg"].float()
    assert float(r.abs().max()) < 2**-6 * float(start["exp_avg"].float().abs().max()), "m' did not cancel"
    assert_state_close(opt.state[params[0]], ref.state[ref_params[0]], f"{name} cancelling m'", start)


@interpreted
@pytest.mark.parametrize("name", ["Adafactor", "CAME"])
@pytest.mark.parametrize("bits", [32, 8])
def test_factor_indices_per_segment_equal_per_element(name, bits, monkeypatch):
    """Matrices whose rows are at least a tile row long (``factored.wide``) index their row and column factors once
    per segment (:func:`lowmemopt.kernels.factored.factor_coords`, ``WIDE``) instead of dividing per element: the same
    indices, so bit-identical results, on rows and matrices that segments cross (3 x 5 x 300: a segment crosses a row
    and a matrix boundary; 2 x 257; 4 x 256: none), and within the kernel bounds of the reference."""
    from lowmemopt.kernels import factored

    seen = []
    real_wide = factored.wide
    monkeypatch.setattr(factored, "wide", lambda *a: seen.append(real_wide(*a)) or seen[-1])
    shapes = [(3, 5, 300), (2, 257), (4, 256)]
    info = BY_NAME[name]
    params, _ = check_against_reference(info.cls, STATEFUL[name], bits, steps=2, shapes=shapes)
    assert seen and all(seen), seen
    monkeypatch.setattr(factored, "wide", lambda *a: False)  # the per-element divisions
    narrow, _ = check_against_reference(info.cls, STATEFUL[name], bits, steps=2, shapes=shapes)
    for a, b in zip(params, narrow):
        assert torch.equal(a, b)


@interpreted
@pytest.mark.parametrize("bits", [32, 16, 8, 4])
def test_came_direct_instability_pass(bits, monkeypatch):
    """Where fp64 is slow (GeForce-class GPUs: ``runtime.fast_fp64``), CAME computes its instability in a second 2-D
    pass over g and m after the clip, as the reference does: every CAME variant against the reference."""
    monkeypatch.setattr(runtime, "INTERPRETER_FAST_FP64", False)
    seen = _launches(monkeypatch)
    info = BY_NAME["CAME"]
    for kwargs in info.variants:
        check_against_reference(info.cls, kwargs, bits, steps=2)
    assert "moments_kernel" not in seen and seen.count("stats_kernel") >= 2, seen


@interpreted
@pytest.mark.parametrize("fast_fp64", [True, False], ids=["moments", "direct"])
@pytest.mark.parametrize("delta", [1e-2, 1e-3])
def test_came_residual_under_cancellation(delta, fast_fp64, monkeypatch):
    """CAME's instability ``(u/c - m')^2`` with the old first moment within ``delta`` of the clipped update: the
    residual is ~``delta^2`` of ``u^2``. Where fp64 is fast the kernel forms its row and column sums from fp64 sums of
    ``u^2``, ``u m`` and ``m^2`` (one pass over g and m instead of two); an fp32 expansion would lose it to
    cancellation (relative error ~1e-7 / delta^2; checked: 0.4% and 27% off). Elsewhere a second pass computes it
    directly, as the reference. Either way the new statistics (beta3 = 0: the new means alone) agree with the
    reference to 1e-3. ``u`` differs by a few ulps between the two (square roots, the order of sums), which a residual
    ``delta`` of ``u`` magnifies ~1/delta times (measured 8e-6 and 7.5e-5): 1e-3 leaves room for that and none for a
    lost residual."""
    seen = _launches(monkeypatch)
    monkeypatch.setattr(runtime, "INTERPRETER_FAST_FP64", fast_fp64)
    kw = dict(lr=1e-3, betas=(0.9, 0.999, 0.0), state_bits=32)
    params = make_params([(64, 96), (3, 16, 40)], seed=3)
    ref_params = clone_params(params)
    opt, ref = lowmemopt.CAME(params, **kw), lowmemopt.CAME(ref_params, **kw)
    set_grads(ref_params, 0)
    ref.step()
    probe_params = clone_params(ref_params)
    probe = lowmemopt.CAME(probe_params, **kw)
    probe.load_state_dict(copy.deepcopy(ref.state_dict()))
    for p in probe_params:
        probe.state[p]["exp_avg"].zero_()
    set_grads(probe_params, 1)
    probe.step()  # m' = (1 - b1) u/c: the clipped update of step 2 from step 1's state
    gen = torch.Generator().manual_seed(7)
    scale = []  # mean((u/c)^2) per tensor: the residual's mean should be b1^2 delta^2 of it
    for r, q in zip(ref_params, probe_params):
        uc = probe.state[q]["exp_avg"] / (1 - 0.9)
        ref.state[r]["exp_avg"].copy_(uc * (1 + delta * torch.randn(uc.shape, generator=gen)))
        scale.append(float(uc.square().mean()))
    _sync(ref, ref_params, opt, params)
    set_grads(ref_params, 1)
    for p, r in zip(params, ref_params):
        p.grad = r.grad.clone()
    with runtime.cpu_interpreter():
        opt.step()
    ref.step()
    for p, r, u2 in zip(params, ref_params, scale):
        for key in ("exp_avg_res_row", "exp_avg_res_col"):
            got, want = opt.state[p][key], ref.state[r][key]
            assert 0.3 < float(want.mean()) / (0.81 * delta**2 * u2) < 3, "the residual did not cancel as set up"
            torch.testing.assert_close(got, want, rtol=1e-3, atol=0, msg=lambda m: f"{key}: {m}")
    assert ("moments_kernel" in seen) == fast_fp64, seen


def _came_m(state: dict, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A CAME 8-bit state's decoded first moment and, per element, the width of the wider of its code's two
    intervals of the ``pow2`` map times the block's absmax (the most a rounding can move it: half of that)."""
    from lowmemopt.quant import dequantize_blockwise
    from lowmemopt.quant.maps import code_book

    codes, absmax = state["exp_avg.codes"], state["exp_avg.absmax"]
    book = code_book("pow2")
    gaps = book.diff()
    wider = torch.maximum(torch.cat((gaps[:1], gaps)), torch.cat((gaps, gaps[-1:])))
    scale = absmax.repeat_interleave(block_size)[: codes.numel()]
    return dequantize_blockwise(codes, absmax, "pow2", block_size), wider[codes.long()] * scale


def _came_confidence(state: dict, shape: torch.Size) -> torch.Tensor:
    """CAME's confidence factor ``F = 1 / sqrt(U)`` (U: the factored instability statistics), flat."""
    from lowmemopt.optim.adafactor import approx_rsqrt

    return approx_rsqrt(state["exp_avg_res_row"], state["exp_avg_res_col"], torch.empty(shape)).flatten()


@interpreted
def test_came_8bit_steps_from_a_flipped_code_match_the_reference():
    """A 64 x 64 weight at lr 1e-3 whose first step flips one code of m under the interpreter (seed 74: a tie, m'/absmax
    0.175781248 in the kernel, 0.175781266 in the reference, around the codes' midpoint 0.17578125; issue 36, item
    13): each following step, taken from the kernel's state by both paths, keeps the one-step rule (codes within a
    step, parameters within 5% of lr). The kernels compute what the reference computes from the same state; runs that
    keep their own states drift apart by the flip, as the next test bounds."""
    check_against_reference(lowmemopt.CAME, dict(lr=1e-3), 8, steps=3, shapes=[(64, 64)], seed=74)


@interpreted
@pytest.mark.parametrize(
    "seed,fast_fp64",
    [(74, True), (0, True), (1, True), (0, False)],
    ids=["74-moments", "0-moments", "1-moments", "0-direct"],
)
def test_came_8bit_runs_stay_within_the_confidence_bound(seed, fast_fp64, monkeypatch):
    """Two CAME 8-bit runs that keep their own state (kernels, eager reference; same gradients) differ by more than
    one step's rule (``check_against_reference``: from the same state, parameters within 5% of lr): a code that
    flipped (allowed) is a first-moment difference ``dm`` that CAME's next update multiplies by its confidence factor
    ``F = 1/sqrt(U)`` (docs/kernels.md, "CAME: runs that keep their own state"). Seed 74 flips one code at step 1
    by itself (the tie of the test above, on this machine); the other seeds get one moved by a code step after step
    1, where ``gap F`` is largest. Checked at every step, per element (``dm``, ``dp``: the decoded
    first moments' and the parameters' differences when the step starts)::

        |dm'| <= b1 dm + half a code interval on each side;   |dp'| <= dp + lr (1.1 b1 dm F + 0.05)

    and that the bound is met, not vacuous: at step 2 the flipped element moves by 0.9-1.1 of ``lr b1 dm F``, more
    than 5% of lr."""
    monkeypatch.setattr(runtime, "INTERPRETER_FAST_FP64", fast_fp64)
    lr, wd, b1, block = 1e-3, 0.01, 0.9, 256
    kw = dict(lr=lr, weight_decay=wd, state_bits=8, min_quant_numel=MIN_QUANT, block_size=block)
    params = make_params([(64, 64), (3, 16, 40)], seed=seed)
    ref_params = clone_params(params)
    opt, ref = lowmemopt.CAME(params, **kw), lowmemopt.CAME(ref_params, **kw)
    for t in range(3):
        set_grads(ref_params, t, seed=seed + 1)  # the same gradients: the runs differ only by their state
        for p, r in zip(params, ref_params):
            p.grad = r.grad.clone()
        before = []
        for p, r in zip(params, ref_params):
            dm = torch.zeros(p.numel())  # (no state before the first step)
            if t:
                dm = (_came_m(opt.state[p], block)[0] - _came_m(ref.state[r], block)[0]).abs()
            before.append((dm, (p - r).detach().abs().flatten()))
        with runtime.cpu_interpreter():
            opt.step()
        ref.step()
        for i, (p, r, (dm, dp)) in enumerate(zip(params, ref_params, before)):
            what = f"seed {seed} step {t + 1} param {i}"
            (mk, gap_k), (mr, gap_r) = _came_m(opt.state[p], block), _came_m(ref.state[r], block)
            assert bool(((mk - mr).abs() <= b1 * dm + (gap_k + gap_r) / 2 + 1e-6 * mr.abs().max()).all()), what
            F = _came_confidence(ref.state[r], r.shape)
            allowed = dp + lr * (1.1 * b1 * dm * F + 0.05)
            dp_new = (p - r).detach().abs().flatten()
            worst = int((dp_new / allowed).argmax())
            assert dp_new[worst] <= allowed[worst], (
                f"{what}: element {worst} {float(dp_new[worst]) / lr:.3f} lr apart, bound "
                f"{float(allowed[worst]) / lr:.3f} lr (dp {float(dp[worst]) / lr:.3f} lr, dm {float(dm[worst]):.2e}, "
                f"F {float(F[worst]):.1f})"
            )
            if t == 1 and i == 0:  # the flip's step: the amplification is there, as predicted
                j = int((dm * F).argmax())
                predicted = b1 * float(dm[j] * F[j])
                assert predicted > 0.05, f"{what}: no flipped code to follow"
                got = float(dp_new[j] - dp[j]) / lr
                assert 0.9 * predicted <= got <= 1.1 * predicted, (what, got, predicted)
        if t == 0:
            codes = opt.state[params[0]]["exp_avg.codes"]
            if torch.equal(codes, ref.state[ref_params[0]]["exp_avg.codes"]):  # move one code a step: a flip
                _, gap = _came_m(ref.state[ref_params[0]], block)
                j = int((gap * _came_confidence(ref.state[ref_params[0]], params[0].shape)).argmax())
                codes[j] += 1 if int(codes[j]) < 255 else -1


@interpreted
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "LAMB", "LARS", "Adafactor", "CAME", "AdEMAMix"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(name, dtype):
    """bf16/fp16 parameters: the fp32 working copy is rounded back to nearest even, as torch's copy_ does."""
    check_against_reference(BY_NAME[name].cls, STATEFUL[name], 8, steps=2, dtype=dtype)


@interpreted
def test_blocks_ragged_zero_and_outliers():
    """8-bit AdamW on one tensor with an all-zero gradient block, an outlier, a ragged last block; block size 64."""
    params = make_params([(1000,)])
    ref_params = clone_params(params)
    kw = dict(lr=1e-2, state_bits=8, min_quant_numel=0, block_size=64)
    opt, ref = lowmemopt.AdamW(params, **kw), lowmemopt.AdamW(ref_params, **kw)
    for t in range(3):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(t)) * 1e-3
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
    st = opt.state[params[0]]
    assert int(st["exp_avg.absmax"][1]) == 0 and int(st["exp_avg.codes"][64:128].max()) == 127  # zero block: code of 0
    v_codes = st["exp_avg_sq.codes"][256:320]  # the outlier's block: small v never decodes to 0
    assert int(v_codes.min()) > 0


@interpreted
def test_full_tiles_take_the_unmasked_variant(monkeypatch):
    """A tile entirely inside its tensor runs the kernel body without masks (vectorizable on GPU); only the last,
    ragged tile is masked. Both give the reference's result (the other tests compare them)."""
    from lowmemopt.kernels import adamw

    masked = []
    real = adamw._adam_tile

    def spy(*args, **kwargs):
        masked.append(bool(args[-2]))  # (..., MASKED, COLS; the loss scale's gmul by keyword)
        return real(*args, **kwargs)

    monkeypatch.setattr(adamw, "_adam_tile", spy)
    check_against_reference(lowmemopt.AdamW, dict(lr=1e-2), 8, steps=1, shapes=[(2 * runtime.TILE + 5,)])
    assert masked == [False, False, True]


@interpreted
def test_multi_tensor_launch_counts(monkeypatch):
    """Many small tensors take one launch per pass: AdamW 1 for 200 tensors; LAMB 2, LARS 2, CAME (matrices) 5 (6
    where fp64 is slow: ``runtime.fast_fp64``).
    (The interpreter runs ~25 ms per program, so the multi-pass ones use fewer tensors.)"""
    seen = _launches(monkeypatch)
    cases = [
        (lowmemopt.AdamW, dict(lr=1e-3), 200, 1),
        (lowmemopt.LAMB, dict(lr=1e-3), 20, 2),
        (lowmemopt.LARS, dict(lr=1e-3, momentum=0.9), 20, 2),
    ]
    for cls, kw, n, passes in cases:
        params = make_params([(1 + (7 * i) % 61,) for i in range(n)])
        opt = cls(params, **kw)
        set_grads(params, 0)
        seen.clear()
        with runtime.cpu_interpreter():
            opt.step()
        assert len(seen) == passes, (cls.__name__, seen)
        assert all(opt.state[p]["step"] == 1 for p in params)
    for fast_fp64, passes in (
        (True, ["stats_kernel", "factors_kernel", "moments_kernel", "factors_kernel", "apply_kernel"]),
        (
            False,
            ["stats_kernel", "factors_kernel", "sumsq_kernel", "stats_kernel", "factors_kernel", "apply_kernel"],
        ),
    ):
        monkeypatch.setattr(runtime, "INTERPRETER_FAST_FP64", fast_fp64)
        params = make_params([(5 + i % 3, 7 + i % 5) for i in range(12)])
        opt = lowmemopt.CAME(params, lr=1e-3)
        set_grads(params, 0)
        seen.clear()
        with runtime.cpu_interpreter():
            opt.step()
        assert seen == passes, seen


@interpreted
def test_mixed_formats_dtypes_and_groups(monkeypatch):
    """One optimizer, two groups, fp32/bf16 params above and below min_quant_numel: one bucket per (group, format,
    dtype), each right."""
    seen = _launches(monkeypatch)
    a = make_params([(300,), (20,), (33, 9)])
    b = make_params([(300,), (20,)], dtype=torch.bfloat16, seed=3)
    ra, rb = clone_params(a), clone_params(b)
    groups = lambda x, y: [dict(params=x), dict(params=y, lr=3e-3, state_bits=16)]  # noqa: E731
    opt = lowmemopt.AdamW(groups(a, b), lr=1e-2, state_bits=8, min_quant_numel=MIN_QUANT)
    ref = lowmemopt.AdamW(groups(ra, rb), lr=1e-2, state_bits=8, min_quant_numel=MIN_QUANT)
    set_grads(a + b, 0)
    for p, r in zip(a + b, ra + rb):
        r.grad = p.grad.clone()
    with runtime.cpu_interpreter():
        opt.step()
    ref.step()
    assert len(seen) == 4  # group 0: q8, fp32 (small); group 1: bf16 state, fp32 state (small), all bf16 params
    for p, r in zip(a + b, ra + rb):
        assert_state_close(opt.state[p], ref.state[r], "mixed")
    assert_params_close(a + b, ra + rb, 1e-2, True, "mixed")


@interpreted
def test_lr_schedule_is_runtime(monkeypatch):
    """Changing lr every step is honoured (the kernels read it at launch; nothing is baked in)."""
    check_against_reference(
        lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8, steps=4, lr_schedule=lambda t: 1e-2 * 0.5**t
    )
    check_against_reference(lowmemopt.Lion, dict(lr=1e-3), 32, steps=3, lr_schedule=lambda t: 1e-3 * (t + 1))
    check_against_reference(lowmemopt.SGD, dict(lr=torch.tensor(1e-2), momentum=0.9), 8, steps=2)  # CPU-tensor lr


def _kernel_functions():
    from lowmemopt.kernels import adamw, blockwise, factored_passes, lamb, lars, lion, sgd

    for module in (adamw, blockwise, factored_passes, lamb, lars, lion, sgd):
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", obj)
            if name.endswith("_kernel") and getattr(fn, "__module__", None) == module.__name__:  # (defined there)
                yield f"{module.__name__}.{name}", fn


def test_hyperparameters_are_not_constexpr():
    """Only block sizes, formats, dtypes and flags (UPPER-case names) are tl.constexpr; every lower-case argument (lr,
    betas, eps, weight decay, bias corrections, step flags) is a runtime scalar, so an LR schedule never recompiles."""
    import triton.language as tl

    kernels = list(_kernel_functions())
    assert len(kernels) >= 12
    for name, fn in kernels:
        params = inspect.signature(fn).parameters.values()
        constexpr = {p.name for p in params if p.annotation in (tl.constexpr, "tl.constexpr")}
        runtime_args = {p.name for p in params} - constexpr
        assert all(n.isupper() for n in constexpr), (name, constexpr)
        assert all(not n.isupper() for n in runtime_args), (name, runtime_args)
    adam = dict(_kernel_functions())["lowmemopt.kernels.adamw._adam_kernel"]
    assert {"step_size", "eps", "beta2", "weight_decay", "decay"} <= set(inspect.signature(adam).parameters)


# ---------------------------------------------------------------------------------------------------------------------
# dispatch: who takes the kernels, and clean fallbacks


def test_registry_covers_every_pair():
    from lowmemopt.kernels import registry

    declared = {
        cls.algorithm.kernels.name: cls.algorithm.kernels
        for cls in (
            lowmemopt.AdamW,
            lowmemopt.SGD,
            lowmemopt.SignSGD,
            lowmemopt.Lion,
            lowmemopt.LAMB,
            lowmemopt.LARS,
            lowmemopt.Adafactor,
            lowmemopt.CAME,
            lowmemopt.AdEMAMix,
        )
    }
    for name, kernels in declared.items():
        for fmt in ("fp32", "bf16", "q8", "q4"):
            kernel = registry.lookup(kernels, fmt)
            assert (kernel.algorithm, kernel.fmt) == (name, fmt)
        assert registry.lookup(kernels, "q2") is None
    p = [torch.nn.Parameter(torch.zeros(2))]
    expect = {
        lowmemopt.AdamW: "adam",
        lowmemopt.Adam: "adam",
        lowmemopt.AdamW8bit: "adam",
        lowmemopt.SGD: "sgd",
        lowmemopt.Lion8bit: "lion",
        lowmemopt.LAMB: "lamb",
        lowmemopt.LARS8bit: "lars",
        lowmemopt.Adafactor: "adafactor",
        lowmemopt.CAME8bit: "came",
        lowmemopt.AdafactorTorch: "adafactor_torch",
        lowmemopt.GaLoreAdamW: None,
    }
    for cls, algorithm in expect.items():
        opt = cls(p, lr=1e-3) if cls is not lowmemopt.Adafactor else cls(p)
        assert kernel_algorithm(opt) == algorithm, cls

    class CustomMath(AdamAlgorithm):  # changes the math: no kernel reproduces it
        def update(self, p, g, state, group, step, reduce=None):
            return super().update(p, g, state, group, step)

    class Custom(lowmemopt.AdamW):
        algorithm = CustomMath()

    assert kernel_algorithm(Custom(p)) is None
    assert registry.lookup(lowmemopt.AdafactorTorch.algorithm.kernels, "fp32") is None  # a native CPU kernel only


@interpreted
def test_fallbacks_take_the_reference_path(monkeypatch):
    seen = _launches(monkeypatch)

    def stepped(opt, params, interpret=True):
        set_grads(params, 0)
        before = [p.detach().clone() for p in params]
        if interpret:
            with runtime.cpu_interpreter():
                opt.step()
        else:
            opt.step()
        return all(not torch.equal(b, p) for b, p in zip(before, params))

    params = make_params([(50,)])
    assert stepped(lowmemopt.AdamW(params), params, interpret=False) and not seen  # CPU tensors: reference
    params = make_params([(50,)])
    assert stepped(lowmemopt.AdafactorTorch(params), params) and not seen  # no kernel for the algorithm
    params = make_params([(8, 6)])
    assert stepped(lowmemopt.LAMB([dict(params=params, rank=2)]), params) and seen  # GaLore: ||p|| given to the kernel
    seen.clear()
    params = make_params([(8, 6)])
    opt = lowmemopt.AdamW(params)
    set_grads(params, 0)
    params[0].grad = params[0].grad.t().contiguous().t()  # non-contiguous gradient
    with runtime.cpu_interpreter():
        opt.step()
    assert not seen and opt.state[params[0]]["step"] == 1
    monkeypatch.setattr(runtime, "ENABLED", False)  # LOWMEMOPT_KERNELS=0
    params = make_params([(50,)])
    assert stepped(lowmemopt.AdamW(params), params) and not seen
    monkeypatch.setattr(runtime, "ENABLED", True)
    params = make_params([(50,)])
    assert stepped(lowmemopt.AdamW(params), params) and seen  # and the kernel path is really there


@interpreted
def test_nonfinite_gradient_skips_only_that_parameter(monkeypatch):
    seen = _launches(monkeypatch)
    params = make_params([(50,), (60,)])
    opt = lowmemopt.AdamW(params, state_bits=8, min_quant_numel=0)
    set_grads(params, 0)
    params[1].grad[3] = float("nan")
    before = params[1].detach().clone()
    with runtime.cpu_interpreter():
        opt.step()
    with pytest.warns(RuntimeWarning, match="skipped 1 parameter"):  # (decided on the device, settled here)
        assert opt.nonfinite_skips == 1
    assert seen and torch.equal(params[1].detach(), before) and "step" not in opt.state[params[1]]
    assert opt.state[params[0]]["step"] == 1


def test_fast_fp64_by_capability(monkeypatch):
    """Data-centre GPUs (fp64 at half the fp32 rate) take CAME's fp64 moments pass; GeForce / RTX, L4 / L40 and Jetson
    (1/32 to 1/64) keep the direct pass."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for cap, fast in {
        (6, 0): True,
        (7, 0): True,
        (8, 0): True,
        (9, 0): True,
        (10, 0): True,
        (6, 1): False,
        (7, 5): False,
        (8, 6): False,
        (8, 7): False,
        (8, 9): False,
        (12, 0): False,
    }.items():
        monkeypatch.setattr(runtime, "_capability", lambda index, cap=cap: cap)
        assert runtime.fast_fp64(torch.device("cuda")) is fast, cap
        assert runtime.fast_fp64(torch.device("cuda", 1)) is fast, cap
    monkeypatch.setattr(runtime, "INTERPRETER_FAST_FP64", False)
    assert runtime.fast_fp64(torch.device("cpu")) is False


def test_launch_table_caches_are_bounded():
    """The launch-table caches (kernels.table) hold tables by content, least recently used first out, within their
    entry and byte bounds; a hit is the very tensor."""
    from lowmemopt.kernels import table

    cache = table._Cache(3, 48)  # 3 entries, 48 bytes
    made = []
    make = lambda n: lambda: made.append(n) or torch.zeros(n, dtype=torch.int64)  # noqa: E731
    a = cache.get(("a",), make(1))
    assert cache.get(("a",), make(1)) is a and made == [1]
    cache.get(("b",), make(2))
    cache.get(("c",), make(2))  # 40 bytes in 3 entries
    cache.get(("a",), make(1))  # a is the most recent now
    cache.get(("d",), make(1))  # 4 entries: b goes
    assert list(cache.entries) == [("c",), ("a",), ("d",)] and cache.nbytes == 32
    cache.get(("e",), make(3))  # 4 entries, 56 bytes: c goes
    assert list(cache.entries) == [("a",), ("d",), ("e",)] and cache.nbytes == 40
    big = cache.get(("f",), make(10))  # alone over the byte bound: kept, alone
    assert list(cache.entries) == [("f",)] and cache.get(("f",), make(10)) is big
    cache.get(("g",), make(1))  # 2 entries but 88 bytes: f goes
    assert list(cache.entries) == [("g",)] and cache.nbytes == 8
    rows = [[1, 2, 3], [4, 5, 6]]
    t, skipped = table.device_tables(rows, torch.device("cpu"))
    assert t.tolist() == rows and skipped.tolist() == [[1, 2, 0], [4, 5, 0]]
    assert table.device_table(rows, torch.device("cpu")).tolist() == rows


def test_tables_reach_a_cuda_device_without_blocking(monkeypatch):
    """A launch table goes to a CUDA device from page-locked memory with ``non_blocking`` (a copy from pageable memory
    would make the host wait for the stream); without page-locked memory, the blocking copy. (Mocked: no GPU here.)"""
    from lowmemopt.kernels import table

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(
        torch.Tensor, "to", lambda self, device, non_blocking=False: calls.append((str(device), non_blocking)) or self
    )
    rows = torch.tensor([[1, 2, 3]])
    assert table.upload(rows, torch.device("cuda")) is rows
    assert calls == ["pin", ("cuda", True)]

    def no_pinned(self):
        raise RuntimeError("cannot pin")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinned)
    calls.clear()
    table.upload(rows, torch.device("cuda"))
    assert calls == [("cuda", False)]
    calls.clear()
    table.upload(rows, torch.device("cpu"))
    assert calls == [("cpu", False)]


def test_cpu_interpreter_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with runtime.cpu_interpreter():
            pass


def test_launch_failure_before_writing_falls_back(monkeypatch):
    """A kernel that cannot compile (raised before anything is written) turns the fused path off with a warning and
    the step completes on the reference path, state intact."""
    from lowmemopt.kernels import adamw, registry

    def broken(update, bucket):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(runtime, "INTERPRET", True)
    monkeypatch.setattr(runtime, "ENABLED", True)
    monkeypatch.setitem(
        registry._MADE,
        (lowmemopt.AdamW.algorithm.kernels, "fp32"),
        registry.Kernel(lambda g, p: adamw.slots(g), broken, algorithm="adam", fmt="fp32"),
    )
    params = make_params([(50,)])
    ref_params = clone_params(params)
    opt, ref = lowmemopt.AdamW(params), lowmemopt.AdamW(ref_params)
    set_grads(params, 0)
    ref_params[0].grad = params[0].grad.clone()
    with runtime.cpu_interpreter(), pytest.warns(RuntimeWarning, match="no ptxas"):
        opt.step()
    ref.step()
    assert runtime.ENABLED is False
    torch.testing.assert_close(params[0], ref_params[0], rtol=0, atol=0)
    assert opt.state[params[0]]["step"] == 1


RESOURCES_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "kernel_resources.py"


def _resources_module():
    """bench/kernel_resources.py as a module (standard library only at import: its parsing and occupancy helpers)."""
    return load_bench("kernel_resources")


def _nvidia_backend() -> bool:
    """Is there Triton's NVIDIA backend, with its ptxas (the one the compile test compiles with)?"""
    return _resources_module().ptxas_path() is not None


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend (ptxas) is not available")
def test_kernels_compile_for_gpu(tmp_path):
    """Every kernel variant (``lowmemopt.kernels.variants``) compiles for sm_90 with Triton's real compiler and ptxas
    (no GPU needed), through ``bench/kernel_resources.py --no-sweep`` (worker processes without TRITON_INTERPRET): the
    report runs, the full-tile paths keep 128-bit vector loads, and the main kernels do not spill registers at their
    default tile and num_warps. The interpreter checks none of this."""
    import json
    import subprocess
    import sys

    from lowmemopt.kernels.variants import VARIANTS

    out = subprocess.run(
        [sys.executable, str(RESOURCES_SCRIPT), "--no-sweep", "--json", str(tmp_path / "r.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| variant | tile | warps | regs | spill st/ld |" in out.stdout
    records = json.loads((tmp_path / "r.json").read_text())["variants"]
    assert [r["label"] for r in records] == [v.label for v in VARIANTS], out.stdout[-3000:]
    failed = [(r["label"], r["error"]) for r in records if not r["ok"]]
    assert not failed, failed
    by_label = {r["label"]: r for r in records}
    for name in ("adam", "adam-fp32-state", "lion", "lamb", "apply-came", "adam-q4", "apply-came-q4", "unproject"):
        r = by_label[name]
        assert r["path"] == "full" and r["ld_global"]["128"] > 0, (name, r["path"], r["ld_global"])
    for name in ("adam", "adam-q4", "lion", "sgd", "apply-came"):
        r = by_label[name]
        assert r["num_warps"] == runtime.NUM_WARPS and r["registers"] is not None, r
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0), (
            f"{name} spills at tile {r['tile']}, {r['num_warps']} warps: {r['registers']} registers, "
            f"{r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads"
        )
    # the instruction budget of the 8-bit update (SASS per element on the full-tile path; issue-bound with bf16
    # parameters): 8-bit AdamW with amsgrad took 218 with a division per element and class compares, 150 without.
    # Triton before 3.7 lays the tile's gathers (code book, class table) out with its rows fastest and converts the
    # tile to that layout through shared memory (docs/kernels.md, "Triton versions"): 173.8 / 68.4 / 68.5 with 3.6
    sass = {name: by_label[name]["sass_per_element"] for name in ("adam", "lion", "quantize")}
    limits = dict(adam=160, lion=62, quantize=60)
    if runtime._triton_before(3, 7):
        limits = dict(adam=185, lion=75, quantize=75)
    assert all(sass[name] < limit for name, limit in limits.items()), (sass, limits)
    # the tile layout the installed Triton is given (runtime.column_tiles) keeps its gathers out of shared memory:
    # no layout conversion of the whole tile (3.6, row tiles: 70 shared loads and 24 barriers per program)
    native = ("adam-cols", "lion-cols", "lamb-cols") if runtime.column_tiles("q8") else ("adam", "lion", "lamb")
    round_trips = {name: (by_label[name]["ld_shared"], by_label[name]["st_shared"]) for name in native}
    assert all(max(ld_st) <= 8 for ld_st in round_trips.values()), round_trips


_PTX = """\
.visible .entry k(
)
{
	.loc	1 10 5
	ld.global.b64 	{ %rd1 }, [ %rd0 + 0 ];
	.loc	1 11 5                          // k.py:11:5
	@!%p1 bra 	$L__BB0_1;
	.loc	2 7 3, function_name $L__info_string0, inlined_at 1 14 9
	@%p2 ld.global.b32 	{ %r1 }, [ %rd2 + 0 ];
	@%p2 ld.global.b8 	{ %rs1 }, [ %rd2 + 0 ];
	bar.sync 	0;
	bra.uni 	$L__BB0_3;
$L__BB0_1:
	.loc	2 7 3, function_name $L__info_string0, inlined_at 1 12 9
	ld.global.v4.b32 	{ %r2, %r3, %r4, %r5 }, [ %rd3 + 0 ];
	ld.global.v2.b16 	{ %rs2, %rs3 }, [ %rd3 + 0 ];
	st.global.v4.b32 	[ %rd4 + 0 ], { %r2, %r3, %r4, %r5 };
	st.shared.b32 	[%r7], %r6;
	ld.shared.v4.b32 	{ %r2, %r3, %r4, %r5 }, [%r7];
	red.global.add.f32 	[ %rd5 + 0 ], %r6;
$L__BB0_3:
	ret;
$L__func_end0:
}
	.file	1 "/src/k.py"
	.file	2 "/src/codec.py"
"""


def test_kernel_resources_ptx_paths_counts_and_occupancy():
    """bench/kernel_resources.py's static analysis on a hand-written PTX (no compiler): the full-tile path leaves out
    the masked side of ``if full:``, memory instructions count by width, and the occupancy follows CUDA's calculator
    for sm_90."""
    res = _resources_module()
    branch = ("/src/k.py", 11, range(12, 13), range(14, 15))  # if full: (11) / then (12) / else: (13) / else body (14)
    path, lines = res.full_tile_path(_PTX, branch)
    assert path == "full"
    full = res.memory_counts(lines)
    assert full["ld_global"] == {128: 1, 64: 1, 32: 1, 16: 0} and full["st_global"] == {128: 1, 64: 0, 32: 0, 16: 0}
    assert (full["ld_shared"], full["st_shared"], full["bar_sync"], full["atomics"]) == (1, 1, 0, 1)
    assert full["load_bytes"] == 8 + 16 + 4  # v2.b16: one 32-bit access
    whole = res.memory_counts(res.entry_body(_PTX))
    assert whole["ld_global"] == {128: 1, 64: 1, 32: 2, 16: 1} and whole["bar_sync"] == 1
    assert res.full_tile_path(_PTX, None)[0] == "all"  # a kernel without `if full:`
    assert res.full_tile_path(_PTX, ("/src/other.py", 11, range(12, 13), range(14, 15)))[0] == "all"
    # Triton 3.6 and older write the call sites only in the .loc comment: the same path and counts
    old_style = _PTX.replace(
        ", function_name $L__info_string0, inlined_at 1 14 9", "  // codec.py:7:3 @[ k.py:14:9 ]"
    ).replace(", function_name $L__info_string0, inlined_at 1 12 9", "  // codec.py:7:3 @[ k.py:12:9 ]")
    assert "inlined_at" not in old_style
    path_old, lines_old = res.full_tile_path(old_style, branch)
    assert path_old == "full" and res.memory_counts(lines_old) == full
    assert res.masked_ptx_lines(old_style, branch) == res.masked_ptx_lines(_PTX, branch)

    # registers are allocated per warp in units of 256: 160 -> 5120 per warp, 12 warps fit; 3 blocks of 4 warps
    occ = res.occupancy(160, 4096, 4)
    assert (occ.blocks, occ.warps, occ.limiter) == (3, 12, "regs")
    assert res.occupancy(254, 0, 4).warps == 8 and res.occupancy(128, 8192, 8).warps == 16
    assert (res.occupancy(24, 0, 4).warps, res.occupancy(24, 0, 4).limiter) == (64, "threads")
    assert res.occupancy(32, 0, 4).limiter == "regs+threads"  # 1024 registers per warp: exactly 64 warps
    assert res.occupancy(32, 100 * 1024, 4).limiter == "smem"  # 2 blocks of 101 KiB in 228 KiB
    assert res.occupancy(16, 0, 1).limiter == "blocks"

    log = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\n"
        "    368 bytes stack frame, 648 bytes spill stores, 804 bytes spill loads\n"
        "ptxas info    : Used 64 registers, used 1 barriers, 368 bytes cumulative stack size\n"
    )
    assert res.parse_ptxas_log(log, "k") == dict(registers=64, barriers=1, stack=368, spill_stores=648, spill_loads=804)
    usage = (
        "Resource usage:\n Common:\n  GLOBAL:0\n Function k:\n  REG:160 STACK:0 SHARED:1024 LOCAL:0 "
        "CONSTANT[0]:608 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    )
    assert res.parse_resource_usage(usage, "k") == dict(reg=160, stack=0, shared=1024, local=0)


_SASS = """\
.text.k:
	//## File ".nv_debug_ptx_txt", line 4
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
	//## File ".nv_debug_ptx_txt", line 9
        /*0020*/              @P2 LDG.E R4, desc[UR4][R2.64] ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
	//## File ".nv_debug_ptx_txt", line 15
        /*0040*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0050*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
	//## File ".nv_debug_ptx_txt", line 22
        /*0060*/                   EXIT ;
        /*0070*/                   NOP;
$__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath:
        /*0080*/                   FCHK P0, R4, R5 ;
        /*0090*/                   RET.REL.NODEC R2 `(k) ;
"""


def test_kernel_resources_counts_the_sass_of_the_full_tile_path():
    """bench/kernel_resources.py's SASS count on a hand-written ``nvdisasm -gp`` listing of :data:`_PTX`'s kernel:
    instructions made from the PTX lines only the masked side of ``if full:`` reaches are left out, and so are NOP
    padding and the slow-path subroutines."""
    res = _resources_module()
    branch = ("/src/k.py", 11, range(12, 13), range(14, 15))
    masked = res.masked_ptx_lines(_PTX, branch)
    lines = _PTX.splitlines()
    assert masked == set(range(8, 13)) and lines[7].strip().startswith(".loc")  # the masked block: .loc .. bra.uni
    assert res.sass_full_path(_SASS, masked) == ("full", 5)  # LDC BRA LDG.128 CALL EXIT
    assert res.sass_full_path(_SASS, None) == ("all", 7)
    assert res.masked_ptx_lines(_PTX, None) is None


def test_kernel_resources_finds_the_full_branch_of_a_tile_kernel():
    """The ``if full:`` of a real tile kernel's source and its then / else bodies (the lines the PTX's ``.loc``
    directives name)."""
    import linecache

    from lowmemopt.kernels import adamw, blockwise

    res = _resources_module()
    path, if_line, then_lines, else_lines = res.full_branch_lines(adamw._adam_kernel)
    assert linecache.getline(path, if_line).strip() == "if full:"
    assert linecache.getline(path, then_lines.stop).strip() == "else:"
    assert "_adam_tile(" in linecache.getline(path, then_lines.start)
    assert "_adam_tile(" in linecache.getline(path, else_lines.start)
    assert res.full_branch_lines(blockwise._quantize_kernel) is None


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels through the optimizers vs the CPU reference


#: (3, 5, 300): rows of at least a tile row, so the factored passes index their factors per segment (WIDE)
GPU_SHAPES = [(4099,), (257, 129), (3, 64, 100), (3, 5, 300), (40,), (1 << 16,)]
compiled_kernels = pytest.mark.skipif(runtime.INTERPRET, reason="TRITON_INTERPRET=1: the kernels are interpreted")


@pytest.mark.gpu
@compiled_kernels
@pytest.mark.parametrize("info", KERNEL_OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_kernels_match_cpu_reference(info, bits, dtype, monkeypatch):
    """CUDA params through the compiled kernels vs the same optimizer's CPU reference path, one step at a time from
    the kernel's own state (3 steps), with the same rules as the interpreter tests."""
    from lowmemopt import compiled
    from lowmemopt.kernels import dispatch

    monkeypatch.setattr(compiled, "ENABLED", False)  # the eager CPU reference
    kwargs = STATEFUL[info.name]
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(GPU_SHAPES, dtype=dtype)]
    ref_params = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    opt = info.cls(params, state_bits=bits, **kwargs)
    ref = info.cls(ref_params, state_bits=bits, **kwargs)
    for t in range(3):
        if t:  # the load hook moves the state to the reference's (CPU) params
            _sync(opt, params, ref, ref_params)
        set_grads(ref_params, t)
        for p, r in zip(params, ref_params):
            p.grad = r.grad.cuda()
        before = sum(dispatch.stats.values())
        start = [_state_copy(ref.state[r]) for r in ref_params]
        opt.step()
        ref.step()
        assert sum(dispatch.stats.values()) > before, "the kernel path did not run"
        what = f"{info.name} bits={bits} {dtype} step {t + 1}"
        for p, r, st in zip(params, ref_params, start):
            ours = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            assert_state_close(ours, ref.state[r], what, st)
        assert_params_close([p.detach().cpu() for p in params], ref_params, _lr(kwargs), bits < 32, what)


def _compiled_count(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
@compiled_kernels
def test_gpu_lr_change_does_not_recompile():
    """An LR schedule changes lr (and the bias corrections change every step) without compiling the kernel again."""
    from lowmemopt.kernels import adamw

    params = [torch.nn.Parameter(torch.randn(5000, device="cuda"))]
    opt = lowmemopt.AdamW8bit(params, lr=1e-3, min_quant_numel=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9**t)
    counts = []
    for _ in range(6):
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        sched.step()
        counts.append(_compiled_count(adamw._adam_kernel))
    assert counts[0] >= 1 and counts[-1] == counts[0], counts


@pytest.mark.gpu
@compiled_kernels
def test_gpu_codec_matches_reference():
    from lowmemopt.kernels import blockwise
    from lowmemopt.quant import quantize_blockwise

    x = torch.randn(1 << 20) * torch.rand(1 << 20) ** 6
    x[:256] = 0
    x[1000] = 1e4
    for name, inp in (("pow2", x), ("upow2", x.abs()), ("dynamic", x), ("udynamic", x.abs())):
        codes, absmax = blockwise.quantize_blockwise_triton(inp.cuda(), name)
        ref_codes, ref_absmax = quantize_blockwise(inp, name)
        assert torch.equal(codes.cpu(), ref_codes) and torch.equal(absmax.cpu(), ref_absmax)


@pytest.mark.gpu
@compiled_kernels
@pytest.mark.parametrize("name", ["AdamW", "Lion", "SGD", "LAMB", "LARS", "CAME"])
def test_gpu_q8_decode_modes_are_bit_identical(name, monkeypatch):
    """The compiled kernels with ``Q8_DECODE = "arithmetic"`` (no code-book gathers) give the table mode's params and
    state bit for bit, 3 steps of bf16 params with 8-bit state (the GPU sweep times both)."""
    runs = []
    for mode in ("table", "arithmetic"):
        monkeypatch.setattr(runtime, "Q8_DECODE", mode)
        params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(GPU_SHAPES, dtype=torch.bfloat16)]
        opt = BY_NAME[name].cls(params, state_bits=8, min_quant_numel=0, **STATEFUL[name])
        for t in range(3):
            set_grads(params, t)
            opt.step()
        runs.append((params, opt))
    (a, opt_a), (b, opt_b) = runs
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            other = opt_b.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@pytest.mark.gpu
@compiled_kernels
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=["p32", "pbf16"])
def test_gpu_unproject_apply_matches_the_torch_path(p_dtype):
    """GaLore's fused apply (kernels/unproject.py) compiled, against the same arithmetic in torch on the GPU: a full
    and a ragged tile, fp32 and bf16 products, a decay per matrix."""
    from lowmemopt.kernels.unproject import apply_updates

    gen = torch.Generator().manual_seed(5)
    for shape, u_dtype in (((64, 64), torch.float32), ((37, 300), torch.bfloat16)):
        params = [torch.randn(shape, generator=gen).to(p_dtype).cuda() for _ in range(4)]
        updates = (torch.randn((4, *shape), generator=gen) * 1e-2).to(u_dtype).cuda()
        c = torch.tensor([-0.01, -0.02, 0.0, 0.03], device="cuda")
        want = [
            (((p.float() + c[i] * p.float()) * 0.999) + updates[i].float() * 0.25).to(p_dtype)
            for i, p in enumerate(params)
        ]
        apply_updates(params, updates, 0.25, 0.999, c)
        for got, ref in zip(params, want):
            torch.testing.assert_close(
                got.float(), ref.float(), rtol=2**-7 if p_dtype == torch.bfloat16 else 2e-7, atol=1e-6
            )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_without_cuda(tmp_path):
    """bench/fused_kernels.py is GPU-only and says so (exit code 2), instead of timing the CPU reference path."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "fused_kernels.py"
    out = subprocess.run(
        [sys.executable, str(script), "--sizes", "10M"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------------
# GaLore's apply pass after the batched product back (kernels/unproject.py)


@interpreted
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=["p32", "pbf16"])
@pytest.mark.parametrize("u_dtype", [torch.float32, torch.bfloat16], ids=["u32", "ubf16"])
@pytest.mark.parametrize("math_decay", [None, -0.03, "per-matrix"])
@pytest.mark.parametrize("decay", [1.0, 0.999])
def test_unproject_apply_matches_the_torch_path(p_dtype, u_dtype, math_decay, decay):
    """``p <- round(((p + c p) decay) + scale U)`` for a batch of matrices (a ragged last tile, a full tile) against
    the torch path of ``finish_many`` (an fp32 working copy, one rounding): within fp32 rounding (the kernel's
    ``p + c p`` is one fused multiply-add), so bf16 parameters are equal but for a rounding tie's ulp."""
    from lowmemopt.kernels.unproject import apply_updates

    gen = torch.Generator().manual_seed(3)
    for shape in [(37, 53), (64, 32)]:  # 1961 elements (one masked tile); 2048 (one full tile)
        params = [torch.randn(shape, generator=gen).to(p_dtype) for _ in range(3)]
        updates = (torch.randn((3, *shape), generator=gen) * 1e-2).to(u_dtype)
        c = torch.tensor([-0.01, -0.02, 0.0]) if math_decay == "per-matrix" else math_decay
        want = []
        for i, p in enumerate(params):
            p32 = p.float()
            if c is not None:
                p32 = p32 + (c[i] if isinstance(c, torch.Tensor) else c) * p32
            p32 = p32 * decay
            want.append((p32 + updates[i].float() * 0.25).to(p_dtype))
        with runtime.cpu_interpreter():
            apply_updates(params, updates, 0.25, decay, c)
        for got, ref in zip(params, want):
            if p_dtype == torch.float32:
                torch.testing.assert_close(got, ref, rtol=2e-7, atol=1e-8)
            else:
                diff = (got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)
                assert float(diff.max()) <= 2**-8 and int((got != ref).sum()) <= 2, (shape, int((got != ref).sum()))
