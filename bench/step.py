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

import sys

from lowmemopt.benchmark import script_main


def main(argv: list[str] | None = None) -> int:
    return script_main("step", argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
