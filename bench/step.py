"""Optimizer step time and state size on a LLaMA-style model: lowmemopt AdamW (32/16/8-bit state) against torch
AdamW (fused, foreach), bitsandbytes AdamW8bit and torchao AdamW8bit, in one run.

Every optimizer gets fresh copies of the same initial parameters and the same fixed gradients. For each one the script
runs ``--warmup`` steps, times ``--steps`` steps and reports the median, as a ratio to torch's fused AdamW measured in
the same run, plus the optimizer state in bytes per parameter.

    cd /tmp && python /path/to/repo/bench/step.py --small          # ~11M parameters, quick
    cd /tmp && python /path/to/repo/bench/step.py --json step.json # ~148M parameters

(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import json
import sys

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_bench_args(__doc__.split("\n\n")[0], OPTIMIZERS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    preset = "10m" if args.small else "150m"

    info = machine_info(device)
    print("## Optimizer step benchmark\n")
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
                          max_step_s=args.max_step_s)
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
            "settings": {"steps": args.steps, "warmup": args.warmup, "grads": args.grads, "baseline": BASELINE},
            "results": [r.to_dict() for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
