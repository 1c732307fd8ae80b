"""The step pipeline (``lowmemopt.pipeline``): every combination of residency (plain, paged in RAM, paged on disk),
projection (full rank, GaLore) and state format (32, 16, 8, 4 bits) through every backend (eager reference, native CPU
kernels, Triton kernels under the interpreter), for every optimizer, against the eager reference.

* Paging never changes a result: paged runs equal the unpaged run on the same backend, bit for bit.
* A backend equals the eager reference bit for bit where it is exact (the native kernels of the elementwise
  algorithms, full rank or GaLore-projected), and within the fused-kernel bounds otherwise (8- and 4-bit codes within
  one step, fp32 within rounding; ``helpers.assert_state_close``).
* The Triton backend really steps paged and projected parameters (the kernel statistics move), in O(buckets) launches.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import assert_params_close, assert_state_close, interpreter_fma_rounds_once, make_params, set_grads
from optim_info import BY_NAME, STATEFUL

import lowmemopt
from lowmemopt import cpu
from lowmemopt.kernels import runtime

NAMES = ["AdamW", "Adam", "SGD", "Lion", "LAMB", "LARS", "Adafactor", "AdafactorTorch", "CAME", "GaLoreAdamW"]
NAMES += ["AdEMAMix"]
#: 2-D shapes for the projected group (ragged 8-bit blocks at min_quant_numel=64), a 1-D one in a full-rank group
MATRICES = [(37, 53), (24, 40), (40, 24)]
VECTOR = (300,)
MIN_QUANT = 64
STEPS = 3
#: (algorithm, projected) pairs whose native CPU step equals the eager one bit for bit
NATIVE_EXACT = {
    ("AdamW", False),
    ("Adam", False),
    ("SGD", False),
    ("Lion", False),
    ("AdamW", True),
    ("Adam", True),
    ("Lion", True),
}
#: GaLore algorithms whose math reads the weight (its norm, its RMS, a decay inside the math): their stand-ins take the
#: Triton kernels given the full weight's statistic, within fp32 rounding of the reference core (norms summed in
#: another order), so their Triton runs keep one basis: a refresh from parameters an ulp apart may rotate the singular
#: vectors (the cross test's other runs refresh at step 2)
WEIGHT_STAT = {"LAMB", "LARS", "Adafactor", "CAME"}

interpreted = pytest.mark.skipif(
    not (runtime.HAS_TRITON and runtime.INTERPRET),
    reason="needs Triton and TRITON_INTERPRET=1 before lowmemopt.kernels is imported",
)


def _groups(params, rank, gap=2):
    matrices, vector = params[:-1], params[-1:]
    if rank is None:
        return [dict(params=matrices), dict(params=vector)]
    return [dict(params=matrices, rank=rank, update_proj_gap=gap), dict(params=vector)]


def _run(name, bits, rank, backend, paged, tmp_path, monkeypatch, gap=2):
    info = BY_NAME[name]
    kwargs = dict(STATEFUL[name])
    params = make_params(MATRICES + [VECTOR])
    storage = dict(state_bits=bits, min_quant_numel=MIN_QUANT)
    if paged:
        storage.update(paged=paged, offload_dir=tmp_path / f"{name}-{bits}-{rank}-{backend}")
    opt = info.cls(_groups(params, rank, gap), **kwargs, **storage)
    with monkeypatch.context() as m:
        if backend == "eager":
            m.setattr(cpu, "ENABLED", False)
        for t in range(STEPS):
            set_grads(params, t)
            if backend == "triton":
                with runtime.cpu_interpreter():
                    opt.step()
            else:
                opt.step()
    lowmemopt.paging.settle(opt)
    return params, opt


def _state(opt, p):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}


def _assert_identical(a_params, a_opt, b_params, b_opt, what):
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert torch.equal(a, b), f"{what}: param {i}"
        sa, sb = _state(a_opt, a), _state(b_opt, b)
        assert sa.keys() == sb.keys(), what
        for k, v in sb.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(sa[k], v), f"{what}: param {i} {k}"
            else:
                assert sa[k] == v, f"{what}: param {i} {k}"


@pytest.mark.parametrize("backend", ["eager", "native", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("rank", [None, 4], ids=["full", "galore"])
@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("name", NAMES)
def test_every_combination_equals_the_eager_reference(
    name, bits, rank, backend, tmp_path, monkeypatch, correctly_rounded_sqrt
):
    """(``correctly_rounded_sqrt``: the eager reference's sqrt rounds as the kernels' does, so that exact backends
    compare bit for bit.)"""
    if backend == "triton":
        from lowmemopt.kernels import dispatch

        if rank is not None and not interpreter_fma_rounds_once():
            pytest.skip(
                "this Triton's interpreter rounds tl.fma twice (before Triton 3.9): the parameters drift "
                "from the reference by an ulp, and GaLore's SVD of the next gradient magnifies it"
            )
        before = dict(dispatch.stats)
    native_steps = []  # elements each native elementwise kernel call stepped
    if backend == "native":
        from lowmemopt.cpu import elementwise

        real = elementwise.prepare  # (the one-parameter call's and the bucket's arguments)
        monkeypatch.setattr(
            elementwise, "prepare", lambda *a, **k: native_steps.append((r := real(*a, **k))[::-1]) or r
        )
    gap = STEPS + 1 if backend == "triton" and name in WEIGHT_STAT else 2
    plain, plain_opt = _run(name, bits, rank, backend, False, tmp_path, monkeypatch, gap)
    if backend == "native" and (name, rank is not None) in NATIVE_EXACT and cpu.available():
        assert any(done for done, _ in native_steps), "the native kernels did not run"  # 4 bits included
    if backend == "triton" and name not in ("AdafactorTorch", "GaLoreAdamW"):
        assert sum(dispatch.stats.values()) > sum(before.values()), "the Triton backend did not run"
        if bits == 4:  # the quantized slots' buckets took the 4-bit kernels
            assert any(n > before.get(key, 0) for key, n in dispatch.stats.items() if key[1] == "q4"), dispatch.stats
    for tier in ("cpu", "disk"):  # paging never changes a result
        paged, paged_opt = _run(name, bits, rank, backend, tier, tmp_path, monkeypatch, gap)
        _assert_identical(paged, paged_opt, plain, plain_opt, f"{name} {bits}-bit {backend} paged={tier}")
        for p in paged:
            assert lowmemopt.paging.where_state_lives(paged_opt, p) == tier
        paged_opt.close()
    if backend == "eager":
        return
    what = f"{name} {bits}-bit {'GaLore' if rank else 'full rank'} {backend}"
    ref, ref_opt = _run(name, bits, rank, "eager", False, tmp_path, monkeypatch, gap)
    if backend == "native" and (name, rank is not None) in NATIVE_EXACT:
        _assert_identical(plain, plain_opt, ref, ref_opt, what)
        return
    for i, (p, r) in enumerate(zip(plain, ref)):
        assert_state_close(_state(plain_opt, p), _state(ref_opt, r), f"{what} param {i}")
    lr = float(STATEFUL[name].get("lr") or 1e-2)
    assert_params_close(plain, ref, lr, bits < 32, what)


def _launch_counter(monkeypatch) -> list:
    from lowmemopt.kernels.launch import Bucket

    seen = []
    real = Bucket.launch

    def launch(self, kernel, rows, counts, *args, **kwargs):
        if sum(counts):
            seen.append(len(rows))
        return real(self, kernel, rows, counts, *args, **kwargs)

    monkeypatch.setattr(Bucket, "launch", launch)
    return seen


@interpreted
@pytest.mark.parametrize("mode", ["plain", "paged", "galore"])
def test_launches_per_step_do_not_grow_with_the_number_of_parameters(mode, tmp_path, monkeypatch):
    """N parameters of one param group (one bucket) take one AdamW launch per step however large N is: paged ones
    (brought to the device in one batch) and GaLore-projected ones too."""
    seen = _launch_counter(monkeypatch)
    counts = []
    for n in (3, 12):
        params = make_params([(24, 40)] * n)
        group = dict(params=params, rank=4) if mode == "galore" else dict(params=params)
        storage = dict(paged="cpu") if mode == "paged" else {}
        opt = lowmemopt.AdamW([group], state_bits=8, min_quant_numel=MIN_QUANT, **storage)
        for t in range(2):
            set_grads(params, t)
            seen.clear()
            with runtime.cpu_interpreter():
                opt.step()
        counts.append(list(seen))
    assert counts[0] == [3] and counts[1] == [12], counts  # one launch, its table holding every parameter


def _per_parameter_groups(params, lrs, **kw):
    """One param group per parameter (as u-muP's ``scaled_parameters`` makes), ``lrs[i]`` for parameter i."""
    return [dict(params=[p], lr=lr, **kw) for p, lr in zip(params, lrs)]


@interpreted
@pytest.mark.parametrize("name,kw", [("AdamW", dict(weight_decay=0.1)), ("LAMB", dict(weight_decay=0.01))])
def test_groups_with_equal_values_share_a_bucket(name, kw, monkeypatch):
    """N per-parameter groups whose values are equal take the launches of one group of N parameters (buckets go by
    the groups' values), with the same bits as when each group is its own bucket; groups whose lr differs take
    launches of their own; equal values again (a schedule) bring them back together."""
    from lowmemopt.work.record import BucketRecord

    cls, shapes = getattr(lowmemopt, name), [(8, 12), (12, 8), (9, 9), (100,)]  # all 8-bit state
    storage = dict(state_bits=8, min_quant_numel=MIN_QUANT)
    seen = _launch_counter(monkeypatch)

    def steps(groups_of, n=2, by_identity=False):
        params = make_params(shapes)
        opt = cls(groups_of(params), **storage)
        launches = []
        with monkeypatch.context() as m:
            if by_identity:  # each group its own bucket: the launches of separate groups
                m.setattr(BucketRecord, "version", property(lambda record: ("id", id(record))))
            for t in range(n):
                set_grads(params, t)
                seen.clear()
                with runtime.cpu_interpreter():
                    opt.step()
                launches.append(list(seen))
        return params, opt, launches

    one, one_opt, one_launches = steps(lambda ps: [dict(params=ps, lr=1e-2, **kw)])
    per, per_opt, per_launches = steps(lambda ps: _per_parameter_groups(ps, [1e-2] * len(ps), **kw))
    alone, alone_opt, alone_launches = steps(
        lambda ps: _per_parameter_groups(ps, [1e-2] * len(ps), **kw), by_identity=True
    )
    assert per_launches == one_launches, (per_launches, one_launches)
    passes = len(one_launches[-1])  # launches per bucket (LAMB: norms, apply)
    assert one_launches[-1] == [len(shapes)] * passes  # one launch per pass, its table holding every parameter
    assert alone_launches[-1] == [1] * (passes * len(shapes))  # by group: a launch per parameter and pass
    _assert_identical(per, per_opt, one, one_opt, f"{name}: per-parameter groups vs one group")
    _assert_identical(per, per_opt, alone, alone_opt, f"{name}: by value vs by group")

    # three distinct learning rates: three buckets; a schedule that makes them equal again: one
    params = make_params(shapes)
    opt = cls(_per_parameter_groups(params, [1e-2, 2e-2, 1e-2, 3e-2], **kw), **storage)
    for t, expected in enumerate(([2, 1, 1] * passes, [len(shapes)] * passes)):
        if t:
            for group in opt.param_groups:
                group["lr"] = 5e-3
        set_grads(params, t)
        seen.clear()
        with runtime.cpu_interpreter():
            opt.step()
        assert sorted(seen) == sorted(expected), (t, seen)


@pytest.mark.skipif(not runtime.HAS_TRITON, reason="triton is not installed")
def test_group_values_compare_what_kernels_read():
    """Groups share a bucket when their values are equal: parameters aside; -0.0 apart from 0.0 (``-lr`` differs in
    the sign of a zero step); a tensor (an lr a scheduler changes in place) only when it is the same tensor."""
    from lowmemopt.work.record import group_values

    lr = torch.tensor(0.1)
    a = dict(params=[torch.zeros(2)], lr=0.1, betas=(0.9, 0.999), weight_decay=0.0, state_bits=8, paged=False)
    assert group_values(a) == group_values(dict(a, params=[torch.ones(3)], param_names=["w"]))
    assert group_values(a) != group_values(dict(a, lr=0.2)) and group_values(a) != group_values(dict(a, state_bits=4))
    assert group_values(a) != group_values(dict(a, betas=(0.9, 0.99)))
    assert group_values(dict(a, weight_decay=-0.0)) != group_values(a)
    assert group_values(dict(a, lr=lr)) == group_values(dict(a, lr=lr)) != group_values(dict(a, lr=torch.tensor(0.1)))
    assert group_values(dict(a, extra={"k": 1})) != group_values(dict(a, extra={"k": 1}))  # unhashable: by identity


@interpreted
def test_paged_batches_keep_to_the_bucket_size(tmp_path, monkeypatch):
    """Paged state moves through the device in batches of at most PAGE_BUCKET_BYTES (at least one parameter each):
    the working copies of one batch are on the device together, never the whole state."""
    from lowmemopt import pipeline

    params = make_params([(64, 64)] * 6)
    opt = lowmemopt.AdamW(params, state_bits=8, min_quant_numel=MIN_QUANT, paged="cpu")
    per_param = 2 * 64 * 64 + 2 * 4 * (64 * 64 // 256)  # m and v codes + absmax
    monkeypatch.setattr(pipeline, "PAGE_BUCKET_BYTES", 2 * per_param)
    seen = _launch_counter(monkeypatch)
    set_grads(params, 0)
    with runtime.cpu_interpreter():
        opt.step()  # first step: state made on the device, homes written
    seen.clear()
    set_grads(params, 1)
    with runtime.cpu_interpreter():
        opt.step()
    assert seen == [2, 2, 2]


BATCHED = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),  # decay: the factor 1 - lr wd
    ("Adafactor", dict(beta1=0.9, weight_decay=0.1)),  # p += c p, c per matrix (from its RMS(p))
    ("CAME", dict(lr=1e-2, weight_decay=0.1)),
]  # p += c p, one c for the group


@interpreted
@pytest.mark.parametrize("name,kw", BATCHED, ids=[n for n, _ in BATCHED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_projections_equal_the_per_matrix_ones(dtype, name, kw, monkeypatch):
    """The CUDA code path of GaLore buckets (matrices of one shape projected and projected back by ``torch.bmm``,
    decays and add in one fused pass, :mod:`lowmemopt.kernels.unproject`), run on the CPU under the interpreter:
    within fp32 rounding of the per-matrix reference. (One
    basis, from the first gradient: a refresh from slightly different parameters may rotate the singular vectors of
    near-equal singular values, which says nothing about the products.)"""
    from lowmemopt.kernels import unproject
    from lowmemopt.projection import batched as galore_batched

    shapes = [(24, 40)] * 3 + [(40, 24)] * 2 + [(37, 53)]
    bmm = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: bmm.append(1) or real_bmm(*a, **k))
    monkeypatch.setattr(galore_batched, "BATCH_ON_CPU", True)
    applied = []
    real_apply = unproject.apply_updates
    monkeypatch.setattr(
        unproject, "apply_updates", lambda params, *a: applied.append(len(params)) or real_apply(params, *a)
    )
    runs = []
    for fused in (True, False):
        params = make_params(shapes, dtype=dtype)
        opt = getattr(lowmemopt, name)([dict(params=params, rank=4)], state_bits=8, min_quant_numel=MIN_QUANT, **kw)
        for t in range(STEPS):
            set_grads(params, t)
            if fused:
                with runtime.cpu_interpreter():
                    opt.step()
            else:
                opt.step()
        runs.append((params, opt))
        if fused:
            # per step: two shape classes, each projected and projected back once (the matrix alone in its class
            # takes plain products)
            assert len(bmm) == 4 * STEPS
            assert applied == [3, 2, 1] * STEPS  # and applied by one fused pass each, the lone matrix too
    (ours, opt), (ref, ref_opt) = runs
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert_state_close(_state(opt, p), _state(ref_opt, r), f"param {i}")
    assert_params_close(ours, ref, 1e-2, True, f"GaLore {name} 8-bit, batched, {dtype}")


def test_finite_flags_of_mixed_dtypes_keep_their_order():
    """The up-front non-finite check takes one fused norm per (device, dtype) and returns the flags in the gradients'
    order, whatever dtypes are interleaved."""
    from lowmemopt.pipeline.finite import host_flags as _finite_flags

    grads = [
        torch.ones(5),
        torch.ones(7, dtype=torch.bfloat16),
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf")], dtype=torch.bfloat16),
        torch.full((3,), 3e19),
        torch.ones(2),
    ]
    assert _finite_flags(grads) == [True, True, False, False, False, True]  # 3e19 squared overflows fp32


# ---------------------------------------------------------------------------------------------------------------------
# GaLore stand-ins of algorithms whose math reads the weight: the fused kernels, given the full weight's statistic

#: (name, hyper-parameters): each reads the weight (LAMB / LARS: ||p|| in the trust ratio, Adafactor: RMS(p) in its
#: step size and ``p -= a wd p``, CAME: ``p -= lr wd p``), with weight decay, which the stand-in's math must not apply
STAND_IN = [
    ("LAMB", dict(lr=1e-2, weight_decay=0.1)),
    ("LARS", dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
    ("Adafactor", dict(beta1=0.9, weight_decay=0.1)),  # relative step with scale_parameter: RMS(p)
    ("CAME", dict(lr=1e-2, weight_decay=0.1)),
]


def _stand_in_run(name, kw, bits, shapes, fused, dtype=torch.float32):
    """3 steps of a GaLore group (one basis: no refresh after the first), through the fused backends (``fused``: the
    Triton interpreter when the ``runtime.cpu_interpreter`` context is given, else the native CPU kernels) or the
    reference core (native kernels off)."""
    params = make_params(shapes, dtype=dtype)
    opt = getattr(lowmemopt, name)(
        [dict(params=params, rank=16 if shapes[0][0] > 40 else 4)], state_bits=bits, min_quant_numel=MIN_QUANT, **kw
    )
    for t in range(STEPS):
        set_grads(params, t)
        with fused():
            opt.step()
    return params, opt


def _assert_stand_in_close(ours, opt, ref, ref_opt, bits, what):
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert_state_close(_state(opt, p), _state(ref_opt, r), f"{what} param {i}")
    assert_params_close(ours, ref, 1e-2, bits < 32, what)
    if bits == 32 and ours[0].dtype == torch.float32:  # fp32 rounding of the norms and sums, not more
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@interpreted
@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("name,kw", STAND_IN, ids=[n for n, _ in STAND_IN])
def test_galore_weight_reading_algorithms_take_the_triton_kernels(name, kw, bits, monkeypatch):
    """LAMB, LARS, Adafactor and CAME GaLore steps run on zeroed low-rank stand-ins through the Triton kernels, given
    the full weight's ||p|| / RMS(p) (a stand-in's own would be 0): one bucket per step for the three matrices, the
    reference core never, and the result within fp32 rounding (8-bit: one code step) of the reference core's."""
    from lowmemopt.kernels import dispatch
    from lowmemopt.projection.stage import GaLoreStage

    core = []
    real = GaLoreStage.update_per_tensor
    monkeypatch.setattr(
        GaLoreStage, "update_per_tensor", staticmethod(lambda plan, it: core.append(it) or real(plan, it))
    )
    monkeypatch.setattr(cpu, "ENABLED", False)
    algorithm = lowmemopt.optimizer.kernel_algorithm(getattr(lowmemopt, name))
    fmt = {32: "fp32", 16: "bf16", 8: "q8"}[bits]
    before = dispatch.stats.get((algorithm, fmt), 0)
    ours, opt = _stand_in_run(name, kw, bits, MATRICES, runtime.cpu_interpreter)
    assert dispatch.stats.get((algorithm, fmt), 0) - before == STEPS
    assert core == []
    ref, ref_opt = _stand_in_run(name, kw, bits, MATRICES, contextlib.nullcontext)
    assert len(core) == STEPS * len(MATRICES)  # the reference run: the reference core
    _assert_stand_in_close(ours, opt, ref, ref_opt, bits, f"GaLore {name} {bits}-bit Triton")


#: low-rank shapes the native factored kernels take (16 | columns) once MIN_NUMEL is lowered: (64, 48) -> 64 x 16
#: (right), (48, 80) -> 16 x 80 (left)
NATIVE_SHAPES = [(64, 48), (48, 80), (64, 48)]


@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize(
    "name,kw",
    STAND_IN[2:] + [("AdafactorTorch", dict(lr=1e-2, weight_decay=0.1))],
    ids=["Adafactor", "CAME", "AdafactorTorch"],
)
def test_galore_factored_stand_ins_take_the_native_kernels(name, kw, bits, monkeypatch):
    """On the CPU, Adafactor, CAME and AdafactorTorch GaLore stand-ins take the native factored kernels (given the
    full weight's RMS(p); the decay applied to the full weight), within fp32 rounding of the reference core."""
    from lowmemopt.cpu import factored

    if not cpu.available():
        pytest.skip("no native CPU kernels")
    monkeypatch.setattr(factored, "MIN_NUMEL", 256)
    calls = []
    real = cpu.step_factored
    monkeypatch.setattr(cpu, "step_factored", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    ours, opt = _stand_in_run(name, kw, bits, NATIVE_SHAPES, contextlib.nullcontext)
    assert calls == [True] * (STEPS * len(NATIVE_SHAPES))
    monkeypatch.setattr(cpu, "ENABLED", False)
    ref, ref_opt = _stand_in_run(name, kw, bits, NATIVE_SHAPES, contextlib.nullcontext)
    _assert_stand_in_close(ours, opt, ref, ref_opt, bits, f"GaLore {name} {bits}-bit native")
