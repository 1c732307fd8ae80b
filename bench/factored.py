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

import sys

from lowmemopt.benchmark import script_main


def main(argv: list[str] | None = None) -> int:
    return script_main("factored", argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
