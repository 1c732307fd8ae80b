"""Multi-process test jobs: run a worker script on N gloo (or NCCL) ranks once, read each rank's results.

A worker (``dist_worker.py``, ``onebit_worker.py``, ``distsgd_worker.py``) takes ``--world-size``, ``--out`` and
``--cases``, spawns its ranks, runs every named case on each and writes ``rank{r}.json``: ``{case: "ok" | what went
wrong}``. One spawn per world size serves all of a module's cases (a process group costs seconds to start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_job(worker: str, out, world: int, cases: list[str], extra_args: tuple[str, ...] = (),
            timeout: float = 600) -> dict[str, list[str]]:
    """Run ``worker`` on ``world`` ranks; ``{case: [result of each rank]}`` (a missing result reads as the job's
    output)."""
    env = dict(os.environ, LOWMEMOPT_COMPILE="0")
    cmd = [sys.executable, worker, "--world-size", str(world), *extra_args, "--out", str(out),
           "--cases", ",".join(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=os.path.dirname(worker))
    results: dict[str, list[str]] = {name: [] for name in cases}
    for rank in range(world):
        path = os.path.join(out, f"rank{rank}.json")
        got = json.load(open(path)) if os.path.exists(path) else {}
        for name in cases:
            results[name].append(got.get(name, f"rank {rank} reported nothing (exit {proc.returncode}):\n"
                                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"))
    return results


def check_ranks(results: dict[str, list[str]], name: str) -> None:
    """Fail with every rank's report unless case ``name`` said "ok" on all of them."""
    problems = [f"rank {r}:\n{res}" for r, res in enumerate(results[name]) if res != "ok"]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
