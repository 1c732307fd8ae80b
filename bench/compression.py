"""Communication-compressed data parallelism: bytes sent per rank and step, and the loss, on the demo's LLaMA.

Every method trains the same randomly initialised byte-level ``LlamaForCausalLM`` (``lowmemopt.demo``, 1.9M
parameters) on gloo ranks, each rank on its own batches of the standard library's sources, and reports one row:

    method | optimizer | bytes sent per rank per step | x fewer than DDP fp32 | final train loss | held-out loss |
    vs AdamW

Bytes are counted by wrapping the ``torch.distributed`` collectives that the methods call from Python (DDP's
reduction goes through an explicit comm hook, ``allreduce_hook``, so that it is counted too), each as a ring moves
it: an all-reduce of B bytes sends ``2 (N - 1) / N * B`` per rank, an all-to-all of B bytes ``(N - 1) / N * B``, an
all-gather of B bytes per rank ``(N - 1) * B``, a ``batch_isend_irecv`` the bytes of its sends (gossip). Construction
(the parameter broadcast) is not counted. Every row runs the same learning-rate schedule (``--schedule``, default a
linear warm-up over the warm-up steps, the 1-bit optimizers' freeze step, then a cosine decay to 0.1x, as the
papers warm up before freezing the variance).

Methods are rows of :data:`METHODS` (a name and a function that wraps the model and makes the optimizer), so other
DDP communication hooks (sparsified SGD, gossip) are one entry each. Run from outside the repository root::

    cd /tmp && python /path/to/lowmemopt/bench/compression.py --steps 200 --warmup 0.15 --json compression.json

Targets: over a run with 15% warm-up, 1-bit Adam sends at least 5x fewer bytes than DDP fp32, 0/1 Adam at least 15x,
and their final losses stay within 2% of AdamW's with the same ``state_bits``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# ---------------------------------------------------------------------------------------------------------------------
# counting bytes


class ByteCounter:
    """Wraps the Python-level collectives of ``torch.distributed`` and adds what each sends per rank."""

    NAMES = (
        "all_reduce",
        "all_to_all_single",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "broadcast",
        "batch_isend_irecv",
    )

    def __init__(self, world: int) -> None:
        self.world = world
        self.sent = 0
        self.enabled = False
        self._saved: dict[str, Callable] = {}

    def _bytes(self, name: str, args: tuple, kwargs: dict) -> int:
        n = self.world

        def size(t):
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        if name == "all_reduce":
            return int(2 * (n - 1) / n * size(args[0]))
        if name == "all_to_all_single":
            return int((n - 1) / n * size(args[1] if len(args) > 1 else kwargs["input"]))
        if name == "all_gather":
            return (n - 1) * size(args[1] if len(args) > 1 else kwargs["tensor"])
        if name in ("all_gather_into_tensor", "all_gather_single"):
            return (n - 1) * size(args[1] if len(args) > 1 else kwargs["input_tensor"])
        if name == "reduce_scatter_tensor":
            return int((n - 1) / n * size(args[1] if len(args) > 1 else kwargs["input"]))
        if name == "broadcast":
            return size(args[0])  # (an upper bound: the source sends it)
        if name == "batch_isend_irecv":  # the sends of the batch (gossip): each goes to one peer
            ops = args[0] if args else kwargs["p2p_op_list"]
            return sum(size(op.tensor) for op in ops if getattr(op.op, "__name__", "") == "isend")
        return 0

    def install(self) -> None:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                if self.enabled:
                    self.sent += self._bytes(_name, args, kwargs)
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapped)

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


# ---------------------------------------------------------------------------------------------------------------------
# the methods: each wraps the model and makes the optimizer


@dataclass
class Setup:
    model: torch.nn.Module  # what the forward pass calls (a DDP wrapper, or the model)
    optimizer: torch.optim.Optimizer
    label: str  # the optimizer and its settings


def _adamw(params, args):
    import lowmemopt

    return lowmemopt.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, state_bits=args.state_bits)


def _ddp(model, hook, state=None):
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    ddp.register_comm_hook(state, hook)
    return ddp


def ddp_fp32(model, args, warmup):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = _ddp(model, default_hooks.allreduce_hook)
    return Setup(ddp, _adamw(ddp.parameters(), args), f"AdamW {args.state_bits}-bit")


def bf16_any_backend(state, bucket):
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name outside NCCL, though gloo reduces
    bf16 tensors too."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


bf16_any_backend.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def ddp_bf16(model, args, warmup):
    ddp = _ddp(model, bf16_any_backend)
    return Setup(ddp, _adamw(ddp.parameters(), args), f"AdamW {args.state_bits}-bit")


def ddp_powersgd_one_bucket(rank):
    def make(model, args, warmup):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=max(2, warmup),
            use_error_feedback=True,
            warm_start=True,
        )
        # one bucket (bucket_cap_mb above the model's gradients; an explicit cap applies to the first bucket too):
        # powerSGD_hook's chained all-reduces of several buckets can reach gloo in different orders on the ranks
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=1024)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return Setup(
            ddp,
            _adamw(ddp.parameters(), args),
            f"AdamW {args.state_bits}-bit, rank {rank} from step {max(2, warmup)}, one bucket",
        )

    return make


def ddp_sparsified(method):
    def make(model, args, warmup):
        from lowmemopt.distributed.sparsified import SparsifiedState, sparsified_hook

        state = SparsifiedState(ratio=args.sparsified_ratio, method=method, start_iter=2, seed=args.seed)
        ddp = _ddp(model, sparsified_hook, state)
        return Setup(
            ddp,
            _adamw(ddp.parameters(), args),
            f"AdamW {args.state_bits}-bit, {method}-k ratio {args.sparsified_ratio} from step 2",
        )

    return make


def gossip_ring(model, args, warmup):
    from torch.distributed.optim import PostLocalSGDOptimizer

    from lowmemopt.distributed.gossip import GossipAverager, ring

    opt = PostLocalSGDOptimizer(_adamw(model.parameters(), args), GossipAverager(ring(dist.get_world_size()), period=1))
    return Setup(model, opt, f"AdamW {args.state_bits}-bit (local), ring gossip every step")


def onebit_adam(model, args, warmup):
    import lowmemopt

    opt = lowmemopt.OnebitAdam(
        model.parameters(),
        lr=args.lr,
        weight_decay=args.weight_decay,
        freeze_step=warmup,
        state_bits=args.state_bits,
        bias_correction=args.bias_correction,
    )
    return Setup(model, opt, f"OnebitAdam {args.state_bits}-bit, freeze_step={warmup}{_bc(args)}")


def zero_one_adam(model, args, warmup):
    import lowmemopt

    kw = dict(
        var_freeze_step=warmup,
        var_update_scaler=args.var_update_scaler,
        local_step_scaler=args.local_step_scaler,
        local_step_clipper=args.local_step_clipper,
    )
    opt = lowmemopt.ZeroOneAdam(
        model.parameters(),
        lr=args.lr,
        weight_decay=args.weight_decay,
        state_bits=args.state_bits,
        bias_correction=args.bias_correction,
        **kw,
    )
    return Setup(
        model, opt, f"ZeroOneAdam {args.state_bits}-bit, " + ", ".join(f"{k}={v}" for k, v in kw.items()) + _bc(args)
    )


def onebit_lamb(model, args, warmup):
    import lowmemopt

    opt = lowmemopt.OnebitLAMB(
        model.parameters(),
        lr=args.lamb_lr,
        weight_decay=args.weight_decay,
        freeze_step=warmup,
        state_bits=args.state_bits,
        bias_correction=args.bias_correction,
    )
    return Setup(model, opt, f"OnebitLAMB {args.state_bits}-bit, lr={args.lamb_lr}, freeze_step={warmup}{_bc(args)}")


def _bc(args) -> str:
    return "" if args.bias_correction else ", bias_correction=False"


#: the table's rows: a name and what makes the run's model wrapper and optimizer (model, args, warm-up steps)
METHODS: dict[str, Callable[[torch.nn.Module, Any, int], Setup]] = {
    "DDP fp32": ddp_fp32,
    "DDP + bf16_compress_hook": ddp_bf16,
    "DDP + powerSGD_hook rank 1": ddp_powersgd_one_bucket(1),
    "DDP + powerSGD_hook rank 4": ddp_powersgd_one_bucket(4),
    "DDP + sparsified top-k": ddp_sparsified("top"),
    "DDP + sparsified random-k": ddp_sparsified("random"),
    "DDP + sparsified block-k": ddp_sparsified("block"),
    "gossip (ring) + PostLocalSGDOptimizer": gossip_ring,
    "1-bit Adam": onebit_adam,
    "0/1 Adam": zero_one_adam,
    "1-bit LAMB": onebit_lamb,
}
#: the row whose loss each row is compared with, and the row whose bytes
LOSS_BASELINE = "DDP fp32"


# ---------------------------------------------------------------------------------------------------------------------
# the learning-rate schedule, the same for every row

SCHEDULES = ("warmup-cosine", "warmup-linear", "warmup-constant", "constant")


def lr_factor(step: int, steps: int, warmup: int, schedule: str, floor: float = 0.1) -> float:
    """The multiplier of each group's peak learning rate at ``step`` (0-based): a linear warm-up over the ``warmup``
    steps (the 1-bit optimizers' freeze step), then constant, or a cosine or linear decay to ``floor`` of the peak at
    the last step; ``"constant"`` has no warm-up."""
    if schedule == "constant":
        return 1.0
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "warmup-constant":
        return 1.0
    done = (step - warmup) / max(1, steps - 1 - warmup)
    if schedule == "warmup-linear":
        return 1.0 - (1.0 - floor) * done
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))


# ---------------------------------------------------------------------------------------------------------------------
# one run per method, every rank


def _run(rank: int, world: int, port: int, args: Any, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(max(1, args.threads))
    from lowmemopt.demo import _llama, heldout_loss, stdlib_bytes

    data = stdlib_bytes()
    counter = ByteCounter(world)
    counter.install()
    warmup = max(1, round(args.warmup * args.steps))
    results = {}
    for name in args.methods:
        model = _llama(args.seed)
        setup = METHODS[name](model, args, warmup)
        gen = torch.Generator().manual_seed(1000 * (rank + 1) + args.seed)  # each rank its own batches
        losses, sent = [], []
        peaks = [group["lr"] for group in setup.optimizer.param_groups]
        for step in range(args.steps):
            factor = lr_factor(step, args.steps, warmup, args.schedule)
            for group, peak in zip(setup.optimizer.param_groups, peaks):
                group["lr"] = peak * factor
            idx = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
            windows = data[idx.unsqueeze(1) + torch.arange(args.seq)]
            before = counter.sent
            counter.enabled = True
            loss = setup.model(input_ids=windows, labels=windows).loss
            setup.optimizer.zero_grad()
            loss.backward()
            setup.optimizer.step()
            counter.enabled = False
            sent.append(counter.sent - before)
            losses.append(float(loss.detach()))
        mean = torch.tensor([statistics.fmean(losses[-20:])])
        dist.all_reduce(mean)
        held = heldout_loss(lambda w: model(input_ids=w, labels=w).loss, data, args.seq)
        results[name] = dict(
            label=setup.label,
            bytes_per_step=statistics.fmean(sent),
            final=float(mean) / world,
            heldout=held,
            losses=losses,
        )
        if rank == 0:
            print(
                f"{name}: {results[name]['bytes_per_step']:.0f} B/step, final {results[name]['final']:.4f}", flush=True
            )
    counter.uninstall()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def probe_variance(args: Any) -> str:
    """One process, the global batch of ``--world-size`` ranks, lowmemopt AdamW (32-bit state) under ``--schedule``:
    how the second moment at the freeze step compares with the second moment later. A frozen ``v`` makes the update
    ``m / sqrt(v_freeze)`` where AdamW's is ``m / sqrt(v_t)``: the quantiles of ``sqrt(v_freeze / v_t)`` over the
    elements (bias-corrected) say how much smaller (> 1) or larger (< 1) the frozen steps are than AdamW's."""
    import lowmemopt
    from lowmemopt.demo import _llama, stdlib_bytes

    torch.set_num_threads(max(1, args.threads))
    data = stdlib_bytes()
    model = _llama(args.seed)
    opt = lowmemopt.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, state_bits=32)
    warmup = max(1, round(args.warmup * args.steps))
    gen = torch.Generator().manual_seed(1000 + args.seed)
    marks = sorted({warmup, 2 * warmup, args.steps // 2, args.steps})

    def v_hat() -> torch.Tensor:
        beta2 = opt.defaults["betas"][1]
        parts = [
            opt.state[p]["exp_avg_sq"].reshape(-1) / (1 - beta2 ** float(opt.state[p]["step"]))
            for p in model.parameters()
        ]
        return torch.cat(parts)

    frozen, lines = None, []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step, args.steps, warmup, args.schedule)
        idx = torch.randint(0, data.numel() - args.seq, (args.batch * args.world_size,), generator=gen)
        windows = data[idx.unsqueeze(1) + torch.arange(args.seq)]
        loss = model(input_ids=windows, labels=windows).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 in marks:
            v = v_hat()
            if step + 1 == warmup:
                frozen = v.clone()
            ratio = (frozen / v.clamp_min(1e-30)).sqrt()
            q = torch.quantile(
                ratio[torch.randperm(ratio.numel(), generator=gen)[: 1 << 20]], torch.tensor([0.1, 0.5, 0.9])
            )
            lines.append(
                f"| {step + 1} | {float(loss.detach()):.4f} | {float(v.sqrt().median()):.3e} | "
                f"{q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} |"
            )
    return "\n".join(
        [
            f"AdamW 32-bit, one process, batch {args.batch * args.world_size}, schedule {args.schedule}, "
            f"freeze step {warmup}",
            "",
            "| step t | train loss | median sqrt(v_t) | sqrt(v_freeze / v_t): 10% / 50% / 90% |",
            "| --- | --- | --- | --- |",
            *lines,
        ]
    )


def table(results: dict[str, dict], world: int, steps: int, warmup: int, schedule: str = "constant") -> str:
    base = results.get(LOSS_BASELINE)
    lines = [
        f"{world} gloo ranks, {steps} steps, warm-up {warmup} steps, schedule {schedule}; bytes sent per rank "
        "per step (mean)",
        "",
        "| method | optimizer | bytes / step | x fewer than DDP fp32 | final train loss | held-out loss | "
        "final vs AdamW |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        fewer = f"{base['bytes_per_step'] / r['bytes_per_step']:.1f}" if base and r["bytes_per_step"] else "-"
        rel = f"{100 * (r['final'] / base['final'] - 1):+.2f}%" if base else "-"
        lines.append(
            f"| {name} | {r['label']} | {r['bytes_per_step']:,.0f} | {fewer} | {r['final']:.4f} | "
            f"{r['heldout']:.4f} | {rel} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=float, default=0.15, help="warm-up (freeze step) as a fraction of the steps")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated rows of METHODS")
    ap.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="warmup-cosine",
        help="every row's learning rate: a linear warm-up over --warmup, then a cosine decay to 0.1x (the "
        "default, as 0/1 Adam's GPT-2 runs), a linear decay to 0.1x, or constant; 'constant' has no "
        "warm-up",
    )
    ap.add_argument("--state-bits", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lamb-lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparsified-ratio", type=float, default=0.01)
    ap.add_argument(
        "--var-update-scaler",
        type=int,
        default=2,
        help="0/1 Adam's kappa (DeepSpeed's default, 16, suits runs of ~1e5 steps)",
    )
    ap.add_argument(
        "--local-step-scaler",
        type=int,
        default=None,
        help="0/1 Adam's local interval doubling period; default 0.22 x --steps (44 for 200 steps: the "
        "interval doubles about every quarter of the steps after the freeze, as DeepSpeed's "
        "default, 32678, does over runs of ~1e5 steps)",
    )
    ap.add_argument(
        "--local-step-clipper",
        type=int,
        default=16,
        help="0/1 Adam's longest interval between synchronisations (1: no local steps)",
    )
    ap.add_argument(
        "--no-bias-correction",
        dest="bias_correction",
        action="store_false",
        help="the 1-bit optimizers without bias correction (DeepSpeed's update)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--probe-variance",
        action="store_true",
        help="instead of the table: AdamW's second moment at the freeze step against later steps",
    )
    args = ap.parse_args(argv)
    if args.local_step_scaler is None:
        args.local_step_scaler = max(1, round(0.22 * args.steps))
    if args.probe_variance:
        print(probe_variance(args))
        return
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {list(METHODS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_run, args=(args.world_size, port, args, out), nprocs=args.world_size)
        with open(out) as f:
            results = json.load(f)
    warmup = max(1, round(args.warmup * args.steps))
    print(table(results, args.world_size, args.steps, warmup, args.schedule))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f)


if __name__ == "__main__":
    sys.exit(main())
