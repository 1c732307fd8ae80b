"""Fused Triton kernels (lowmemopt.kernels) against the reference composition decode -> fp32 math -> encode.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by CI and by ``conftest.py`` on
machines without CUDA): each test sends CPU tensors through them with ``runtime.cpu_interpreter()``. The reference is
the same optimizer's eager path (``_step_param``) started from an exact copy of the kernel's params and state, so
every check is one step of decode -> math -> encode. Rules checked (docs/kernels.md):

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
import os

import pytest
import torch
from helpers import assert_params_close, assert_state_close, clone_params, make_params, set_grads
from optim_info import BY_NAME, OPTIMIZERS, STATEFUL

import lowmemopt
from lowmemopt.kernels import runtime
from lowmemopt.optimizer import kernel_algorithm

pytestmark = pytest.mark.skipif(not runtime.HAS_TRITON, reason="triton is not installed")
interpreted = pytest.mark.skipif(
    not runtime.INTERPRET,
    reason="needs TRITON_INTERPRET=1 before lowmemopt.kernels is imported (conftest sets it without CUDA); "
    "on a GPU machine the gpu tests cover the kernels",
)

def _has_kernel(cls) -> bool:
    from lowmemopt.kernels import registry

    return kernel_algorithm(cls) in registry.ALGORITHMS


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


def check_against_reference(cls, kwargs, bits, *, steps=3, shapes=SHAPES, dtype=torch.float32, seed=0,
                            opt_kwargs=None, lr_schedule=None):
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
    from lowmemopt.kernels import codec
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
            codes, absmax = codec.quantize_blockwise(inp, name, block_size)
            ref_codes, ref_absmax = quantize_blockwise(inp, name, block_size)
            assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax), (name, n, inp.dtype)
            out = codec.dequantize_blockwise(codes, absmax, name, block_size)
            assert torch.equal(out, dequantize_blockwise(ref_codes, ref_absmax, name, block_size))
    if name.startswith("u"):
        assert int(codes[block_size + 4]) > 0


@interpreted
def test_codec_bad_inputs():
    from lowmemopt.kernels import codec

    x = torch.randn(100)
    with pytest.raises(ValueError, match="unknown quantization map"):
        codec.quantize_blockwise(x, "linear")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        codec.quantize_blockwise(x, "dynamic", 100)
    with pytest.raises(TypeError, match="floating-point"):
        codec.quantize_blockwise(torch.ones(10, dtype=torch.int32))
    codes, absmax = codec.quantize_blockwise(x)
    with pytest.raises(TypeError, match="codes must be uint8"):
        codec.dequantize_blockwise(codes.int(), absmax)
    with pytest.raises(ValueError, match="absmax has 2 blocks"):
        codec.dequantize_blockwise(codes, torch.zeros(2))


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
    o, r = opt.state[params[0]]["exp_avg"].float(), ref.state[ref_params[0]]["exp_avg"].float()
    assert float(r.abs().max()) < 2 ** -6 * float(start["exp_avg"].float().abs().max()), "m' did not cancel"
    assert_state_close(opt.state[params[0]], ref.state[ref_params[0]], f"{name} cancelling m'", start)


@interpreted
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "LAMB", "LARS", "Adafactor", "CAME"])
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

    def spy(*args):
        masked.append(bool(args[-1]))
        return real(*args)

    monkeypatch.setattr(adamw, "_adam_tile", spy)
    check_against_reference(lowmemopt.AdamW, dict(lr=1e-2), 8, steps=1, shapes=[(2 * runtime.TILE + 5,)])
    assert masked == [False, False, True]


@interpreted
def test_multi_tensor_launch_counts(monkeypatch):
    """Many small tensors take one launch per pass: AdamW 1 for 200 tensors; LAMB 2, LARS 2, CAME (matrices) 6.
    (The interpreter runs ~25 ms per program, so the multi-pass ones use fewer tensors.)"""
    seen = _launches(monkeypatch)
    cases = [(lowmemopt.AdamW, dict(lr=1e-3), 200, 1), (lowmemopt.LAMB, dict(lr=1e-3), 20, 2),
             (lowmemopt.LARS, dict(lr=1e-3, momentum=0.9), 20, 2)]
    for cls, kw, n, passes in cases:
        params = make_params([(1 + (7 * i) % 61,) for i in range(n)])
        opt = cls(params, **kw)
        set_grads(params, 0)
        seen.clear()
        with runtime.cpu_interpreter():
            opt.step()
        assert len(seen) == passes, (cls.__name__, seen)
        assert all(opt.state[p]["step"] == 1 for p in params)
    params = make_params([(5 + i % 3, 7 + i % 5) for i in range(12)])
    opt = lowmemopt.CAME(params, lr=1e-3)
    set_grads(params, 0)
    seen.clear()
    with runtime.cpu_interpreter():
        opt.step()
    assert len(seen) == 6, seen


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
    check_against_reference(lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8, steps=4,
                            lr_schedule=lambda t: 1e-2 * 0.5 ** t)
    check_against_reference(lowmemopt.Lion, dict(lr=1e-3), 32, steps=3, lr_schedule=lambda t: 1e-3 * (t + 1))
    check_against_reference(lowmemopt.SGD, dict(lr=torch.tensor(1e-2), momentum=0.9), 8, steps=2)  # CPU-tensor lr


def _kernel_functions():
    from lowmemopt.kernels import adamw, codec, factored, lamb, lars, lion, sgd

    for module in (adamw, codec, factored, lamb, lars, lion, sgd):
        for name, obj in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel"):
                yield f"{module.__name__}.{name}", getattr(obj, "fn", obj)


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

    pairs = set(registry.registered())
    for algorithm in ("adam", "sgd", "lion", "lamb", "lars", "adafactor", "came"):
        for fmt in ("fp32", "bf16", "q8", "q4"):
            assert (algorithm, fmt) in pairs
    p = [torch.nn.Parameter(torch.zeros(2))]
    expect = {lowmemopt.AdamW: "adam", lowmemopt.Adam: "adam", lowmemopt.AdamW8bit: "adam", lowmemopt.SGD: "sgd",
              lowmemopt.Lion8bit: "lion", lowmemopt.LAMB: "lamb", lowmemopt.LARS8bit: "lars",
              lowmemopt.Adafactor: "adafactor", lowmemopt.CAME8bit: "came",
              lowmemopt.AdafactorTorch: "adafactor_torch", lowmemopt.GaLoreAdamW: None}
    for cls, algorithm in expect.items():
        opt = cls(p, lr=1e-3) if cls is not lowmemopt.Adafactor else cls(p)
        assert kernel_algorithm(opt) == algorithm, cls

    class Custom(lowmemopt.AdamW):  # changes the math: no kernel reproduces it
        def _update(self, p, g, state, group, step):
            return super()._update(p, g, state, group, step)

    assert kernel_algorithm(Custom(p)) is None
    assert "adafactor_torch" not in registry.ALGORITHMS  # a native CPU kernel only


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
    with runtime.cpu_interpreter(), pytest.warns(RuntimeWarning, match="skipped 1 parameter"):
        opt.step()
    assert seen and torch.equal(params[1].detach(), before) and "step" not in opt.state[params[1]]
    assert opt.state[params[0]]["step"] == 1


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
    registry._load()
    monkeypatch.setitem(registry._REGISTRY, ("adam", "fp32"),
                        registry.Kernel("adam", "fp32", lambda g, p: adamw.slots(g), broken))
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


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        takes_arch = "arch" in inspect.signature(get_ptxas).parameters
        return bool((get_ptxas(90) if takes_arch else get_ptxas()).path)
    except Exception:  # noqa: BLE001 - no NVIDIA backend or no ptxas in this Triton install
        return False


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend (ptxas) is not available")
def test_kernels_compile_for_gpu(tmp_path):
    """Every kernel compiles for sm_90 with Triton's real compiler and ptxas (no GPU needed; in a subprocess without
    TRITON_INTERPRET), and the full-tile variants keep 128-bit vector loads/stores: the interpreter checks neither."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    worker = Path(__file__).resolve().parent / "kernels_aot_worker.py"
    out = subprocess.run([sys.executable, str(worker)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 21, out.stdout[-3000:]
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
    vectorized = {r["kernel"]: r["v4"] for r in results}
    for name in ("adam", "adam-fp32-state", "lion", "lamb", "apply-came", "adam-q4", "apply-came-q4"):
        assert vectorized[name] > 0, vectorized


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels through the optimizers vs the CPU reference


GPU_SHAPES = [(4099,), (257, 129), (3, 64, 100), (40,), (1 << 16,)]
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9 ** t)
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
    from lowmemopt.kernels import codec
    from lowmemopt.quant import quantize_blockwise

    x = torch.randn(1 << 20) * torch.rand(1 << 20) ** 6
    x[:256] = 0
    x[1000] = 1e4
    for name, inp in (("pow2", x), ("upow2", x.abs()), ("dynamic", x), ("udynamic", x.abs())):
        codes, absmax = codec.quantize_blockwise(inp.cuda(), name)
        ref_codes, ref_absmax = quantize_blockwise(inp, name)
        assert torch.equal(codes.cpu(), ref_codes) and torch.equal(absmax.cpu(), ref_absmax)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_without_cuda(tmp_path):
    """bench/fused_kernels.py is GPU-only and says so (exit code 2), instead of timing the CPU reference path."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "fused_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--sizes", "10M"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr, out.stderr[-2000:]
