"""GaLore's basis stored at ``proj_bits`` 32 / 16 / 8 / 4 (:mod:`lowmemopt.projection.storage`): every optimizer that
takes GaLore groups, the stored bytes, the codec's error, resume bit for bit across refreshes, conversion on load, a
change of ``proj_bits`` within a run, paged state and the batched products."""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers import clone_params, make_params, set_grads, trajectory_error

import lowmemopt
from lowmemopt.checkpoint import CheckpointError
from lowmemopt.projection import batched, principal_angles, storage
from lowmemopt.projection import projector as pj
from lowmemopt.quant.blockwise import num_blocks

SHAPES = [(96, 64), (48, 80), (30,)]  # side right: basis (64, 8); side left: basis (8, 48); a plain 1-D param
RANK, GAP = 8, 3

#: every optimizer class that takes GaLore groups (the others refuse them: test_the_others_refuse_galore_groups)
GALORE_OPTIMIZERS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "Adam": dict(lr=1e-2),
    "SGD": dict(lr=1e-2, momentum=0.9),
    "SignSGD": dict(lr=1e-3, momentum=0.9),
    "Lion": dict(lr=1e-3, weight_decay=0.1),
    "LAMB": dict(lr=1e-2, weight_decay=0.01),
    "LARS": dict(lr=1e-2, momentum=0.9),
    "Adafactor": dict(beta1=0.9, weight_decay=0.01),
    "AdafactorTorch": dict(lr=1e-2),
    "CAME": dict(lr=1e-2, weight_decay=0.01),
    "AdEMAMix": dict(lr=1e-2),
    "CPUAdam": dict(lr=1e-2),
    "FusedAdam": dict(lr=1e-2),
    "FusedLAMB": dict(lr=1e-2),
    "FusedSGD": dict(lr=1e-2, momentum=0.9),
    "DeepSpeedCPUAdam": dict(lr=1e-2),
}
#: optimizers whose ``rank`` groups are not GaLore's (APOLLO stores its projection as a seed: no basis to store)
NOT_GALORE = {"APOLLOAdamW", "AdamMini", "Muon", "OnebitAdam", "OnebitLAMB", "OnebitLamb", "ZeroOneAdam"}


def _groups(params, bits, **kw):
    mats = [p for p in params if p.dim() >= 2]
    vecs = [p for p in params if p.dim() < 2]
    group = dict(params=mats, rank=RANK, update_proj_gap=GAP, proj_bits=bits, **kw)
    return [dict(params=vecs), group] if vecs else [group]


def _make(name, params, bits, state_bits=8, **kw):
    return getattr(lowmemopt, name)(
        _groups(params, bits, **kw), state_bits=state_bits, min_quant_numel=64, **GALORE_OPTIMIZERS[name]
    )


def _run(opt, params, steps, start=0):
    for t in range(start, start + steps):
        set_grads(params, t)
        opt.step()


def _stored(state):
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items() if k.startswith("galore.proj")}


def _expected(shape, bits):
    """The stored tensors of a basis of ``shape`` (``galore.proj``) at ``bits``: exact by construction."""
    numel = math.prod(shape)
    if bits == 32:
        return {"galore.proj": (torch.float32, shape)}
    if bits == 16:
        return {"galore.proj": (torch.bfloat16, shape)}
    if bits == 8:
        return {
            "galore.proj.codes": (torch.uint8, (numel,)),
            "galore.proj.absmax": (torch.float32, (-(-numel // 256),)),
        }
    return {
        "galore.proj.nibbles": (torch.uint8, (-(-numel // 2),)),
        "galore.proj.absmax": (torch.float32, (-(-numel // 128),)),
    }


def _equal_states(a, b):
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("name", list(GALORE_OPTIMIZERS))
def test_every_galore_optimizer_stores_its_basis_at_proj_bits(name, bits):
    """The basis is stored at ``proj_bits`` (exact bytes), the inner state as ``state_bits`` says, the run descends
    and stays near its twin with fp32 bases (the distance grows as the bits shrink)."""
    params = make_params(SHAPES)
    start = clone_params(params)
    opt = _make(name, params, bits)
    _run(opt, params, 10)
    for p in params[:2]:
        m, n = p.shape
        side = pj.RIGHT if m >= n else pj.LEFT
        shape = pj.basis_shapes(m, n, RANK, side)[pj.PROJ]
        assert _stored(opt.state[p]) == _expected(shape, bits), name
    twin = make_params(SHAPES)
    _run(_make(name, twin, 32), twin, 10)
    err = trajectory_error(params, twin, start)
    assert err < {16: 0.02, 8: 0.05, 4: 0.35}[bits], (name, err)
    assert all(torch.isfinite(p).all() for p in params)


def test_the_others_refuse_galore_groups_or_store_no_basis():
    """Every optimizer class is either in GALORE_OPTIMIZERS or takes no basis (this list cannot go stale)."""
    classes = {
        n
        for n in lowmemopt.__all__
        if isinstance(getattr(lowmemopt, n), type) and issubclass(getattr(lowmemopt, n), torch.optim.Optimizer)
    }
    aliases = {n for n in classes if any(n.endswith(s) for s in ("8bit", "4bit")) or n.startswith(("Paged", "GaLore"))}
    assert classes - aliases - NOT_GALORE == set(GALORE_OPTIMIZERS), classes - aliases - NOT_GALORE
    p = torch.nn.Parameter(torch.randn(16, 12))
    opt = lowmemopt.APOLLOAdamW([dict(params=[p], rank=4, proj_bits=4)], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    assert not any(k.startswith("galore.") for k in opt.state[p])


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_the_stored_basis_decodes_within_its_bound(bits):
    """An orthonormal basis stored and decoded: its relative error (the codec's, measured: bf16 1.7e-3, 8-bit 1.0e-2,
    4-bit 1.2e-1) and the largest principal angle to the original."""
    torch.manual_seed(0)
    q = torch.linalg.qr(torch.randn(512, 16)).Q  # m x k, stored transposed as the left side's (k, m)
    decoded = storage.round_trip(q.t().contiguous(), bits).t()
    rel = ((decoded - q).norm() / q.norm()).item()
    angle = principal_angles(q, torch.linalg.qr(decoded).Q).max().item()
    assert rel < {16: 2.5e-3, 8: 1.2e-2, 4: 0.14}[bits], rel
    assert angle < {16: 3e-3, 8: 1.5e-2, 4: 0.16}[bits], angle
    assert storage.round_trip(q, 32) is q
    again = storage.round_trip(decoded.t().contiguous(), bits)  # decoded values store to themselves
    assert torch.equal(again, decoded.t())


def test_32_bits_is_the_default_bit_for_bit():
    params, twin = make_params(SHAPES), make_params(SHAPES)
    a = lowmemopt.AdamW(_groups(params, 32), lr=1e-2, state_bits=8, min_quant_numel=64)
    groups = _groups(twin, 32)
    del groups[1]["proj_bits"]
    b = lowmemopt.AdamW(groups, lr=1e-2, state_bits=8, min_quant_numel=64)
    assert b.param_groups[1]["proj_bits"] == 32
    _run(a, params, 7)
    _run(b, twin, 7)
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
        _equal_states(a.state[p], b.state[q])


@pytest.mark.parametrize("value", [12, 0, True, "8", 8.0])
def test_invalid_proj_bits_is_refused(value):
    params = make_params(SHAPES)
    with pytest.raises(ValueError, match=r"Invalid proj_bits: .* \(expected one of 32, 16, 8, 4\)"):
        lowmemopt.AdamW(_groups(params, value), lr=1e-2)
    with pytest.raises(ValueError, match="proj_bits"):
        lowmemopt.galore_param_groups(torch.nn.Linear(8, 8), "all-linear", rank=2, proj_bits=value)


def _state_dict_round_trip(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("how", ["state_dict", "file"])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_resume_is_bit_exact_across_refreshes(bits, how, tmp_path):
    """Saved at step 4 (after refreshes at 0 and 3), resumed in a fresh optimizer: steps 4-10 (refreshes at 6 and 9)
    equal the uninterrupted run's bit for bit, parameters and every state tensor; CAME (factored state) and AdamW."""
    for name in ("AdamW", "CAME"):
        params = make_params(SHAPES)
        opt = _make(name, params, bits, proj_moments="project")
        _run(opt, params, 4)
        resumed = clone_params(params)
        if how == "state_dict":
            saved = _state_dict_round_trip(opt)
        else:
            lowmemopt.save_state(opt, tmp_path / f"{name}.safetensors")
        _run(opt, params, 7, start=4)
        opt2 = _make(name, resumed, bits, proj_moments="project")
        if how == "state_dict":
            opt2.load_state_dict(saved)
        else:
            lowmemopt.load_state(opt2, tmp_path / f"{name}.safetensors")
        _run(opt2, resumed, 7, start=4)
        for p, q in zip(params, resumed):
            assert torch.equal(p, q), name
            _equal_states(opt.state[p], opt2.state[q])


@pytest.mark.parametrize("how", ["state_dict", "file"])
@pytest.mark.parametrize("src,dst", [(32, 8), (8, 32), (8, 4), (4, 16), (16, 8)])
def test_a_basis_converts_on_load(src, dst, how, tmp_path):
    """State saved at one ``proj_bits`` loads into a group of another: stored at the group's, decoding to the saved
    basis stored again (exactly: 32 <- 8 keeps the decoded values)."""
    params = make_params(SHAPES)
    opt = _make("AdamW", params, src)
    _run(opt, params, 4)
    target = clone_params(params)
    opt2 = _make("AdamW", target, dst)
    if how == "state_dict":
        opt2.load_state_dict(_state_dict_round_trip(opt))
    else:
        lowmemopt.save_state(opt, tmp_path / "s.safetensors")
        lowmemopt.load_state(opt2, tmp_path / "s.safetensors")
    for p, q in zip(params[:2], target[:2]):
        shape = pj.basis_shapes(*p.shape, RANK, opt.state[p][pj.SIDE])[pj.PROJ]
        assert _stored(opt2.state[q]) == _expected(shape, dst)
        saved = storage.decode_basis(opt.state[p], pj.PROJ, shape)
        assert torch.equal(storage.decode_basis(opt2.state[q], pj.PROJ, shape), storage.round_trip(saved, dst))
    _run(opt2, target, 3, start=4)  # steps on
    assert all(torch.isfinite(p).all() for p in target)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_basis_that_does_not_fit_is_refused_at_low_bits(bits, tmp_path):
    """Codes of another size (another model's matrix, or a rank changed within a run) are refused by name, from a
    state dict, a file and before a step, and nothing changes."""
    params = make_params(SHAPES)
    opt = _make("AdamW", params, bits)
    _run(opt, params, 2)
    projector = pj.split_projector_state(opt.state[params[0]])[0]
    group = opt.param_groups[1]
    assert pj.projector_problem(projector, group, params[0].shape) is None
    assert "needs {'galore.proj': (72, 8)}" in pj.projector_problem(projector, group, torch.Size((96, 72)))
    assert "unknown projector state ['galore.proj.extra']" in pj.projector_problem(
        dict(projector, **{"galore.proj.extra": torch.zeros(1)}), group, params[0].shape
    )
    lowmemopt.save_state(opt, tmp_path / "s.safetensors")
    other = make_params([(96, 72), (48, 80), (30,)])
    opt2 = _make("AdamW", other, bits)
    with pytest.raises(CheckpointError, match="shape"):
        lowmemopt.load_state(opt2, tmp_path / "s.safetensors")
    assert not opt2.state
    group["rank"] = 4
    with pytest.raises(ValueError, match="needs"):
        opt.step()


def test_changing_proj_bits_within_a_run_restores_the_basis():
    """A group's ``proj_bits`` set between steps: the next step stores the basis at the new width (the old basis
    decoded and stored again), then steps as a run begun at it would from there."""
    params = make_params(SHAPES)
    opt = _make("CAME", params, 32)
    _run(opt, params, 4)
    p = params[0]
    shape = pj.basis_shapes(*p.shape, RANK, opt.state[p][pj.SIDE])[pj.PROJ]
    before = opt.state[p][pj.PROJ].clone()
    opt.param_groups[1]["proj_bits"] = 8
    set_grads(params, 4)
    opt.step()  # no refresh at step 4 (gap 3: refreshed at 3)
    assert _stored(opt.state[p]) == _expected(shape, 8)
    assert torch.equal(storage.decode_basis(opt.state[p], pj.PROJ, shape), storage.round_trip(before, 8))
    opt.param_groups[1]["proj_bits"] = 32
    _run(opt, params, 1, start=5)
    assert _stored(opt.state[p]) == _expected(shape, 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_paged_equals_unpaged(bits):
    params, twin = make_params(SHAPES), make_params(SHAPES)
    paged = _make("AdamW", params, bits, paged="cpu")
    plain = _make("AdamW", twin, bits)
    _run(paged, params, 7)
    _run(plain, twin, 7)
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
    a, b = paged.state_dict()["state"], plain.state_dict()["state"]
    assert a.keys() == b.keys()
    for key in a:
        _equal_states({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a[key].items()}, b[key])


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_batched_products_take_the_decoded_bases(bits, monkeypatch):
    """The batched products (CUDA's, run on the CPU here) decode each basis into the stacked buffer: within fp32
    rounding of the per-matrix products, for every width."""
    shapes = [(64, 40)] * 3 + [(40, 64)] * 2
    params, twin = make_params(shapes), make_params(shapes)
    per_matrix = _make("AdamW", params, bits)
    _run(per_matrix, params, 5)
    monkeypatch.setattr(batched, "BATCH_ON_CPU", True)
    batch = _make("AdamW", twin, bits)
    _run(batch, twin, 5)
    for p, q in zip(params, twin):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_state_bytes_shrink_with_proj_bits():
    """The basis' bytes per element: 4, 2, 1 + 4/256, 1/2 + 4/128 (exact by construction)."""
    sizes = {}
    for bits in (32, 16, 8, 4):
        params = make_params([(256, 512)])
        opt = lowmemopt.AdamW([dict(params=params, rank=64, proj_bits=bits)], lr=1e-2)
        set_grads(params, 0)
        opt.step()
        sizes[bits] = sum(
            v.numel() * v.element_size() for k, v in opt.state[params[0]].items() if k.startswith("galore.proj")
        )
    numel = 64 * 256
    assert sizes == {
        32: 4 * numel,
        16: 2 * numel,
        8: numel + 4 * num_blocks(numel, 256),
        4: numel // 2 + 4 * num_blocks(numel, 128),
    }


def test_estimate_counts_the_stored_bases_and_the_cli_takes_proj_bits(capsys):
    """``lowmemopt estimate --proj-bits``: the layout's state shrinks by exactly the bases' bytes; without GaLore the
    flag is refused."""
    pytest.importorskip("transformers")
    from lowmemopt.cli import main
    from lowmemopt.estimate import estimate, model_from_config

    cfg = dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = model_from_config(cfg)
    full = estimate(model, "galore_adamw_8bit", 8, galore_rank=16)
    small = estimate(model, "galore_adamw_8bit", 8, galore_rank=16, proj_bits=4)
    bases = 0  # every projected matrix's (k, m) or (n, k) basis: fp32 against 4-bit codes and a scale per 128
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name:  # ("all-linear": the LM head too)
            m, n = p.shape
            numel = min(16, m, n) * min(m, n)
            bases += 4 * numel - (-(-numel // 2) + 4 * num_blocks(numel, 128))
    assert full.state - small.state == bases > 0
    assert estimate(model, "adamw", 8, proj_bits=4).state == estimate(model, "adamw", 8).state  # (no GaLore groups)
    assert main(["estimate", "llama-2-7b", "--proj-bits", "8"]) == 1
    assert "--proj-bits sets how GaLore's bases are stored: give --galore-rank R too" in capsys.readouterr().err


def test_the_traced_step_counts_the_decoded_basis():
    """A traced per-layer GaLore step with 4-bit bases against the same step run for real on the CPU: within 5%, the
    optimizer state exact (as for every cell of test_estimate_traced.py)."""
    pytest.importorskip("transformers")
    from lowmemopt.traced_step import measure_step, real_model, trace_step

    cfg = dict(
        model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=8000, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    kw = dict(batch=2, seq=128, galore_rank=32, checkpointing=True, per_layer=True, proj_bits=4)
    traced = trace_step(cfg, "galore_adamw_8bit", 8, device="cpu", refresh=False, **kw)
    real = measure_step(real_model(cfg), "galore_adamw_8bit", 8, **kw)
    assert abs(traced.peak / real.peak - 1) <= 0.05, (traced, real)
    assert traced.at_peak["optimizer state"] == real.at_peak["optimizer state"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_every_parameter_dtype_steps_and_resumes_with_8_bit_bases(dtype):
    """float64, fp32, bf16 and fp16 parameters step with 8-bit bases, and a state dict round trip resumes bit for bit
    (the codes and their fp32 scales come back as they were, not cast to the parameter's dtype)."""
    params = make_params(SHAPES, dtype=dtype)
    opt = _make("AdamW", params, 8)
    _run(opt, params, 4)
    resumed = clone_params(params)
    saved = _state_dict_round_trip(opt)
    _run(opt, params, 3, start=4)
    opt2 = _make("AdamW", resumed, 8)
    opt2.load_state_dict(saved)
    assert opt2.state[resumed[0]]["galore.proj.absmax"].dtype == torch.float32
    _run(opt2, resumed, 3, start=4)
    for p, q in zip(params, resumed):
        assert p.dtype == dtype and torch.isfinite(p).all() and torch.equal(p, q)
        _equal_states(opt.state[p], opt2.state[q])
