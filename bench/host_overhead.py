"""Host work of one optimizer step on the fused-kernel path: the CPU time ``opt.step()`` spends in Python and torch
dispatch per step, per parameter, with a LLaMA-shaped list of tensors (issue 17: no host work that scales with the
number of parameters).

    cd /tmp && python /path/to/lowmemopt/bench/host_overhead.py                  # CPU: kernels gated, not launched
    python /path/to/lowmemopt/bench/host_overhead.py --device cuda --layers 22     # GPU: real launches (asynchronous)

On a GPU the kernels are launched for real; kernel launches are asynchronous, so the step's CPU time (the thread's
CPU time, ``time.thread_time``: not the wall time, which a loaded machine inflates) is the host's share, and the
anchors' (torch's fused and foreach AdamW) is measured the same way in the same run. On the CPU the step takes the
Triton path under the interpreter gate (``TRITON_INTERPRET=1`` is set here before lowmemopt is imported) with every
launch replaced by building its launch table: everything the host does on a GPU except the launch calls themselves
(no anchors: torch's CPU optimizers do their arithmetic on the host). Tensors are small (``--hidden``): host work does
not depend on their size.

Columns: parameters, host ms per step (median of ``--repeat`` rounds of ``--steps`` steps), and µs per parameter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("TRITON_INTERPRET", "0" if "--device" in sys.argv and "cuda" in sys.argv else "1")

import torch  # noqa: E402

import lowmemopt  # noqa: E402

OPTIMIZERS: dict[str, Callable] = {
    "lowmemopt AdamW 32-bit": lambda ps: lowmemopt.AdamW(ps, lr=1e-4, weight_decay=0.01),
    "lowmemopt AdamW 8-bit": lambda ps: lowmemopt.AdamW(ps, lr=1e-4, weight_decay=0.01, state_bits=8,
                                                        min_quant_numel=0),
    "lowmemopt AdamW 4-bit": lambda ps: lowmemopt.AdamW(ps, lr=1e-4, weight_decay=0.01, state_bits=4,
                                                        min_quant_numel=0),
    "lowmemopt Lion 8-bit": lambda ps: lowmemopt.Lion(ps, lr=1e-5, state_bits=8, min_quant_numel=0),
    "lowmemopt CAME 8-bit": lambda ps: lowmemopt.CAME(ps, lr=1e-4, state_bits=8, min_quant_numel=0),
}
ANCHORS: dict[str, Callable] = {
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
}


def llama_shapes(layers: int, hidden: int, vocab: int) -> list[tuple[int, ...]]:
    """A LLaMA's parameter list: embedding, per layer 4 attention and 3 MLP matrices and 2 norms, final norm, head."""
    inter = (hidden * 8 // 3 + 7) // 8 * 8
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)] + [(hidden,)] * 2
    return shapes + [(hidden,), (vocab, hidden)]


def _stub_launches() -> None:
    """CPU: every kernel launch only builds its launch tables (the host's part of it)."""
    from lowmemopt.kernels import launch
    from lowmemopt.kernels.table import device_table, unit_map

    def launch_tables_only(self, kernel, rows, counts, args, *, writes, **meta):
        if sum(counts):
            device_table(rows, self.device)
            unit_map(counts, self.device)
            self.written = self.written or writes

    launch.Bucket.launch = launch_tables_only


def host_ms(make: Callable, shapes, device: str, dtype: torch.dtype, steps: int, repeat: int) -> float:
    """Median over ``repeat`` rounds of the thread's CPU time per ``opt.step()``, in ms."""
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    for _ in range(3):  # state made, kernels compiled, tables cached
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    rounds = []
    for _ in range(repeat):
        t = time.thread_time()
        for _ in range(steps):
            opt.step()
        rounds.append((time.thread_time() - t) / steps * 1e3)
        if device == "cuda":
            torch.cuda.synchronize()
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers (22: 201 tensors, as TinyLlama-1.1B)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--optimizers", help="comma-separated subset of the rows")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    from lowmemopt.kernels import runtime

    if not runtime.HAS_TRITON:
        print("Triton is not installed: there is no fused-kernel path to measure", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    shapes = llama_shapes(args.layers, args.hidden, args.vocab)
    rows = dict(OPTIMIZERS, **(ANCHORS if args.device == "cuda" else {}))
    if args.optimizers:
        wanted = {n.strip() for n in args.optimizers.split(",")}
        rows = {k: v for k, v in rows.items() if k in wanted}
    if args.device == "cpu":
        _stub_launches()
    lines = [f"{len(shapes)} tensors ({args.layers} layers, hidden {args.hidden}), {args.dtype}, {args.device}, "
             f"torch {torch.__version__}",
             "| optimizer | host ms / step | µs / parameter |", "| --- | ---: | ---: |"]
    for name, make in rows.items():
        if args.device == "cpu":
            with runtime.cpu_interpreter():
                ms = host_ms(make, shapes, "cpu", dtype, args.steps, args.repeat)
        else:
            ms = host_ms(make, shapes, "cuda", dtype, args.steps, args.repeat)
        lines.append(f"| {name} | {ms:.2f} | {1e3 * ms / len(shapes):.1f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
