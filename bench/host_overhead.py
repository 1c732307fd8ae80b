"""Host work of one optimizer step on the fused-kernel path: the CPU time ``opt.step()`` spends in Python and torch
dispatch per step, per parameter, with a LLaMA-shaped list of tensors (the target: no host work that scales with
the number of parameters).

    cd /tmp && python /path/to/lowmemopt/bench/host_overhead.py                  # CPU: kernels gated, not launched
    python /path/to/lowmemopt/bench/host_overhead.py --device cuda --layers 22     # GPU: real launches (asynchronous)
    python /path/to/lowmemopt/bench/host_overhead.py --galore 16 --optimizers "lowmemopt AdamW 8-bit"

On a GPU the kernels are launched for real; kernel launches are asynchronous, so the step's CPU time (the thread's
CPU time, ``time.thread_time``: not the wall time, which a loaded machine inflates) is the host's share, and the
anchors' (torch's fused and foreach AdamW) is measured the same way in the same run. On the CPU the step takes the
Triton path under the interpreter gate (``TRITON_INTERPRET=1`` is set here before lowmemopt is imported) with every
launch replaced by building its launch table: everything the host does on a GPU except the launch calls themselves
(no anchors: torch's CPU optimizers do their arithmetic on the host). Tensors are small (``--hidden``): host work does
not depend on their size.

The ``capturable`` rows take ``capturable=True`` steps eagerly (``opt.step()`` only; no GaLore): the host work a step
does when it is not replayed from a CUDA graph (captured, it does none).

``--mode``: ``step`` (``opt.step()``), ``per-layer`` (the per-layer updates of ``step_in_backward``: every parameter
handed over in backward order, as its hook does, to :class:`lowmemopt.per_layer.PerLayerSteps`: stepped alone, or
with ``--bucket-bytes`` held and stepped in buckets; then the end of the backward pass's one flag read), or ``both``
(default; their rounds alternate, on one optimizer). ``--galore RANK``:
the attention and MLP matrices in a GaLore group (basis refreshed on the first step only); on the CPU the batched
products CUDA takes run there (``lowmemopt.projection.batched.BATCH_ON_CPU``), so the host work is CUDA's.
``--per-parameter-groups``: one param group per parameter with equal values (u-muP's layout): buckets go by the
groups' values, so the launches are those of one group.

Columns: host ms per step (median of ``--repeat`` rounds of ``--steps`` steps), µs per parameter, and for the
per-layer updates their ratio to ``opt.step()`` (``both``).
"""

from __future__ import annotations

import argparse
import contextlib
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
    "lowmemopt AdamW 8-bit": lambda ps: lowmemopt.AdamW(
        ps, lr=1e-4, weight_decay=0.01, state_bits=8, min_quant_numel=0
    ),
    "lowmemopt AdamW 4-bit": lambda ps: lowmemopt.AdamW(
        ps, lr=1e-4, weight_decay=0.01, state_bits=4, min_quant_numel=0
    ),
    "lowmemopt Lion 8-bit": lambda ps: lowmemopt.Lion(ps, lr=1e-5, state_bits=8, min_quant_numel=0),
    "lowmemopt CAME 8-bit": lambda ps: lowmemopt.CAME(ps, lr=1e-4, state_bits=8, min_quant_numel=0),
    # paged state within its budget (all of it resident): what paging costs the host when nothing moves
    "lowmemopt AdamW 8-bit paged resident": lambda ps: lowmemopt.AdamW(
        ps, lr=1e-4, weight_decay=0.01, state_bits=8, min_quant_numel=0, paged="cpu", page_budget_bytes=1 << 40
    ),
    # capturable=True taken eagerly (not captured): what the device-side counts and scalars cost the host
    "lowmemopt AdamW 8-bit capturable": lambda ps: lowmemopt.AdamW(
        ps, lr=_lr_tensor(ps, 1e-4), weight_decay=0.01, state_bits=8, min_quant_numel=0, capturable=True
    ),
    "lowmemopt CAME 8-bit capturable": lambda ps: lowmemopt.CAME(
        ps, lr=_lr_tensor(ps, 1e-4), state_bits=8, min_quant_numel=0, capturable=True
    ),
}
#: rows that take opt.step() only (per-layer updates and GaLore groups do not take capturable=True)
STEP_ONLY = {name for name in OPTIMIZERS if name.endswith("capturable")}
ANCHORS: dict[str, Callable] = {
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
}


def _lr_tensor(groups: list, lr: float) -> torch.Tensor:
    """A learning rate as a 0-dim tensor on the parameters' device (a scheduler can change it in place)."""
    first = groups[0]["params"][0] if isinstance(groups[0], dict) else groups[0]
    return torch.tensor(lr, device=first.device)


def llama_shapes(layers: int, hidden: int, vocab: int) -> list[tuple[int, ...]]:
    """A LLaMA's parameter list: embedding, per layer 4 attention and 3 MLP matrices and 2 norms, final norm, head."""
    inter = (hidden * 8 // 3 + 7) // 8 * 8
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)] + [(hidden,)] * 2
    return shapes + [(hidden,), (vocab, hidden)]


def _stub_launches() -> None:
    """CPU: every kernel launch only builds its launch tables (the host's part of it: with the device-side
    finiteness flags, the masked table too); GaLore's apply pass builds its tables and launches nothing."""
    from lowmemopt.kernels import check, launch, unproject

    def launch_tables_only(self, kernel, rows, counts, args, *, writes, memo_key=None, **meta):
        if sum(counts):
            self.tables(rows, counts, memo_key)
            self.written = self.written or writes

    launch.Bucket.launch = launch_tables_only

    class _NoLaunch:  # kernels launched after their tables are built (GaLore's apply pass, the gradients' check)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    unproject._apply_kernel = _NoLaunch()
    check._sumsq_kernel = _NoLaunch()


def make_params(shapes, device: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def param_groups(params: list[torch.nn.Parameter], rank: int | None, per_parameter: bool = False) -> list:
    """The parameters as ``make`` takes them: a plain list, or with ``rank`` two groups, the attention and MLP
    matrices (every 2-D tensor but the embedding and the head, as ``galore_param_groups`` picks them) in a GaLore
    group whose basis is refreshed on the first step only (host work per step, not SVDs), the rest full rank.
    ``per_parameter``: one group per parameter, all with the same values (as u-muP's ``scaled_parameters`` makes
    them for parameters of one scale): the fused kernels bucket them by value, one launch as for one group."""
    if per_parameter:
        return [{"params": [p]} for p in params]
    if rank is None:
        return params
    mats = [p for p in params[1:-1] if p.dim() == 2]
    rest = [params[0]] + [p for p in params[1:-1] if p.dim() != 2] + [params[-1]]
    return [{"params": mats, "rank": rank, "update_proj_gap": 10**9}, {"params": rest}]


def per_layer(opt, bucket_bytes: int = 0) -> Callable[[], None]:
    """One step as ``step_in_backward`` takes it: each parameter in backward order (reversed) handed to
    :class:`lowmemopt.per_layer.PerLayerSteps` as its post-accumulate-grad hook does (grad mode off, as in
    backward()): stepped alone, or held and stepped in buckets of ``bucket_bytes``; then the end of the backward
    pass (the held ones, the one flag read). The updates free the gradients: each round puts them back at its end (a
    few hundred attribute writes, counted)."""
    from lowmemopt.per_layer import PerLayerSteps

    order = [(p, g) for g in opt.param_groups for p in g["params"]][::-1]
    grads = [p.grad for p, _ in order]
    updates = PerLayerSteps(opt, bucket_bytes)

    def run() -> None:
        with torch.no_grad():  # as in backward(), whose hooks run with grad mode off
            for p, group in order:
                updates.add(p, group)
        updates.finish()
        for (p, _), g in zip(order, grads):  # (for the next round, and for opt.step()'s)
            p.grad = g

    return run


def host_ms(
    make: Callable,
    shapes,
    device: str,
    dtype: torch.dtype,
    steps: int,
    repeat: int,
    modes: tuple[str, ...],
    rank: int | None = None,
    bucket_bytes: int = 0,
    per_parameter: bool = False,
) -> dict[str, float]:
    """Per mode (``"step"``: ``opt.step()``; ``"per-layer"``: :func:`per_layer`), the median over ``repeat`` rounds of
    the thread's CPU time per step, in ms. The modes' rounds alternate, on one optimizer."""
    opt = make(param_groups(make_params(shapes, device, dtype), rank, per_parameter))
    runs = {"step": opt.step, "per-layer": per_layer(opt, bucket_bytes) if "per-layer" in modes else None}
    for mode in modes:
        for _ in range(3):  # state made, kernels compiled, tables cached
            runs[mode]()
    if device == "cuda":
        torch.cuda.synchronize()
    rounds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeat):
        for mode in modes:
            t = time.thread_time()
            for _ in range(steps):
                runs[mode]()
            rounds[mode].append((time.thread_time() - t) / steps * 1e3)
            if device == "cuda":
                torch.cuda.synchronize()
    return {mode: statistics.median(r) for mode, r in rounds.items()}


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
    ap.add_argument(
        "--mode",
        choices=("step", "per-layer", "both"),
        default="both",
        help="opt.step(), the per-layer updates of step_in_backward, or both (alternated)",
    )
    ap.add_argument(
        "--galore", type=int, metavar="RANK", help="the attention and MLP matrices in a GaLore group of this rank"
    )
    ap.add_argument(
        "--bucket-bytes",
        type=int,
        default=0,
        help="per-layer updates held and stepped in buckets of this many gradient bytes "
        "(step_in_backward's bucket_bytes; 0: each parameter alone)",
    )
    ap.add_argument(
        "--per-parameter-groups",
        action="store_true",
        help="one param group per parameter, equal values (u-muP's layout for parameters of one scale)",
    )
    args = ap.parse_args(argv)
    if args.per_parameter_groups and args.galore is not None:
        print("--per-parameter-groups and --galore: choose one", file=sys.stderr)
        return 2
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
        # one intra-op thread: the tensors are tiny, and on a loaded machine the timed thread would count the
        # OpenMP barriers' spinning of torch's worker threads (GaLore's batched products), 2-6x the host work
        torch.set_num_threads(1)
        if args.galore is not None:  # the batched products CUDA takes (the CPU's own are per matrix)
            from lowmemopt.projection import batched as galore_batched

            galore_batched.BATCH_ON_CPU = True
    modes = ("step", "per-layer") if args.mode == "both" else (args.mode,)
    matrices = sum(len(s) == 2 for s in shapes[1:-1])  # (param_groups' selection: not the embedding and the head)
    galore = "" if args.galore is None else f", GaLore rank {args.galore} on {matrices} matrices"
    if args.bucket_bytes and "per-layer" in modes:
        galore += f", per-layer buckets of {args.bucket_bytes} bytes"
    if args.per_parameter_groups:
        galore += ", one param group per parameter"
    lines = [
        f"{len(shapes)} tensors ({args.layers} layers, hidden {args.hidden}){galore}, {args.dtype}, "
        f"{args.device}, torch {torch.__version__}",
        "| optimizer | mode | host ms / step | µs / parameter | × step() |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, make in rows.items():
        step_only = name in ANCHORS or name in STEP_ONLY  # (per-layer updates are lowmemopt's: step_in_backward)
        if (step_only and "step" not in modes) or (name in STEP_ONLY and args.galore is not None):
            continue
        row_modes = ("step",) if step_only else modes
        with runtime.cpu_interpreter() if args.device == "cpu" else contextlib.nullcontext():
            ms = host_ms(
                make,
                shapes,
                args.device,
                dtype,
                args.steps,
                args.repeat,
                row_modes,
                args.galore,
                args.bucket_bytes,
                args.per_parameter_groups,
            )
        for mode, value in ms.items():
            ratio = f"{value / ms['step']:.2f}" if mode != "step" and "step" in ms else ""
            lines.append(
                f"| {name} | {'step()' if mode == 'step' else mode} | {value:.2f} | "
                f"{1e3 * value / len(shapes):.1f} | {ratio} |"
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
