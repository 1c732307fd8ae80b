"""Distributed test cases, run in spawned processes by ``tests/test_distributed.py`` (gloo on CPU, nccl on CUDA).

    python tests/dist_worker.py --world-size 2 --out DIR [--backend gloo|nccl] [--cases a,b,...]

Every case runs on every rank inside one process group (starting processes costs seconds, so the cases share them).
Each rank writes ``DIR/rank<r>.json``: ``{case: "ok" | traceback}``. A single-process reference runs beside each
distributed run, in the same process, on plain tensors with the same gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import itertools
import os
import sys
import tempfile

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from spawn import free_port, run_cases  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

import lowmemopt  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


class Ctx:
    def __init__(self, rank: int, world: int, device: torch.device, out: str):
        self.rank, self.world, self.device, self.out = rank, world, device, out
        self.mesh = init_device_mesh(device.type, (world,))


# ---------------------------------------------------------------------------------------------------------------------
# problems: full tensors, their shards, gradients


def full_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def targets(shapes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def grad_for(ref: torch.Tensor, target: torch.Tensor, step: int, i: int, noise: float = 0.5) -> torch.Tensor:
    """Full-rank gradient: pull towards a target plus step-seeded Gaussian noise (a function of the reference param)."""
    gen = torch.Generator().manual_seed(7919 * step + 104729 * i + 17)
    return (ref.detach().float().cpu() - target) + noise * torch.randn(ref.shape, generator=gen)


class Holder(torch.nn.Module):
    def __init__(self, tensors):
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))


def fsdp_params(ctx, tensors, mesh=None):
    """FSDP2-sharded (Shard(0), padded uneven shards; HSDP on a 2-D mesh) parameters holding ``tensors``; returns
    (module, params)."""
    module = Holder([t.to(ctx.device) for t in tensors])
    fully_shard(module, mesh=ctx.mesh if mesh is None else mesh)
    return module, list(module.parameters())


def dtensor_params(ctx, tensors, placements, mesh=None):
    mesh = ctx.mesh if mesh is None else mesh
    return [torch.nn.Parameter(distribute_tensor(t.to(ctx.device), mesh, pl)) for t, pl in zip(tensors, placements)]


def plain_params(tensors):
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def set_grad(p, g):
    if isinstance(p, DTensor):
        p.grad = distribute_tensor(g.to(p.device_mesh.device_type), p.device_mesh, p.placements)
    else:
        p.grad = g.clone().to(p.device)


def step_both(opt, params, ref_opt, ref_params, tgts, steps, start=0):
    """``steps`` steps of the sharded and the reference optimizer with the same full gradients (computed from the
    reference's parameters)."""
    for t in range(start, start + steps):
        for i, (p, r, tg) in enumerate(zip(params, ref_params, tgts)):
            g = grad_for(full(r), tg, t, i)
            set_grad(r, g)
            set_grad(p, g)
        opt.step()
        ref_opt.step()


def full(t):
    return t.full_tensor().cpu() if isinstance(t, DTensor) else t.detach().cpu()


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def _where(a, b):
    """Where two tensors differ: count, the largest difference, its index and both values (for a machine we cannot
    reproduce on: which element, and whether it is one ulp)."""
    d = (a - b).abs()
    j = int(d.flatten().argmax())
    return (
        f"{int((d > 0).sum())} of {d.numel()} elements, max |d| {float(d.max()):.3g} at flat index {j}: "
        f"{float(a.flatten()[j])!r} vs {float(b.flatten()[j])!r}"
    )


def compare(params, ref_params, what, exact=False, rtol=1e-5, atol=1e-6):
    for i, (p, r) in enumerate(zip(params, ref_params)):
        a, b = full(p).float(), full(r).float()
        if exact:
            check(torch.equal(a, b), f"{what}: param {i} {tuple(b.shape)} differs, {_where(a, b)}")
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: param {i}: {m}")


def dense_state(opt, p, ref=False):
    """{slot: full fp32 tensor} of one param: the reference's state decoded, or the sharded state_dict's DTensors."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    if ref:
        state = opt.state[p]
        out = {}
        for name, slot in opt._state_slots(group, p).items():
            shape = p.shape if slot.shape is None else torch.Size(slot.shape)
            fmt = lowmemopt.quant.formats.format_of(state, name)
            out[name] = fmt.decode(state, name, 0, shape.numel(), slot.signed, group["block_size"]).view(shape).cpu()
        out.update({k: v.cpu() for k, v in state.items() if k.startswith("galore.") and isinstance(v, torch.Tensor)})
        return out
    sd = opt.state_dict()
    index = next(i for i, q in enumerate(q for g in opt.param_groups for q in g["params"]) if q is p)
    return {k: full(v).float() for k, v in sd["state"][index].items() if isinstance(v, torch.Tensor)}


#: reduction-derived state's absolute slack as a fraction of the slot's largest value (16 fp32 ulps)
STATE_CANCEL = 2.0**-20


def compare_state(opt, params, ref_opt, ref_params, what, exact=False, rtol=1e-5, atol=1e-6):
    for i, (p, r) in enumerate(zip(params, ref_params)):
        mine, ref = dense_state(opt, p), dense_state(ref_opt, r, ref=True)
        check(set(mine) == set(ref), f"{what}: param {i}: slots {sorted(mine)} vs reference {sorted(ref)}")
        check(opt.state[p]["step"] == ref_opt.state[r]["step"], f"{what}: param {i}: step counts differ")
        for k in ref:
            a, b = mine[k], ref[k]
            check(a.shape == b.shape, f"{what}: param {i} slot {k}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            if exact:
                check(torch.equal(a, b), f"{what}: param {i} slot {k} differs: {_where(a, b)}")
            else:
                # a sum over shards rounds in another order: a value that cancels (b1 m + (1-b1) u, u from a
                # reduction) keeps the absolute error of its terms, a few ulps of the slot's scale (STATE_CANCEL)
                scale = float(b.abs().max()) if b.numel() else 0.0
                torch.testing.assert_close(
                    a, b, rtol=rtol, atol=max(atol, STATE_CANCEL * scale), msg=lambda m: f"{what}: param {i} {k}: {m}"
                )


# shapes that shard unevenly over 2 ranks (Shard(0): 4+3, 5+4, 3+2 conv filters, 4+3, and 1+0: an empty shard)
UNEVEN = [(7, 5), (9, 3), (5, 3, 3, 3), (7,), (1, 6)]


def run_pair(ctx, cls, kwargs, shapes, steps, placements=None, mesh=None):
    """Sharded (FSDP2, or DTensors with ``placements``) and single-process runs of ``cls(**kwargs)``."""
    tensors = full_params(shapes)
    if placements is None:
        _, params = fsdp_params(ctx, tensors, mesh)
    else:
        params = dtensor_params(ctx, tensors, placements, mesh)
    ref_params = plain_params(tensors)
    opt, ref_opt = cls(params, **kwargs), cls(ref_params, **kwargs)
    step_both(opt, params, ref_opt, ref_params, targets(shapes), steps)
    return opt, params, ref_opt, ref_params


# ---------------------------------------------------------------------------------------------------------------------
# element-wise optimizers


@contextlib.contextmanager
def torch_paths_only():
    """Step through the torch (eager) path only, not the native CPU kernels (lowmemopt.cpu) or the compiled path: so
    that a bit-exact comparison covers the torch path too (the native kernels are tested as they run by default)."""
    from lowmemopt import compiled, cpu

    saved = cpu.ENABLED, compiled.ENABLED
    cpu.ENABLED = compiled.ENABLED = False
    try:
        yield
    finally:
        cpu.ENABLED, compiled.ENABLED = saved


ELEMENTWISE = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.05)),
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
]


@case
def elementwise_32_16_exact(ctx):
    """32- and 16-bit state: the local shard's element-wise step is the single process's, bit for bit, on the torch
    path and on the native CPU kernels (which step a shard's ragged tail as they step the whole tensor's rows)."""
    for cls, kw in ELEMENTWISE:
        for bits, native in ((32, False), (16, False), (32, True), (16, True)):
            what = f"{cls.__name__} {bits}-bit" + (" native CPU kernels" if native else "")
            with contextlib.nullcontext() if native else torch_paths_only():
                opt, params, ref_opt, ref_params = run_pair(
                    ctx, cls, dict(kw, state_bits=bits, min_quant_numel=0), UNEVEN, 10
                )
            compare(params, ref_params, what, exact=True)
            compare_state(opt, params, ref_opt, ref_params, what, exact=True)
            local = params[0].to_local()
            st = opt.state[params[0]]
            slot = next(k for k in st if k != "step")
            check(
                st[slot].shape == local.shape and not isinstance(st[slot], DTensor),
                f"{what}: state is not a plain tensor on the local shard: {type(st[slot])} {tuple(st[slot].shape)}",
            )


@case
def bf16_stochastic_global_index(ctx):
    """bf16 parameters with ``bf16_update="stochastic"``: a shard hashes its elements' indices in the whole parameter
    and its ranks agree on the seed, so FSDP2 shards (contiguous ranges) and column shards (Shard(1): an index per
    element) round exactly as one process with that seed does; on the torch path and the native CPU kernels."""
    shapes = UNEVEN[:2] + [(6, 10)]
    tensors = [t.bfloat16() for t in full_params(shapes)]
    tgts = targets(shapes)
    for cls, kw in ELEMENTWISE:
        kw = dict(kw, lr=0.05, bf16_update="stochastic")
        for layout, native in (("fsdp2", False), ("fsdp2", True), ("shard1", False)):
            what = f"{cls.__name__} bf16 stochastic {layout}" + (" native CPU kernels" if native else "")
            ref_params = plain_params(tensors)
            if layout == "fsdp2":
                _, params = fsdp_params(ctx, tensors)
            else:
                params = dtensor_params(ctx, tensors, [[Shard(1)]] * len(tensors))
            with contextlib.nullcontext() if native else torch_paths_only():
                opt, ref_opt = cls(params, **kw), cls(ref_params, **kw)
                for t in range(4):  # the reference's gradients; torch's generator reseeded before the seeds are drawn
                    for i, (p, r, tg) in enumerate(zip(params, ref_params, tgts)):
                        g = grad_for(full(r).float(), tg, t, i).bfloat16()
                        set_grad(p, g)
                        set_grad(r, g)
                    for o in (opt, ref_opt):
                        if t == 0:
                            torch.manual_seed(1234)  # every rank draws the one-process run's seeds
                        o.step()
            compare(params, ref_params, what, exact=True)
            moved = sum(int((full(p).float() != t.float()).sum()) for p, t in zip(params, tensors))
            check(moved > 0, f"{what}: nothing moved")
    # ranks that draw different seeds agree on one (the largest), so shards of a parameter share one stream
    ref = plain_params(tensors)
    _, params = fsdp_params(ctx, tensors)
    opt = lowmemopt.AdamW(params, lr=0.05, bf16_update="stochastic")
    for i, (p, r, tg) in enumerate(zip(params, ref, tgts)):
        set_grad(p, grad_for(full(r).float(), tg, 0, i).bfloat16())
    torch.manual_seed(100 + ctx.rank)
    opt.step()
    seeds = torch.tensor([opt.state[p]["bf16_update.seed"] for p in params], dtype=torch.int64)
    gathered = [torch.empty_like(seeds) for _ in range(ctx.world)]
    dist.all_gather(gathered, seeds)
    check(all(torch.equal(g, gathered[0]) for g in gathered), f"seeds differ across ranks: {gathered}")


@case
def elementwise_8bit_block_aligned_exact(ctx):
    """8- and 4-bit state, every shard a whole number of blocks: the blocks are the single process's, so results are
    equal (4 bits: a shard's bytes are the single process's bytes, blocks being byte-aligned)."""
    shapes = [(8, 32), (6, 48)]  # shards of 128 and 144 elements: 8 and 9 blocks of 16
    for cls, kw in [(c, dict(k, state_bits=b)) for c, k in ELEMENTWISE for b in (8, 4)]:
        what = f"{cls.__name__} {kw['state_bits']}-bit aligned"
        opt, params, ref_opt, ref_params = run_pair(ctx, cls, dict(kw, block_size=16, min_quant_numel=0), shapes, 10)
        compare(params, ref_params, what, exact=True)
        for p, r in zip(params, ref_params):
            for key, t in opt.state[p].items():
                if key.endswith((".codes", ".nibbles")):
                    n = t.numel()
                    ref_codes = ref_opt.state[r][key][ctx.rank * n : (ctx.rank + 1) * n]
                    check(torch.equal(t.cpu(), ref_codes), f"{what}: codes of {key} differ from the reference's")


@case
def elementwise_8bit_unaligned_bound(ctx):
    """8-bit state on shards that split blocks: different blocks than one process, the same error against fp32."""
    shapes = [(7, 37), (9, 13), (5, 3, 3, 3)]  # shard boundaries fall inside 16-element blocks
    for cls, kw in ELEMENTWISE:
        tensors = full_params(shapes)
        runs = {}
        for name, bits, sharded in (("fp32", 32, False), ("q8", 8, False), ("q8 sharded", 8, True)):
            params = fsdp_params(ctx, tensors)[1] if sharded else plain_params(tensors)
            ref_params = plain_params(tensors)
            opt = cls(params, **dict(kw, state_bits=bits, block_size=16, min_quant_numel=0))
            ref_opt = cls(ref_params, **dict(kw, state_bits=32))
            step_both(opt, params, ref_opt, ref_params, targets(shapes), 20)
            runs[name] = [full(p).detach() for p in params]
        start = tensors

        def err(a, b):
            num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b))
            den = sum(float((y - s).pow(2).sum()) for y, s in zip(b, start))
            return (num / den) ** 0.5

        e_single, e_sharded = err(runs["q8"], runs["fp32"]), err(runs["q8 sharded"], runs["fp32"])
        check(e_sharded > 0, f"{cls.__name__}: 8-bit sharded run equals fp32: the blocks were not quantized")
        # measured (20 steps, blocks of 16): sharded / one-process error 0.90 - 1.01; both runs 0.4 - 0.6 % apart
        check(
            e_sharded <= 1.5 * e_single,
            f"{cls.__name__}: 8-bit on split blocks is off fp32 by {e_sharded:.4f}, one process by {e_single:.4f}",
        )
        check(err(runs["q8 sharded"], runs["q8"]) < 0.02, f"{cls.__name__}: 8-bit sharded vs one process too far")


# ---------------------------------------------------------------------------------------------------------------------
# LAMB, LARS: norms over the shards


@case
def lamb_lars_norms(ctx):
    configs = [
        (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1, bias_correction=True)),
        (lowmemopt.LARS, dict(lr=1e-1, momentum=0.9, weight_decay=1e-3)),
    ]
    for cls, kw in configs:
        for bits in (32, 8):
            what = f"{cls.__name__} {bits}-bit"
            shapes = UNEVEN if bits == 32 else [(8, 32), (6, 48)]
            opt, params, ref_opt, ref_params = run_pair(
                ctx, cls, dict(kw, state_bits=bits, block_size=16, min_quant_numel=0), shapes, 10
            )
            compare(params, ref_params, what, rtol=1e-5, atol=1e-6)
        # a local-norm trust ratio would not match: make sure the test can tell
        opt, params, ref_opt, ref_params = run_pair(ctx, cls, kw, [(7, 5)], 1)
        d = full(params[0]) - full_params([(7, 5)])[0]
        rd = ref_params[0].detach() - full_params([(7, 5)])[0]
        check(torch.allclose(d, rd, rtol=1e-5, atol=1e-7), f"{cls.__name__}: first step differs")


# ---------------------------------------------------------------------------------------------------------------------
# Adafactor, CAME: factored statistics over the shards

FACTORED = [
    (lowmemopt.Adafactor, dict()),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
    (lowmemopt.Adafactor, dict(lr=1e-2, relative_step=False, scale_parameter=False, clip_threshold=0.5)),
    (lowmemopt.AdafactorTorch, dict(lr=1e-2, weight_decay=0.01)),
    (lowmemopt.CAME, dict(lr=2e-3, weight_decay=0.01)),
]


@case
def factored_fsdp_shard0(ctx):
    """FSDP2 (Shard(0), uneven, one rank with an empty shard): equal to one process to fp32 tolerance, 12 steps."""
    for cls, kw in FACTORED:
        what = f"{cls.__name__} {kw}"
        opt, params, ref_opt, ref_params = run_pair(ctx, cls, kw, UNEVEN, 12)
        compare(params, ref_params, what)
        compare_state(opt, params, ref_opt, ref_params, what, rtol=1e-5, atol=1e-7)


@case
def factored_shard_columns(ctx):
    """DTensors sharded along the column dim (Shard(-1)) or a row / batch dim of a 3-D tensor, uneven."""
    shapes = [(7, 5), (9, 3), (2, 7, 5), (3, 4, 5), (5, 7)]
    placements = [[Shard(1)], [Shard(1)], [Shard(2)], [Shard(1)], [Replicate()]]
    for cls, kw in FACTORED:
        what = f"{cls.__name__} {kw} column-sharded"
        opt, params, ref_opt, ref_params = run_pair(ctx, cls, kw, shapes, 12, placements=placements)
        compare(params, ref_params, what)
        compare_state(opt, params, ref_opt, ref_params, what, rtol=1e-5, atol=1e-7)


@case
def partial_gradients(ctx):
    """Tensor-parallel style: a replicated parameter whose gradient is a pending sum (Partial) over the ranks; the
    optimizer reduces it to the parameter's placement first, and the step equals one process's on the summed
    gradient."""
    from torch.distributed.tensor import Partial

    for cls, kw in [(lowmemopt.AdamW, dict(lr=1e-2)), (lowmemopt.CAME, dict(lr=1e-3))]:
        tensors = full_params([(6, 5)])
        params = dtensor_params(ctx, tensors, [[Replicate()]])
        ref_params = plain_params(tensors)
        opt, ref_opt = cls(params, **kw), cls(ref_params, **kw)
        for t in range(3):
            g = grad_for(ref_params[0], targets([(6, 5)])[0], t, 0)
            ref_params[0].grad = g.clone()
            part = g * (ctx.rank + 1) / sum(range(1, ctx.world + 1))  # shares that sum to g
            params[0].grad = DTensor.from_local(part.to(ctx.device), ctx.mesh, [Partial()])
            opt.step()
            ref_opt.step()
        compare(params, ref_params, f"{cls.__name__} Partial gradient", rtol=1e-5, atol=1e-6)


@case
def factored_column_reduction_matters(ctx):
    """The test above can fail: skipping the column statistic's sum over row shards (ColossalAI's distributed
    Adafactor/CAME) gives a visibly different result on full-rank gradients."""
    from lowmemopt.distributed import reduction

    original = reduction.ShardedReduction.mean

    def no_column_sum(self, x, dim, pdim, keepdim=False):
        if pdim % len(self.shape) == len(self.shape) - 2 and x.dim() == len(self.shape):
            return x.mean(dim=dim, keepdim=keepdim)  # column mean of the local rows only
        return original(self, x, dim, pdim, keepdim)

    reduction.ShardedReduction.mean = no_column_sum
    try:
        _, params, _, ref_params = run_pair(ctx, lowmemopt.Adafactor, dict(), [(7, 5)], 5)
    finally:
        reduction.ShardedReduction.mean = original
    diff = (full(params[0]) - ref_params[0].detach()).abs().max()
    check(diff > 1e-4, f"without the column reduction the result still matches (max |d| {diff:.3g})")


@case
def factored_8bit(ctx):
    """8-bit first moment (block-aligned shards) with fp32 factored statistics: equal to one process to tolerance."""
    for cls, kw in [(lowmemopt.Adafactor, dict(beta1=0.9)), (lowmemopt.CAME, dict(lr=2e-3))]:
        what = f"{cls.__name__} 8-bit"
        opt, params, ref_opt, ref_params = run_pair(
            ctx, cls, dict(kw, state_bits=8, block_size=16, min_quant_numel=0), [(8, 32), (6, 48)], 10
        )
        compare(params, ref_params, what, rtol=1e-4, atol=1e-5)


BATCHED = [
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.LARS, dict(lr=1e-1, momentum=0.9, weight_decay=1e-3)),
    (lowmemopt.Adafactor, dict(beta1=0.9)),
    (lowmemopt.CAME, dict(lr=2e-3, weight_decay=0.01)),
]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "gather")


@contextlib.contextmanager
def counting_collectives():
    """Count the calls of torch.distributed's collectives (by name) while active."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@case
def reductions_batched(ctx):
    """A step's whole-tensor reductions go out in a number of collectives that does not grow with the parameter count
    (8 and 64 FSDP2 parameters, uneven and empty shards), and the batched step equals the per-parameter one bit for bit
    (parameters and state), and one process to fp32 tolerance."""
    from lowmemopt.pipeline import per_param

    def local(t, like):  # ``t``'s shard laid out like DTensor ``like``, made here (no communication)
        return distribute_tensor(t, like.device_mesh, like.placements, src_data_rank=None)

    def run(cls, kw, n, per_parameter, bucket_numel=per_param.REDUCTION_BUCKET_NUMEL):
        shapes = [[(7, 5), (9, 3), (1, 6), (6,)][i % 4] for i in range(n)]
        default, default_numel = per_param.REDUCTION_BUCKET_STEPS, per_param.REDUCTION_BUCKET_NUMEL
        devices = per_param.BATCHED_DEVICES
        per_param.REDUCTION_BUCKET_STEPS = 1 if per_parameter else default
        per_param.REDUCTION_BUCKET_NUMEL = bucket_numel
        per_param.BATCHED_DEVICES = ("cpu", "cuda")  # (NCCL: the rounds run there too, for their results)
        try:
            tensors, tgts = full_params(shapes), targets(shapes)
            _, params = fsdp_params(ctx, tensors)
            ref_params = plain_params(tensors)
            opt, ref_opt = cls(params, **kw), cls(ref_params, **kw)
            for t in range(2):
                for i, (p, r, tg) in enumerate(zip(params, ref_params, tgts)):
                    r.grad = grad_for(r, tg, t, i)
                    p.grad = local(r.grad, p)
                if t == 0:
                    opt.step()
                else:
                    with counting_collectives() as counts:
                        opt.step()
                ref_opt.step()
        finally:
            per_param.REDUCTION_BUCKET_STEPS, per_param.REDUCTION_BUCKET_NUMEL = default, default_numel
            per_param.BATCHED_DEVICES = devices
        for i, (p, r) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(
                p.to_local(), local(r.detach(), p).to_local(), rtol=1e-5, atol=1e-6, msg=lambda m: f"param {i}: {m}"
            )
        return opt, params, counts["all_reduce"], sum(counts.values())

    report = []
    for cls, kw in BATCHED:
        got = {}
        for n in (8, 64):
            what = f"{cls.__name__} {n} parameters"
            opt, params, batched, total = run(cls, kw, n, False)
            check(total == batched, f"{what}: collectives other than all_reduce in the step ({total} vs {batched})")
            got[n] = batched
            if n == 64 and cls is not lowmemopt.LAMB:
                continue  # (the per-parameter path's count at 64: LAMB's shows that it grows)
            old, old_params, got[n, "per parameter"], _ = run(cls, kw, n, True)
            if n == 8:
                per_parameter_params = old_params
            for i, (p, q) in enumerate(zip(params, old_params)):
                check(torch.equal(p.to_local(), q.to_local()), f"{what}: param {i}: batched vs per-parameter differ")
                mine, theirs = opt.state[p], old.state[q]
                check(mine.keys() == theirs.keys(), f"{what}: param {i}: slots {sorted(mine)} vs {sorted(theirs)}")
                for k, v in theirs.items():
                    same = torch.equal(mine[k], v) if isinstance(v, torch.Tensor) else mine[k] == v
                    check(same, f"{what}: param {i} {k}: batched vs per-parameter differ")
        if cls is lowmemopt.LAMB:  # buckets of ~2 parameters (uneven shards: the same buckets on both ranks)
            small, small_params, got["buckets of 40"], _ = run(cls, kw, 8, False, bucket_numel=40)
            for i, (p, q) in enumerate(zip(small_params, per_parameter_params)):
                check(torch.equal(p.to_local(), q.to_local()), f"{cls.__name__} buckets of 40: param {i} differs")
            check(got[8] < got["buckets of 40"] < got[8, "per parameter"], f"buckets of 40: {got}")
        report.append(f"{cls.__name__}: {got}")
        check(got[8] == got[64], f"{cls.__name__}: the batched count grows with the parameters: {got}")
        if cls is lowmemopt.LAMB:
            check(got[64, "per parameter"] > got[8, "per parameter"], f"the per-parameter count does not grow: {got}")
    if ctx.rank == 0:
        print("all_reduce calls per step: " + "; ".join(report), file=sys.stderr)


FOUR_RANK_CASES = ["mesh_2d", "tp_fsdp2_2d"]


@case
def mesh_2d(ctx):
    """A 2 x 2 mesh (4 ranks): a tensor sharded on two dims at once (rows over one mesh dim, columns over the other:
    each statistic sums over the right one), and HSDP (Replicate x Shard(0))."""
    check(ctx.world == 4, "mesh_2d needs 4 ranks")
    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    shapes = [(7, 5), (9, 3), (2, 7, 5), (5, 7)]
    placements = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(1), Shard(2)], [Replicate(), Shard(1)]]
    for cls, kw in FACTORED + [(lowmemopt.LAMB, dict(lr=1e-2)), (lowmemopt.LARS, dict(lr=1e-1, momentum=0.9))]:
        what = f"{cls.__name__} {kw} 2-D sharded"
        opt, params, ref_opt, ref_params = run_pair(ctx, cls, kw, shapes, 10, placements=placements, mesh=mesh)
        compare(params, ref_params, what)
        if cls not in (lowmemopt.LAMB, lowmemopt.LARS):
            compare_state(opt, params, ref_opt, ref_params, what, rtol=1e-5, atol=1e-7)
    for cls, kw in [
        (lowmemopt.AdamW, dict(lr=1e-2, state_bits=16)),
        (lowmemopt.Adafactor, dict(beta1=0.9)),
        (lowmemopt.CAME, dict(lr=1e-3)),
    ]:
        what = f"{cls.__name__} HSDP"
        with torch_paths_only():
            opt, params, ref_opt, ref_params = run_pair(ctx, cls, kw, UNEVEN, 10, mesh=mesh)
        check(tuple(params[0].placements) == (Replicate(), Shard(0)), f"HSDP placements {params[0].placements}")
        compare(params, ref_params, what, exact=cls is lowmemopt.AdamW)
        compare_state(opt, params, ref_opt, ref_params, what, exact=cls is lowmemopt.AdamW)
    for cls, kw in [(lowmemopt.AdamW, dict(lr=1e-2)), (lowmemopt.Adafactor, dict(beta1=0.9))]:
        _, params, _, ref_params = galore_pair(ctx, cls, kw, 8, mesh=mesh)
        noisy = _sign_noise_params(cls)
        keep = [i for i in range(len(params)) if i not in noisy]
        compare(
            [params[i] for i in keep],
            [ref_params[i] for i in keep],
            f"GaLore {cls.__name__} HSDP",
            rtol=1e-5,
            atol=2e-5,
        )
        _compare_sign_noise(params, ref_params, noisy, kw.get("lr", 0.0), 8, f"GaLore {cls.__name__} HSDP")


def tp_mlp(seed=0):
    """Linear 16 -> 64 (column-parallel), Tanh, Linear 64 -> 16 (row-parallel): every 16-element block of a weight
    lies inside one 2 x 2 shard, so 8-bit blocks are the one-process blocks."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("up_proj", torch.nn.Linear(16, 64))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("down_proj", torch.nn.Linear(64, 16))
    return model


def _matrices(model, **other):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() == 2]}, {"params": [p for p in params if p.dim() != 2], **other}]


Q8 = dict(state_bits=8, block_size=16, min_quant_numel=64)  # (the 16-element down_proj.bias keeps fp32 state)
#: (name, optimizer of a model, atol): the row-parallel layer's gradients are sums over the tp ranks, added in another
#: order than one matmul's, so the runs agree to that fp32 rounding as the optimizers carry it (measured on 2 cores:
#: at most 7.5e-8 over 3 steps, for every entry, 8-bit included: its blocks are the one-process blocks). 1e-6 leaves
#: room for another machine's rounding; Lion's update is a sign, which a rounding can flip where the momentum is ~0:
#: an lr-sized (1e-3) step, hence its bound; Muon orthogonalizes in bf16, where a rounding can move a value by a
#: bf16 step (lr 2^-7 per step at most)
TP_OPTIMIZERS = [
    ("AdamW", lambda m: lowmemopt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), 1e-6),
    ("AdamW 8-bit", lambda m: lowmemopt.AdamW(m.parameters(), lr=1e-2, **Q8), 1e-6),
    ("Adam", lambda m: lowmemopt.Adam(m.parameters(), lr=1e-2), 1e-6),
    ("SGD", lambda m: lowmemopt.SGD(m.parameters(), lr=1e-1, momentum=0.9, nesterov=True), 1e-6),
    ("Lion", lambda m: lowmemopt.Lion(m.parameters(), lr=1e-3), 2e-3),
    ("Lion 8-bit", lambda m: lowmemopt.Lion(m.parameters(), lr=1e-3, **Q8), 2e-3),
    ("LAMB", lambda m: lowmemopt.LAMB(m.parameters(), lr=1e-2, weight_decay=0.1), 1e-6),
    ("LAMB 8-bit", lambda m: lowmemopt.LAMB(m.parameters(), lr=1e-2, **Q8), 1e-6),
    ("LARS", lambda m: lowmemopt.LARS(m.parameters(), lr=1e-1, momentum=0.9), 1e-6),
    ("Adafactor", lambda m: lowmemopt.Adafactor(m.parameters(), beta1=0.9), 1e-6),
    ("Adafactor 8-bit", lambda m: lowmemopt.Adafactor(m.parameters(), beta1=0.9, **Q8), 1e-6),
    ("CAME", lambda m: lowmemopt.CAME(m.parameters(), lr=2e-3, weight_decay=0.01), 1e-6),
    ("CAME 8-bit", lambda m: lowmemopt.CAME(m.parameters(), lr=2e-3, **Q8), 1e-6),
    ("Muon", lambda m: lowmemopt.Muon(_matrices(m, use_muon=False), lr=0.02), 3 * 0.02 * 2**-7),
    (
        "Adam-mini",
        lambda m: lowmemopt.AdamMini(list(m.named_parameters()), lr=1e-2, dim=16, n_heads=2, verbose=False),
        1e-6,
    ),
    (  # (up_proj named as a query projection: per-head blocks of 8 rows, cut by the strided shards)
        "Adam-mini heads",
        lambda m: lowmemopt.AdamMini(
            [(n.replace("up_proj", "q_proj"), p) for n, p in m.named_parameters()],
            lr=1e-2,
            dim=16,
            n_heads=2,
            verbose=False,
        ),
        1e-6,
    ),
    ("AdEMAMix", lambda m: lowmemopt.AdEMAMix(m.parameters(), lr=1e-2, t_alpha=4, t_beta3=4), 1e-6),
    ("AdEMAMix 8-bit", lambda m: lowmemopt.AdEMAMix(m.parameters(), lr=1e-2, t_alpha=4, t_beta3=4, **Q8), 1e-6),
]


def _tp_fsdp(model, mesh):
    """Tensor parallelism on mesh dim "tp" (up_proj column-, down_proj row-parallel), FSDP2 on "dp" over it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _tp_train(model, opt, steps, start=0):
    gen = torch.Generator().manual_seed(11)
    data = [(torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(start + steps)]
    for x, y in data[start:]:  # (every rank the whole batch: the dp mean of equal gradients is that gradient)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@case
def tp_fsdp2_2d(ctx):
    """A 2 x 2 mesh ("dp", "tp"): parallelize_module (column- and row-parallel) on "tp", fully_shard on "dp" over it
    (_StridedShard placements for the column-parallel layer); every optimizer against one process; state_dict()
    and DCP resharded to one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    check(ctx.world == 4, "tp_fsdp2_2d needs 4 ranks")
    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    strided = type(_tp_fsdp(tp_mlp(), mesh).up_proj.weight.placements[0]).__name__
    check(strided == "_StridedShard", f"up_proj.weight is placed {strided} on dp")
    failures, diffs = [], {}
    for name, make, atol in TP_OPTIMIZERS:
        ref = tp_mlp()
        ref_opt = make(ref)
        _tp_train(ref, ref_opt, 3)
        model = _tp_fsdp(tp_mlp(), mesh)
        opt = make(model)
        try:
            if name == "Adam-mini heads":
                check(
                    opt.param_groups[0]["block"] == "head", f"{name}: blocks {[g['block'] for g in opt.param_groups]}"
                )
            _tp_train(model, opt, 3)
            compare(list(model.parameters()), list(ref.parameters()), f"TP x FSDP2 {name}", rtol=1e-5, atol=atol)
            diffs[name] = max(
                float((full(p) - r.detach()).abs().max()) for p, r in zip(model.parameters(), ref.parameters())
            )
            sd = opt.state_dict()  # every slot laid out like its parameter, _StridedShard included
            for index, st in sd["state"].items():
                for k, v in st.items():
                    if isinstance(v, DTensor):
                        full(v)
        except Exception as e:  # noqa: BLE001 - collected: one report for all optimizers
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:600]}")
    check(not failures, "\n".join(failures))
    if ctx.rank == 0:
        print(
            "TP x FSDP2 vs one process, max |d|: " + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()),
            file=sys.stderr,
        )
    model = _tp_fsdp(tp_mlp(), mesh)
    groups = [{"params": [model.up_proj.weight, model.down_proj.weight], "rank": 2}, {"params": [model.up_proj.bias]}]
    try:
        _tp_train(model, lowmemopt.APOLLOAdamW(groups, lr=1e-2), 1)
    except NotImplementedError as e:  # (APOLLO's projection takes row-sharded and replicated parameters only)
        check("only row sharding" in str(e), f"APOLLO under tensor parallelism: unclear error {e}")
    else:
        raise AssertionError("APOLLO stepped a tensor-parallel parameter")
    # DCP: save at 4 ranks, load into one process's unsharded model (resharding the strided layout)
    root = _shared_tmpdir(ctx)
    solo_group = dist.new_group([0])
    solo_mesh = DeviceMesh.from_group(solo_group, ctx.device.type) if ctx.rank == 0 else None
    for name, make, _ in [TP_OPTIMIZERS[0], TP_OPTIMIZERS[1], TP_OPTIMIZERS[9]]:
        model = _tp_fsdp(tp_mlp(), mesh)
        opt = make(model)
        _tp_train(model, opt, 2)
        path = os.path.join(root, "tp-" + name.replace(" ", "-"))
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path
        )
        saved = {
            k: {s: full(v) if isinstance(v, torch.Tensor) else v for s, v in st.items()}
            for k, st in get_optimizer_state_dict(model, opt)["state"].items()
        }
        whole = [full(p) for p in model.parameters()]  # (collectives: on every rank)
        dist.barrier()
        if ctx.rank == 0:  # (FSDP2 over a mesh of one: the single-process layout of a DCP checkpoint)
            solo = tp_mlp(seed=1)
            fully_shard(solo, mesh=solo_mesh)
            solo_opt = make(solo)
            sd = {"model": get_model_state_dict(solo), "optim": get_optimizer_state_dict(solo, solo_opt)}
            dcp.load(sd, checkpoint_id=path, process_group=solo_group)
            set_model_state_dict(solo, sd["model"])
            set_optimizer_state_dict(solo, solo_opt, sd["optim"])
            loaded = get_optimizer_state_dict(solo, solo_opt)["state"]
            compare(list(solo.parameters()), whole, f"DCP 4 -> 1 {name} parameters", exact=True)
            check(sorted(loaded) == sorted(saved), f"DCP 4 -> 1 {name}: {sorted(loaded)} vs {sorted(saved)}")
            for key, st in saved.items():
                for k, v in st.items():
                    w = loaded[key][k]
                    if not isinstance(v, torch.Tensor):
                        check(v == w, f"DCP 4 -> 1 {name} {key}/{k}: {v} vs {w}")
                    elif "8-bit" not in name or v.numel() != v.shape.numel() or k.endswith(("_row", "_col")):
                        check(torch.equal(v, full(w)), f"DCP 4 -> 1 {name} {key}/{k}: {_where(v, full(w))}")
                    else:  # re-encoded on the same blocks: within one code step (1/64 of the largest value)
                        err = (v - full(w)).abs().max()
                        check(err <= v.abs().max() / 64, f"DCP 4 -> 1 {name} {key}/{k} off by {err:.3g}")
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# GaLore: the projector from the whole gradient, the projected update equal to one process's

# (optimizer, kwargs): the inner algorithms exercise the element-wise path, factored statistics of the low-rank
# matrix, and the parameter's own norm / RMS (LAMB's ||p||, Adafactor's RMS(p)) next to the low-rank tensor's
GALORE = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0)),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
    (lowmemopt.CAME, dict(lr=2e-3)),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1)),
]
# (7, 5) std -> right (rows sharded 4 + 3), (5, 9) std -> left (rows 3 + 2), (9, 6) full -> both, (5, 2, 3, 3) a conv
# weight projected as 5 x 18 (left); (1, 8) right with an empty shard on rank 1
GALORE_SHAPES = [(7, 5), (5, 9), (9, 6), (5, 2, 3, 3), (1, 8)]


def galore_groups(params, proj_type="std", **kw):
    groups = [
        dict(
            params=[params[0], params[1], params[3], params[4]],
            rank=3,
            update_proj_gap=3,
            scale=0.25,
            proj_type=proj_type,
            **kw,
        ),
        dict(params=[params[2]], rank=2, update_proj_gap=4, scale=0.5, proj_type="full", **kw),
    ]
    return groups


def galore_pair(ctx, cls, kw, steps, mesh=None, **group_kw):
    tensors = full_params(GALORE_SHAPES)
    _, params = fsdp_params(ctx, tensors, mesh)
    ref_params = plain_params(tensors)
    opt = cls(galore_groups(params, **group_kw), **kw)
    ref_opt = cls(galore_groups(ref_params, **group_kw), **kw)
    step_both(opt, params, ref_opt, ref_params, targets(GALORE_SHAPES), steps)
    return opt, params, ref_opt, ref_params


# proj_type="full" (GALORE_SHAPES[2], group scale 0.5): at a refresh step G_low = P^T G Q^T is diagonal in exact
# arithmetic (the top singular values); its off-diagonal entries are fp32 rounding (~3e-7 of |G| ~ 11 here), far above
# Adam's eps, so an Adam-type inner step (AdamW, LAMB) normalizes them to about +-1: an update of ~lr * scale along
# P_i Q_j whose sign is that rounding. Two summation orders of P^T G (shards vs one matmul, or two BLAS builds: the
# H100 machine's CPU) can flip it, and the trajectories then part by up to ~lr * scale per step: what is checked.
GALORE_FULL = 2


def _sign_noise_params(cls) -> set[int]:
    return {GALORE_FULL} if cls in (lowmemopt.AdamW, lowmemopt.LAMB) else set()


def _compare_sign_noise(params, ref_params, noisy, lr, steps, what, scale=0.5):
    for i in sorted(noisy):
        d = float((full(params[i]).float() - full(ref_params[i]).float()).abs().max())
        check(d <= lr * scale * steps, f"{what}: param {i} (proj_type full) off by {d:.3g} > lr * scale * steps")


@case
def galore_fsdp2(ctx):
    """GaLore groups on FSDP2 parameters, 10 steps with refreshes at steps 0, 3, 6, 9 (and 0, 4, 8): projectors equal
    to one process's (the same whole gradient, the same SVD), updates to fp32 rounding."""
    from lowmemopt.projection import projector as pj

    for cls, kw in GALORE:
        what = f"GaLore {cls.__name__} {kw}"
        opt, params, ref_opt, ref_params = galore_pair(ctx, cls, kw, 10)
        # sides left / both sum P_r^T G_r over the row shards: fp32 rounding of G_low, which Adam-like normalization
        # magnifies in near-zero low-rank coordinates (measured: up to 5e-6 on parameters of size ~1, lr 1e-2)
        # 8-bit: the side-right low-rank state's shards (12 and 9 elements) split 16-element blocks
        noisy = _sign_noise_params(cls)
        keep = [i for i in range(len(params)) if i not in noisy]
        compare(
            [params[i] for i in keep],
            [ref_params[i] for i in keep],
            what,
            rtol=1e-5,
            atol=1e-3 if kw.get("state_bits") == 8 else 2e-5,
        )
        _compare_sign_noise(params, ref_params, noisy, kw.get("lr", 0.0), 10, what)
        for i, (p, r) in enumerate(zip(params, ref_params)):
            a, b = opt.state[p], ref_opt.state[r]
            check(
                a[pj.SIDE] == b[pj.SIDE] and a[pj.REFRESHED_AT] == b[pj.REFRESHED_AT] == (9 if i != 2 else 8),
                f"{what}: param {i}: side / refresh {a[pj.SIDE]} {a[pj.REFRESHED_AT]} vs {b[pj.SIDE]}",
            )
            for key in pj.PROJECTOR_TENSORS:
                if key in b:
                    torch.testing.assert_close(
                        a[key].cpu(), b[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: param {i} {key}: {m}"
                    )
        if kw.get("state_bits", 32) == 32:
            compare_state(
                opt, [params[i] for i in keep], ref_opt, [ref_params[i] for i in keep], what, rtol=1e-4, atol=1e-5
            )
    # the side-right low-rank state is sharded by rows like its parameter: memory per rank falls with the world size
    opt, params, _, ref_params = galore_pair(ctx, lowmemopt.AdamW, dict(lr=1e-2), 1)
    local_rows = params[0].to_local().shape[0]
    check(
        opt.state[params[0]]["exp_avg"].shape == (local_rows, 3),
        f"side-right state {tuple(opt.state[params[0]]['exp_avg'].shape)}, expected ({local_rows}, 3)",
    )


@case
def galore_proj_bits_fsdp2(ctx):
    """GaLore's bases stored at proj_bits 8 and 4 under FSDP2 (row shards decode the replicated basis): the same codes
    as one process's (the same SVD of the same whole gradient), parameters to the shards' fp32 sums (measured: 6e-8)."""
    from lowmemopt.projection import projector as pj
    from lowmemopt.projection import storage

    for bits in (8, 4):
        what = f"GaLore AdamW proj_bits={bits}"
        opt, params, ref_opt, ref_params = galore_pair(ctx, lowmemopt.AdamW, dict(lr=1e-2), 10, proj_bits=bits)
        compare(params, ref_params, what, rtol=1e-5, atol=1e-6)
        for i, (p, r) in enumerate(zip(params, ref_params)):
            a, b = opt.state[p], ref_opt.state[r]
            for key in pj.PROJECTOR_TENSORS:
                if key + ".absmax" not in b:
                    continue
                check(storage.stored_bits(a, key) == bits, f"{what}: param {i} {key}: {storage.stored_bits(a, key)}")
                for k in (key + ".absmax", key + (".codes" if bits == 8 else ".nibbles")):
                    check(torch.equal(a[k].cpu(), b[k]), f"{what}: param {i} {k} differs from one process's")


@case
def galore_moment_policies(ctx):
    """proj_moments="project" and "reset" (moments carried into the new basis, or zeroed) and randomized SVD."""
    for group_kw in (dict(proj_moments="project"), dict(proj_moments="reset"), dict(proj_svd="randomized")):
        what = f"GaLore AdamW {group_kw}"
        opt, params, ref_opt, ref_params = galore_pair(ctx, lowmemopt.AdamW, dict(lr=1e-2), 8, **group_kw)
        keep = [i for i in range(len(params)) if i != GALORE_FULL]
        compare([params[i] for i in keep], [ref_params[i] for i in keep], what, rtol=1e-5, atol=2e-5)
        _compare_sign_noise(params, ref_params, {GALORE_FULL}, 1e-2, 8, what)


@case
def galore_checkpoints(ctx):
    """GaLore state through state_dict (DTensors: side-right state sharded by rows, the rest and the bases
    replicated), DCP at 2 -> 1 ranks, and per-rank save_state files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from lowmemopt.projection import projector as pj

    root = _shared_tmpdir(ctx)
    solo_group = dist.new_group([0])
    for cls, kw in [
        (lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0)),
        (lowmemopt.Adafactor, dict(beta1=0.9)),
    ]:
        what = f"GaLore {cls.__name__}"
        tensors = full_params(GALORE_SHAPES)
        model, params = fsdp_params(ctx, tensors)
        opt = cls(galore_groups(params), **kw)
        ref_params = plain_params(tensors)
        ref_opt = cls(galore_groups(ref_params), **kw)
        step_both(opt, params, ref_opt, ref_params, targets(GALORE_SHAPES), 4)
        sd = opt.state_dict()
        check(
            all(
                isinstance(v, DTensor)
                for st in sd["state"].values()
                for k, v in st.items()
                if isinstance(v, torch.Tensor)
            ),
            f"{what}: state_dict holds plain tensors",
        )
        check(
            sd["state"][0]["exp_avg" if cls is lowmemopt.AdamW else "exp_avg"].placements[0].is_shard(),
            f"{what}: side-right state not sharded",
        )
        # same world size: load, continue, equal to continuing
        model2, params2 = fsdp_params(ctx, [full(p) for p in params])
        twin = cls(galore_groups(params2), **kw)
        twin.load_state_dict(copy.deepcopy(sd))
        for p, q in zip(params, params2):
            check(sorted(opt.state[p]) == sorted(twin.state[q]), f"{what}: keys differ after reload")
            for key in pj.PROJECTOR_TENSORS:
                if key in opt.state[p]:
                    check(torch.equal(opt.state[p][key], twin.state[q][key]), f"{what}: {key} changed")
        step_both(opt, params, twin, params2, targets(GALORE_SHAPES), 4, start=4)  # crosses a refresh
        compare(params, params2, f"{what} reloaded", rtol=0, atol=5e-4 if kw.get("state_bits") == 8 else 1e-6)
        # DCP: 2 ranks -> 1
        path = os.path.join(root, f"galore-{cls.__name__}")
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        saved = {
            k: {s: full(v).clone() if isinstance(v, torch.Tensor) else v for s, v in st.items()}
            for k, st in get_optimizer_state_dict(model, opt)["state"].items()
        }
        dist.barrier()
        if ctx.rank == 0:
            solo = DeviceMesh.from_group(solo_group, ctx.device.type)
            module = Holder([t.to(ctx.device) for t in tensors])
            fully_shard(module, mesh=solo)
            opt1 = cls(galore_groups(list(module.parameters())), **kw)
            sd1 = {"optim": get_optimizer_state_dict(module, opt1)}
            dcp.load(sd1, checkpoint_id=path, process_group=solo_group)
            set_optimizer_state_dict(module, opt1, sd1["optim"])
            got = {
                k: {s: full(v) if isinstance(v, torch.Tensor) else v for s, v in st.items()}
                for k, st in get_optimizer_state_dict(module, opt1)["state"].items()
            }
            for name in saved:
                for key, v in saved[name].items():
                    w = got[name][key]
                    if not isinstance(v, torch.Tensor):
                        check(v == w, f"{what} 2->1: {name}/{key} {v} vs {w}")
                    elif key.startswith("galore.") or kw.get("state_bits", 32) == 32:
                        check(torch.equal(v, w), f"{what} 2->1: {name}/{key} differs")
                    else:
                        check((v - w).abs().max() <= 2 * v.abs().max() / 64, f"{what} 2->1: {name}/{key} off")
        dist.barrier()
        # per-rank files
        file = os.path.join(root, f"galore-{cls.__name__}.safetensors")
        lowmemopt.save_state(opt, file, model=model)
        opt3 = cls(galore_groups(params2), **kw)
        lowmemopt.load_state(opt3, file, model=model2)
        for p, q in zip(params, params2):
            for key, v in opt.state[p].items():
                w = opt3.state[q][key]
                check(torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"{what}: save_state {key}")
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# non-finite gradients


@case
def nonfinite_skip_agrees(ctx):
    """A NaN in one rank's shard skips the whole parameter on every rank (and no collective is left waiting)."""
    for cls, kw in [(lowmemopt.AdamW, dict(lr=1e-2)), (lowmemopt.Adafactor, dict(beta1=0.9))]:
        tensors = full_params([(7, 5), (6,)])
        _, params = fsdp_params(ctx, tensors)
        opt = cls(params, **kw)
        g = [torch.ones(7, 5), torch.ones(6)]
        g[0][6, 0] = float("nan")  # row 6 lives on the last rank only
        for p, gi in zip(params, g):
            p.grad = distribute_tensor(gi.to(ctx.device), ctx.mesh, p.placements)
        with torch.no_grad():
            before = [full(p).clone() for p in params]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
        check(torch.equal(full(params[0]), before[0]), f"{cls.__name__}: the NaN parameter moved")
        check(not torch.equal(full(params[1]), before[1]), f"{cls.__name__}: the finite parameter did not move")
        check(
            opt.nonfinite_skips == 1 and "step" not in opt.state[params[0]],
            f"{cls.__name__}: rank {ctx.rank} skips {opt.nonfinite_skips}, state {sorted(opt.state[params[0]])}",
        )


# ---------------------------------------------------------------------------------------------------------------------
# real training loops: FSDP2 and DDP against one process


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 23), torch.nn.Tanh(), torch.nn.Linear(23, 5))


def batches(steps, n=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=gen), torch.randn(n, 5, generator=gen)) for _ in range(steps)]


def train(model, opt, data, rank=0, world=1, device="cpu"):
    for x, y in data:
        n = x.shape[0] // world
        x, y = x[rank * n : (rank + 1) * n].to(device), y[rank * n : (rank + 1) * n].to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


TRAINING = [  # (class, kwargs, atol): the gradients differ by summation order; 8-bit rounding can magnify that
    (lowmemopt.AdamW, dict(lr=1e-2), 1e-5),
    (lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0), 1e-3),
    (lowmemopt.Adafactor, dict(beta1=0.9), 1e-5),
    (lowmemopt.CAME, dict(lr=1e-3), 1e-5),
    (lowmemopt.LAMB, dict(lr=1e-2), 1e-5),
]


@case
def fsdp2_training(ctx):
    """fully_shard model, each rank a slice of the batch, real backward (reduce-scattered gradients)."""
    data = batches(6)
    for cls, kw, atol in TRAINING:
        ref = mlp()
        train(ref, cls(ref.parameters(), **kw), data)
        model = mlp().to(ctx.device)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        train(model, cls(model.parameters(), **kw), data, ctx.rank, ctx.world, ctx.device)
        compare(list(model.parameters()), list(ref.parameters()), f"FSDP2 {cls.__name__} {kw}", rtol=2e-4, atol=atol)


def mlp3(seed=0):
    """The issue's model: three Linear layers 37 -> 130 -> 75 -> 9 (weights of 4810, 9750 and 675 elements)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 130), torch.nn.Tanh(), torch.nn.Linear(130, 75), torch.nn.Tanh(), torch.nn.Linear(75, 9)
    )


def mlp3_batches(steps, n=16, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 37, generator=gen), torch.randn(n, 9, generator=gen)) for _ in range(steps)]


def _max_diff(a, b):
    return max(float((full(x).float() - full(y).float()).abs().max()) for x, y in zip(a, b))


@case
def came_8bit_fsdp2(ctx):
    """CAME at 8 bits on FSDP2 against one process (the issue's 37 -> 130 -> 75 -> 9 MLP, lr 1e-2, 8 steps).

    The 8-bit format is chosen by the whole parameter's size, as in one process (it was the local shard's: the
    130 x 37 weight, 4810 elements, has 2405-element shards below ``min_quant_numel`` = 4096, so it kept fp32 state
    under FSDP2 and 8-bit state alone). The blocks of a shard start at the shard (65 x 37 and 38 x 130 rows are not
    multiples of 256), so codes differ from one process's: the sharded 8-bit run must be as close to the fp32 run as
    the one-process 8-bit run is, and close to it."""
    data = mlp3_batches(8)
    kw = dict(lr=1e-2)
    runs = {}
    for name, bits, sharded in (("fp32", 32, False), ("q8", 8, False), ("q8 sharded", 8, True)):
        model = mlp3().to(ctx.device) if sharded else mlp3()
        if sharded:
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=ctx.mesh)
            fully_shard(model, mesh=ctx.mesh)
        opt = lowmemopt.CAME(model.parameters(), state_bits=bits, **kw)
        train(model, opt, data, ctx.rank if sharded else 0, ctx.world if sharded else 1, ctx.device)
        runs[name] = (model, opt)
    params = {k: list(m.parameters()) for k, (m, _) in runs.items()}
    d_single = _max_diff(params["q8"], params["fp32"])
    d_sharded = _max_diff(params["q8 sharded"], params["fp32"])
    d_between = _max_diff(params["q8 sharded"], params["q8"])
    if ctx.rank == 0:
        print(
            f"came_8bit_fsdp2: max |8-bit - fp32| one process {d_single:.4g}, sharded {d_sharded:.4g}; "
            f"sharded vs one process {d_between:.4g}",
            file=sys.stderr,
        )
    single, sharded = runs["q8"], runs["q8 sharded"]
    for p, r in zip(sharded[0].parameters(), single[0].parameters()):
        for key in single[1].state[r]:
            check(
                (key in sharded[1].state[p]),
                f"slot {key} of a {tuple(r.shape)} parameter: 8-bit in one process, not under FSDP2 "
                f"({sorted(sharded[1].state[p])})",
            )
    check(d_sharded <= 1.5 * d_single, f"8-bit CAME sharded is {d_sharded:.4g} from fp32, one process {d_single:.4g}")
    check(
        d_between <= 1.5 * d_single, f"8-bit CAME sharded vs one process {d_between:.4g} (8-bit vs fp32 {d_single:.4g})"
    )


@case
def ddp_training(ctx):
    """DistributedDataParallel: replicated plain parameters stay identical on every rank and equal one process."""
    data = batches(6)
    for cls, kw, atol in TRAINING:
        ref = mlp()
        train(ref, cls(ref.parameters(), **kw), data)
        model = torch.nn.parallel.DistributedDataParallel(mlp().to(ctx.device))
        train(model, cls(model.parameters(), **kw), data, ctx.rank, ctx.world, ctx.device)
        mine = [p.detach() for p in model.module.parameters()]
        compare(mine, list(ref.parameters()), f"DDP {cls.__name__} {kw}", rtol=2e-4, atol=atol)
        for p in mine:  # replicas agree bit for bit
            other = p.clone()
            dist.broadcast(other, src=0)
            check(torch.equal(other, p), f"DDP {cls.__name__}: replicas diverged")


@case
def step_in_backward_fsdp2(ctx):
    """lowmemopt.step_in_backward (per-layer updates in FSDP2's post-reduce-scatter hooks), GaLore groups included."""
    data = batches(5)

    def groups(model):
        return lowmemopt.galore_param_groups(model, target_modules="all-linear", rank=4, update_proj_gap=2)

    # bucket_bytes: completed gradients held and stepped together; the buckets are cut by whole-gradient sizes, so
    # every rank cuts them at the same parameters (their finiteness checks are collectives)
    configs = [
        (lowmemopt.AdamW, dict(lr=1e-2), False),
        (lowmemopt.Adafactor, dict(beta1=0.9), False),
        (lowmemopt.AdamW, dict(lr=1e-2), True),
    ]
    for bucket, (cls, kw, galore) in itertools.product((0, 600), configs):
        ref = mlp()
        lowmemopt.step_in_backward(ref, cls(groups(ref) if galore else ref.parameters(), **kw))
        model = mlp().to(ctx.device)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        opt = cls(groups(model) if galore else model.parameters(), **kw)
        stepper = lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket)
        for i, (x, y) in enumerate(data):
            n = x.shape[0] // ctx.world
            torch.nn.functional.mse_loss(ref(x), y).backward()
            xs, ys = (
                x[ctx.rank * n : (ctx.rank + 1) * n].to(ctx.device),
                y[ctx.rank * n : (ctx.rank + 1) * n].to(ctx.device),
            )
            torch.nn.functional.mse_loss(model(xs), ys).backward()
        check(stepper.steps == len(data), f"{stepper.steps} per-layer updates, expected {len(data)}")
        check(all(p.grad is None for p in model.parameters()), "gradients were not freed")
        what = f"step_in_backward {cls.__name__}{' GaLore' if galore else ''} bucket_bytes={bucket}"
        compare(list(model.parameters()), list(ref.parameters()), what, rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------------
# state_dict, torch.distributed.checkpoint, save_state


@case
def state_dict_dtensors(ctx):
    """state_dict() shows sharded state as DTensors laid out like the parameter; load_state_dict takes it back."""
    for cls, kw in [
        (lowmemopt.AdamW, dict(lr=1e-2)),
        (lowmemopt.Adafactor, dict(beta1=0.9)),
        (lowmemopt.AdafactorTorch, dict()),
        (lowmemopt.CAME, dict(lr=1e-3)),
    ]:
        for bits in (32, 8, 4):
            kwb = dict(kw, state_bits=bits, block_size=16, min_quant_numel=0)
            opt, params, ref_opt, ref_params = run_pair(ctx, cls, kwb, UNEVEN, 3)
            sd = opt.state_dict()
            for i, p in enumerate(params):
                for key, v in sd["state"][i].items():
                    if key == "step":
                        check(isinstance(v, int), f"step is {type(v)}")
                        continue
                    check(isinstance(v, DTensor), f"{cls.__name__} {key} is {type(v).__name__}, not a DTensor")
                    check(v.dtype == torch.float32, f"{key}: {v.dtype}")
            # same world size: load back, continue, equal to continuing the original
            twin_params = fsdp_params(ctx, [full(p) for p in params])[1]
            twin = cls(twin_params, **kwb)
            twin.load_state_dict(copy.deepcopy(sd))  # as in torch, loaded dense state is not copied again
            for p, q in zip(params, twin_params):
                a, b = opt.state[p], twin.state[q]
                check(sorted(a) == sorted(b), f"keys {sorted(a)} vs {sorted(b)}")
                for k in a:
                    if k.endswith((".codes", ".nibbles")) or bits == 32 or k == "step":
                        check(a[k] == b[k] if k == "step" else torch.equal(a[k], b[k]), f"{cls.__name__} {k} changed")
                    else:
                        torch.testing.assert_close(a[k], b[k], rtol=2e-7, atol=0)
            step_both(opt, params, twin, twin_params, targets(UNEVEN), 2, start=3)
            # 8/4-bit: absmax may come back 1 ulp off, so a later re-encode may pick the neighbouring code
            compare(
                params,
                twin_params,
                f"{cls.__name__} {bits}-bit reloaded",
                exact=bits == 32,
                rtol=0,
                atol=5e-4 if bits == 8 else 5e-3,
            )


def _dcp_model(mesh, device, tensors):
    module = Holder([t.to(device) for t in tensors])
    fully_shard(module, mesh=mesh)
    return module


DCP_CONFIGS = [
    (lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0)),
    (lowmemopt.AdamW, dict(lr=1e-2)),
    (lowmemopt.Adafactor, dict(beta1=0.9, state_bits=8, block_size=16, min_quant_numel=0)),
    (lowmemopt.CAME, dict(lr=1e-3)),
    (lowmemopt.AdamW, dict(lr=1e-2, bf16_update="kahan")),  # bf16 params: the Kahan buffer reshards like them
]


@case
def dcp_reshard(ctx):
    """torch.distributed.checkpoint through get/set_optimizer_state_dict: save at 2 ranks, load at 1 and at 2, save
    at 1, load at 2. 32-bit state loads exactly; 8-bit state within one quantization step of the saved values (its
    blocks are laid over the new shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    check(ctx.world == 2, "dcp_reshard needs 2 ranks")
    solo_group = dist.new_group([0])  # a world of one inside this job: rank 0 alone
    solo_mesh = DeviceMesh.from_group(solo_group, ctx.device.type) if ctx.rank == 0 else None
    root = _shared_tmpdir(ctx)
    shapes = [(7, 37), (9, 13), (5,)]
    tensors = full_params(shapes)

    def full_state(model, opt):
        sd = get_optimizer_state_dict(model, opt)
        return {
            k: {s: full(v).clone() if isinstance(v, torch.Tensor) else v for s, v in st.items()}
            for k, st in sd["state"].items()
        }

    def fresh(mesh, cls, kw):
        model = _dcp_model(mesh, ctx.device, [t.bfloat16() for t in tensors] if "bf16_update" in kw else tensors)
        opt = cls(model.parameters(), **kw)
        return model, opt

    def save(model, opt, path, group=None):
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, checkpoint_id=path, process_group=group)

    def load(model, opt, path, group=None):
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path, process_group=group)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])

    def train_steps(model, opt, start, steps):
        tgts = targets(shapes)
        for t in range(start, start + steps):
            for i, p in enumerate(model.parameters()):
                set_grad(p, grad_for(full(p).float(), tgts[i], t, i).to(ctx.device, p.dtype))
            opt.step()

    def same(a, b, kw, what):
        check(sorted(a) == sorted(b), f"{what}: params {sorted(a)} vs {sorted(b)}")
        for name in a:
            check(sorted(a[name]) == sorted(b[name]), f"{what}: {name} keys {sorted(a[name])} vs {sorted(b[name])}")
            for k, v in a[name].items():
                w = b[name][k]
                if not isinstance(v, torch.Tensor):
                    check(v == w, f"{what}: {name}/{k}: {v} vs {w}")
                elif kw.get("state_bits", 32) == 32 or v.numel() != v.shape.numel() or k.endswith(("_row", "_col")):
                    check(torch.equal(v, w), f"{what}: {name}/{k} max |d| {(v - w).abs().max():.3g}")
                else:  # re-quantized on other blocks: within one code step of the block's scale (<= 1/64 of absmax
                    # of any 16-element block holding it; bound by the tensor's max, 2 steps for the rounding)
                    bound = 2 * v.abs().max() / 64
                    err = (v - w).abs().max()
                    check(err <= bound, f"{what}: {name}/{k} re-quantized off by {err:.3g} (bound {bound:.3g})")

    for n, (cls, kw) in enumerate(DCP_CONFIGS):
        what = f"{cls.__name__} {kw.get('state_bits', 32)}-bit"
        path2, path1 = os.path.join(root, f"{n}-ws2"), os.path.join(root, f"{n}-ws1")
        model, opt = fresh(ctx.mesh, cls, kw)
        train_steps(model, opt, 0, 3)
        save(model, opt, path2)
        saved2 = full_state(model, opt)
        train_steps(model, opt, 3, 2)  # the uninterrupted run, for the 32-bit continuation check
        after = [full(p) for p in model.parameters()]
        dist.barrier()
        # 2 -> 2: same layout
        model_b, opt_b = fresh(ctx.mesh, cls, kw)
        load(model_b, opt_b, path2)
        same(saved2, full_state(model_b, opt_b), kw, f"{what} 2->2")
        # 2 -> 1 and 1 -> 2
        if ctx.rank == 0:
            model1, opt1 = fresh(solo_mesh, cls, kw)
            load(model1, opt1, path2, solo_group)
            got = full_state(model1, opt1)
            same(saved2, got, kw, f"{what} 2->1")
            check(opt1.state[next(iter(model1.parameters()))]["step"] == 3, f"{what}: step not restored")
            save(model1, opt1, path1, solo_group)
            saved1 = got
            # an unsharded model (plain tensors, no FSDP): the same checkpoint entries under dense_state_dict
            plain = Holder([t.to(ctx.device, next(model.parameters()).dtype) for t in tensors])
            opt_p = cls(plain.parameters(), **kw)
            with lowmemopt.distributed.dense_state_dict(opt_p):
                load(plain, opt_p, path2, solo_group)
                same(saved2, full_state(plain, opt_p), kw, f"{what} 2->1 unsharded")
                train_steps(plain, opt_p, 3, 1)
                saved_plain = full_state(plain, opt_p)
                save(plain, opt_p, path1 + "-plain", solo_group)
            check(
                any(k.endswith(".codes") for k in opt_p.state_dict()["state"][0]) == (kw.get("state_bits") == 8),
                f"{what}: outside dense_state_dict an unsharded optimizer's state_dict is compact again",
            )
        else:
            saved1 = saved_plain = None
        dist.barrier()
        holder = [saved1, saved_plain]
        dist.broadcast_object_list(holder, src=0)
        model_c, opt_c = fresh(ctx.mesh, cls, kw)
        load(model_c, opt_c, path1)
        same(holder[0], full_state(model_c, opt_c), kw, f"{what} 1->2")
        model_e, opt_e = fresh(ctx.mesh, cls, kw)
        load(model_e, opt_e, path1 + "-plain")
        same(holder[1], full_state(model_e, opt_e), kw, f"{what} unsharded 1->2")
        if kw.get("state_bits", 32) == 32:  # a 32-bit reload continues exactly like the uninterrupted run
            model_d, opt_d = fresh(ctx.mesh, cls, kw)
            load(model_d, opt_d, path2)
            train_steps(model_d, opt_d, 3, 2)
            compare(list(model_d.parameters()), after, f"{what} resumed", rtol=1e-6, atol=1e-7)
    dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# paged state under FSDP2: each rank pages its own shard's state (docs/distributed.md#paged-state-under-fsdp2)

#: (what, optimizer, kwargs, with a GaLore group): 8-bit AdamW, 8-bit CAME (factored statistics), a GaLore group
PAGED_CONFIGS = [
    # min_quant_numel=30: the whole (7, 5) and (5, 9) quantize, their shards (20 + 15, 27 + 18 elements) would not
    (
        "AdamW 8-bit",
        lowmemopt.AdamW,
        dict(lr=1e-2, weight_decay=0.1, state_bits=8, block_size=16, min_quant_numel=30),
        0,
    ),
    ("CAME 8-bit", lowmemopt.CAME, dict(lr=1e-3, state_bits=8, block_size=16, min_quant_numel=0), 0),
    ("GaLore AdamW 8-bit", lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0), 1),
]
# rows shard 4 + 3, 3 + 2, 5 + 4 and 1 + 0 (an empty shard on rank 1); GaLore: (7, 5) side right, (5, 9) side left
PAGED_SHAPES = [(7, 5), (5, 9), (9,), (1, 6)]


def _paged_groups(params, galore):
    if not galore:
        return params
    return [dict(params=params[:2], rank=2, update_proj_gap=2, scale=0.25), dict(params=params[2:])]


def _paged_run(ctx, mesh, tensors, cls, kw, galore, paging, policy=None):
    """(module, params, optimizer): ``tensors`` under ``fully_shard`` on ``mesh``, the optimizer with ``paging``."""
    module = Holder([t.to(ctx.device) for t in tensors])
    fully_shard(module, mesh=mesh, **({} if policy is None else dict(offload_policy=policy)))
    params = list(module.parameters())
    return module, params, cls(_paged_groups(params, galore), **kw, **paging)


def _paged_steps(runs, start, steps):
    """``steps`` steps of every run with the same gradients (computed from the first run's parameters)."""
    tgts = targets(PAGED_SHAPES)
    for t in range(start, start + steps):
        for i, ps in enumerate(zip(*[params for _, params, _ in runs])):
            g = grad_for(full(ps[0]), tgts[i], t, i)
            for p in ps:
                set_grad(p, g)
        for _, _, opt in runs:
            opt.step()


def _same_run(run, ref, what):
    """Parameters and every local state tensor of ``run`` equal ``ref``'s bit for bit."""
    _, params, opt = run
    _, ref_params, ref_opt = ref
    compare(params, ref_params, what, exact=True)
    for i, (p, r) in enumerate(zip(params, ref_params)):
        a, b = opt.state[p], ref_opt.state[r]
        check(sorted(a) == sorted(b), f"{what}: param {i} keys {sorted(a)} vs {sorted(b)}")
        for k, v in b.items():
            if isinstance(v, torch.Tensor):
                check(a[k].dtype == v.dtype and torch.equal(a[k].cpu(), v.cpu()), f"{what}: param {i} {k} differs")
            else:
                check(a[k] == v, f"{what}: param {i} {k}: {a[k]} vs {v}")


def _pages_to(opt, params, tier, what):
    for i, p in enumerate(params):
        where = lowmemopt.paging.where_state_lives(opt, p)
        check(where == tier, f"{what}: param {i}'s state lives on {where}, not {tier}")


def _homes_made_ahead(opt, params, what):
    """The layout the pager learns before a first step (homes made ahead, on a meta twin of the DTensor) is the one
    the step makes: the local shard's shapes, the formats the whole tensor's size picks."""
    from lowmemopt.paging.placement import initial_layout

    for i, p in enumerate(params):
        group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        ahead = initial_layout(opt.state, p, group, opt._first_state) or {}
        made = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        got = {k: (tuple(v.shape), v.dtype) for k, v in ahead.items()}
        want = {k: (tuple(v.shape), v.dtype) for k, v in made.items()}
        check(got == want, f"{what}: param {i}: layout made ahead {got}, the step's {want}")


def _full_sd(sd):
    return {
        k: {s: full(v).clone() if isinstance(v, torch.Tensor) else v for s, v in st.items()} for k, st in sd.items()
    }


def _same_sd(a, b, what):
    check(sorted(a) == sorted(b), f"{what}: params {sorted(a)} vs {sorted(b)}")
    for name in a:
        check(sorted(a[name]) == sorted(b[name]), f"{what}: {name} keys {sorted(a[name])} vs {sorted(b[name])}")
        for k, v in a[name].items():
            w = b[name][k]
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
            check(same, f"{what}: {name}/{k} differs")


@case
def paged_fsdp2(ctx):
    """paged="cpu" / "disk" on FSDP2 parameters: each rank pages its own shard's state (its files in its own
    directory), bit for bit the unpaged FSDP2 run, params and state; state_dict() and save_state round trips;
    residency that differs between ranks; CPUOffloadPolicy; a model in training, per-layer updates too."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    root = _shared_tmpdir(ctx)
    tensors = full_params(PAGED_SHAPES)
    for n, (what, cls, kw, galore) in enumerate(PAGED_CONFIGS):
        for tier in ("cpu", "disk"):
            where = os.path.join(root, f"paged-{n}-{tier}")
            paging = dict(paged=tier, offload_dir=where if tier == "disk" else None)
            label = f"{what} paged={tier}"
            ref = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, {})
            run = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, paging)
            _paged_steps([ref, run], 0, 3)
            _same_run(run, ref, label)
            _pages_to(run[2], run[1], tier, label)
            _homes_made_ahead(run[2], run[1], label)
            if tier == "disk":  # one directory per rank, named by it
                dist.barrier()
                mine = f"lowmemopt-rank{ctx.rank:05d}-of-{ctx.world:05d}-"
                dirs = run[2]._pager.homes.directories()
                check(dirs and all(os.path.basename(d).startswith(mine) for d in dirs), f"{label}: directories {dirs}")
                names = sorted(os.listdir(where))
                check(len(names) == ctx.world, f"{label}: {names} in offload_dir, not one directory per rank")
            # state_dict(): what the unpaged optimizer shows; loaded back into a paged and an unpaged optimizer
            sd = run[2].state_dict()
            _same_sd(_full_sd(sd["state"]), _full_sd(ref[2].state_dict()["state"]), f"{label} state_dict")
            current = [full(p) for p in run[1]]
            twin = _paged_run(ctx, ctx.mesh, current, cls, kw, galore, paging)
            twin_ref = _paged_run(ctx, ctx.mesh, current, cls, kw, galore, {})
            twin[2].load_state_dict(copy.deepcopy(sd))
            twin_ref[2].load_state_dict(copy.deepcopy(sd))
            _pages_to(twin[2], twin[1], tier, f"{label} loaded")
            _same_run(twin, twin_ref, f"{label} loaded")
            _paged_steps([ref, run, twin_ref, twin], 3, 2)
            _same_run(run, ref, f"{label} continued")
            _same_run(twin, twin_ref, f"{label} loaded and continued")
            # per-rank files (lowmemopt.save_state): this rank's shards as stored, loaded back into paged homes
            path = os.path.join(root, f"paged-{n}-{tier}.safetensors")
            lowmemopt.save_state(run[2], path, model=run[0])
            again = _paged_run(ctx, ctx.mesh, [full(p) for p in run[1]], cls, kw, galore, paging)
            lowmemopt.load_state(again[2], path, model=again[0])
            _pages_to(again[2], again[1], tier, f"{label} save_state")
            _same_run(again, run, f"{label} save_state / load_state")
            for _, _, opt in (run, twin, again):
                opt.close()
            dist.barrier()
    # what stays resident is each rank's choice (an int budget of the local shards' bytes; rank 1's are smaller, and
    # its empty shard fits any budget), batches of a few parameters: the ranks still step the same parameters in the
    # same batches (cut by the whole tensors' sizes), so the steps' collectives pair up: bit for bit as unpaged
    from lowmemopt import pipeline
    from lowmemopt.paging import pager as pager_module
    from lowmemopt.paging.placement import buckets_of

    sizes = pager_module.HOST_BUCKET_BYTES, pipeline.PAGE_BUCKET_BYTES
    pager_module.HOST_BUCKET_BYTES = pipeline.PAGE_BUCKET_BYTES = 64  # (bytes: a few parameters' state per batch)
    try:
        lamb = ("LAMB", lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1), 0)
        for what, cls, kw, galore in [lamb, *PAGED_CONFIGS[1:]]:
            differs = False
            for budget in (0, 160):
                label = f"{what} page_budget_bytes={budget}"
                ref = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, {})
                run = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, dict(paged="cpu", page_budget_bytes=budget))
                _paged_steps([ref, run], 0, 3)
                _same_run(run, ref, label)
                opt = run[2]
                work = [(p, g) for g in opt.param_groups for p in g["params"]]
                index = {id(p): i for i, (p, _) in enumerate(work)}
                cuts = [[index[id(p)] for p, _ in b] for b in buckets_of(work, opt._pager.entries, 64, 64)]
                kept = [lowmemopt.paging.where_state_lives(opt, p) for p in run[1]]
                everyone = [None] * ctx.world
                dist.all_gather_object(everyone, (cuts, kept))
                check(all(c == cuts for c, _ in everyone), f"{label}: batches differ between ranks: {everyone}")
                check(len(cuts) > 1, f"{label}: one batch {cuts}")
                differs = differs or len({tuple(k) for _, k in everyone}) > 1
                opt.close()
            # (else this proves little; one rank: the NCCL job on one GPU)
            check(differs or ctx.world == 1, f"{what}: the same residency on every rank at every budget")
    finally:
        pager_module.HOST_BUCKET_BYTES, pipeline.PAGE_BUCKET_BYTES = sizes
    # FSDP2 CPU offload (parameters and gradients in host RAM): the state pages like any CPU parameter's (gloo jobs:
    # an NCCL-only job has no CPU backend for the offloaded gradients' collectives)
    offload = CPUOffloadPolicy(pin_memory=False)
    what, cls, kw, galore = PAGED_CONFIGS[0]
    for tier in ("cpu", "disk") if ctx.device.type == "cpu" else ():
        paging = dict(paged=tier, offload_dir=os.path.join(root, "paged-offload") if tier == "disk" else None)
        label = f"{what} CPUOffloadPolicy paged={tier}"
        ref = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, {}, offload)
        run = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, paging, offload)
        _paged_steps([ref, run], 0, 3)
        _same_run(run, ref, label)
        _pages_to(run[2], run[1], tier, label)
        run[2].close()
    # a model in training (reduce-scattered gradients), stepped by step() and per layer in the backward pass
    for per_layer in (False, True):
        models = []
        for paging in ({}, dict(paged="disk", offload_dir=os.path.join(root, f"paged-training-{per_layer}"))):
            model = mlp()
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=ctx.mesh)
            models.append((fully_shard(model, mesh=ctx.mesh), cls(model.parameters(), **kw, **paging)))
            if per_layer:
                lowmemopt.step_in_backward(*models[-1])
        for x, y in batches(3):
            n = x.shape[0] // ctx.world
            for model, opt in models:
                xs, ys = x[ctx.rank * n :][:n].to(ctx.device), y[ctx.rank * n :][:n].to(ctx.device)
                torch.nn.functional.mse_loss(model(xs), ys).backward()
                if not per_layer:
                    opt.step()
                    opt.zero_grad()
        (model, opt), (ref_model, ref_opt) = models[1], models[0]
        label = f"{what} paged=disk in training, {'per layer' if per_layer else 'step()'}"
        _same_run((model, list(model.parameters()), opt), (ref_model, list(ref_model.parameters()), ref_opt), label)
        _pages_to(opt, list(model.parameters()), "disk", label)
        opt.close()


@case
def paged_fsdp2_dcp(ctx):
    """Paged FSDP2 state through torch.distributed.checkpoint: saved as the unpaged optimizer saves it, loaded at 2
    ranks and resharded to 1 into paged and unpaged optimizers alike, which then step bit for bit the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    check(ctx.world == 2, "paged_fsdp2_dcp needs 2 ranks")
    root = _shared_tmpdir(ctx)
    solo_group = dist.new_group([0])
    solo_mesh = DeviceMesh.from_group(solo_group, ctx.device.type) if ctx.rank == 0 else None
    tensors = full_params(PAGED_SHAPES)

    def load(run, path, group=None):
        module, _, opt = run
        sd = {"optim": get_optimizer_state_dict(module, opt)}
        dcp.load(sd, checkpoint_id=path, process_group=group)
        set_optimizer_state_dict(module, opt, sd["optim"])

    for n, (what, cls, kw, galore) in enumerate(PAGED_CONFIGS):
        tier = ("disk", "cpu", "disk")[n]
        paging = dict(paged=tier, offload_dir=os.path.join(root, f"dcp-{n}") if tier == "disk" else None)
        label = f"{what} paged={tier}"
        ref = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, {})
        run = _paged_run(ctx, ctx.mesh, tensors, cls, kw, galore, paging)
        _paged_steps([ref, run], 0, 3)
        saved = get_optimizer_state_dict(run[0], run[2])
        _same_sd(_full_sd(saved["state"]), _full_sd(get_optimizer_state_dict(ref[0], ref[2])["state"]), label)
        path = os.path.join(root, f"paged-dcp-{n}")
        dcp.save({"optim": saved}, checkpoint_id=path)
        current = [full(p) for p in run[1]]
        # 2 -> 2
        twin = _paged_run(ctx, ctx.mesh, current, cls, kw, galore, paging)
        twin_ref = _paged_run(ctx, ctx.mesh, current, cls, kw, galore, {})
        for r in (twin, twin_ref):
            load(r, path)
        _pages_to(twin[2], twin[1], tier, f"{label} 2->2")
        _paged_steps([twin_ref, twin], 3, 1)
        _same_run(twin, twin_ref, f"{label} 2->2 continued")
        # 2 -> 1: rank 0 alone, its own directory
        if ctx.rank == 0:
            solo_paging = dict(paging, offload_dir=paging["offload_dir"] and paging["offload_dir"] + "-solo")
            one = _paged_run(ctx, solo_mesh, current, cls, kw, galore, solo_paging)
            one_ref = _paged_run(ctx, solo_mesh, current, cls, kw, galore, {})
            for r in (one, one_ref):
                load(r, path, solo_group)
            _pages_to(one[2], one[1], tier, f"{label} 2->1")
            _same_sd(
                _full_sd(get_optimizer_state_dict(one[0], one[2])["state"]),
                _full_sd(get_optimizer_state_dict(one_ref[0], one_ref[2])["state"]),
                f"{label} 2->1",
            )
            _paged_steps([one_ref, one], 3, 1)
            _same_run(one, one_ref, f"{label} 2->1 continued")
            one[2].close()
        for _, _, opt in (run, twin):
            opt.close()
        dist.barrier()


def _shared_tmpdir(ctx):
    path = os.path.join(ctx.out, "tmp")
    if ctx.rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


@case
def save_state_per_rank(ctx):
    """lowmemopt.save_state on a sharded optimizer writes one file per rank; load_state reads this rank's back."""
    root = _shared_tmpdir(ctx)
    for cls, kw in [
        (lowmemopt.AdamW, dict(lr=1e-2, state_bits=8, block_size=16, min_quant_numel=0)),
        (lowmemopt.CAME, dict(lr=1e-3)),
    ]:
        tensors = full_params(UNEVEN)
        model, params = fsdp_params(ctx, tensors)
        opt = cls(params, **kw)
        ref_params = plain_params(tensors)
        ref_opt = cls(ref_params, **kw)
        step_both(opt, params, ref_opt, ref_params, targets(UNEVEN), 3)
        path = os.path.join(root, f"{cls.__name__}.safetensors")
        lowmemopt.save_state(opt, path, model=model)
        mine = lowmemopt.distributed.rank_path(path, ctx.rank, ctx.world)
        check(os.path.exists(mine), f"no per-rank file {mine}")
        meta = lowmemopt.checkpoint.read_metadata(mine)
        check(
            meta["sharding"]["rank"] == ctx.rank and meta["sharding"]["world_size"] == ctx.world,
            f"sharding metadata {meta.get('sharding')}",
        )
        from lowmemopt.inspection import _describe

        text = _describe(mine, meta, list_params=True)
        check(f"rank {ctx.rank} of world size {ctx.world}" in text, f"lowmemopt inspect does not say the rank:\n{text}")
        model2, params2 = fsdp_params(ctx, [full(p) for p in params])
        opt2 = cls(params2, **kw)
        lowmemopt.load_state(opt2, path, model=model2)
        for p, q in zip(params, params2):
            a, b = opt.state[p], opt2.state[q]
            check(sorted(a) == sorted(b), f"keys {sorted(a)} vs {sorted(b)}")
            for k in a:
                check(a[k] == b[k] if k == "step" else torch.equal(a[k], b[k]), f"{cls.__name__}: {k} differs")
        dist.barrier()
        # another layout (one rank alone holds everything): refused, with the reason
        solo_group = dist.new_group([0])  # every rank takes part in making a group
        if ctx.rank == 0:
            solo = DeviceMesh.from_group(solo_group, ctx.device.type)
            module = Holder([t.to(ctx.device) for t in tensors])
            fully_shard(module, mesh=solo)
            other = cls(module.parameters(), **kw)
            try:
                lowmemopt.load_state(other, path, model=module)
            except lowmemopt.checkpoint.CheckpointError as e:
                check("world size" in str(e) or "shard" in str(e), f"unclear error: {e}")
            else:
                raise AssertionError("a per-rank file loaded into another sharding")
        dist.barrier()


@case
def bad_inputs(ctx):
    """Clear errors, and the optimizer left as it was."""
    from torch.distributed.tensor import Partial

    _, params = fsdp_params(ctx, [torch.randn(7, 5)])
    opt = lowmemopt.AdamW(params, lr=1e-2)
    params[0].grad = torch.zeros(7, 5, device=ctx.device)  # a plain tensor, not a DTensor
    before = full(params[0]).clone()
    try:
        opt.step()
    except TypeError as e:
        check("plain-tensor gradient" in str(e), f"unclear error: {e}")
    else:
        raise AssertionError("a DTensor parameter stepped with a plain gradient")
    check(torch.equal(full(params[0]), before) and not opt.state[params[0]], "a failed step changed the optimizer")
    pending = torch.nn.Parameter(DTensor.from_local(torch.randn(3, 4, device=ctx.device), ctx.mesh, [Partial()]))
    opt = lowmemopt.Adafactor([pending])
    pending.grad = DTensor.from_local(torch.randn(3, 4, device=ctx.device), ctx.mesh, [Partial()])
    try:
        opt.step()
    except ValueError as e:
        check("Partial" in str(e), f"unclear error: {e}")
    else:
        raise AssertionError("a Partial parameter was optimized")


@case
def ademamix_and_adam_mini(ctx):
    """AdEMAMix (element-wise: 32-bit bit for bit on the torch path) and Adam-mini (its block means summed over the
    shards: per neuron along rows, per head where FSDP2's Shard(0) cuts a head in two, per tensor over both ranks)
    on FSDP2 parameters, against one process."""
    with torch_paths_only():
        opt, params, ref_opt, ref_params = run_pair(
            ctx, lowmemopt.AdEMAMix, dict(lr=1e-2, t_alpha=4, t_beta3=4, min_quant_numel=0), UNEVEN, 8
        )
    compare(params, ref_params, "AdEMAMix 32-bit", exact=True)
    compare_state(opt, params, ref_opt, ref_params, "AdEMAMix 32-bit", exact=True)
    # dim 6, 3 heads: a q / k head is 12 elements, 2 rows of the (6, 6) matrices; Shard(0) gives 3 + 3 rows, so head 1
    # has a row on each rank; the norm and bias are one block and per-element; (1, 6) leaves one rank empty
    names = ["q_proj.weight", "k_proj.weight", "mlp.weight", "norm.weight", "mlp.bias", "embed.weight"]
    shapes = [(6, 6), (6, 6), (7, 5), (7,), (7,), (1, 6)]
    tensors, tgts = full_params(shapes), targets(shapes)
    for bits in (32, 8):
        _, params = fsdp_params(ctx, tensors)
        ref_params = plain_params(tensors)
        kw = dict(
            lr=1e-2,
            weight_decay=0.1,
            dim=6,
            n_heads=3,
            verbose=False,
            state_bits=bits,
            min_quant_numel=0,
            block_size=16,
        )
        opt = lowmemopt.AdamMini(list(zip(names, params)), **kw)
        ref_opt = lowmemopt.AdamMini(list(zip(names, ref_params)), **kw)
        step_both(opt, params, ref_opt, ref_params, tgts, 6)
        what = f"AdamMini {bits}-bit"
        check(
            [g["block"] for g in opt.param_groups] == ["head", "head", "neuron", "tensor", "element", "neuron"],
            f"{what}: blocks {[g['block'] for g in opt.param_groups]}",
        )
        if bits == 32:
            compare(params, ref_params, what)
            compare_state(opt, params, ref_opt, ref_params, what)
        else:  # (8-bit blocks of 16 elements lie over each shard: another rounding, the same error)
            compare(params, ref_params, what, rtol=0, atol=2e-2)


@case
def muon_fsdp2(ctx):
    """Muon under FSDP2 (Shard(0); uneven and empty shards) equals one process: each matrix is gathered whole on one
    rank (dealt out in turn), orthogonalized there and scattered back; 32-bit and 8-bit momentum (blocks aligned with
    the shards), AdamW groups beside. One matrix per batch: the same products as the one-process run, bit for bit;
    with two matrices of a shape batched in one process and split over the ranks here, to bf16 rounding."""
    from lowmemopt.optim import muon_batches

    shapes = [(8, 8), (8, 8), (4, 16), (1, 6), (32,)]

    def groups(ps):
        return [
            {"params": [p for p in ps if p.dim() == 2]},
            {"params": [p for p in ps if p.dim() != 2], "use_muon": False},
        ]

    default = muon_batches.BATCH_BYTES
    try:
        for bits, batch_bytes in ((32, 1), (8, 1), (32, default)):
            muon_batches.BATCH_BYTES = batch_bytes
            tensors = full_params(shapes)
            _, params = fsdp_params(ctx, tensors)
            ref_params = plain_params(tensors)
            kw = dict(lr=0.02, weight_decay=0.1, state_bits=bits, min_quant_numel=0, block_size=16)
            opt, ref_opt = lowmemopt.Muon(groups(params), **kw), lowmemopt.Muon(groups(ref_params), **kw)
            step_both(opt, params, ref_opt, ref_params, targets(shapes), 3)
            compare(
                params,
                ref_params,
                f"Muon {bits}-bit, batches of {batch_bytes} B",
                exact=batch_bytes == 1,
                rtol=0,
                atol=3 * 0.02 * 2**-7,
            )
            compare_state(opt, params, ref_opt, ref_params, f"Muon {bits}-bit state", exact=batch_bytes == 1)
    finally:
        muon_batches.BATCH_BYTES = default


@case
def apollo_fsdp2(ctx):
    """APOLLO under FSDP2 (Shard(0); uneven and empty shards) equals one process: side right (rows kept) projects the
    local rows, side left sums over the shards; the random projection regenerated alike on every rank, an SVD
    refresh from the gathered gradient; channel- and tensor-wise factors, the limiter's norm over the shards."""
    shapes = [(8, 6), (6, 10), (7, 5), (1, 6), (5,)]
    for keys in (dict(rank=2, update_proj_gap=2), dict(rank=2, proj="svd", scale_type="tensor", update_proj_gap=2)):
        tensors = full_params(shapes)
        _, params = fsdp_params(ctx, tensors)
        ref_params = plain_params(tensors)

        def groups(ps):
            return [{"params": [p for p in ps if p.dim() == 2], **keys}, {"params": [p for p in ps if p.dim() != 2]}]

        opt = lowmemopt.APOLLOAdamW(groups(params), lr=1e-2, weight_decay=0.01)
        ref_opt = lowmemopt.APOLLOAdamW(groups(ref_params), lr=1e-2, weight_decay=0.01)
        step_both(opt, params, ref_opt, ref_params, targets(shapes), 4)
        compare(params, ref_params, f"APOLLO {keys}")
        compare_state(opt, params, ref_opt, ref_params, f"APOLLO {keys} state")


# ---------------------------------------------------------------------------------------------------------------------


def _worker(rank, world, port, out, backend, names):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    ctx = Ctx(rank, world, device, out)
    run_cases(CASES, names, ctx, out, rank)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="lowmemopt-dist-")
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("LOWMEMOPT_COMPILE", "0")  # for the spawned ranks: the compiled CPU path is tested elsewhere
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {sorted(CASES)}")
    mp.spawn(_worker, args=(args.world_size, free_port(), out, args.backend, names), nprocs=args.world_size)
    print(out)


if __name__ == "__main__":
    main()
