"""Quickstart: train a small byte-level language model on the Python standard library's source with a few lowmemopt
optimizers, and print state memory, step time and final loss (the mean of the last 20 steps' losses) next to
torch.optim.AdamW. Runs offline on the CPU in about 10 seconds of CPU time (measured: 9.9 s on one thread of a 2-core
AMD EPYC VM).

    python examples/quickstart.py [--steps 300]
"""

import argparse

import torch

import lowmemopt
from lowmemopt.demo import stdlib_bytes, train_bytes

CHOICES = {
    "torch.optim.AdamW": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
    "lowmemopt.AdamW (32-bit)": lambda p: lowmemopt.AdamW(p, lr=3e-3, weight_decay=0.01),
    "lowmemopt.AdamW (16-bit)": lambda p: lowmemopt.AdamW(p, lr=3e-3, weight_decay=0.01, state_bits=16),
    "lowmemopt.AdamW8bit": lambda p: lowmemopt.AdamW8bit(p, lr=3e-3, weight_decay=0.01),
    "lowmemopt.Lion8bit": lambda p: lowmemopt.Lion8bit(p, lr=3e-4, weight_decay=0.01),
    "lowmemopt.LAMB8bit": lambda p: lowmemopt.LAMB8bit(p, lr=2e-2, weight_decay=0.01, bias_correction=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    data = stdlib_bytes()
    print(f"byte-level LM on {data.numel():,} bytes of Python stdlib source, {args.steps} steps, batch 128\n")
    print(f"| {'optimizer':26} | state KiB | median step ms | final loss (mean of last 20 steps) |")
    print(f"| {'-' * 26} | --------: | -------------: | ---------------------------------: |")
    for name, make in CHOICES.items():
        r = train_bytes(make, args.steps, data=data)
        print(f"| {name:26} | {r['state_bytes'] / 1024:9.1f} | {r['step_s'] * 1e3:14.2f} | {r['final']:33.4f} |")


if __name__ == "__main__":
    main()
