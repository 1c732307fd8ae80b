"""Distributed SGD recipes (DDP + lowmemopt, PowerSGD, sparsified error feedback, gossip averaging), run in spawned
processes by ``tests/test_distsgd.py`` (gloo on CPU).

    python tests/distsgd_worker.py --world-size 2 --out DIR [--cases a,b,...]

Every case runs on every rank inside one process group; each rank writes ``DIR/rank<r>.json``:
``{case: "ok" | traceback}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn import free_port, run_cases
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import lowmemopt
from lowmemopt.distributed.gossip import GossipAverager, mixing_weights, ring, torus
from lowmemopt.distributed.sparsified import SparsifiedState, sparsified_hook

CASES = {}
FOUR_RANK_CASES = [
    "ddp_equals_manual_allreduce",
    "sparsified_error_feedback",
    "gossip_ring",
    "gossip_irregular_graph",
    "gossip_post_local_sgd",
]


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


# every lowmemopt optimizer (name, kwargs); a name this build lacks is left out
OPTIMIZERS = [
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0)),
    ("Adam", dict(lr=1e-2, state_bits=4, block_size=16, min_quant_numel=0)),
    ("SGD", dict(lr=5e-2, momentum=0.9, nesterov=True)),
    ("Lion", dict(lr=1e-3, weight_decay=0.1)),
    ("LAMB", dict(lr=1e-2)),
    ("LARS", dict(lr=0.1, momentum=0.9)),
    ("Adafactor", dict(beta1=0.9)),
    ("AdafactorTorch", dict(lr=1e-2)),
    ("CAME", dict(lr=1e-3)),
    ("SignSGD", dict(lr=1e-3, momentum=0.9)),
]


def optimizers(ctx):
    """Every optimizer on 2 ranks; on 4 (a check of summation order and topology, 4 processes on a small CI box) two."""
    chosen = OPTIMIZERS if ctx.world == 2 else [OPTIMIZERS[0], OPTIMIZERS[3]]
    return [(getattr(lowmemopt, n), kw) for n, kw in chosen if hasattr(lowmemopt, n)]


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 23), torch.nn.Tanh(), torch.nn.Linear(23, 5))


def batches(steps, world, n=4, seed=3):
    """``steps`` batches of ``n`` rows per rank (each rank takes its slice)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n * world, 12, generator=gen), torch.randn(n * world, 5, generator=gen)) for _ in range(steps)]


def loss_on(model, batch, rank, world):
    x, y = batch
    n = x.shape[0] // world
    return torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])


def same_on_all_ranks(tensors, what):
    for t in tensors:
        other = t.detach().clone()
        dist.broadcast(other, src=0)
        check(torch.equal(other, t.detach()), f"{what}: replicas differ")


def ddp_run(ctx, cls, kw, steps, hook=None, state=None, dtype=torch.float32, **ddp_kw):
    model = DDP(mlp().to(dtype), **ddp_kw)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = cls(model.parameters(), **kw)
    for x, y in batches(steps, ctx.world):
        opt.zero_grad()
        loss_on(model, (x.to(dtype), y.to(dtype)), ctx.rank, ctx.world).backward()
        opt.step()
    return [p.detach() for p in model.module.parameters()]


def _where(a, b):
    d = (a.detach().float() - b.detach().float()).abs()
    return f"{int((d > 0).sum())} of {d.numel()} differ, max {float(d.max()):.3g}"


class Ctx:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world


# ---------------------------------------------------------------------------------------------------------------------
# centralized: DDP + a lowmemopt optimizer is mlbench's CentralizedSGD / CentralizedAdam / CustomCentralizedOptimizer


@case
def ddp_equals_manual_allreduce(ctx):
    """DDP + optimizer == plain module + all_reduce(SUM) of the flattened gradients / world + the same optimizer (what
    mlbench's centralized optimizers do), bit for bit, for every optimizer.

    Bit for bit needs the same summation order, so the flat buffer is laid out as DDP's one bucket: parameter order
    in the first iteration, gradient-ready (reverse) order once DDP has rebuilt its buckets. (With 2 ranks any
    order gives the same bits: a + b == b + a; with 4, gloo's ring sums each chunk starting at another rank.)"""
    for cls, kw in optimizers(ctx):
        got = ddp_run(ctx, cls, kw, 4)
        model = mlp()
        opt = cls(model.parameters(), **kw)
        for t, batch in enumerate(batches(4, ctx.world)):
            opt.zero_grad()
            loss_on(model, batch, ctx.rank, ctx.world).backward()
            grads = [p.grad for p in model.parameters()]
            grads = grads if t == 0 else grads[::-1]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= ctx.world
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            opt.step()
        for a, b in zip(got, model.parameters()):
            check(torch.equal(a, b.detach()), f"{cls.__name__} {kw}: DDP vs manual all-reduce: {_where(a, b)}")
        same_on_all_ranks(got, f"DDP {cls.__name__}")


@case
def powersgd_lossless_rank(ctx):
    """DDP + PowerSGDState(rank >= every matrix's smaller side, every tensor compressed) == plain DDP (to fp32
    rounding), with lowmemopt optimizers; a rank-1 PowerSGD run keeps the replicas identical."""
    for cls, kw in [(lowmemopt.SGD, dict(lr=5e-2, momentum=0.9)), (lowmemopt.AdamW, dict(lr=1e-3))]:
        plain = ddp_run(ctx, cls, kw, 6)
        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=32,
            start_powerSGD_iter=2,
            min_compression_rate=0,
            use_error_feedback=True,
            warm_start=True,
        )
        got = ddp_run(ctx, cls, kw, 6, powerSGD_hook, state)
        for a, b in zip(got, plain):
            check(torch.allclose(a, b, rtol=1e-5, atol=2e-6), f"PowerSGD lossless {cls.__name__}: {_where(a, b)}")
        check(state.iter == 6 and state.error_dict, "PowerSGD never compressed")
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    got = ddp_run(
        ctx, lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0), 5, powerSGD_hook, state
    )
    same_on_all_ranks(got, "PowerSGD rank 1 + AdamW 8-bit")


# ---------------------------------------------------------------------------------------------------------------------
# sparsified SGD with memory


class Recorder:
    """Wraps sparsified_hook: records each bucket's local gradient, its memory before and after, and the average that
    DDP receives."""

    def __init__(self, state):
        self.state, self.log = state, []

    def hook(self, state, bucket):
        index = bucket.index()
        before = state.error_dict.get(index)
        before = None if before is None else before.clone()
        grad = bucket.buffer().clone()
        compressing = state.iter >= state.start_iter
        entry = dict(index=index, grad=grad, before=before, compressing=compressing)
        self.log.append(entry)

        def done(fut):
            out = fut.value()
            entry["out"] = out.clone()
            if compressing:
                entry["after"] = state.error_dict[index].clone()
            return out

        return sparsified_hook(state, bucket).then(done)


@case
def sparsified_error_feedback(ctx):
    """Per rank and bucket: what was sent + the memory = the sum of the gradients; at most k coordinates sent (top-k:
    the largest of m + g; random: k distinct; block: k consecutive); DDP's gradient is the ranks' average of what they
    sent; replicas identical. With bf16 gradients the values go as bf16 and the memory keeps their rounding."""
    runs = [("top", torch.float32), ("random", torch.float32), ("block", torch.float32), ("top", torch.bfloat16)]
    for method, dtype in runs if ctx.world == 2 else runs[:3]:
        state = SparsifiedState(ratio=0.1, method=method, seed=5)
        rec = Recorder(state)
        steps = 7
        got = ddp_run(ctx, lowmemopt.SGD, dict(lr=5e-2, momentum=0.9), steps, rec.hook, state, dtype)
        method = f"{method} {dtype}"
        same_on_all_ranks(got, f"sparsified {method}")
        check(state.iter == steps, f"{method}: iter {state.iter}")
        totals = {}
        chosen = []
        for e in rec.log:
            if not e["compressing"]:
                continue
            n = e["grad"].numel()
            k = state.k_for(n)
            before = e["before"] if e["before"] is not None else torch.zeros(n)
            acc = before + e["grad"]  # the hook's fp32 a_t, the same op
            sent = acc - e["after"]  # exact: the values sent are acc rounded to the gradient's dtype
            nz = sent.nonzero().flatten()
            check(len(nz) <= k, f"{method}: {len(nz)} sent, k {k}")
            check(torch.equal(sent[nz], acc[nz].to(dtype).float()), f"{method}: sent values are not a_t's")
            rest = torch.ones(n, dtype=torch.bool)
            rest[nz] = False
            check(torch.equal(e["after"][rest], acc[rest]), f"{method}: memory lost unsent coordinates")
            if method.startswith("top"):
                check(float(acc[nz].abs().min()) >= float(acc[rest].abs().max()), "top-k did not send the largest")
            if method.startswith("block") and len(nz):
                check(int(nz[-1] - nz[0]) < k, f"block: sent coordinates {nz.tolist()} span more than k = {k}")
            mask = torch.zeros(n)
            mask[nz] = 1
            chosen.append(mask)
            everyone = [torch.empty_like(sent) for _ in range(ctx.world)]
            dist.all_gather(everyone, sent)
            avg = torch.zeros(n, dtype=dtype)
            for s in everyone:
                avg += s.to(dtype)
            avg /= ctx.world
            check(
                torch.equal(avg, e["out"]), f"{method}: DDP's gradient is not the average sent: {_where(avg, e['out'])}"
            )
            t = totals.setdefault(
                e["index"], dict(sent=torch.zeros(n, dtype=torch.float64), grad=torch.zeros(n, dtype=torch.float64))
            )
            t["sent"] += sent.double()
            t["grad"] += e["grad"].double()  # (bf16 gradients: the memory keeps the rounding of what is sent)
            t["memory"] = e["after"]
        check(totals, f"{method}: nothing was compressed")
        for index, t in totals.items():
            lhs = t["sent"] + t["memory"].double()
            check(
                torch.allclose(lhs, t["grad"], rtol=0, atol=1e-5),
                f"{method} bucket {index}: sum sent + memory != sum of gradients: {_where(lhs, t['grad'])}",
            )
        if method.startswith("random"):
            mine = torch.cat(chosen)
            other = mine.clone()
            dist.broadcast(other, src=0)
            check(ctx.rank == 0 or not torch.equal(mine, other), "random-k: ranks drew the same coordinates")
        rate, before_b, sent_b = state.compression_stats()
        size = torch.finfo(dtype).bits // 8
        compressed = [e["grad"].numel() for e in rec.log if e["compressing"]]
        want_sent = sum(
            (1 if method.startswith("block") else state.k_for(n)) * 4 + state.k_for(n) * size for n in compressed
        )
        check(
            (before_b, sent_b) == (sum(compressed) * size, want_sent) and rate == before_b / sent_b,
            f"{method}: compression stats {rate:.2f} ({before_b} -> {sent_b} bytes), want {want_sent} sent",
        )


@case
def sparsified_composes(ctx):
    """The sparsified hook under every lowmemopt optimizer: replicas stay identical; with ratio=1 (nothing kept back)
    the run equals plain DDP to fp32 rounding; several buckets work."""
    for cls, kw in optimizers(ctx):
        got = ddp_run(ctx, cls, kw, 4, sparsified_hook, SparsifiedState(k=20, method="top"))
        same_on_all_ranks(got, f"sparsified {cls.__name__} {kw}")
    for method in ("top", "random", "block"):
        plain = ddp_run(ctx, lowmemopt.SGD, dict(lr=5e-2, momentum=0.9), 5)
        got = ddp_run(
            ctx,
            lowmemopt.SGD,
            dict(lr=5e-2, momentum=0.9),
            5,
            sparsified_hook,
            SparsifiedState(ratio=1.0, method=method),
        )
        for a, b in zip(got, plain):
            check(torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"ratio 1 {method} vs DDP: {_where(a, b)}")
        # several buckets (one memory each, all-gathers in flight together)
        state = SparsifiedState(ratio=0.2, method=method)
        got = ddp_run(ctx, lowmemopt.SGD, dict(lr=5e-2, momentum=0.9), 5, sparsified_hook, state, bucket_cap_mb=4e-4)
        check(len(state.error_dict) > 1, f"{method}: one bucket only ({len(state.error_dict)})")
        same_on_all_ranks(got, f"sparsified {method}, several buckets")


# ---------------------------------------------------------------------------------------------------------------------
# decentralized: gossip averaging


def rank_params(ctx, seed=11):
    gen = torch.Generator().manual_seed(seed + 1000 * ctx.rank)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5, 3), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.zeros_like(p)  # torch's averagers skip parameters without a gradient
    return params


def mean_over_ranks(params, world):
    out = []
    for p in params:
        m = p.detach().double().clone()
        dist.all_reduce(m)
        out.append(m / world)
    return out


def gossip_converges(ctx, topology, what, rounds, **kw):
    params = rank_params(ctx)
    mean = mean_over_ranks(params, ctx.world)
    averager = GossipAverager(topology, **kw)
    for t in range(rounds):
        averager.average_parameters(params)
        if t % 10 and t != rounds - 1:
            continue
        now = mean_over_ranks(params, ctx.world)
        for a, b in zip(now, mean):
            check(
                torch.allclose(a, b, rtol=0, atol=1e-6), f"{what}: the mean moved by {float((a - b).abs().max()):.3g}"
            )
    for p, m in zip(params, mean):
        gap = float((p.detach().double() - m).abs().max())
        check(gap < 1e-5, f"{what}: {gap:.3g} from the mean after {rounds} rounds")


@case
def gossip_ring(ctx):
    gossip_converges(ctx, ring(ctx.world), "ring", 30)
    gossip_converges(ctx, ring(ctx.world)[ctx.rank], "ring, this rank's neighbours", 30)
    if ctx.world == 4:
        gossip_converges(ctx, torus(2, 2), "torus 2 x 2", 30, weights="uniform")
    row = mixing_weights(ring(ctx.world), ctx.rank)
    check(abs(sum(row.values()) - 1) < 1e-12, f"ring row {row}")


@case
def gossip_irregular_graph(ctx):
    """An irregular graph (Metropolis-Hastings weights keep the mean); mlbench's uniform weights are refused there."""
    if ctx.world != 4:
        return
    graph = [[1, 2, 3], [0, 2], [0, 1], [0]]
    gossip_converges(ctx, graph, "irregular", 60)
    cols = [sum(mixing_weights(graph, i)[j] for i in range(4) if j in mixing_weights(graph, i)) for j in range(4)]
    check(max(abs(c - 1) for c in cols) < 1e-12, f"Metropolis weights not doubly stochastic: column sums {cols}")
    for bad, topo in (
        ("uniform weights on an irregular graph", dict(topology=graph, weights="uniform")),
        ("a directed graph", dict(topology=[[1], [2], [0, 1], []])),
        ("a disconnected graph", dict(topology=[[1], [0], [3], [2]])),
    ):
        try:
            GossipAverager(**topo)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad} was accepted")


@case
def gossip_post_local_sgd(ctx):
    """PostLocalSGDOptimizer(lowmemopt optimizer, GossipAverager(period=2, warmup_steps=1)): local steps, then a gossip
    round at steps 1, 3, 5, ...; equals local steps + the mixing computed by hand from all-gathered parameters."""
    graph = ring(ctx.world)
    row = mixing_weights(graph, ctx.rank)
    for cls, kw in [
        (lowmemopt.SGD, dict(lr=5e-2, momentum=0.9)),
        (lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0)),
    ][: 2 if ctx.world == 2 else 1]:
        model, ref = mlp(), mlp()
        opt = PostLocalSGDOptimizer(cls(model.parameters(), **kw), GossipAverager(graph, period=2, warmup_steps=1))
        ref_opt = cls(ref.parameters(), **kw)
        data = batches(6, ctx.world, seed=9)
        for t, batch in enumerate(data):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss_on(m, batch, ctx.rank, ctx.world).backward()
                o.step()
            if t >= 1 and (t - 1) % 2 == 0:
                with torch.no_grad():
                    for p in ref.parameters():
                        everyone = [torch.empty_like(p) for _ in range(ctx.world)]
                        dist.all_gather(everyone, p.detach().contiguous())
                        mixed = everyone[ctx.rank] * row[ctx.rank]
                        for j in sorted(j for j in row if j != ctx.rank):
                            mixed.add_(everyone[j], alpha=row[j])
                        p.copy_(mixed)
            for a, b in zip(model.parameters(), ref.parameters()):
                check(
                    torch.allclose(a, b, rtol=0, atol=1e-7),
                    f"{cls.__name__} step {t}: {_where(a.detach(), b.detach())}",
                )
        check(opt.state_dict()["step"] == 6, "PostLocalSGDOptimizer did not record the averager's step")
        if ctx.world == 2:  # one neighbour with weight 1/2: the gossip round is the exact average
            for p in model.parameters():
                same_on_all_ranks([p], "2-rank gossip after an averaging step")


# ---------------------------------------------------------------------------------------------------------------------


def _worker(rank, world, port, out, names):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    ctx = Ctx(rank, world)
    run_cases(CASES, names, ctx, out, rank)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="lowmemopt-distsgd-")
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("LOWMEMOPT_COMPILE", "0")
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {sorted(CASES)}")
    mp.spawn(_worker, args=(args.world_size, free_port(), out, names), nprocs=args.world_size)
    print(out)


if __name__ == "__main__":
    main()
