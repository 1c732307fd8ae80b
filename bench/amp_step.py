"""``scaler.step(opt)`` under ``torch.amp.GradScaler`` on the CPU: lowmemopt's native loss scaling (the step applies
``1 / scale`` where it loads each gradient, reads ``found_inf`` directly and runs no non-finite check of its own)
against GradScaler's generic path (``unscale_``: one pass multiplying every gradient in place and checking it, then
``found_inf.item()``, then ``step()`` with the optimizer's own non-finite check).

    cd /tmp && python /path/to/repo/bench/amp_step.py                  # ~11M-parameter LLaMA ("10m")
    cd /tmp && python /path/to/repo/bench/amp_step.py --preset 150m --rounds 15

Both sides are the same optimizer class over their own copy of the same fp32 parameters, with the same fixed scaled
gradients copied into ``p.grad`` before every timed call (outside the timing: the generic path unscales them in
place). Each round times one ``scaler.step(opt)`` of each side, in an order that alternates from round to round; the
figure is the median over rounds of generic time / native time (> 1: the native path is faster).
(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lowmemopt
from lowmemopt.benchmark import build_llama, fixed_grads, machine_info

CONFIGS = {
    "AdamW 32-bit": lambda ps: lowmemopt.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "AdamW 8-bit": lambda ps: lowmemopt.AdamW(ps, lr=1e-3, weight_decay=0.01, state_bits=8),
    "Lion 8-bit": lambda ps: lowmemopt.Lion(ps, lr=1e-4, weight_decay=0.01, state_bits=8),
}


def side(model: torch.nn.Module, make, native: bool, grads: list[torch.Tensor], scale: float):
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt = make(params)
    if not native:
        opt._step_supports_amp_scaling = False  # GradScaler's generic path
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**9)
    scaler.scale(torch.ones(()))
    scaled = [g * scale for g in grads]
    for p, g in zip(params, scaled):
        p.grad = g.clone()

    def one() -> float:
        for p, g in zip(params, scaled):
            p.grad.copy_(g)
        t = time.perf_counter()
        scaler.step(opt)
        dt = time.perf_counter() - t
        scaler.update()
        return dt

    return one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="10m")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_llama(args.preset)
    grads = fixed_grads(model)
    n = sum(p.numel() for p in model.parameters())
    info = machine_info(torch.device("cpu"))
    print(
        f"{args.preset}: {n / 1e6:.1f}M parameters, {torch.get_num_threads()} threads; torch {torch.__version__}, "
        f"{info.get('cpu', '')}"
    )
    print(f"{'optimizer':<14} {'native ms':>10} {'generic ms':>11} {'generic / native (median of rounds)':>37}")
    for name, make in CONFIGS.items():
        native, generic = side(model, make, True, grads, 2.0**16), side(model, make, False, grads, 2.0**16)
        for _ in range(args.warmup):
            native(), generic()
        tn, tg, ratios = [], [], []
        for r in range(args.rounds):
            if r % 2:
                b, a = generic(), native()
            else:
                a, b = native(), generic()
            tn.append(a)
            tg.append(b)
            ratios.append(b / a)
        print(
            f"{name:<14} {statistics.median(tn) * 1e3:>10.2f} {statistics.median(tg) * 1e3:>11.2f} "
            f"{statistics.median(ratios):>36.2f}x"
        )


if __name__ == "__main__":
    main()
