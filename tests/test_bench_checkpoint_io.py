"""bench/checkpoint_io.py: its state maker (shared with tests/load_rss_worker.py) gives the same state for the same
arguments, and a small run prints its table (each call in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_bench

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "checkpoint_io.py"


def _state(opt) -> list[dict]:
    return [dict(opt.state[p]) for g in opt.param_groups for p in g["params"] if p in opt.state]


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_random_state_is_the_same_for_the_same_arguments(bits):
    """Seeded by its own generator, not by the process's: what ran before (here: draws from torch's global generator)
    changes nothing, so the benchmark's and the load-memory test's rounds save the same file."""
    random_state = load_bench("checkpoint_io").random_state
    a = random_state(1 << 16, bits, fill=True)
    torch.rand(7)
    b = random_state(1 << 16, bits, fill=True)
    sa, sb = _state(a), _state(b)
    assert len(sa) == 4 and [s.keys() for s in sa] == [s.keys() for s in sb]
    assert all(s["step"] == 7 for s in sa)
    tensors = [(x[k], y[k]) for x, y in zip(sa, sb) for k in x if isinstance(x[k], torch.Tensor)]
    assert tensors and all(torch.equal(x, y) for x, y in tensors)
    assert len({x.sum().item() for x, _ in tensors}) == len(tensors)  # each tensor its own draws
    assert _state(random_state(1 << 16, bits, fill=False)) == []  # the load's target: no state yet


def test_small_run_prints_its_table(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--numel", "2e6", "--rounds", "1", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        r[0]: r[1:]
        for r in ([c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines())
        if r and r[0] in ("save_state", "load_state")
    }
    assert set(rows) == {"save_state", "load_state"}, out.stdout
    assert all(float(v[0]) > 0 and float(v[1]) >= 0 and v[2].endswith(" GB") for v in rows.values())
    assert "2,000,000 elements" in out.stdout and list(tmp_path.iterdir()) == []  # its temporary folder removed
