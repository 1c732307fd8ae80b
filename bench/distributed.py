"""Optimizer state per rank under FSDP2 (``fully_shard``) as the world size grows, on CPU with gloo.

Builds the same randomly initialised ``LlamaForCausalLM`` in every process, shards each decoder layer and the root
with ``fully_shard``, gives every parameter the same fixed random gradient (a DTensor laid out like it), and runs each
optimizer for ``--warmup`` + ``--steps`` steps. It reports, per world size, the optimizer state held by each rank (the
largest rank; state lives on the local shard, so it should fall as 1 / world size) and the sum over ranks (no
replication: it should stay the world-size-1 figure), with the median step time. Run from outside the repository root::

    cd /tmp && python /path/to/lowmemopt/bench/distributed.py --world-sizes 1,2,4 --json dist.json

Processes are started with ``torch.multiprocessing`` (one job per world size); on a machine with fewer cores than
processes the step times measure contention, the memory figures do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import LLAMA_PRESETS, build_llama, machine_info, state_bytes


def _lowmemopt(name: str, **kw):
    def make(params):
        import lowmemopt

        return getattr(lowmemopt, name)(params, **kw)

    return make


def _galore_adamw(params):
    import lowmemopt

    return lowmemopt.AdamW(params, lr=1e-3, weight_decay=1e-2)


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)


def _torch_adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2)


def _bnb_adamw8bit(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=1e-2)


OPTIMIZERS = {
    "lowmemopt-adamw-32bit": _lowmemopt("AdamW", lr=1e-3, weight_decay=1e-2),
    "lowmemopt-adamw-8bit": _lowmemopt("AdamW", lr=1e-3, weight_decay=1e-2, state_bits=8),
    "lowmemopt-adafactor": _lowmemopt("Adafactor"),
    "lowmemopt-came-8bit": _lowmemopt("CAME", lr=2e-4, state_bits=8),
    "lowmemopt-galore-adamw": _galore_adamw,  # rank 64 on the attention and MLP weights (see _param_groups)
    "lowmemopt-galore-adamw-right": _galore_adamw,  # the same with proj_type="right"
    "torch-adamw": _torch_adamw,
    "torch-adafactor": _torch_adafactor,
    "bnb-adamw8bit": _bnb_adamw8bit,
}
DEFAULT = ["lowmemopt-adamw-32bit", "lowmemopt-adamw-8bit", "lowmemopt-adafactor", "lowmemopt-came-8bit", "torch-adamw"]


def _param_groups(name: str, model: torch.nn.Module, params: list) -> list:
    """All parameters; for the GaLore rows, GaLore's usual groups: rank 64 (a quarter of the 10m preset's hidden size;
    update_proj_gap 200, scale 0.25) on the attention and MLP weights, everything else unprojected. ``proj_type``
    "std" projects a wide matrix on its left side, whose low-rank state is replicated under FSDP2; "right" projects
    every matrix on its right side, whose state is sharded by rows (docs/distributed.md)."""
    if "galore" not in name:
        return params
    import lowmemopt

    proj_type = "right" if name.endswith("-right") else "std"
    return lowmemopt.galore_param_groups(model, target_modules=["attn", "mlp"], rank=64, proj_type=proj_type)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOWMEMOPT_COMPILE=os.environ.get("LOWMEMOPT_COMPILE", "0")
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, args.threads))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for name in args.names:
        row = {"name": name, "world_size": world}
        try:
            model = build_llama(args.preset)
            n_params = sum(p.numel() for p in model.parameters())
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            params = list(model.parameters())
            gen = torch.Generator().manual_seed(0)
            for p in params:
                g = torch.randn(p.shape, generator=gen).mul_(1e-3)
                p.grad = distribute_tensor(g, mesh, p.placements)
            opt = OPTIMIZERS[name](_param_groups(name, model, params))
            times = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                dist.barrier()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            local = torch.tensor([state_bytes(opt), sum(p.to_local().numel() * 4 for p in params)], dtype=torch.float64)
            biggest, total = local.clone(), local.clone()
            dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            row.update(
                params=n_params,
                state_bytes_max_rank=int(biggest[0]),
                state_bytes_total=int(total[0]),
                param_bytes_max_rank=int(biggest[1]),
                median_step_s=statistics.median(times),
                times_s=times,
            )
            del opt, model, params
        except Exception as exc:  # noqa: BLE001 - a failing optimizer is a row, not a crash
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        rows.append(row)
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out, f"ws{world}.json"), "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    ap.add_argument("--preset", default="10m", choices=sorted(LLAMA_PRESETS), help="model size (default 10m)")
    ap.add_argument(
        "--optimizers", default=",".join(DEFAULT), help="comma-separated subset of: " + ", ".join(OPTIMIZERS)
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    args.names = [n for n in args.optimizers.split(",") if n]
    unknown = sorted(set(args.names) - set(OPTIMIZERS))
    if unknown:
        ap.error(f"unknown optimizer(s) {unknown}; choose from {sorted(OPTIMIZERS)}")
    sizes = [int(w) for w in args.world_sizes.split(",")]
    out = tempfile.mkdtemp(prefix="lowmemopt-bench-dist-")
    info = machine_info(torch.device("cpu"))
    results = []
    for world in sizes:
        mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world)
        results += json.load(open(os.path.join(out, f"ws{world}.json")))
    info["load_avg_1m_end"] = machine_info(torch.device("cpu"))["load_avg_1m"]

    print(
        f"LLaMA preset {args.preset}, gloo on CPU, {args.threads} thread(s) per rank; torch {info['torch']}; "
        f"load {info['load_avg_1m']} -> {info['load_avg_1m_end']}"
    )
    head = " | ".join(f"W={w}" for w in sizes)
    print(f"\nOptimizer state per rank, MiB (largest rank); in brackets: sum over ranks / the W={sizes[0]} state\n")
    print(f"| optimizer | {head} |")
    print("| --- |" + " ---: |" * len(sizes))
    by = {(r["name"], r["world_size"]): r for r in results}
    for name in args.names:
        cells = []
        base = by.get((name, sizes[0]), {}).get("state_bytes_total")
        for w in sizes:
            r = by[(name, w)]
            if "error" in r:
                cells.append(f"FAILED: {r['error']}".replace("|", "\\|"))
                continue
            ratio = f" ({r['state_bytes_total'] / base:.3f}x)" if base else ""
            cells.append(f"{r['state_bytes_max_rank'] / 2**20:.2f}{ratio}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nMedian step time, s\n")
    print(f"| optimizer | {head} |")
    print("| --- |" + " ---: |" * len(sizes))
    for name in args.names:
        cells = ["—" if "error" in by[(name, w)] else f"{by[(name, w)]['median_step_s']:.3f}" for w in sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    params = next((r["params"] for r in results if "params" in r), None)
    print(
        f"\n{params} parameters; fp32 parameter shard per rank (largest), MiB: "
        + ", ".join(f"W={w}: {by[(args.names[0], w)].get('param_bytes_max_rank', 0) / 2**20:.2f}" for w in sizes)
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"machine": info, "settings": {k: v for k, v in vars(args).items()}, "results": results}, fh, indent=1
            )


if __name__ == "__main__":
    sys.exit(main())
