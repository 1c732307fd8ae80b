"""lowmemopt.step_in_backward: per-layer updates in post-accumulate-grad hooks, against ordinary backward + step."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import lowmemopt


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _loss(model, t, micro=0):
    gen = torch.Generator().manual_seed(1000 * t + micro)
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {
    "GaLoreAdamW": lambda m: lowmemopt.GaLoreAdamW(
        lowmemopt.galore_param_groups(m, "all-linear", rank=4, update_proj_gap=3, weight_decay=0.1), lr=1e-2
    ),
    "CAME8bit-galore": lambda m: lowmemopt.CAME(
        lowmemopt.galore_param_groups(m, ["0"], rank=4, update_proj_gap=2), lr=1e-2, state_bits=8, min_quant_numel=32
    ),
    "AdamW8bit": lambda m: lowmemopt.AdamW8bit(m.parameters(), lr=1e-2, min_quant_numel=32),
}


def _reference(make, steps, accumulation=1, seed=0):
    model = _model(seed)
    opt = make(model)
    for t in range(steps):
        for micro in range(accumulation):
            (_loss(model, t, micro) / accumulation).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_gradient_accumulation_steps_on_the_last_micro_batch():
    make = OPTIMIZERS["GaLoreAdamW"]
    model = _model()
    opt = make(model)
    stepper = lowmemopt.step_in_backward(model, opt, accumulation_steps=3)
    for t in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(3):
            (_loss(model, t, micro) / 3).backward()
            if micro < 2:
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                assert all(p.grad is not None for p in model.parameters()) and stepper.micro_step == micro + 1
        assert all(p.grad is None for p in model.parameters()) and stepper.micro_step == 0
    ref = _reference(make, 4, accumulation=3)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_checkpoint_and_resume_is_bit_exact():
    """Save the optimizer and stepper state (weights_only-safe) after 3 steps with accumulation 2, resume in a fresh
    model / optimizer / stepper: 3 more steps equal 6 uninterrupted ones (across the GaLore refresh at step 3)."""
    make = OPTIMIZERS["GaLoreAdamW"]

    def train(model, stepper, start, stop):
        for t in range(start, stop):
            for micro in range(2):
                (_loss(model, t, micro) / 2).backward()

    model = _model()
    opt = make(model)
    stepper = lowmemopt.step_in_backward(model, opt, accumulation_steps=2)
    train(model, stepper, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "stepper": stepper.state_dict()}, buf)
    (_loss(model, 3, 0) / 2).backward()
    with pytest.raises(RuntimeError, match="save at a step boundary"):
        stepper.state_dict()

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = _model(seed=1)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = make(resumed)
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_stepper = lowmemopt.step_in_backward(resumed, resumed_opt, accumulation_steps=2)
    resumed_stepper.load_state_dict(ckpt["stepper"])
    assert resumed_stepper.steps == 3
    train(resumed, resumed_stepper, 3, 6)

    full = _model()
    full_stepper = lowmemopt.step_in_backward(full, make(full), accumulation_steps=2)
    train(full, full_stepper, 0, 6)
    for p, r in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, r)
    with pytest.raises(ValueError, match="accumulation_steps=2"):
        lowmemopt.step_in_backward(resumed, resumed_opt, accumulation_steps=4).load_state_dict(ckpt["stepper"])
    with pytest.raises(ValueError, match="'steps' must be an int"):
        resumed_stepper.load_state_dict(dict(ckpt["stepper"], steps=-1))


def test_gradient_clipping_is_refused_clearly():
    model = _model()
    opt = OPTIMIZERS["GaLoreAdamW"](model)
    with pytest.raises(ValueError, match="cannot clip gradients by global norm"):
        lowmemopt.step_in_backward(model, opt, max_grad_norm=1.0)
    lowmemopt.step_in_backward(model, opt, max_grad_norm=None).remove()
    lowmemopt.step_in_backward(model, opt, max_grad_norm=0.0).remove()


def test_bad_arguments():
    model = _model()
    with pytest.raises(TypeError, match="needs a lowmemopt optimizer"):
        lowmemopt.step_in_backward(model, torch.optim.AdamW(model.parameters()))
    opt = lowmemopt.AdamW(model.parameters())
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="Invalid accumulation_steps"):
            lowmemopt.step_in_backward(model, opt, accumulation_steps=bad)
    with pytest.raises(ValueError, match="is not a parameter of the model"):
        lowmemopt.step_in_backward(model, lowmemopt.AdamW([torch.nn.Parameter(torch.zeros(3))]))
    with pytest.warns(UserWarning, match="not in the optimizer keep their gradients"):
        lowmemopt.step_in_backward(model, lowmemopt.AdamW(model[0].parameters())).remove()


def test_optimizer_step_between_micro_batches_raises_and_is_a_noop_at_boundaries():
    model = _model()
    opt = OPTIMIZERS["GaLoreAdamW"](model)
    lowmemopt.step_in_backward(model, opt, accumulation_steps=2)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="between micro-batches"):
        opt.step()
    _loss(model, 0, 1).backward()
    after = [p.detach().clone() for p in model.parameters()]
    opt.step()  # boundary: no gradients left, nothing happens
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after))


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["alone", "bucketed"])
def test_nonfinite_gradient_is_skipped(bucket_bytes):
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2, state_bits=8, min_quant_numel=32)
    lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket_bytes)
    _loss(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model[2].weight].items() if isinstance(v, torch.Tensor)}
    handle = model[2].weight.register_hook(lambda g: g * float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped 1 parameter"):
        _loss(model, 1).backward()
    handle.remove()
    assert torch.equal(model[2].weight, before[2]) and opt.nonfinite_skips == 1
    assert opt.state[model[2].weight]["step"] == 1
    assert all(torch.equal(opt.state[model[2].weight][k], v) for k, v in state.items())
    assert not torch.equal(model[0].weight, before[0]) and all(p.grad is None for p in model.parameters())


def test_remove_restores_ordinary_training():
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    stepper = lowmemopt.step_in_backward(model, opt)
    stepper.remove()
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert not torch.equal(model[0].weight, before[0])


def test_group_dicts_replaced_by_load_state_dict_are_followed():
    """load_state_dict (a resume, accelerate's prepare) replaces the optimizer's group dicts and an LR scheduler then
    updates the new ones: the hooks must step with the current groups, not the ones seen at attach time."""
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    lowmemopt.step_in_backward(model, opt)
    opt.load_state_dict(opt.state_dict())  # new group dicts
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # lr 0: nothing moved
    opt.param_groups[0]["lr"] = 1e-2
    _loss(model, 1).backward()
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _host_work_optimizer(name, params):
    """An 8-bit optimizer over ``params`` (GaLore: the matrices in a rank-4 group) for the per-parameter tests."""
    kw = dict(lr=1e-2, weight_decay=0.1, state_bits=8, min_quant_numel=0, block_size=32)
    if name == "GaLoreAdamW8bit":
        groups = [
            {"params": [p for p in params if p.dim() == 2], "rank": 4, "update_proj_gap": 2},
            {"params": [p for p in params if p.dim() != 2]},
        ]
    else:
        groups = [{"params": list(params)}]
    cls = lowmemopt.CAME if name == "CAME8bit" else lowmemopt.AdamW
    return cls(groups, **kw)


@pytest.mark.parametrize("name", ["AdamW8bit", "CAME8bit", "GaLoreAdamW8bit"])
def test_per_parameter_steps_follow_changes_between_steps(name):
    """The per-layer path (``per_layer.step_one``: one parameter per call, through the Triton kernels under the
    interpreter; the finiteness flags on the device) keeps nothing stale between steps: hyper-parameters changed
    (an LR scheduler), ``load_state_dict`` (new group dicts and state tensors), a parameter's storage replaced by a
    new tensor, then by one of another dtype, a param group added. Every step equals ``step()`` of a twin, bit for bit,
    whose optimizer is made afresh from the state dict at the reload."""
    from lowmemopt.kernels import dispatch, runtime
    from lowmemopt.per_layer import step_one
    from lowmemopt.pipeline.finite import resolve

    if not (runtime.HAS_TRITON and runtime.INTERPRET):
        pytest.skip("needs TRITON_INTERPRET=1")
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 24), (16,), (8, 8)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = _host_work_optimizer(name, a), _host_work_optimizer(name, b)
    gen = torch.Generator().manual_seed(1)
    with runtime.cpu_interpreter():
        for t in range(7):
            if t == 2:  # an LR scheduler, and a weight decay changed between steps
                for opt in (opt_a, opt_b):
                    for group in opt.param_groups:
                        group["lr"] *= 0.5
                        group["weight_decay"] = 0.3
            if t == 3:  # a reload: new group dicts and state tensors; the twin is a fresh optimizer
                opt_a.load_state_dict(opt_a.state_dict())
                saved = opt_b.state_dict()
                opt_b = _host_work_optimizer(name, b)
                opt_b.load_state_dict(saved)
            if t == 4:  # new storage (the launch tables hold addresses)
                for params in (a, b):
                    params[0].data = params[0].data.clone()
            if t == 5:  # another dtype
                for params in (a, b):
                    params[1].data = params[1].data.to(torch.bfloat16)
            if t == 6:  # a param group added
                new = torch.randn(12)
                for opt, params in ((opt_a, a), (opt_b, b)):
                    params.append(torch.nn.Parameter(new.clone()))
                    opt.add_param_group({"params": [params[-1]], "lr": 5e-3})
            for pa, pb in zip(a, b):
                g = torch.randn(pa.shape, generator=gen).to(pa.dtype)
                pa.grad, pb.grad = g, g.clone()
            before = sum(dispatch.stats.values())
            pending: list = []
            work = [(p, group) for group in opt_a.param_groups for p in group["params"]]
            for p, group in reversed(work):
                assert step_one(opt_a, p, group, pending)
            assert resolve(pending) == 0
            full_rank = sum(group.get("rank") is None for _, group in work)
            assert len(pending) == full_rank  # decided on the device (GaLore's on the host)
            assert sum(dispatch.stats.values()) - before >= len(work) // 2  # (GaLore: a bucket per group of a hook)
            opt_b.step()
            for pa, pb in zip(a, b):
                assert pa.dtype == pb.dtype and torch.equal(pa, pb), (t, tuple(pa.shape))
                sa, sb = opt_a.state[pa], opt_b.state[pb]
                assert sorted(sa) == sorted(sb) and sa["step"] == sb["step"] == (t + 1 if pa.numel() != 12 else 1)
                for k in sa:
                    if isinstance(sa[k], torch.Tensor):
                        assert torch.equal(sa[k], sb[k]), (t, k)
                    else:
                        assert sa[k] == sb[k], (t, k)


def test_low_rank_slots_with_unhashable_fields():
    """A GaLore parameter's low-rank slots are memoized by value; a slot that cannot be a key is derived anyway."""
    from lowmemopt.optimizer import Slot
    from lowmemopt.projection import state as step

    slot = Slot(signed=True, shape=[3, 2], dims=[0, None])  # lists: unhashable
    assert step._low_rank_slot(slot, (4, 2), (0, None)) == Slot(True, True, [3, 2], (0, None))
    plain = Slot(signed=False)
    assert step._low_rank_slot(plain, (4, 2), (0, None)) == Slot(False, True, (4, 2), (0, None))
    assert step._low_rank_slot(plain, (4, 2), (0, None)) is step._low_rank_slot(Slot(signed=False), (4, 2), (0, None))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bucket_bytes", [0, 600, 1 << 20], ids=["alone", "600B", "1MiB"])
def test_equals_ordinary_steps_and_frees_gradients(name, bucket_bytes):
    """7 steps (two GaLore refreshes) of per-layer updates equal backward() + step() bit for bit, and after each
    backward every gradient is freed. Alone (``bucket_bytes=0``) the first layer's gradient is completed after the
    last layer was already updated and its gradient freed. In buckets, completed gradients are held until they add up
    to the bucket, then stepped together (one pipeline pass), so at most a bucket (plus the gradient that fills it)
    waits: with 600 bytes the last layer (32 x 8 + 8 floats: 1,056 bytes) is stepped before the first layer's gradient
    exists; with 1 MiB every gradient waits for the end of the backward pass."""
    make = OPTIMIZERS[name]
    model = _model()
    opt = make(model)
    stepper = lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket_bytes)
    held = []

    def watch(p):  # (after the stepper's hook: the gradients alive once it has run)
        held.append(sum(q.grad.numel() * q.grad.element_size() for q in model.parameters() if q.grad is not None))

    for q in model.parameters():
        q.register_post_accumulate_grad_hook(watch)
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(model[2].weight.grad is None))
    for t in range(7):
        _loss(model, t).backward()
        assert all(p.grad is None for p in model.parameters())
    assert seen == [bucket_bytes < 1056] * 7 and stepper.steps == 7
    sizes = [p.numel() * 4 for p in model.parameters()]
    if bucket_bytes < 1056:
        assert max(held) <= bucket_bytes + max(sizes)
    else:
        assert max(held) == sum(sizes)  # all of them, at the last hook
    ref = _reference(make, 7)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_a_bucket_is_one_pipeline_pass(monkeypatch):
    # the held parameters go through the step pipeline together: one call per bucket, not one per parameter
    from lowmemopt import pipeline

    calls = []
    real = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda plan: calls.append(len(plan.work)) or real(plan))
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    lowmemopt.step_in_backward(model, opt, bucket_bytes=1 << 20)
    _loss(model, 0).backward()
    assert calls == [4]
    calls.clear()
    model2 = _model()
    lowmemopt.step_in_backward(model2, lowmemopt.AdamW(model2.parameters(), lr=1e-2))
    _loss(model2, 0).backward()
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_bad_bucket_bytes(bad):
    model = _model()
    with pytest.raises(ValueError, match="bucket_bytes"):
        lowmemopt.step_in_backward(model, lowmemopt.AdamW(model.parameters()), bucket_bytes=bad)


def _edit(name, model, opt):
    """An edit between steps, as training code makes them."""
    group = opt.param_groups[0]
    if name == "lr":
        group["lr"] *= 0.5
    elif name == "weight_decay":
        group["weight_decay"] = 0.2
    elif name == "freeze":
        model[2].weight.requires_grad_(False)
    elif name == "unfreeze":
        model[2].weight.requires_grad_(True)
    elif name == "state_bits":
        group["state_bits"] = 32  # (state made from now on: what exists keeps its format)
    elif name == "kahan":
        group["bf16_update"] = "kahan"
    elif name == "reset":
        opt.state.pop(model[0].weight, None)
    elif name == "state_dict":
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        opt.load_state_dict(torch.load(buf, weights_only=True))


EDITED_RUNS = {  # optimizer, parameter dtype, accumulation, bucket_bytes, the edit before each step
    "AdamW8bit": (
        lambda m: lowmemopt.AdamW(m.parameters(), lr=1e-2, state_bits=8, min_quant_numel=0, block_size=32),
        torch.float32,
        1,
        0,
        ["lr", "freeze", "state_dict", "unfreeze", "reset", "state_bits"],
    ),
    "Lion8bit-bf16-bucketed": (
        lambda m: lowmemopt.Lion(m.parameters(), lr=1e-3, state_bits=8, min_quant_numel=0),
        torch.bfloat16,
        2,
        4096,
        ["kahan", "weight_decay", "state_dict", "reset", "lr"],
    ),
    "CAME8bit-galore": (
        lambda m: lowmemopt.CAME(
            lowmemopt.galore_param_groups(m, ["0"], rank=4, update_proj_gap=2), lr=1e-2, state_bits=8, min_quant_numel=0
        ),
        torch.float32,
        2,
        0,
        ["freeze", "lr", "state_dict", "unfreeze", "reset"],
    ),
    "SGD4bit-float64": (
        lambda m: lowmemopt.SGD(m.parameters(), lr=1e-2, momentum=0.9, state_bits=4, min_quant_numel=0, block_size=16),
        torch.float64,
        1,
        1 << 20,
        ["state_dict", "weight_decay", "reset", "freeze", "lr"],
    ),
}


@pytest.mark.parametrize("name", EDITED_RUNS)
def test_edits_between_steps_as_in_ordinary_steps(name):
    """Group values changed, parameters frozen and unfrozen, a state reset, ``state_bits`` or ``bf16_update`` changed
    and a state dict round trip between steps: per-layer updates give what backward + ``step()`` give, bit for bit."""
    make, dtype, accumulation, bucket_bytes, edits = EDITED_RUNS[name]
    finals = []
    for per_layer in (False, True):
        model = _model().to(dtype)
        opt = make(model)
        if per_layer:
            lowmemopt.step_in_backward(model, opt, accumulation_steps=accumulation, bucket_bytes=bucket_bytes)
        for t in range(len(edits) + 1):
            if t:
                _edit(edits[t - 1], model, opt)
            for micro in range(accumulation):
                x, y = _batch(t, micro)
                (torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) / accumulation).backward()
            if not per_layer:
                opt.step()
                opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def _batch(t, micro):
    gen = torch.Generator().manual_seed(1000 * t + micro)
    return torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
