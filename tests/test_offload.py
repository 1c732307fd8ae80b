"""FSDP2 CPU offload (``fully_shard(..., offload_policy=CPUOffloadPolicy())``: parameters, gradients and optimizer
state on the host, the optimizer step on the CPU) with every lowmemopt optimizer at every ``state_bits``, on 1 and 2
CPU processes (gloo).

The cases live in ``tests/offload_worker.py`` (on ``tests/dist_worker.py``'s machinery); one spawned job per world
size runs them all. Without an accelerator, ``CPUOffloadPolicy()`` cannot pin memory and ``fully_shard`` refuses it;
``CPUOffloadPolicy(pin_memory=False)`` runs FSDP2's offload paths on the CPU, and its steps equal the unoffloaded
ones bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import dist_worker
import offload_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offload_worker.py")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def results(request, tmp_path_factory) -> list[dict[str, str]]:
    """Each rank's {case: "ok" | traceback} of one job of ``request.param`` processes."""
    world = request.param
    out = tmp_path_factory.mktemp(f"offload{world}")
    cmd = [sys.executable, WORKER, "--world-size", str(world), "--out", str(out)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, LOWMEMOPT_COMPILE="0"),
        cwd=os.path.dirname(WORKER),
    )
    ranks = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    missing = [
        f"rank {r}: {name}" for r, got in enumerate(ranks) for name in offload_worker.OFFLOAD_CASES if name not in got
    ]
    assert not missing, (
        f"no result for {missing} (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return ranks


@pytest.mark.parametrize("name", offload_worker.OFFLOAD_CASES)
def test_offload(results, name):
    problems = [f"rank {r}:\n{got[name]}" for r, got in enumerate(results) if got[name] != "ok"]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_docs_examples_run(tmp_path):
    """docs/offload.md's examples (paged state; FSDP2 CPU offload in one process), in one fresh process: on this
    machine's GPU if it has one, else on the CPU."""
    page = Path(__file__).resolve().parent.parent / "docs" / "offload.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    assert len(blocks) == 2 and "paged=" in blocks[0] and "CPUOffloadPolicy" in blocks[1]
    script = tmp_path / "examples.py"
    script.write_text("\n".join(blocks) + "\nassert all(int(s['step']) == 10 for s in opt.state.values())\n")
    env = dict(os.environ, MASTER_PORT=str(dist_worker.free_port()), LOWMEMOPT_COMPILE="0")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
