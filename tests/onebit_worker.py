"""Cases of ``tests/test_onebit.py``, run in spawned gloo processes (one spawn per world size, every case inside it).

    python tests/onebit_worker.py --world-size 2 --out DIR [--cases a,b,...]

Each rank writes ``DIR/rank<r>.json``: ``{case: "ok" | traceback}``. Every rank computes the inputs of all ranks
(shared seeds), so each checks its own results against a single-process simulation of the N workers written here
from the papers, independently of the library's code.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn import free_port, run_cases

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or not torch.equal(a, b):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: differs (max abs diff {diff}, shapes {tuple(a.shape)} {tuple(b.shape)})")


# ---------------------------------------------------------------------------------------------------------------------
# the reference: N workers' compressed all-reduce, one tensor at a time, one chunk at a time


def sim_sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))


def sim_padded(numel: int, world: int, align: int) -> int:
    a = align * 8 // math.gcd(align, 8)
    return max(1, -(-numel // (world * a))) * a * world


def sim_allreduce(inputs, worker_errors, server_errors, numels, world, aligns=None):
    """inputs[r][i]: rank r's tensor i (flat, unpadded); worker_errors[r][i] (padded), server_errors[j][i] (chunk):
    updated in place. Returns the result of tensor i (the same for every rank), unpadded."""
    aligns = aligns or [8] * len(numels)
    results = []
    for i, numel in enumerate(numels):
        padded = sim_padded(numel, world, aligns[i])
        chunk = padded // world
        signs, scales = [], []
        for r in range(world):
            x = torch.zeros(padded)
            x[:numel] = inputs[r][i]
            x = x + worker_errors[r][i]
            s = torch.linalg.vector_norm(x) / math.sqrt(padded)
            worker_errors[r][i].copy_(x - s * sim_sign(x))
            signs.append(sim_sign(x))
            scales.append(s)
        out = torch.zeros(padded)
        for j in range(world):
            c = None
            for r in range(world):  # rank order
                term = signs[r][j * chunk : (j + 1) * chunk] * (scales[r] / world)
                c = term if c is None else c + term
            c = c + server_errors[j][i]
            t = torch.linalg.vector_norm(c) / math.sqrt(chunk)
            server_errors[j][i].copy_(c - t * sim_sign(c))
            out[j * chunk : (j + 1) * chunk] = t * sim_sign(c)
        results.append(out[:numel])
    return results


# ---------------------------------------------------------------------------------------------------------------------
# the collective


@case
def compressed_allreduce_matches_simulation(ctx):
    from lowmemopt.distributed.compression import CompressedAllReduce, Layout

    world, rank = ctx.world, ctx.rank
    for numels, aligns in [([5, 64, 33], None), ([300, 7], [256, 128]), ([1], None)]:
        layout = Layout.of(numels, world, aligns)
        op = CompressedAllReduce(layout)
        werr, serr = op.new_errors()
        sim_w = [
            [torch.zeros(sim_padded(n, world, a)) for n, a in zip(numels, aligns or [8] * len(numels))]
            for _ in range(world)
        ]
        sim_s = [
            [torch.zeros(sim_padded(n, world, a) // world) for n, a in zip(numels, aligns or [8] * len(numels))]
            for _ in range(world)
        ]
        for it in range(4):  # error feedback carries over
            gen = torch.Generator().manual_seed(100 + it)
            inputs = [[torch.randn(n, generator=gen) for n in numels] for _ in range(world)]
            if it == 2:
                for r in range(world):
                    inputs[r][0].zero_()  # zeros take sign +1
            expect = sim_allreduce(inputs, sim_w, sim_s, numels, world, aligns)
            bucket = torch.zeros(layout.numel)
            for view, x in zip(layout.views(bucket), inputs[rank]):
                view.copy_(x)
            op(bucket, werr, serr)
            for i, (view, e) in enumerate(zip(layout.views(bucket), expect)):
                same(view, e, f"{numels} step {it} tensor {i}")
            for i, (seg, e) in enumerate(zip(torch.split(werr, list(layout.padded)), sim_w[rank])):
                same(seg, e, f"{numels} step {it} worker error {i}")
            for i, (seg, e) in enumerate(zip(torch.split(serr, list(layout.chunks)), sim_s[rank])):
                same(seg, e, f"{numels} step {it} server error {i}")
    # block alignment: every 256-block of the result holds one magnitude, which 8-bit codes keep exactly
    layout = Layout.of([1000], world, [256])
    assert all(c % 256 == 0 for c in layout.chunks), layout.chunks


@case
def compressed_allreduce_nonfinite_keeps_errors(ctx):
    from lowmemopt.distributed.compression import CompressedAllReduce, Layout

    layout = Layout.of([16, 16], ctx.world)
    op = CompressedAllReduce(layout)
    werr, serr = op.new_errors()
    bucket = torch.zeros(layout.numel)
    torch.manual_seed(3)
    for view in layout.views(bucket):
        view.copy_(torch.randn(16))
    op(bucket, werr, serr)
    w0, s0 = werr.clone(), serr.clone()
    bucket = torch.zeros(layout.numel)
    for view in layout.views(bucket):
        view.copy_(torch.randn(16))
    if ctx.rank == 0:
        layout.views(bucket)[0][3] = float("nan")
    op(bucket, werr, serr)
    first, second = layout.views(bucket)
    assert not torch.isfinite(first).any(), "a non-finite input reaches every rank's result"
    assert torch.isfinite(second).all()
    pad0 = layout.padded[0]
    if ctx.rank == 0:
        same(werr[:pad0], w0[:pad0], "worker error of the non-finite tensor")
    same(serr[: layout.chunks[0]], s0[: layout.chunks[0]], "server error of the non-finite tensor")
    assert torch.isfinite(werr).all() and torch.isfinite(serr).all()


# ---------------------------------------------------------------------------------------------------------------------
# 1-bit Adam against the paper's algorithm, N workers in one process

SHAPES = [(6, 5), (7,), (16, 16)]


def grads_of(step: int, world: int):
    """grads[r][i]: multiples of 2^-10, so every sum over ranks is exact in any order."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [[torch.randint(-512, 512, s, generator=gen).float() / 1024 for s in SHAPES] for _ in range(world)]


def init_params():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def reference_onebit_adam(
    steps, world, lr, betas, eps, wd, freeze, bias_correction=True, eps_inside_sqrt=False, masks=None
):
    """Parameters, m and v after each step: warm-up Adam on averaged gradients, then the local momentum averaged by
    the 1-bit compressed all-reduce with error feedback, variance frozen (Tang et al. 2021, Algorithm 1). ``masks``:
    per parameter None or DeepSpeed's ``exp_avg_mask``, which multiplies the compressed mean."""
    masks = masks or [None] * len(SHAPES)
    b1, b2 = betas
    ps = init_params()
    ms = [torch.zeros(s) for s in SHAPES]
    vs = [torch.zeros(s) for s in SHAPES]
    numels = [math.prod(s) for s in SHAPES]
    werr = [[torch.zeros(sim_padded(n, world, 8)) for n in numels] for _ in range(world)]
    serr = [[torch.zeros(sim_padded(n, world, 8) // world) for n in numels] for _ in range(world)]
    history = []
    for t in range(1, steps + 1):
        g = grads_of(t, world)
        if t <= freeze:
            for i in range(len(SHAPES)):
                avg = g[0][i]
                for r in range(1, world):
                    avg = avg + g[r][i]
                avg = avg / world
                ms[i].mul_(b1).add_(avg, alpha=1 - b1)
                vs[i].mul_(b2).addcmul_(avg, avg, value=1 - b2)
        else:
            msgs = [
                [ms[i].mul(b1).add_(g[r][i], alpha=1 - b1).reshape(-1) for i in range(len(SHAPES))]
                for r in range(world)
            ]
            if world > 1:
                means = sim_allreduce(msgs, werr, serr, numels, world)
            else:
                means = msgs[0]
            for i in range(len(SHAPES)):
                ms[i].copy_(means[i].view(SHAPES[i]) if masks[i] is None else means[i].view(SHAPES[i]) * masks[i])
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2s = math.sqrt(1 - b2 ** min(t, freeze)) if bias_correction else 1.0
        for i in range(len(SHAPES)):
            if eps_inside_sqrt:
                denom = vs[i].div(bc2s * bc2s).add_(eps).sqrt_()
            else:
                denom = vs[i].sqrt().div_(bc2s).add_(eps)
            delta = torch.mul(ms[i], -lr / bc1).div_(denom)
            ps[i].mul_(1 - lr * wd).add_(delta)
        history.append(([p.clone() for p in ps], [m.clone() for m in ms], [v.clone() for v in vs]))
    return history


def run_onebit(ctx, steps, opt=None, params=None, start=1, **kw):
    import lowmemopt

    if params is None:
        params = [torch.nn.Parameter(p + ctx.rank) for p in init_params()]  # broadcast at construction fixes it
    if opt is None:
        opt = lowmemopt.OnebitAdam(params, **kw)
    out = []
    for t in range(start, start + steps):
        for p, g in zip(params, grads_of(t, ctx.world)[ctx.rank]):
            p.grad = g.clone()
        kept = [p.grad for p in params]
        opt.step()
        assert all(p.grad is k for p, k in zip(params, kept)), "the gradients are given back"
        out.append([p.detach().clone() for p in params])
    return opt, params, out


def replicas_equal(ctx, tensors, what):
    for t in tensors:
        got = [torch.empty_like(t) for _ in range(ctx.world)]
        dist.all_gather(got, t.contiguous())
        for r, x in enumerate(got):
            same(x, t, f"{what}: rank {r} vs rank {ctx.rank}")


KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, freeze_step=3)


@case
def onebit_adam_matches_reference(ctx):
    for extra in ({}, {"bias_correction": False, "eps_inside_sqrt": True}):
        kw = dict(KW, **extra)
        ref = reference_onebit_adam(
            7,
            ctx.world,
            kw["lr"],
            kw["betas"],
            kw["eps"],
            kw["weight_decay"],
            kw["freeze_step"],
            kw.get("bias_correction", True),
            kw.get("eps_inside_sqrt", False),
        )
        opt, params, out = run_onebit(ctx, 7, **kw)
        for t, (got, (ps, ms, vs)) in enumerate(zip(out, ref), 1):
            for i, (a, b) in enumerate(zip(got, ps)):
                same(a, b, f"{extra} step {t} param {i}")
        for i, p in enumerate(params):
            same(opt.state[p]["exp_avg"], ref[-1][1][i], f"{extra} exp_avg {i}")
            same(opt.state[p]["exp_avg_sq"], ref[-1][2][i], f"{extra} exp_avg_sq {i}")
        replicas_equal(ctx, [p.detach() for p in params], f"{extra} parameters")
        replicas_equal(ctx, [opt.state[p]["exp_avg"] for p in params], f"{extra} exp_avg")


@case
def onebit_adam_quantized_state(ctx):
    """8- and 4-bit m through the compressed phase: replicas equal, each block of m one magnitude (exact at 8 bits),
    parameters close to the 32-bit run."""
    from lowmemopt.quant.formats import format_of

    _, _, out32 = run_onebit(ctx, 7, **KW)
    for bits in (8, 4):
        opt, params, out = run_onebit(ctx, 7, state_bits=bits, min_quant_numel=64, block_size=64, **KW)
        big = params[2]
        st = opt.state[big]
        assert format_of(st, "exp_avg").bits == bits, format_of(st, "exp_avg")
        m = format_of(st, "exp_avg").decode(st, "exp_avg", 0, big.numel(), True, 64)
        mags = m.abs().view(-1, 64)
        spread = (mags.max(1).values - mags.min(1).values) / mags.max(1).values
        limit = 0.0 if bits == 8 else 1e-6
        assert spread.max().item() <= limit, f"{bits}-bit: a block of m holds several magnitudes ({spread.max()})"
        replicas_equal(ctx, [p.detach() for p in params], f"{bits}-bit parameters")
        for a, b in zip(out[-1], out32[-1]):
            err = ((a - b).norm() / b.norm()).item()
            assert err < 0.05, f"{bits}-bit: relative distance to 32-bit {err}"


@case
def onebit_adam_resume_mid_compression(ctx):
    """A state dict saved after a compressed step (m, v and this rank's error buffers) resumes bit for bit; at another
    world size the error buffers restart from zero with a warning."""
    import warnings

    import lowmemopt

    for bits in (32, 8):
        kw = dict(KW, state_bits=bits, min_quant_numel=64, block_size=64)
        _, _, whole = run_onebit(ctx, 8, **kw)
        opt, params, first = run_onebit(ctx, 5, **kw)
        opt2, params2, sd = reload(opt, params, lowmemopt.OnebitAdam, kw)
        _, _, rest = run_onebit(ctx, 3, opt=opt2, params=params2, start=6)
        for t, (a, b) in enumerate(zip(first + rest, whole), 1):
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{bits}-bit resumed run, step {t} param {i}")
    sd["onebit"]["world"] = ctx.world + 1
    opt3 = lowmemopt.OnebitAdam([torch.nn.Parameter(p.detach().clone()) for p in params], **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt3.load_state_dict(sd)
    assert any("restart from zero" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert opt3._stage.buckets == {}


@case
def onebit_adam_ddp_hook(ctx):
    """A DDP-wrapped model with the optimizer's comm hook steps as the unwrapped model does (DDP averages warm-up
    gradients, sends nothing on compressed steps)."""
    import lowmemopt

    if ctx.world != 2:
        return  # (with 2 ranks a + b is the same sum in any order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = lowmemopt.OnebitAdam(ddp.parameters(), **KW)
    opt.register_ddp(ddp)
    opt2 = lowmemopt.OnebitAdam(twin, **KW)
    gen = torch.Generator().manual_seed(5 + ctx.rank)
    for t in range(1, 8):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        local = [p.grad.clone() for p in model.parameters()]
        if t > KW["freeze_step"]:  # compressed: DDP left the gradients local
            h = torch.tanh(x @ twin[0].T + twin[1])
            loss = torch.nn.functional.mse_loss(h @ twin[2].T + twin[3], y)
            expect = torch.autograd.grad(loss, twin)
            for a, b in zip(local, expect):
                torch.testing.assert_close(a, b)
        for p, g in zip(twin, local):
            p.grad = g
        # (warm-up: DDP averaged; the twin's optimizer averages the same values again, which leaves them equal)
        opt.step()
        opt2.step()
        for a, b in zip(model.parameters(), twin):
            same(a.detach(), b.detach(), f"step {t}")


@case
def onebit_adam_bad_inputs(ctx):
    import lowmemopt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    p = [torch.nn.Parameter(torch.zeros(4))]
    for kw, word in [
        (dict(amsgrad=True), "amsgrad"),
        (dict(max_grad_norm=1.0), "max_grad_norm"),
        (dict(freeze_step=0), "freeze_step"),
        (dict(paged=True), "paged"),
        (dict(capturable=True), "capturable"),
    ]:
        try:
            lowmemopt.OnebitAdam(p, **kw)
        except ValueError as e:
            assert word in str(e), (kw, e)
        else:
            raise AssertionError(f"{kw} accepted")
    for params, word in [
        ([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], "fp32"),
        ([{"params": p, "rank": 2}], "GaLore"),
    ]:
        try:
            lowmemopt.OnebitAdam(params)
        except ValueError as e:
            assert word in str(e), e
        else:
            raise AssertionError(f"{word} accepted")
    mesh = init_device_mesh("cpu", (ctx.world,))
    d = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
    try:
        lowmemopt.OnebitAdam([d])
    except ValueError as e:
        assert "DTensor" in str(e), e
    else:
        raise AssertionError("DTensor accepted")
    for refuse in (
        lambda: lowmemopt.step_in_backward(torch.nn.Linear(2, 2), lowmemopt.OnebitAdam(p)),
        lambda: lowmemopt.OnebitAdam(p)._step_some([]),
    ):
        try:
            refuse()
        except ValueError as e:
            assert "step_in_backward" in str(e), e
        else:
            raise AssertionError("per-layer updates accepted")


# ---------------------------------------------------------------------------------------------------------------------
# 0/1 Adam against the paper's algorithm (Lu et al. 2022, Algorithm 1 with DeepSpeed's schedules)

ZO = dict(
    lr=1e-2,
    betas=(0.9, 0.99),
    eps=1e-8,
    weight_decay=0.01,
    var_freeze_step=6,
    var_update_scaler=2,
    local_step_scaler=2,
    local_step_clipper=4,
)


def reference_zero_one_adam(
    steps,
    world,
    lr,
    betas,
    eps,
    weight_decay,
    var_freeze_step,
    var_update_scaler,
    local_step_scaler,
    local_step_clipper,
    bias_correction=True,
    masks=None,
):
    """Every rank's parameters after each step. Variance steps (t a multiple of an interval that doubles every
    var_update_scaler of them) average the gradients and update v; the other steps up to var_freeze_step move m by the
    1-bit mean gradient; afterwards ranks step locally, accumulate their updates and synchronise them, compressed,
    every local interval (doubling every local_step_scaler steps, at most local_step_clipper)."""
    b1, b2 = betas
    n = len(SHAPES)
    numels = [math.prod(s) for s in SHAPES]
    masks = [None if m is None else m.reshape(-1) for m in (masks or [None] * n)]  # (exp_avg_mask: on each mean)

    def masked(means):
        return [x if m is None else x * m for x, m in zip(means, masks)]

    ps = [[x.clone() for x in init_params()] for _ in range(world)]
    ms = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    us = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    vs = [torch.zeros(s) for s in SHAPES]

    def fresh_errors():
        return (
            [[torch.zeros(sim_padded(k, world, 8)) for k in numels] for _ in range(world)],
            [[torch.zeros(sim_padded(k, world, 8) // world) for k in numels] for _ in range(world)],
        )

    werr, serr = fresh_errors()
    var_interval, var_count, k = 1, 0, 0
    local_interval, local_count, lrs = 1, 0, 0.0
    history = []
    for t in range(1, steps + 1):
        g = grads_of(t, world)
        local = t > var_freeze_step
        if t == var_freeze_step + 1:
            werr, serr = fresh_errors()
        full = not local and t % var_interval == 0
        if full:
            k += 1
            avg = []
            for i in range(n):
                a = g[0][i]
                for r in range(1, world):
                    a = a + g[r][i]
                avg.append(a / world)
            feed = [avg for _ in range(world)]
        elif not local:
            means = masked(
                sim_allreduce([[x.reshape(-1) for x in g[r]] for r in range(world)], werr, serr, numels, world)
            )
            feed = [[mm.view(s) for mm, s in zip(means, SHAPES)] for _ in range(world)]
        else:
            feed = g
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2s = math.sqrt(1 - b2 ** max(k, 1)) if bias_correction else 1.0
        denoms = [vs[i].sqrt().div_(bc2s).add_(eps) for i in range(n)]
        for i in range(n):
            if full:
                vs[i].mul_(b2).addcmul_(feed[0][i], feed[0][i], value=1 - b2)
                denoms[i] = vs[i].sqrt().div_(bc2s).add_(eps)
            for r in range(world):
                ms[r][i].mul_(b1).add_(feed[r][i], alpha=1 - b1)
                upd = torch.div(ms[r][i], denoms[i])
                if bc1 != 1.0:
                    upd.div_(bc1)
                upd.add_(ps[r][i], alpha=weight_decay)
                d = upd.mul_(-lr)
                ps[r][i].add_(d)
                if local:
                    us[r][i].add_(d)
        if full:
            var_count += 1
            if var_count == var_update_scaler:
                var_count, var_interval = 0, var_interval * 2
        if local:
            lrs += lr / bc1
            if t % local_interval == 0:
                msgs = [[(us[r][i] * denoms[i]).reshape(-1) for i in range(n)] for r in range(world)]
                means = masked(sim_allreduce(msgs, werr, serr, numels, world))
                for r in range(world):
                    for i in range(n):
                        flat = ps[r][i].view(-1)
                        flat.sub_(us[r][i].view(-1))
                        flat.add_(means[i] / denoms[i].view(-1))
                        ms[r][i].copy_(torch.div(means[i], lrs).neg_().view(SHAPES[i]))
                        us[r][i].zero_()
                lrs = 0.0
            local_count += 1
            if local_count == local_step_scaler:
                local_count, local_interval = 0, min(local_step_clipper, local_interval * 2)
        history.append(([[x.clone() for x in ps[r]] for r in range(world)], full, local))
    return history


def run_opt(ctx, cls, steps, opt=None, params=None, start=1, **kw):
    if params is None:
        params = [torch.nn.Parameter(p + ctx.rank) for p in init_params()]
    if opt is None:
        opt = cls(params, **kw)
    out = []
    for t in range(start, start + steps):
        for p, g in zip(params, grads_of(t, ctx.world)[ctx.rank]):
            p.grad = g.clone()
        opt.step()
        out.append([p.detach().clone() for p in params])
    return opt, params, out


def reload(opt, params, cls, kw, own_params: bool = False):
    """``(opt2, params2, sd)``: a new ``cls(**kw)`` over copies of ``params`` with ``opt``'s state dict ``sd``, through
    a ``torch.save`` / ``torch.load`` round trip. ``own_params``: each rank's own parameters put back after the
    constructor's broadcast (between synchronisations the ranks' parameters differ)."""
    import io

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = cls(params2, **kw)
    if own_params:
        with torch.no_grad():
            for q, p in zip(params2, params):
                q.copy_(p)
    opt2.load_state_dict(sd)
    return opt2, params2, sd


@case
def zero_one_adam_matches_reference(ctx):
    import lowmemopt

    steps = 16
    phases = []
    for extra in ({}, {"bias_correction": False}):
        kw = dict(ZO, **extra)
        ref = reference_zero_one_adam(steps, ctx.world, **kw)
        opt, params, out = run_opt(ctx, lowmemopt.ZeroOneAdam, steps, **kw)
        for t, (got, (ps, full, local)) in enumerate(zip(out, ref), 1):
            phases.append("F" if full else "L" if local else "C")
            for i, (a, b) in enumerate(zip(got, ps[ctx.rank])):
                same(a, b, f"{extra} step {t} param {i}")
    # the schedule the reference ran: variance steps thin out, local steps follow (not a trivial run)
    assert phases[:steps] == list("FFCFCF") + ["L"] * (steps - 6), phases


@case
def exp_avg_mask_multiplies_the_compressed_mean(ctx):
    """DeepSpeed's ``exp_avg_mask`` group key: the compressed means of that group (1-bit Adam's momentum, 0/1 Adam's
    variance-phase gradient and synchronised update) times the mask, against the references; masked momentum stays
    exactly zero; a loaded state dict leaves each group its own mask; a mask that does not fit is refused."""
    import io

    import lowmemopt

    mask = torch.ones(16, 16)
    mask[9:] = 0
    masks = [None, None, mask]
    for cls, kw, ref in (
        (
            lowmemopt.OnebitAdam,
            KW,
            lambda: [
                ps
                for ps, _, _ in reference_onebit_adam(
                    7, ctx.world, KW["lr"], KW["betas"], KW["eps"], KW["weight_decay"], KW["freeze_step"], masks=masks
                )
            ],
        ),
        (
            lowmemopt.ZeroOneAdam,
            ZO,
            lambda: [ps[ctx.rank] for ps, _, _ in reference_zero_one_adam(12, ctx.world, masks=masks, **ZO)],
        ),
    ):
        want = ref()
        params = [torch.nn.Parameter(p + ctx.rank) for p in init_params()]
        groups = [{"params": params[:2]}, {"params": params[2:], "exp_avg_mask": mask}]
        opt, _, out = run_opt(ctx, cls, len(want), params=params, opt=cls(groups, **kw))
        for t, (got, ps) in enumerate(zip(out, want), 1):
            for i, (a, b) in enumerate(zip(got, ps)):
                same(a, b, f"{cls.__name__} step {t} param {i}")
        if cls is lowmemopt.OnebitAdam:
            m = opt.state[params[2]]["exp_avg"]
            assert torch.all(m[9:] == 0) and torch.any(m[:9] != 0), m
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        for own in (None, torch.ones(16)):
            buf.seek(0)
            fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
            other = cls(
                [{"params": fresh[:2]}, dict({"params": fresh[2:]}, **({} if own is None else {"exp_avg_mask": own}))],
                **kw,
            )
            other.load_state_dict(torch.load(buf, weights_only=True))
            assert other.param_groups[1].get("exp_avg_mask") is own
    for bad, err in (
        (torch.ones(3), ValueError),
        ([1.0], TypeError),
        (torch.ones(16, 16, dtype=torch.int64), TypeError),
    ):
        try:
            lowmemopt.OnebitAdam([{"params": [torch.nn.Parameter(torch.zeros(16, 16))], "exp_avg_mask": bad}])
        except err as e:
            assert "exp_avg_mask" in str(e), e
        else:
            raise AssertionError(f"exp_avg_mask={bad!r} was accepted")


@case
def zero_one_adam_resume_and_quantized(ctx):
    """Resume in the local phase (counters, accumulators, error buffers) bit for bit; 8- and 4-bit m and v through
    the whole schedule with replicas equal at synchronisations."""
    import lowmemopt

    for bits in (32, 8, 4):
        kw = dict(ZO, state_bits=bits, min_quant_numel=64, block_size=64)
        _, _, whole = run_opt(ctx, lowmemopt.ZeroOneAdam, 14, **kw)
        opt, params, first = run_opt(ctx, lowmemopt.ZeroOneAdam, 9, **kw)
        opt2, params2, _ = reload(opt, params, lowmemopt.ZeroOneAdam, kw, own_params=True)
        for p, q in zip(params, params2):
            for key, value in opt.state[p].items():
                other = opt2.state[q][key]
                if isinstance(value, torch.Tensor):
                    same(other, value, f"loaded {key}")
                else:
                    assert value == other, (key, value, other)
        assert opt2._stage.counters == opt._stage.counters, (opt2._stage.counters, opt._stage.counters)
        for key, (lay, _, w, s) in opt._stage.buckets.items():
            lay2, _, w2, s2 = opt2._stage.buckets[key]
            assert lay == lay2
            same(w2, w, "worker error")
            same(s2, s, "server error")
        _, _, rest = run_opt(ctx, lowmemopt.ZeroOneAdam, 5, opt=opt2, params=params2, start=10)
        for t, (a, b) in enumerate(zip(first + rest, whole), 1):
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{bits}-bit resumed 0/1 Adam, step {t} param {i}")
        # step 12 synchronises (local interval 4 from step 11): replicas agree, to the rounding of p - u
        for t in whole[11]:
            got = [torch.empty_like(t) for _ in range(ctx.world)]
            dist.all_gather(got, t)
            for x in got:
                torch.testing.assert_close(x, t, rtol=0, atol=1e-6)
            assert not torch.equal(whole[10][0], whole[11][0])


# ---------------------------------------------------------------------------------------------------------------------
# 1-bit LAMB against the paper's algorithm (Li et al. 2021, Algorithm 1, with DeepSpeed's coefficient rules)

LB = dict(
    lr=1e-2,
    betas=(0.9, 0.99),
    eps=1e-8,
    weight_decay=0.01,
    freeze_step=3,
    max_coeff=10.0,
    min_coeff=0.01,
    coeff_beta=0.9,
    factor_max=4.0,
    factor_min=0.5,
    factor_threshold=0.1,
)


def reference_onebit_lamb(
    steps,
    world,
    lr,
    betas,
    eps,
    weight_decay,
    freeze_step,
    max_coeff,
    min_coeff,
    coeff_beta,
    factor_max,
    factor_min,
    factor_threshold,
    bias_correction=True,
):
    b1, b2 = betas
    n = len(SHAPES)
    numels = [math.prod(s) for s in SHAPES]
    ps = init_params()
    ms = [torch.zeros(s) for s in SHAPES]
    vs = [torch.zeros(s) for s in SHAPES]
    fresh = [torch.zeros(s) for s in SHAPES]
    frozen = [torch.zeros(()) for _ in SHAPES]
    last = [torch.zeros(()) for _ in SHAPES]
    scaling = None
    werr = [[torch.zeros(sim_padded(k, world, 8)) for k in numels] for _ in range(world)]
    serr = [[torch.zeros(sim_padded(k, world, 8) // world) for k in numels] for _ in range(world)]
    history = []
    for t in range(1, steps + 1):
        g = grads_of(t, world)
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2s = math.sqrt(1 - b2 ** min(t, freeze_step)) if bias_correction else 1.0
        fcs = math.sqrt(1 - b2**t) if bias_correction else 1.0
        if t <= freeze_step:
            for i in range(n):
                avg = g[0][i]
                for r in range(1, world):
                    avg = avg + g[r][i]
                avg = avg / world
                ms[i].mul_(b1).add_(avg, alpha=1 - b1)
                vs[i].mul_(b2).addcmul_(avg, avg, value=1 - b2)
                if t == freeze_step:
                    fresh[i].copy_(vs[i])
                u = torch.div(ms[i], vs[i].sqrt().div_(bc2s).add_(eps))
                if bc1 != 1.0:
                    u.div_(bc1)
                u.add_(ps[i], alpha=weight_decay)
                wn, un = torch.linalg.vector_norm(ps[i]), torch.linalg.vector_norm(u)
                if wn > 0 and un > 0:
                    c = (wn / un).clamp(min_coeff, max_coeff)
                else:
                    c = torch.tensor(1.0)
                if c != 1.0:
                    frozen[i] = frozen[i] * coeff_beta + c * (1 - coeff_beta)
                ps[i].add_(u.mul_(c * -lr))
        else:
            if scaling is None:
                rms = [torch.linalg.vector_norm(m) / math.sqrt(m.numel()) for m in ms]
                united = torch.stack(rms).mean()
                scaling = [united / x for x in rms]
            msgs = [
                [ms[i].mul(b1).add_(g[r][i], alpha=1 - b1).reshape(-1).mul_(scaling[i]) for i in range(n)]
                for r in range(world)
            ]
            means = sim_allreduce(msgs, werr, serr, numels, world)
            for i in range(n):
                new_m = means[i].view(SHAPES[i]) / scaling[i]
                rebuilt = new_m.sub(ms[i], alpha=b1).div_(1 - b1)
                ms[i].copy_(new_m)
                fresh[i].mul_(b2).addcmul_(rebuilt, rebuilt, value=1 - b2)
                d = vs[i].sqrt().div_(bc2s).add_(eps)
                u0 = torch.div(ms[i], d)
                if bc1 != 1.0:
                    u0.div_(bc1)
                u = u0.add(ps[i], alpha=weight_decay)
                f = d.div_(fresh[i].sqrt().div_(fcs).add_(eps)).max()
                un = torch.linalg.vector_norm(u)
                ratio = (torch.linalg.vector_norm(u0) / un).clamp(max=1.0)
                f = f * ratio + (1.0 - ratio)
                prev = last[i] if last[i] != 0 else torch.tensor(1.0)
                f = f.clamp(factor_min, factor_max)
                f = torch.minimum(f, prev * (1.0 + factor_threshold))
                f = torch.maximum(f, prev * (1.0 - factor_threshold))
                last[i] = f
                ps[i].add_(u.mul_(frozen[i] * f * -lr))
        history.append([p.clone() for p in ps])
    return history


@case
def onebit_lamb_matches_reference(ctx):
    import lowmemopt

    assert lowmemopt.OnebitLamb is lowmemopt.OnebitLAMB
    for extra in ({}, {"bias_correction": False}):
        kw = dict(LB, **extra)
        ref = reference_onebit_lamb(7, ctx.world, **kw)
        opt, params, out = run_opt(ctx, lowmemopt.OnebitLAMB, 7, **kw)
        for t, (got, want) in enumerate(zip(out, ref), 1):
            for i, (a, b) in enumerate(zip(got, want)):
                same(a, b, f"{extra} step {t} param {i}")
        replicas_equal(ctx, [p.detach() for p in params], f"{extra} parameters")


@case
def onebit_lamb_resume_and_quantized(ctx):
    import lowmemopt

    for bits in (32, 8, 4):
        kw = dict(LB, state_bits=bits, min_quant_numel=64, block_size=64)
        _, _, whole = run_opt(ctx, lowmemopt.OnebitLAMB, 8, **kw)
        opt, params, first = run_opt(ctx, lowmemopt.OnebitLAMB, 5, **kw)
        opt2, params2, _ = reload(opt, params, lowmemopt.OnebitLAMB, kw)
        _, _, rest = run_opt(ctx, lowmemopt.OnebitLAMB, 3, opt=opt2, params=params2, start=6)
        for t, (a, b) in enumerate(zip(first + rest, whole), 1):
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{bits}-bit resumed 1-bit LAMB, step {t} param {i}")
        replicas_equal(ctx, [p.detach() for p in params2], f"{bits}-bit replicas")
        if bits != 32:
            _, _, run32 = run_opt(ctx, lowmemopt.OnebitLAMB, 8, **LB)
            for a, b in zip(whole[-1], run32[-1]):
                err = ((a - b).norm() / b.norm()).item()
                assert err < 0.05, f"{bits}-bit: relative distance to 32-bit {err}"


@case
def save_state_one_file_per_rank(ctx):
    """lowmemopt.save_state writes one file per rank (m, v, the error buffers, the schedule); load_state resumes
    1-bit Adam and 0/1 Adam bit for bit."""
    import os

    import lowmemopt

    tmp = os.path.join(ctx.out, "ckpt")
    os.makedirs(tmp, exist_ok=True)
    for cls, kw, first_steps, total in [
        (lowmemopt.OnebitAdam, dict(KW, state_bits=8, min_quant_numel=64, block_size=64), 5, 8),
        (lowmemopt.ZeroOneAdam, ZO, 9, 13),
    ]:
        path = os.path.join(tmp, f"{cls.__name__}.safetensors")
        _, _, whole = run_opt(ctx, cls, total, **kw)
        opt, params, first = run_opt(ctx, cls, first_steps, **kw)
        lowmemopt.save_state(opt, path)
        dist.barrier()
        expect = os.path.join(tmp, f"{cls.__name__}.rank{ctx.rank:05d}-of-{ctx.world:05d}.safetensors")
        assert os.path.exists(expect), os.listdir(tmp)
        params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = cls(params2, **kw)
        with torch.no_grad():
            for q, p in zip(params2, params):
                q.copy_(p)
        lowmemopt.load_state(opt2, path)
        _, _, rest = run_opt(ctx, cls, total - first_steps, opt=opt2, params=params2, start=first_steps + 1)
        for t, (a, b) in enumerate(zip(first + rest, whole), 1):
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{cls.__name__} from save_state, step {t} param {i}")


# ---------------------------------------------------------------------------------------------------------------------
# harness


class Ctx:
    def __init__(self, rank: int, world: int, out: str):
        self.rank, self.world, self.out = rank, world, out


def _worker(rank: int, world: int, port: int, out: str, names: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    ctx = Ctx(rank, world, out)
    run_cases(CASES, names, ctx, out, rank)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="")
    args = ap.parse_args(argv)
    os.environ.setdefault("LOWMEMOPT_COMPILE", "0")
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases: {unknown}")
    mp.spawn(_worker, args=(args.world_size, free_port(), args.out, names), nprocs=args.world_size)


if __name__ == "__main__":
    main()
