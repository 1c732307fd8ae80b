"""Multi-process test jobs: run a worker script on N gloo (or NCCL) ranks once, read each rank's results.

A worker (``dist_worker.py``, ``onebit_worker.py``, ``distsgd_worker.py``) takes ``--world-size``, ``--out`` and
``--cases``, spawns its ranks, runs every named case on each and writes ``rank{r}.json``: ``{case: "ok" | what went
wrong}``. One spawn per world size serves all of a module's cases (a process group costs seconds to start). The
workers use :func:`free_port` and :func:`run_cases`; the tests :func:`run_job` and :func:`check_ranks`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    """A free TCP port on the loopback interface, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases: dict[str, Callable[[Any], None]], names: list[str], ctx: Any, out: str, rank: int) -> None:
    """On one rank: run each named case on ``ctx``, record "ok" or its traceback, write ``rank{rank}.json`` after
    each (a crash later still reports the earlier ones), and meet the other ranks at a barrier between cases."""
    import torch.distributed as dist

    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            cases[name](ctx)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
        if rank == 0:
            print(f"{name}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
        dist.barrier()


def run_job(
    worker: str, out, world: int, cases: list[str], extra_args: tuple[str, ...] = (), timeout: float = 600
) -> dict[str, list[str]]:
    """Run ``worker`` on ``world`` ranks; ``{case: [result of each rank]}`` (a missing result reads as the job's
    output)."""
    env = dict(os.environ, LOWMEMOPT_COMPILE="0")
    cmd = [
        sys.executable,
        worker,
        "--world-size",
        str(world),
        *extra_args,
        "--out",
        str(out),
        "--cases",
        ",".join(cases),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=os.path.dirname(worker))
    results: dict[str, list[str]] = {name: [] for name in cases}
    for rank in range(world):
        path = os.path.join(out, f"rank{rank}.json")
        got = json.load(open(path)) if os.path.exists(path) else {}
        for name in cases:
            results[name].append(
                got.get(
                    name,
                    f"rank {rank} reported nothing (exit {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}",
                )
            )
    return results


def check_ranks(results: dict[str, list[str]], name: str) -> None:
    """Fail with every rank's report unless case ``name`` said "ok" on all of them."""
    import pytest

    problems = [f"rank {r}:\n{res}" for r, res in enumerate(results[name]) if res != "ok"]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
