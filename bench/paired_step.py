"""The optimizer step on the CPU beside its reference implementation, paired: lowmemopt's Muon against
``torch.optim.Muon``, its APOLLOAdamW against ``apollo_torch.APOLLOAdamW`` (``--pair apollo``, ``apollo_mini``).

    cd /tmp && python /path/to/lowmemopt/bench/paired_step.py                    # Muon, the ~11M LLaMA's matrices
    cd /tmp && python /path/to/lowmemopt/bench/paired_step.py --preset 150m --rounds 9

The parameters are the hidden matrices of ``lowmemopt.benchmark``'s LLaMA preset (per layer q, k, v, o, gate, up,
down; the embedding, head and norms left out, as Muon users give them to AdamW), fp32, with fixed gradients: the step's
time does not depend on the values. Each optimizer keeps its own copy of the parameters and its own state. Each round
steps every optimizer once, in an order that rotates from round to round; a row's ratio is the median over the rounds
of its step time over the reference's in the same round, so both sides of every ratio ran under the same machine
conditions (``time.thread_time``: CPU time of this thread, steadier than wall time on a shared machine; the matrix
products run on the calling thread when ``--threads 1``, the default). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch

import lowmemopt
from lowmemopt.benchmark import LLAMA_PRESETS, machine_info, state_bytes

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

#: pair name -> (reference label, reference factory, {row label: lowmemopt factory}); each over the same matrices
PAIRS: dict[str, tuple[str, Factory, dict[str, Factory]]] = {
    "muon": (
        "torch.optim.Muon",
        lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.01),
        {
            f"lowmemopt.Muon {bits}-bit": (
                lambda bits: lambda ps: lowmemopt.Muon(ps, lr=0.02, weight_decay=0.01, state_bits=bits)
            )(bits)
            for bits in (32, 8, 4)
        },
    ),
    # every matrix projected at a quarter of the hidden size (rank 64 on the 10m preset), channel-wise
    "apollo": (
        "apollo_torch.APOLLOAdamW",
        lambda ps: _apollo_torch(ps, rank=64),
        {
            f"lowmemopt.APOLLOAdamW {bits}-bit": (
                lambda bits: lambda ps: lowmemopt.APOLLOAdamW([{"params": ps, "rank": 64}], lr=1e-3, state_bits=bits)
            )(bits)
            for bits in (32, 8)
        },
    ),
    "apollo_mini": (
        "apollo_torch.APOLLOAdamW",
        lambda ps: _apollo_torch(ps, rank=1, scale_type="tensor", scale=128.0),
        {
            f"lowmemopt.APOLLOAdamW {bits}-bit": (
                lambda bits: (
                    lambda ps: lowmemopt.APOLLOAdamW(
                        [{"params": ps, "rank": 1, "scale_type": "tensor", "scale": 128.0}],
                        lr=1e-3,
                        state_bits=bits,
                        min_quant_numel=256,
                    )
                )
            )(bits)
            for bits in (32, 8)
        },
    ),
}


def _apollo_torch(params: list[torch.nn.Parameter], **keys) -> torch.optim.Optimizer:
    from apollo_torch import APOLLOAdamW

    group = dict(proj="random", scale_type="channel", update_proj_gap=200, scale=1.0, proj_type="std")
    return APOLLOAdamW([{"params": params, **group, **keys}], lr=1e-3)


def held_bytes(opt: torch.optim.Optimizer) -> int:
    """State bytes, with apollo-torch's projection matrices (kept in a projector object in its state, not as a
    tensor) counted too."""
    projections = sum(
        st["projector"].ortho_matrix.nbytes
        for st in opt.state.values()
        if getattr(st.get("projector"), "ortho_matrix", None) is not None
    )
    return state_bytes(opt) + projections


def matrices(preset: str, seed: int = 0) -> list[torch.nn.Parameter]:
    """The hidden matrices of a LLaMA preset, N(0, 0.02), each with a fixed gradient ``1e-3 N(0, 1)``."""
    c = LLAMA_PRESETS[preset]
    h, i = c["hidden_size"], c["intermediate_size"]
    shapes = ([(h, h)] * 4 + [(i, h), (i, h), (h, i)]) * c["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen).mul_(1e-3)
        out.append(p)
    return out


def copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


def run(pair: str, preset: str, rounds: int, warmup: int) -> str:
    ref_label, ref_factory, rows = PAIRS[pair]
    params = matrices(preset)
    n = sum(p.numel() for p in params)
    opts = {ref_label: ref_factory(copies(params))}
    opts.update({label: make(copies(params)) for label, make in rows.items()})
    times: dict[str, list[float]] = {k: [] for k in opts}
    ratios: dict[str, list[float]] = {k: [] for k in opts}
    names = list(opts)
    for r in range(warmup + rounds):
        shift = r % len(names)
        got = {}
        for name in names[shift:] + names[:shift]:
            t0 = time.thread_time()
            opts[name].step()
            got[name] = time.thread_time() - t0
        print(
            f"  round {r + 1}/{warmup + rounds}{' (warm-up)' if r < warmup else ''}: "
            + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in got.items()),
            file=sys.stderr,
            flush=True,
        )
        if r >= warmup:
            for name in names:
                times[name].append(got[name])
                ratios[name].append(got[name] / got[ref_label])
    lines = [
        f"{len(params)} matrices of the {preset} LLaMA ({n / 1e6:.1f}M parameters), {rounds} rounds, "
        f"{torch.get_num_threads()} thread(s)",
        "",
        f"| optimizer | state B/param | median step (ms, CPU time) | vs {ref_label} (median; quartiles) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in names:
        q = statistics.quantiles(ratios[name], n=4) if len(ratios[name]) >= 4 else None
        spread = f"; {q[0]:.2f}-{q[2]:.2f}" if q else ""
        lines.append(
            f"| {name} | {held_bytes(opts[name]) / n:.3f} | {1e3 * statistics.median(times[name]):.0f} | "
            f"{statistics.median(ratios[name]):.2f}x{spread} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="muon", choices=sorted(PAIRS))
    ap.add_argument("--preset", default="10m", choices=sorted(LLAMA_PRESETS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info(torch.device("cpu"))
    print(f"torch {info['torch']}, {info['cpu']}", file=sys.stderr)
    print(run(args.pair, args.preset, args.rounds, args.warmup))


if __name__ == "__main__":
    main()
