"""Factored optimizers' step time and state size on a LLaMA-style model: lowmemopt Adafactor and CAME (32 and 8-bit
state) against transformers' Adafactor, torch.optim.Adafactor, came-pytorch and pytorch-optimizer's CAME, in one run,
with times as ratios to torch's fused AdamW measured in the same run.

Every optimizer gets fresh copies of the same initial parameters and the same fixed gradients, lr 1e-3 and weight
decay 1e-2 (each library's own weight-decay rule); Adafactor runs with an external lr (``relative_step=False``,
``scale_parameter=False``) where it has the flags. Rows ending in ``-m`` keep a first moment (``beta1=0.9``): the only
full-size Adafactor state, so the only one 8 bits can shrink.

    cd /tmp && python /path/to/repo/bench/factored.py --small          # ~11M parameters, quick
    cd /tmp && python /path/to/repo/bench/factored.py --json fac.json  # ~148M parameters

(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from typing import Callable

import torch

from common import (
    BASELINE,
    LLAMA_PRESETS,
    OPTIMIZERS,
    build_llama,
    fixed_grads,
    machine_info,
    parse_bench_args,
    print_table,
    run_benchmark,
)

Factory = Callable[..., torch.optim.Optimizer]


def _lowmemopt(cls_name: str, bits: int, **fixed) -> Factory:
    def make(params, lr, weight_decay):
        import lowmemopt

        return getattr(lowmemopt, cls_name)(params, lr=lr, weight_decay=weight_decay, state_bits=bits, **fixed)

    return make


def _transformers_adafactor(**fixed) -> Factory:
    def make(params, lr, weight_decay):
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=weight_decay, **fixed)

    return make


def _torch_adafactor(params, lr, weight_decay):
    return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)


def _came_pytorch(params, lr, weight_decay):
    from came_pytorch import CAME

    return CAME(params, lr=lr, weight_decay=weight_decay)


def _pytorch_optimizer_came(params, lr, weight_decay):
    from pytorch_optimizer import CAME

    return CAME(params, lr=lr, weight_decay=weight_decay)


_EXTERNAL_LR = dict(relative_step=False, scale_parameter=False)

FACTORED: dict[str, Factory] = {
    BASELINE: OPTIMIZERS[BASELINE],
    "transformers-adafactor": _transformers_adafactor(**_EXTERNAL_LR),
    "lowmemopt-adafactor-32bit": _lowmemopt("Adafactor", 32, **_EXTERNAL_LR),
    "transformers-adafactor-m": _transformers_adafactor(beta1=0.9, **_EXTERNAL_LR),
    "lowmemopt-adafactor-m-32bit": _lowmemopt("Adafactor", 32, beta1=0.9, **_EXTERNAL_LR),
    "lowmemopt-adafactor-m-8bit": _lowmemopt("Adafactor", 8, beta1=0.9, **_EXTERNAL_LR),
    "torch-adafactor": _torch_adafactor,
    "lowmemopt-adafactortorch-32bit": _lowmemopt("AdafactorTorch", 32),
    "came-pytorch": _came_pytorch,
    "pytorch-optimizer-came": _pytorch_optimizer_came,
    "lowmemopt-came-32bit": _lowmemopt("CAME", 32),
    "lowmemopt-came-8bit": _lowmemopt("CAME", 8),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_bench_args(__doc__.split("\n\n")[0], FACTORED, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    preset = "10m" if args.small else "150m"

    info = machine_info(device)
    info["came_pytorch"] = _dist_version("came-pytorch")
    info["pytorch_optimizer"] = _dist_version("pytorch-optimizer")
    print("## Factored optimizers: step time and state\n")
    for key, value in info.items():
        print(f"- {key}: {value}")

    model = build_llama(preset, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"- model: LlamaForCausalLM {LLAMA_PRESETS[preset]}, fp32, {n_params / 1e6:.1f}M parameters "
          f"in {len(list(model.parameters()))} tensors")
    print(f"- gradients: {args.grads} (the same for every optimizer); warm-up {args.warmup}, timed {args.steps} steps, "
          "median reported\n")
    sys.stdout.flush()

    grads = fixed_grads(model, mode=args.grads)
    reference = [p.detach() for p in model.parameters()]
    del model

    results = []
    for name in args.names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r = run_benchmark(name, reference, grads, steps=args.steps, warmup=args.warmup, device=device,
                          max_step_s=args.max_step_s, factory=FACTORED[name])
        print(f"  {name}: median {r.median_s} s, {r.bytes_per_param} B/param {r.error or r.note}",
              file=sys.stderr, flush=True)
        results.append(r)

    base = next((r.median_s for r in results if r.name == BASELINE), None)
    for r in results:
        if base and r.median_s is not None:
            r.ratio = r.median_s / base

    print_table(results)
    info["load_avg_1m_end"] = machine_info(device)["load_avg_1m"]
    print(f"\nload average (1 min) at start {info['load_avg_1m']}, at end {info['load_avg_1m_end']} "
          f"(torch uses {info['torch_threads']} threads; a higher load means contended timings)")

    if args.json:
        payload = {
            "machine": info,
            "model": {"preset": preset, "config": LLAMA_PRESETS[preset], "n_params": n_params},
            "settings": {"steps": args.steps, "warmup": args.warmup, "grads": args.grads, "baseline": BASELINE,
                         "lr": 1e-3, "weight_decay": 1e-2},
            "results": [r.to_dict() for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
