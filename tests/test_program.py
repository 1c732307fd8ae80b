"""Step programs (lowmemopt.pipeline.program), under the Triton interpreter: a steady step launches the buckets kept
from the step before, equals the pipeline's step bit for bit, reads nothing back from the device, and the program is
made again whenever what it was made for changes (parameters, groups, state, a skip undone)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import assert_runs_same

import lowmemopt
from lowmemopt import optimizer as optimizer_module
from lowmemopt.kernels import runtime
from lowmemopt.pipeline import finite, program

pytestmark = pytest.mark.skipif(not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1")

SHAPES = [(33, 17), (300,), (8, 8), (5,), (40, 24)]
CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8),
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 4),
    (lowmemopt.Adam, dict(lr=1e-2, amsgrad=True), 32),
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True), 8),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1), 8),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1), 8),
    (lowmemopt.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3), 16),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.1), 32),
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1), 8),
]


def _spy(monkeypatch) -> dict[str, int]:
    """Counts of programmed steps (``"steps"``) and programs made (``"made"``) from now on."""
    counts = {"steps": 0, "made": 0}
    real_step, real_init = program.StepProgram.step, program.StepProgram.__init__

    def step(self, *a, **k):
        counts["steps"] += 1
        return real_step(self, *a, **k)

    def init(self, *a, **k):
        counts["made"] += 1
        real_init(self, *a, **k)

    monkeypatch.setattr(program.StepProgram, "step", step)
    monkeypatch.setattr(program.StepProgram, "__init__", init)
    return counts


def _run(cls, kw, bits, on_device, monkeypatch, steps=7, bad=(), each=None, dtype=torch.float32):
    """``steps`` steps of ``cls`` on fresh gradients (new tensors each step); ``bad``: (step, param) pairs whose
    gradient gets a NaN; ``each(opt, params, step)`` runs before each step. Returns (params, optimizer)."""
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
    opt = cls(params, state_bits=bits, min_quant_numel=0, block_size=16 if bits == 4 else 32, **kw)
    gen = torch.Generator().manual_seed(1)
    with runtime.cpu_interpreter(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                if (step, i) in bad:
                    p.grad.view(-1)[3] = float("nan")
            if each is not None:
                each(opt, params, step)
            opt.step()
        skips = opt.nonfinite_skips  # (settles the last step)
    return params, opt, skips


@pytest.mark.parametrize("cls,kw,bits", CASES, ids=[f"{c.__name__}-{b}" for c, _, b in CASES])
def test_programmed_steps_equal_the_host_checked_pipeline(cls, kw, bits, monkeypatch):
    # a NaN at step 4 (param 1, a programmed step) and step 5 (param 3): a skip undone at the next step makes the
    # program again there
    counts = _spy(monkeypatch)
    a, opt_a, skips_a = _run(cls, kw, bits, True, monkeypatch, bad={(4, 1), (5, 3)})
    assert counts == {"steps": 4, "made": 3}, counts  # steps 1-4 programmed; made at steps 0, 5, 6
    b, opt_b, skips_b = _run(cls, kw, bits, False, monkeypatch, bad={(4, 1), (5, 3)})
    assert counts["steps"] == 4
    assert skips_a == skips_b == 2
    assert_runs_same(a, opt_a, b, opt_b)


def test_a_bf16_model_with_a_scheduler_keeps_its_program(monkeypatch):
    # a learning rate (and weight decay) changed at every step reaches the kernels as arguments: no new program
    def schedule(opt, params, step):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
            group["weight_decay"] = 0.1 * (step % 2)

    counts = _spy(monkeypatch)
    a, opt_a, _ = _run(lowmemopt.AdamW, dict(lr=1e-2), 8, True, monkeypatch, each=schedule, dtype=torch.bfloat16)
    assert counts == {"steps": 6, "made": 1}
    b, opt_b, _ = _run(lowmemopt.AdamW, dict(lr=1e-2), 8, False, monkeypatch, each=schedule, dtype=torch.bfloat16)
    assert_runs_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize(
    "change",
    [
        "maximize",
        "bf16_update",
        "state tensor",
        "state dict",
        "step count",
        "groups split",
        "load_state_dict",
        "no grad",
    ],
)
def test_a_change_makes_the_program_again(change, monkeypatch):
    """What a program was made for changes before step 3: that step takes the pipeline and makes a new program,
    and the results are the host-checked pipeline's."""

    def edit(opt, params, step):
        if step != 3:
            return
        group, p = opt.param_groups[0], params[0]
        if change == "maximize":
            group["maximize"] = True
        elif change == "bf16_update":
            group["bf16_update"] = "kahan"
        elif change == "state tensor":  # (the program must write to the new tensor, not the old one)
            st = opt.state[p]
            st["exp_avg.codes"] = st["exp_avg.codes"].clone()
        elif change == "state dict":
            opt.state[p] = dict(opt.state[p])
        elif change == "step count":
            opt.state[p]["step"] -= 1
        elif change == "groups split":  # the same values in two groups: one bucket again, but other objects
            rest = group["params"][1:]
            group["params"] = group["params"][:1]
            opt.add_param_group({k: v for k, v in group.items() if k != "params"} | {"params": rest})
        elif change == "load_state_dict":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif change == "no grad":
            params[2].grad = None

    counts = _spy(monkeypatch)
    kw = dict(lr=1e-2, weight_decay=0.1)
    a, opt_a, _ = _run(lowmemopt.AdamW, kw, 8, True, monkeypatch, steps=5, each=edit)
    if change == "no grad":  # (step 4 has every gradient again: another program)
        assert counts == {"steps": 2, "made": 3}, counts
    else:
        assert counts == {"steps": 3, "made": 2}, counts  # steps 1, 2, 4; made at steps 0 and 3
    b, opt_b, _ = _run(lowmemopt.AdamW, kw, 8, False, monkeypatch, steps=5, each=edit)
    assert_runs_same(a, opt_a, b, opt_b)


class _Reads:
    """Counts reads of tensor values on the host (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``,
    ``__index__``, ``cpu``, ``numpy``) while entered, except of the host copies of a step's flags
    (:class:`lowmemopt.pipeline.finite.PendingSkip`: copied without waiting, read at the next step)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.n, self.on, self.exempt = 0, False, set()
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))
        real_init = finite.PendingSkip.__init__

        def init(pending, *a, **k):
            real_init(pending, *a, **k)
            self.exempt.add(id(pending.host))

        monkeypatch.setattr(finite.PendingSkip, "__init__", init)

    def _wrap(self, real):
        def counted(t, *a, **k):
            if self.on and id(t) not in self.exempt:
                self.n += 1
            return real(t, *a, **k)

        return counted


STEADY = CASES + [(lowmemopt.SignSGD, dict(lr=1e-2, momentum=0.9), 8), (lowmemopt.Adafactor, dict(weight_decay=0.1), 8)]


@pytest.mark.parametrize("cls,kw,bits", STEADY, ids=[f"{c.__name__}-{b}" for c, _, b in STEADY])
def test_a_steady_step_reads_nothing_back(cls, kw, bits, monkeypatch):
    reads = _Reads(monkeypatch)
    counts = _spy(monkeypatch)

    def watch(opt, params, step):  # steps 2-4: steady (their programs kept)
        reads.on = step >= 2

    _run(cls, kw, bits, True, monkeypatch, steps=5, each=watch)
    assert counts["steps"] == 4 and reads.n == 0


def test_grad_scaler_steps_take_the_program(monkeypatch):
    # GradScaler's native path: its found_inf masks the program's launches, settled at the next step
    class Scaler:
        def __init__(self):
            self.scale = torch.tensor(1024.0)

        def __call__(self, opt, params, step):
            opt.grad_scale = self.scale
            opt.found_inf = torch.tensor(1.0 if step == 4 else 0.0)
            for p in params:
                p.grad.mul_(1024.0)

    counts = _spy(monkeypatch)
    a, opt_a, _ = _run(lowmemopt.AdamW, dict(lr=1e-2), 8, True, monkeypatch, steps=6, each=Scaler())
    assert counts["steps"] >= 3
    b, opt_b, _ = _run(lowmemopt.AdamW, dict(lr=1e-2), 8, False, monkeypatch, steps=6, each=Scaler())
    assert [opt_a.state[p]["step"] for p in a] == [5] * len(SHAPES)  # step 4 skipped whole
    assert_runs_same(a, opt_a, b, opt_b)


GALORE_SHAPES = [(16, 12), (16, 12), (16, 12), (20, 8), (12,), (30, 16)]  # classes of 3 and 1 matrices, a bias
GALORE_CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1), 32),
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1), 8),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1), 8),
]


@pytest.mark.parametrize("cls,kw,bits", GALORE_CASES, ids=[f"{c.__name__}-{b}" for c, _, b in GALORE_CASES])
def test_galore_steps_between_refreshes_take_the_program(cls, kw, bits, monkeypatch):
    """The batched GaLore path (CUDA's: products per shape class, stand-ins, the fused apply pass) through the kept
    layouts and tables: bit for bit the host-checked pipeline's, a basis refresh (step 4) and a NaN (step 6) in
    between, and nothing read back in a steady step."""
    from lowmemopt.projection import batched

    monkeypatch.setattr(batched, "BATCH_ON_CPU", True)

    def run(on_device):
        monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in GALORE_SHAPES]
        matrices = [p for p in params if p.dim() == 2]
        opt = cls(
            [{"params": matrices, "rank": 4, "update_proj_gap": 4}, {"params": params[4:5]}],
            state_bits=bits,
            min_quant_numel=0,
            block_size=32,
            **kw,
        )
        gen = torch.Generator().manual_seed(2)
        with runtime.cpu_interpreter(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in range(9):
                for i, p in enumerate(params):
                    p.grad = torch.randn(p.shape, generator=gen)
                if step == 6:
                    params[1].grad[0, 0] = float("nan")
                reads.on = on_device and step in (2, 3, 7)
                opt.step()
                reads.on = False
            skips = opt.nonfinite_skips
        return params, opt, skips

    reads = _Reads(monkeypatch)
    counts = _spy(monkeypatch)
    a, opt_a, skips_a = run(True)
    # made at steps 1 (step 0 refreshes: checked on the host), 5 (after the refresh at 4) and 7 (the skip at 6
    # undone); programmed: 2, 3, 6 (step 8 refreshes the bases of the parameters not skipped)
    assert counts == {"steps": 3, "made": 3}, counts
    assert reads.n == 0  # (steps 2, 3 and 7: programmed, or the pipeline's with the check on the device)
    b, opt_b, skips_b = run(False)
    assert skips_a == skips_b == 1
    assert_runs_same(a, opt_a, b, opt_b)


def test_galore_scale_made_invalid_leaves_the_program_for_the_checked_step(monkeypatch):
    """A GaLore group's ``scale`` changed to a float it does not take (NaN) is a number changed, which a kept program
    would launch with: the program gives way to the checked step, which refuses it before writing anything."""
    from lowmemopt.projection import batched

    monkeypatch.setattr(batched, "BATCH_ON_CPU", True)
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", True)
    counts = _spy(monkeypatch)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 12)) for _ in range(2)]
    opt = lowmemopt.AdamW(
        [{"params": params, "rank": 4, "update_proj_gap": 10}], lr=1e-2, state_bits=8, min_quant_numel=0, block_size=32
    )
    with runtime.cpu_interpreter():
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        assert counts == {"steps": 1, "made": 1}, counts  # made at step 1 (step 0 refreshes), programmed at step 2
        opt.param_groups[0]["scale"] = float("nan")
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match="Invalid scale: nan"):
            opt.step()
        assert counts["steps"] == 1 and all(torch.equal(p, b) for p, b in zip(params, before))
        opt.param_groups[0]["scale"] = 0.5  # a valid number: programmed again
        opt.step()
        opt.step()
    assert counts["steps"] == 2 and all(torch.isfinite(p).all() for p in params), counts


@pytest.mark.parametrize("moved", [True, False], ids=["moved", "rebuilt"])
def test_galore_buffers_hold_no_memory_between_steps(moved, monkeypatch):
    """A kept GaLore step's low-rank gradients and stand-ins live in buffers that get memory for the step and give it
    back after it (their views kept); the tables follow the buffers by one offset, or are built again where the
    buffers do not move as one (``rebuilt``: every step so); bit for bit the host-checked pipeline's."""
    from lowmemopt.projection import batched

    monkeypatch.setattr(batched, "BATCH_ON_CPU", True)
    if not moved:
        monkeypatch.setattr(program.StepProgram, "_moved", lambda self, layouts: None)

    def run(on_device):
        monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in GALORE_SHAPES]
        matrices = [p for p in params if p.dim() == 2]
        opt = lowmemopt.AdamW(
            [{"params": matrices, "rank": 4}, {"params": params[4:5]}],
            lr=1e-2,
            weight_decay=0.1,
            state_bits=8,
            min_quant_numel=0,
            block_size=32,
        )
        gen = torch.Generator().manual_seed(2)
        held = []
        with runtime.cpu_interpreter():
            for _ in range(6):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).bfloat16()
                opt.step()
                kept = opt._program
                if kept is not None and kept.layouts[0] is not None:
                    project, stand = kept.layouts[0], kept.layouts[1]
                    scratch = [
                        *project.scratch,
                        *(c[0] for c in project.cast_bases.values()),
                        *(c[0] for c in stand.carved),
                    ]
                    held.append(sum(x.tensor.untyped_storage().nbytes() for x in scratch) if scratch else -1)
        return params, opt, held

    counts = _spy(monkeypatch)
    a, opt_a, held = run(True)
    assert counts == {"steps": 4, "made": 1}, counts  # made at step 1 (step 0 refreshes the bases)
    assert held == [0, 0, 0, 0]  # after each programmed step: buffers made (bf16 bases cast: their own) and empty
    b, opt_b, _ = run(False)
    assert_runs_same(a, opt_a, b, opt_b)


def test_gradients_kept_in_place_and_a_parameter_moved(monkeypatch):
    """Gradients kept in place from step to step (``zero_grad(set_to_none=False)``): the kept launch tables serve as
    they are; a parameter whose storage is replaced (``p.data = ...``) makes the program again (its tables would
    write to the old storage)."""

    def run(on_device):
        monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, min_quant_numel=0, block_size=32)
        for p in params:
            p.grad = torch.zeros_like(p)
        gen = torch.Generator().manual_seed(1)
        with runtime.cpu_interpreter():
            for step in range(5):
                if step == 3:
                    params[0].data = params[0].data.clone()
                for p in params:
                    p.grad.copy_(torch.randn(p.shape, generator=gen))
                opt.step()
        return params, opt

    counts = _spy(monkeypatch)
    a, opt_a = run(True)
    assert counts == {"steps": 3, "made": 2}, counts  # steps 1, 2, 4 programmed; made at 0 and 3
    b, opt_b = run(False)
    assert_runs_same(a, opt_a, b, opt_b)


def test_paged_state_resident_takes_the_program_and_an_eviction_drops_it(monkeypatch):
    """Paged state that stays resident (``paged="cpu"`` within its budget) moves nothing: those steps are unpaged
    ones and take the program; state that pages never does; "auto" evicting a state (a mocked device whose peak grew)
    drops the program at that step, which pages from then on. Every run equals the unpaged one bit for bit."""
    from test_paging_auto import FakeDevice

    from lowmemopt import paging

    def run(paged, fake=None):
        monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", True)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, min_quant_numel=0, block_size=32, **paged)
        gen = torch.Generator().manual_seed(1)
        with runtime.cpu_interpreter():
            for step in range(6):
                if fake is not None and step == 4:
                    fake.peak += 2 << 20  # the workload's peak grew beyond the room left: the state pages
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
        return params, opt

    counts = _spy(monkeypatch)
    b, opt_b = run({})
    assert counts == {"steps": 5, "made": 1}
    for paged, expect in [
        (dict(paged="cpu", page_budget_bytes=1 << 30), {"steps": 5, "made": 1}),
        (dict(paged="cpu", page_budget_bytes=0), {"steps": 0, "made": 0}),
    ]:
        counts.update(steps=0, made=0)
        a, opt_a = run(paged)
        assert counts == expect, (paged, counts)
        assert (paging.moving_bytes(opt_a) == 0) == bool(paged["page_budget_bytes"])
        assert_runs_same(a, opt_a, b, opt_b)
    fake = FakeDevice(monkeypatch)
    fake.room(1 << 20, headroom=0)  # everything fits
    counts.update(steps=0, made=0)
    a, opt_a = run(dict(paged="cpu", page_headroom_bytes=0), fake)
    assert counts == {"steps": 3, "made": 1}, counts  # made at step 0 (state placed resident), steps 1-3 programmed
    assert paging.moving_bytes(opt_a) > 0  # step 4 evicted
    assert_runs_same(a, opt_a, b, opt_b)
