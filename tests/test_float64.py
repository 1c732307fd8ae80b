"""float64 parameters beyond the common suite (tests/test_optimizers.py: every optimizer's float64 parity and dtypes):
torch.optim's own float64 inputs for Adam, AdamW, SGD and Adafactor (``common_optimizers.optim_db``, in the manner of
torch's ``TestOptimRenewed``), state dicts and state files, GaLore, paging and loss scaling."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import clone_params, make_params, run_with_reference, set_grads

import lowmemopt

F64 = torch.float64
#: our class for each torch.optim class that torch's optimizer database covers
TORCH_TWINS = {
    "Adam": lowmemopt.Adam,
    "AdamW": lowmemopt.AdamW,
    "SGD": lowmemopt.SGD,
    "Adafactor": lowmemopt.AdafactorTorch,
}


def _torch_inputs():
    """``(name, description, kwargs)`` of torch's own float64 optimizer inputs for the classes of
    :data:`TORCH_TWINS` (their ``optim_inputs_func``: the configurations ``TestOptimRenewed`` runs)."""
    pytest.importorskip("expecttest")  # (torch.testing._internal imports it)
    from torch.testing._internal.common_optimizers import optim_db

    out = []
    for info in optim_db:
        name = info.optim_cls.__name__
        if name in TORCH_TWINS:
            for case in info.optim_inputs_func(device="cpu", dtype=F64):
                out.append((name, case.desc, dict(case.kwargs)))
    return out


def _torch_cases():
    try:
        return _torch_inputs()
    except pytest.skip.Exception:
        return []


TORCH_CASES = _torch_cases()


def _model(dtype=F64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8)).to(dtype)


def _train(model, opt, steps, seed=0, scaler=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen, dtype=F64)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _max_diff(a, b) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


@pytest.mark.skipif(not TORCH_CASES, reason="torch.testing._internal.common_optimizers needs expecttest")
@pytest.mark.parametrize("name,desc,kwargs", TORCH_CASES, ids=[f"{n}-{d}" for n, d, _ in TORCH_CASES])
def test_torch_float64_inputs_equal_torch(name, desc, kwargs):
    """Each of torch's float64 inputs for Adam, AdamW, SGD and Adafactor: our optimizer takes the same keywords
    and 5 steps of a float64 model equal torch's to 1e-12 (its state float64 too), and the loss goes the right way
    (``maximize``: up), as ``TestOptimRenewed``'s checks of these classes ask."""
    ours_model, ref_model = _model(), _model()
    ours = TORCH_TWINS[name](ours_model.parameters(), **copy.deepcopy(kwargs))
    ref = getattr(torch.optim, name)(ref_model.parameters(), **copy.deepcopy(kwargs))
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(3), dtype=F64)
    first = float(ours_model(x).pow(2).mean().detach())
    for model, opt in ((ours_model, ours), (ref_model, ref)):
        for _ in range(5):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert _max_diff(ours_model.parameters(), ref_model.parameters()) <= 1e-12
    last = float(ours_model(x).pow(2).mean().detach())
    assert (last > first) if kwargs.get("maximize") else (last < first)
    for state in ours.state.values():
        assert all(v.dtype == F64 for v in state.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
def test_state_dict_round_trip_float64(name):
    """A float64 optimizer's state dict survives ``torch.save`` / ``torch.load(weights_only=True)`` bit for bit (its
    state float64), and the resumed run equals the uninterrupted one exactly."""
    model, resumed = _model(), _model()
    cls = TORCH_TWINS[name]
    opt = cls(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed.load_state_dict(model.state_dict())
    opt2 = cls(resumed.parameters(), lr=1e-2)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for p, q in zip(model.parameters(), resumed.parameters()):
        for key, v in opt.state[p].items():
            w = opt2.state[q][key]
            assert (torch.equal(v, w) and w.dtype == v.dtype) if isinstance(v, torch.Tensor) else v == w
    _train(model, opt, 2, seed=1)
    _train(resumed, opt2, 2, seed=1)
    assert _max_diff(model.parameters(), resumed.parameters()) == 0


def test_torch_state_dict_loads_without_rounding():
    """torch.optim.AdamW's float64 state loads as it is (float64, no detour through fp32), and the run goes on as
    torch's to 1e-12."""
    model, ours_model = _model(), _model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, ref, 3)
    ours_model.load_state_dict(model.state_dict())
    saved = copy.deepcopy(ref.state_dict())
    ours = lowmemopt.AdamW(ours_model.parameters(), lr=1e-2)
    ours.load_state_dict(saved)
    for p, q in zip(model.parameters(), ours_model.parameters()):
        assert torch.equal(ours.state[q]["exp_avg_sq"], ref.state[p]["exp_avg_sq"])
        assert ours.state[q]["exp_avg_sq"].dtype == F64
    _train(model, ref, 3, seed=1)
    _train(ours_model, ours, 3, seed=1)
    assert _max_diff(model.parameters(), ours_model.parameters()) <= 1e-12


@pytest.mark.parametrize("bits", [32, 8])
def test_state_file_float64(tmp_path, bits, capsys):
    """``save_state`` / ``load_state`` keep a float64 parameter's state: float64 tensors (F64) at 32 bits, codes at 8;
    the resumed run equals the uninterrupted one exactly; ``lowmemopt inspect`` describes the file."""
    from lowmemopt.inspection import inspect

    model, resumed = _model(), _model()
    kw = dict(lr=1e-2, state_bits=bits, min_quant_numel=64)
    opt = lowmemopt.AdamW(model.parameters(), **kw)
    _train(model, opt, 3)
    path = tmp_path / "state.safetensors"
    lowmemopt.save_state(opt, path, model=model)
    assert inspect(str(path)) == 0
    assert ("\nfp64 " if bits == 32 else "\nq8 ") in capsys.readouterr().out
    resumed.load_state_dict(model.state_dict())
    opt2 = lowmemopt.AdamW(resumed.parameters(), **kw)
    lowmemopt.load_state(opt2, path, model=resumed)
    key = "exp_avg" if bits == 32 else "exp_avg.codes"
    assert opt2.state[resumed[0].weight][key].dtype == (F64 if bits == 32 else torch.uint8)
    _train(model, opt, 2, seed=1)
    _train(resumed, opt2, 2, seed=1)
    assert _max_diff(model.parameters(), resumed.parameters()) == 0


@pytest.mark.parametrize("batched", [False, True], ids=["per-matrix", "batched"])
def test_galore_float64_equals_galore_torch(batched, monkeypatch):
    """GaLore on float64 matrices: the basis from the fp32 SVD (stored fp32), the products, the inner AdamW and its
    state in float64: galore-torch's float64 run to 1e-12, over basis refreshes; also through the batched
    products and apply that CUDA takes (``BATCH_ON_CPU``)."""
    galore_torch = pytest.importorskip("galore_torch")
    from lowmemopt.projection import batched as galore_batched

    monkeypatch.setattr(galore_batched, "BATCH_ON_CPU", batched)

    def model():  # (two 32 x 32 matrices: one batch of the batched products)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(24, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)]
        return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())][:-1]).to(F64)

    ours_model, ref_model = model(), model()
    groups = lowmemopt.galore_param_groups(ours_model, target_modules=["0", "2", "4"], rank=4, update_proj_gap=2)
    by_id = {id(p): q for p, q in zip(ours_model.parameters(), ref_model.parameters())}
    ref_groups = [dict(g, params=[by_id[id(p)] for p in g["params"]]) for g in groups]
    ours = lowmemopt.GaLoreAdamW(groups, lr=1e-2)
    ref = galore_torch.GaLoreAdamW(ref_groups, lr=1e-2, no_deprecation_warning=True)
    _train(ours_model, ours, 5)
    _train(ref_model, ref, 5)
    assert _max_diff(ours_model.parameters(), ref_model.parameters()) <= 1e-12
    state = ours.state[ours_model[0].weight]
    assert state["exp_avg"].dtype == F64 and state["galore.proj"].dtype == torch.float32


def test_paged_and_loss_scaled_float64_equal_torch():
    """Paged state and ``torch.amp.GradScaler`` keep float64 exact: both equal torch's AdamW to 1e-12."""
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _train(ref_model, ref, 3, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    for kw in (dict(paged=True), dict()):
        model = _model()
        opt = lowmemopt.AdamW(model.parameters(), lr=1e-2, **kw)
        _train(model, opt, 3, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
        assert _max_diff(model.parameters(), ref_model.parameters()) <= 1e-12, kw


def test_fused_lamb_global_norm_in_float64():
    """FusedLAMB's clip by the global gradient norm is float64 for float64 gradients (exactly the float64
    reference's, which an fp32 norm would miss by ~1e-9)."""
    from optim_info import ApexLAMBReference

    params = make_params([(37, 53), (300,)], dtype=F64)
    ref_params = clone_params(params)
    ours = lowmemopt.FusedLAMB(params, lr=1e-2, max_grad_norm=0.5)
    ref = ApexLAMBReference(ref_params, lr=1e-2, max_grad_norm=0.5)
    run_with_reference(ours, params, ref, ref_params, 5)
    assert _max_diff(params, ref_params) <= 1e-12


def test_float64_beside_float32():
    """A model with float64 and float32 parameters: each steps in its own dtype (float64 as torch, fp32 as before)."""
    params = make_params([(64, 80)], dtype=F64) + make_params([(64, 80)], seed=1)
    ref_params = clone_params(params)
    ours = lowmemopt.AdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    run_with_reference(ours, params, ref, ref_params, 5)
    torch.testing.assert_close(params[0], ref_params[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(params[1], ref_params[1], rtol=2e-6, atol=2e-6)
    assert ours.state[params[0]]["exp_avg"].dtype == F64 and ours.state[params[1]]["exp_avg"].dtype == torch.float32


def test_nonfinite_check_of_float64_gradients():
    """The non-finite check takes a float64 gradient's norm in float64: a NaN skips the parameter; an element of
    1e30, whose square overflows fp32 but not float64 (nor the float64 state), does not."""
    p, q = torch.nn.Parameter(torch.ones(50, dtype=F64)), torch.nn.Parameter(torch.ones(50, dtype=F64))
    opt = lowmemopt.AdamW([p, q], lr=1e-2)
    p.grad, q.grad = torch.ones(50, dtype=F64), torch.ones(50, dtype=F64)
    p.grad[3], q.grad[3] = float("nan"), 1e30
    with pytest.warns(RuntimeWarning, match="skipped 1 parameter"):
        opt.step()
    assert torch.equal(p, torch.ones(50, dtype=F64)) and not torch.equal(q, torch.ones(50, dtype=F64))
    assert torch.isfinite(q).all() and float(opt.state[q]["exp_avg_sq"][3]) > 1e56


def test_large_float64_parameter_equals_torch():
    """A float64 parameter large enough for the compiled CPU path (``lowmemopt.compiled``, fp32 graphs) steps in
    float64 all the same: torch's AdamW to 1e-12."""
    from lowmemopt import compiled

    params = make_params([(compiled.MIN_NUMEL + 300,)], dtype=F64)
    ref_params = clone_params(params)
    run_with_reference(lowmemopt.AdamW(params, lr=1e-2), params, torch.optim.AdamW(ref_params, lr=1e-2), ref_params, 2)
    assert _max_diff(params, ref_params) <= 1e-12


@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)), ("CAME", dict(lr=1e-2))])
def test_galore_float64_through_the_cuda_code_path(name, kw, monkeypatch):
    """The path a GPU takes (the Triton dispatcher, batched ``torch.bmm`` products, the batched apply), under the
    interpreter on the CPU: float64 matrices keep float64 products (the kernels, which take no float64, leave their
    stand-ins to the eager path), equal to the per-matrix CPU run to 1e-12."""
    runtime = pytest.importorskip("lowmemopt.kernels.runtime")
    if not runtime.HAS_TRITON or not runtime.INTERPRET:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    from lowmemopt.projection import batched as galore_batched

    bmm = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, **kw: bmm.append(a.dtype) or real_bmm(a, b, **kw))
    runs = {}
    for batched in (False, True):
        monkeypatch.setattr(galore_batched, "BATCH_ON_CPU", batched)
        params = make_params([(40, 24)] * 3, dtype=F64)
        groups = [dict(params=params, rank=4, update_proj_gap=2)]
        opt = getattr(lowmemopt, name)(groups, **kw)
        for t in range(4):
            set_grads(params, t)
            if batched:
                with runtime.cpu_interpreter():
                    opt.step()
            else:
                opt.step()
        runs[batched] = params
        assert opt.state[params[0]]["exp_avg"].dtype == F64
    assert bmm and set(bmm) == {F64}
    assert _max_diff(runs[True], runs[False]) <= 1e-12


@pytest.mark.parametrize("bits", [32, 8])
def test_factored_statistics_of_float64_parameters_are_float64_as_the_docstrings_say(bits):
    """Adafactor's, AdafactorTorch's and CAME's row and column statistics (and Adam-mini's block means) are float64
    for float64 parameters, at every state_bits; their module docstrings say so instead of "All math is fp32"."""
    import lowmemopt.optim.adafactor as adafactor
    import lowmemopt.optim.adam_mini as adam_mini
    import lowmemopt.optim.came as came

    for module in (adafactor, came, adam_mini):
        doc = " ".join(module.__doc__.split())
        assert "float64 for float64 parameters" in doc and "All math is fp32" not in doc
    for cls, kw in ((lowmemopt.Adafactor, {}), (lowmemopt.AdafactorTorch, {}), (lowmemopt.CAME, dict(lr=1e-3))):
        p = torch.nn.Parameter(torch.randn(8, 6, dtype=torch.float64))
        opt = cls([p], state_bits=bits, min_quant_numel=0, **kw)
        p.grad = torch.randn_like(p)
        opt.step()
        stats = {k: v.dtype for k, v in opt.state[p].items() if k.endswith(("_row", "_col", "row_var", "col_var"))}
        assert stats and set(stats.values()) == {torch.float64}, (cls.__name__, stats)
