"""A parameter's state made for another tensor (``p.data`` replaced by one of another shape, or a group's
``block_size`` changed after 8-bit state was made) is refused with a ValueError before the step changes anything
(:mod:`lowmemopt.pipeline.fits`): the kernels would read and write the state past its end. Every backend: the
native CPU kernels, the Triton kernels (interpreter) on the pipeline and on a kept step program, the per-tensor
reference, GaLore and paged state."""

from __future__ import annotations

import contextlib

import pytest
import torch

import lowmemopt
from lowmemopt.kernels import runtime

needs_interpreter = pytest.mark.skipif(
    not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1"
)


def _backend(name: str):
    """The context a step runs in for backend ``name``: the Triton kernels (interpreted), or the CPU's own."""
    return runtime.cpu_interpreter() if name == "triton" else contextlib.nullcontext()


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()} for p in params
    ]


def _assert_unchanged(opt, params, snap):
    values, states = snap
    for p, v, st in zip(params, values, states):
        assert torch.equal(p.detach(), v) or p.shape != v.shape
        assert sorted(opt.state[p]) == sorted(st)
        for k, x in st.items():
            y = opt.state[p][k]
            assert torch.equal(y, x) if isinstance(x, torch.Tensor) else y == x, k


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


CASES = [  # (optimizer, kwargs, what the message names)
    (lowmemopt.AdamW, dict(state_bits=8), "'exp_avg' holds 561 elements"),
    (lowmemopt.AdamW, dict(state_bits=4, block_size=32), "'exp_avg' holds 281 bytes of 4-bit codes"),
    (lowmemopt.AdamW, dict(state_bits=32), "'exp_avg' holds 561 elements"),
    (lowmemopt.Adafactor, dict(), "'exp_avg_sq_row' holds 33 elements"),
    (lowmemopt.SGD, dict(state_bits=8, momentum=0.9), "'momentum_buffer' holds 561 elements"),
]


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("cls,kw,names", CASES, ids=[f"{c.__name__}-{k.get('state_bits', 32)}" for c, k, _ in CASES])
def test_a_parameter_given_another_shape_is_refused_and_nothing_changes(cls, kw, names, backend):
    params = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(20))]
    opt = cls(params, min_quant_numel=0, **kw)
    with _backend(backend):
        for step in range(2):
            _grads(params, step)
            opt.step()
        params[0].data = torch.randn(20, 11)  # (smaller: without the check the kernels would not crash, only err)
        _grads(params, 2)
        snap = _snapshot(opt, params)
        with pytest.raises(ValueError, match=r"parameter 0 of param group 0 was made for another tensor") as err:
            opt.step()
        assert names in str(err.value) and "(20, 11)" in str(err.value)
        _assert_unchanged(opt, params, snap)
        # the way out the message gives: a fresh state for that parameter
        del opt.state[params[0]]
        opt.step()
    assert opt.state[params[0]]["step"] == 1 and opt.state[params[1]]["step"] == 3


@needs_interpreter
def test_a_kept_program_sees_a_parameter_sliced_in_place():
    """``p.data = p.data[:n]`` keeps the parameter's address: the kept step program compares shapes too, and the
    step that follows refuses the state."""
    params = [torch.nn.Parameter(torch.randn(64, 8)), torch.nn.Parameter(torch.randn(40))]
    opt = lowmemopt.AdamW(params, state_bits=8, min_quant_numel=0, block_size=32)
    with runtime.cpu_interpreter():
        for step in range(3):
            _grads(params, step)
            opt.step()
        assert opt._program is not None  # (steps 1 and 2 took it)
        ptr = params[0].data_ptr()
        params[0].data = params[0].data[:32]
        assert params[0].data_ptr() == ptr
        _grads(params, 3)
        snap = _snapshot(opt, params)
        with pytest.raises(ValueError, match=r"'exp_avg' holds 512 elements, the parameter has shape \(32, 8\)"):
            opt.step()
        _assert_unchanged(opt, params, snap)
        assert opt._program is None


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_block_size_changed_under_quantized_state_is_refused_until_put_back(bits, backend):
    """The step with the group's new block size raises (the state keeps the block size it was made with) and
    changes nothing; with the block size put back the run goes on as one that never changed it, bit for bit."""

    def run(change: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(300))]
        opt = lowmemopt.AdamW(params, state_bits=bits, block_size=32, min_quant_numel=0)
        with _backend(backend):
            for step in range(4):
                _grads(params, step)
                if change and step == 2:
                    opt.param_groups[0]["block_size"] = 64  # (fewer scales than stored: no overrun without a check)
                    snap = _snapshot(opt, params)
                    with pytest.raises(
                        ValueError,
                        match=rf"{bits}-bit state 'exp_avg' of parameter 0 of param group "
                        r"0 was made at block_size 32, but its param group now has "
                        r"block_size 64.*set the group's block_size back to 32",
                    ):
                        opt.step()
                    _assert_unchanged(opt, params, snap)
                    opt.param_groups[0]["block_size"] = 32
                opt.step()
        return params, opt

    a, opt_a = run(True)
    b, opt_b = run(False)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        for k, v in opt_a.state[pa].items():
            assert torch.equal(v, opt_b.state[pb][k]) if isinstance(v, torch.Tensor) else v == opt_b.state[pb][k]


def test_state_in_another_format_than_the_group_asks_for_now_fits():
    """``state_bits`` (or ``min_quant_numel``) changed after the state was made: each slot is read as stored, and
    only new state takes the group's new format."""
    p, q = torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(300))
    opt = lowmemopt.AdamW([p], state_bits=8, block_size=32, min_quant_numel=0)
    _grads([p], 0)
    opt.step()
    opt.param_groups[0]["state_bits"] = 16
    opt.param_groups[0]["params"].append(q)
    for step in (1, 2):
        _grads([p, q], step)
        opt.step()
    assert opt.state[p]["exp_avg.codes"].dtype == torch.uint8 and opt.state[q]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[p]["step"] == 3 and opt.state[q]["step"] == 2


def test_a_reshaped_view_of_the_same_elements_fits_elementwise_state():
    """Elementwise state follows the elements, not the shape: a parameter viewed in another shape of the same size
    steps on (as the flat tensor it is to the kernels)."""
    p = torch.nn.Parameter(torch.randn(33, 17))
    opt = lowmemopt.AdamW([p], state_bits=8, min_quant_numel=0)
    _grads([p], 0)
    opt.step()
    p.data = p.data.view(17, 33)
    _grads([p], 1)
    opt.step()
    assert opt.state[p]["step"] == 2


def test_galore_state_of_another_shape_is_refused():
    p = torch.nn.Parameter(torch.randn(40, 24))
    opt = lowmemopt.AdamW([{"params": [p], "rank": 4}], state_bits=8, min_quant_numel=0)
    _grads([p], 0)
    opt.step()
    for shape, match in [
        ((40, 30), r"basis 'galore.proj' \(24, 4\) does not fit the parameter's shape \(40, 30\)"),
        (
            (48, 24),
            r"'exp_avg' holds 160 elements, the parameter has shape \(48, 24\), whose "
            r"low-rank state at rank 4 is 48 x 4 \(192 elements\)",
        ),
    ]:
        old = p.data
        p.data = torch.randn(shape)
        _grads([p], 1)
        snap = _snapshot(opt, [p])
        with pytest.raises(ValueError, match=match):
            opt.step()
        _assert_unchanged(opt, [p], snap)
        p.data = old
    _grads([p], 2)
    opt.step()
    assert opt.state[p]["step"] == 2


def test_paged_state_of_another_shape_is_refused():
    params = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(300))]
    opt = lowmemopt.AdamW(params, state_bits=8, min_quant_numel=0, paged="cpu", page_budget_bytes=0)
    _grads(params, 0)
    opt.step()
    params[0].data = torch.randn(20, 11)
    _grads(params, 1)
    with pytest.raises(ValueError, match=r"'exp_avg' holds 561 elements, the parameter has shape \(20, 11\)"):
        opt.step()
    assert opt.state[params[1]]["step"] == 1


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["each parameter", "bucketed"])
def test_per_layer_updates_refuse_a_parameter_given_another_shape(bucket_bytes):
    """``step_in_backward``: the updates inside ``backward()`` check the state as ``step()`` does; the error comes
    out of ``backward()`` before that parameter's update."""
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.Linear(33, 4))
    opt = lowmemopt.AdamW(model.parameters(), state_bits=8, min_quant_numel=0)
    lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket_bytes)
    x = torch.randn(8, 17)
    model(x).square().mean().backward()
    first = model[0].weight
    first.data = first.data[:20]  # (a pruned layer whose optimizer state was not pruned with it)
    model[0].bias.data = model[0].bias.data[:20]
    model[1].weight.data = model[1].weight.data[:, :20]
    before = {k: v.clone() for k, v in opt.state[first].items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"the parameter has shape \("):
        model(x).square().mean().backward()
    for k, v in before.items():
        assert torch.equal(opt.state[first][k], v)


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=needs_interpreter)])
def test_a_gradient_of_another_shape_than_its_parameter_is_refused(backend):
    """``p.data`` replaced after the backward pass leaves a gradient of the old shape (torch checks shapes when a
    gradient is set, not when the parameter changes): refused before anything changes, also on a first step."""
    params = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(20))]
    opt = lowmemopt.AdamW(params, state_bits=8, min_quant_numel=0)
    with _backend(backend):
        _grads(params, 0)
        params[0].data = torch.randn(40, 24)
        with pytest.raises(
            ValueError,
            match=r"gradient of parameter 0 of param group 0 has shape \(33, 17\) but the "
            r"parameter \(40, 24\)",
        ):
            opt.step()
        assert not opt.state  # (nothing made, nothing stepped)
        _grads(params, 1)
        opt.step()
    assert opt.state[params[0]]["step"] == 1


GRAD_EDITS = {  # what replaces the .data of parameter 0's gradient after two steps (torch checks only at p.grad = g)
    "float64": lambda g: g.double(),
    "bfloat16": lambda g: g.bfloat16(),
    "int32": lambda g: g.int(),
    "complex64": lambda g: g.to(torch.complex64),
    "shape": lambda g: g[:16],
}


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize(
    "cls,kw",
    [(lowmemopt.AdamW, dict(state_bits=8)), (lowmemopt.FusedLAMB, dict(state_bits=32))],
    ids=["AdamW-8", "FusedLAMB-32"],
)
@pytest.mark.parametrize("edit", GRAD_EDITS)
def test_a_gradient_of_another_dtype_or_shape_is_refused_and_nothing_changes(edit, cls, kw, backend):
    """A gradient whose ``.data`` was replaced by one of another dtype (or shape) is refused before anything reads
    it: a TypeError (ValueError) naming it, nothing changed, the fused kernels still on (a kernel that failed on it
    would turn them off for the process), and a kept step program does not read it as its old dtype and size."""
    params = [torch.nn.Parameter(torch.randn(64, 8)), torch.nn.Parameter(torch.randn(40))]
    opt = cls(params, lr=1e-2, min_quant_numel=0, block_size=32, **kw)
    with _backend(backend):
        for step in range(3):
            _grads(params, step)
            opt.step()
        _grads(params, 3)
        params[0].grad.data = GRAD_EDITS[edit](params[0].grad.data)
        snap = _snapshot(opt, params)
        err, match = (ValueError, r"has shape \(16, 8\)") if edit == "shape" else (TypeError, f"is torch.{edit} but")
        with pytest.raises(err, match=rf"gradient of parameter 0 of param group 0 {match}"):
            opt.step()
        _assert_unchanged(opt, params, snap)
        assert runtime.ENABLED
        _grads(params, 3)
        opt.step()
    assert all(opt.state[p]["step"] == 4 for p in params)


def test_a_parameter_made_complex_through_data_is_refused():
    p = torch.nn.Parameter(torch.randn(6, 5))
    opt = lowmemopt.AdamW([p], lr=1e-2)
    _grads([p], 0)
    opt.step()
    p.data = torch.randn(6, 5, dtype=torch.complex64)
    p.grad = torch.randn(6, 5, dtype=torch.complex64)
    snap = _snapshot(opt, [p])
    with pytest.raises(TypeError, match=r"parameter 0 of param group 0 is torch.complex64 now.*torch.view_as_real"):
        opt.step()
    _assert_unchanged(opt, [p], snap)
