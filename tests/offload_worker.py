"""FSDP2 CPU offload cases (``CPUOffloadPolicy``), run in spawned processes by ``tests/test_offload.py``.

    python tests/offload_worker.py --world-size 2 --out DIR [--cases a,b,...]

The process machinery is ``tests/dist_worker.py``'s: this module registers its cases there and calls its ``main``
(every rank runs every case inside one gloo process group; each rank writes ``DIR/rank<r>.json``).
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

import dist_worker
import lowmemopt
from dist_worker import _where, case, check

#: every lowmemopt optimizer; ``state_bits`` applies to each one's full-size slots (Adafactor's only one is its first
#: moment, hence ``beta1``)
OPTIMIZERS = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.05)),
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.01)),
    (lowmemopt.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.01)),
]
BITS = (32, 16, 8, 4)
STEPS = 3


def model() -> torch.nn.Sequential:
    """Two Linear layers whose rows shard unevenly over 2 ranks (37 = 19 + 18, 11 = 6 + 5)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 11))


def data(n: int = 8, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 13, generator=gen), torch.randn(n, 11, generator=gen)) for _ in range(STEPS)]


def sharded(ctx, policy: OffloadPolicy) -> torch.nn.Module:
    """The model with each Linear and the root under ``fully_shard(..., offload_policy=policy)``."""
    m = model()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=ctx.mesh, offload_policy=policy)
    return fully_shard(m, mesh=ctx.mesh, offload_policy=policy)


def train(ctx, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """``STEPS`` steps, each rank on its slice of the batch (FSDP2 averages the gradients over the ranks)."""
    for x, y in data():
        n = x.shape[0] // ctx.world
        lo = ctx.rank * n
        loss = torch.nn.functional.mse_loss(m(x[lo : lo + n]), y[lo : lo + n])
        opt.zero_grad()
        loss.backward()
        opt.step()


def offloaded(m: torch.nn.Module) -> bool:
    """Whether FSDP2 runs ``m``'s parameters with CPU offload (its parameter group's ``offload_to_cpu``)."""
    groups = [layer._get_fsdp_state()._fsdp_param_group for layer in m if isinstance(layer, torch.nn.Linear)]
    return all(fp.offload_to_cpu for group in groups for fp in group.fsdp_params)


@case
def offload_default_policy_needs_an_accelerator(ctx):
    """``CPUOffloadPolicy()`` pins the sharded parameters (``pin_memory=True``): without an accelerator torch refuses
    in ``fully_shard`` itself; ``pin_memory=False`` is the policy that runs on a CPU-only machine."""
    if torch.accelerator.is_available():
        return
    try:
        fully_shard(model(), mesh=ctx.mesh, offload_policy=CPUOffloadPolicy())
    except RuntimeError as e:
        check("accelerator" in str(e), f"unexpected error: {e}")
    else:
        raise AssertionError("fully_shard(offload_policy=CPUOffloadPolicy()) pinned memory without an accelerator")


@case
def offload_matches_unoffloaded(ctx):
    """Every optimizer at every ``state_bits``: ``STEPS`` steps of the model under ``CPUOffloadPolicy`` equal the same
    run under FSDP2 without offload, parameters and every state tensor bit for bit; on one rank also the plain model's
    run without FSDP (with more ranks the summed gradients round differently, see ``dist_worker.fsdp2_training``)."""
    failures = []
    for cls, kw in OPTIMIZERS:
        for bits in BITS:
            what = f"{cls.__name__} {bits}-bit"
            runs = []
            for policy in (OffloadPolicy(), CPUOffloadPolicy(pin_memory=False)):
                m = sharded(ctx, policy)
                opt = cls(m.parameters(), state_bits=bits, min_quant_numel=0, **kw)
                train(ctx, m, opt)
                runs.append((m, opt))
            (base, base_opt), (off, off_opt) = runs
            if ctx.world == 1:
                plain = model()
                train(ctx, plain, cls(plain.parameters(), state_bits=bits, min_quant_numel=0, **kw))
                for i, (p, q) in enumerate(zip(off.parameters(), plain.parameters())):
                    a, b = p.detach().to_local(), q.detach()
                    if not torch.equal(a, b):
                        failures.append(f"{what}: param {i} {tuple(p.shape)} vs no FSDP: {_where(a, b)}")
            check(offloaded(off) and not offloaded(base), f"{what}: offload policy not in effect")
            for i, (p, q) in enumerate(zip(off.parameters(), base.parameters())):
                a, b = p.detach().to_local(), q.detach().to_local()
                if not torch.equal(a, b):
                    failures.append(f"{what}: param {i} {tuple(p.shape)}: {_where(a, b)}")
                sa, sb = off_opt.state[p], base_opt.state[q]
                if sorted(sa) != sorted(sb):
                    failures.append(f"{what}: param {i}: state keys {sorted(sa)} vs {sorted(sb)}")
                    continue
                for key, v in sb.items():
                    u = sa[key]
                    same = torch.equal(u, v) if isinstance(v, torch.Tensor) else u == v
                    if not same:
                        failures.append(f"{what}: param {i} state {key} differs")
    check(not failures, "\n".join(failures))


OFFLOAD_CASES = [n for n in dist_worker.CASES if n.startswith("offload_")]

if __name__ == "__main__":
    dist_worker.main(sys.argv[1:] if "--cases" in sys.argv else [*sys.argv[1:], "--cases", ",".join(OFFLOAD_CASES)])
