"""Subprocess half of the resume test: load params + optimizer state saved by the parent (``torch.load`` with
``weights_only=True``), run more steps, save the final params. Usage: python resume_worker.py CASES.json"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import run  # noqa: E402
from optim_info import BY_NAME  # noqa: E402


def main(path: str) -> None:
    with open(path) as f:
        cases = json.load(f)
    for case in cases:
        saved = torch.load(case["params"], weights_only=True)
        params = [torch.nn.Parameter(t) for t in saved]
        opt = BY_NAME[case["optimizer"]].cls(params, state_bits=case["bits"], **case["kwargs"])
        opt.load_state_dict(torch.load(case["state"], weights_only=True))
        run(opt, params, case["steps"], start=case["start"])
        torch.save([p.detach() for p in params], case["out"])


if __name__ == "__main__":
    main(sys.argv[1])
