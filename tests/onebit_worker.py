"""Cases of ``tests/test_onebit.py``, run in spawned gloo processes (one spawn per world size, every case inside it).

    python tests/onebit_worker.py --world-size 2 --out DIR [--cases a,b,...]

Each rank writes ``DIR/rank<r>.json``: ``{case: "ok" | traceback}``. Every rank computes the inputs of all ranks
(shared seeds), so each checks its own results against a single-process simulation of the N workers written here
from the papers, independently of the library's code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
                term = signs[r][j * chunk:(j + 1) * chunk] * (scales[r] / world)
                c = term if c is None else c + term
            c = c + server_errors[j][i]
            t = torch.linalg.vector_norm(c) / math.sqrt(chunk)
            server_errors[j][i].copy_(c - t * sim_sign(c))
            out[j * chunk:(j + 1) * chunk] = t * sim_sign(c)
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
        sim_w = [[torch.zeros(sim_padded(n, world, a)) for n, a in zip(numels, aligns or [8] * len(numels))]
                 for _ in range(world)]
        sim_s = [[torch.zeros(sim_padded(n, world, a) // world) for n, a in zip(numels, aligns or [8] * len(numels))]
                 for _ in range(world)]
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
    same(serr[:layout.chunks[0]], s0[:layout.chunks[0]], "server error of the non-finite tensor")
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


def reference_onebit_adam(steps, world, lr, betas, eps, wd, freeze, bias_correction=True, eps_inside_sqrt=False):
    """Parameters, m and v after each step: warm-up Adam on averaged gradients, then the local momentum averaged by
    the 1-bit compressed all-reduce with error feedback, variance frozen (Tang et al. 2021, Algorithm 1)."""
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
            msgs = [[ms[i].mul(b1).add_(g[r][i], alpha=1 - b1).reshape(-1) for i in range(len(SHAPES))]
                    for r in range(world)]
            if world > 1:
                means = sim_allreduce(msgs, werr, serr, numels, world)
            else:
                means = msgs[0]
            for i in range(len(SHAPES)):
                ms[i].copy_(means[i].view(SHAPES[i]))
        bc1 = 1 - b1 ** t if bias_correction else 1.0
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
        ref = reference_onebit_adam(7, ctx.world, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"],
                                    kw["freeze_step"], kw.get("bias_correction", True), kw.get("eps_inside_sqrt", False))
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
    import io
    import warnings

    import lowmemopt

    for bits in (32, 8):
        kw = dict(KW, state_bits=bits, min_quant_numel=64, block_size=64)
        _, _, whole = run_onebit(ctx, 8, **kw)
        opt, params, first = run_onebit(ctx, 5, **kw)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True)
        params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = lowmemopt.OnebitAdam(params2, **kw)
        opt2.load_state_dict(sd)
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
    for kw, word in [(dict(amsgrad=True), "amsgrad"), (dict(max_grad_norm=1.0), "max_grad_norm"),
                     (dict(freeze_step=0), "freeze_step"), (dict(paged=True), "paged"),
                     (dict(capturable=True), "capturable")]:
        try:
            lowmemopt.OnebitAdam(p, **kw)
        except ValueError as e:
            assert word in str(e), (kw, e)
        else:
            raise AssertionError(f"{kw} accepted")
    for params, word in [([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], "fp32"),
                         ([{"params": p, "rank": 2}], "GaLore")]:
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
    try:
        lowmemopt.OnebitAdam(p)._step_some([])
    except ValueError as e:
        assert "step_in_backward" in str(e), e
    else:
        raise AssertionError("per-layer updates accepted")


# ---------------------------------------------------------------------------------------------------------------------
# harness


class Ctx:
    def __init__(self, rank: int, world: int, out: str):
        self.rank, self.world, self.out = rank, world, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, names: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    ctx = Ctx(rank, world, out)
    results = {}
    for name in names:
        try:
            CASES[name](ctx)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
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
