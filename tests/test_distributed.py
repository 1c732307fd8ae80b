"""torch.distributed: FSDP2 (fully_shard / DTensor), DDP and torch.distributed.checkpoint, on 2 CPU processes (gloo).

The cases live in ``tests/dist_worker.py``; one spawned job runs them all (starting processes and process groups costs
seconds, so the cases share them) and each test here reports one case. With CUDA, the same cases run over NCCL.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import dist_worker
from spawn import check_ranks, run_job
from lowmemopt.distributed import LOCAL, rank_path

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


TWO_RANK_CASES = [c for c in dist_worker.CASES if c not in dist_worker.FOUR_RANK_CASES]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_job(WORKER, tmp_path_factory.mktemp("gloo"), 2, TWO_RANK_CASES, ("--backend", "gloo"), timeout=900)


@pytest.mark.parametrize("name", TWO_RANK_CASES)
def test_gloo_two_ranks(gloo_results, name):
    check_ranks(gloo_results, name)


def test_gloo_four_ranks_2d_mesh(tmp_path):
    """Tensors sharded over two mesh dims at once, and HSDP: 4 processes (~1 minute on 2 cores)."""
    results = run_job(WORKER, tmp_path, 4, dist_worker.FOUR_RANK_CASES, ("--backend", "gloo"), timeout=900)
    for name in dist_worker.FOUR_RANK_CASES:
        check_ranks(results, name)


# cases that need two ranks to mean anything (reshard 2 <-> 1, a reduction that must differ, a foreign layout)
_TWO_RANKS_ONLY = {"dcp_reshard", "factored_column_reduction_matters", "save_state_per_rank", "paged_fsdp2_dcp"}


@pytest.mark.gpu
def test_nccl(tmp_path):
    """The same cases over NCCL on CUDA: two ranks with two GPUs, else one rank (collectives on a mesh of one)."""
    world = min(2, torch.cuda.device_count())
    cases = [c for c in TWO_RANK_CASES if world == 2 or c not in _TWO_RANKS_ONLY]
    results = run_job(WORKER, tmp_path, world, cases, ("--backend", "nccl"), timeout=900)
    for name in cases:
        check_ranks(results, name)


def test_local_reduction_is_the_plain_torch_op():
    """Single process: the reduction interface is exactly the ops the math used before (bit-identical results)."""
    x = torch.randn(5, 7, 3)
    assert torch.equal(LOCAL.norm(x), torch.linalg.vector_norm(x))
    assert torch.equal(LOCAL.norm_along(x, -1, -1, keepdim=True), torch.linalg.vector_norm(x, dim=-1, keepdim=True))
    assert torch.equal(LOCAL.mean(x, -2, -2), x.mean(dim=-2))
    assert LOCAL.size(x, 1, 1) == 7 and LOCAL.numel(x) == x.numel() and not LOCAL.distributed


def test_rank_path():
    assert rank_path("ckpt/opt.safetensors", 1, 8) == "ckpt/opt.rank00001-of-00008.safetensors"
    assert rank_path("opt", 0, 2) == "opt.rank00000-of-00002"


def test_reduction_rounds_take_turns_in_order():
    """ReductionRounds (no process group: sums over no groups): each step runs alone up to its next sum, the steps in
    order; a round per dependent sum; results in order; the caller's grad mode; tensors handed back in place."""
    from lowmemopt.distributed.reduction import all_reduce
    from lowmemopt.distributed.rounds import ReductionRounds

    events = []

    def step(k):
        def run():
            events.append((k, "start", torch.is_grad_enabled()))
            t = torch.full((k + 1,), float(k))
            for r in range(k):  # step k asks for k sums, each after the last
                out = all_reduce(t, [])
                assert out is t
                events.append((k, r))
            return t.sum().item()

        return run

    rounds = ReductionRounds()
    with torch.no_grad():
        results = rounds.run([step(k) for k in range(4)])
    assert results == [0.0, 2.0, 6.0, 12.0]
    assert rounds.rounds == 3
    starts = [e for e in events if e[1] == "start"]
    assert starts == [(k, "start", False) for k in range(4)]
    # round by round, each step's part runs whole and in order: the starts, then step 1..3's first sums, ...
    assert [e[0] for e in events] == [0, 1, 2, 3, 1, 2, 3, 2, 3, 3]


def test_reduction_rounds_raise_the_first_error():
    """A failing step: its error is raised, the others stop at their next sum (nothing hangs)."""
    from lowmemopt.distributed.reduction import all_reduce
    from lowmemopt.distributed.rounds import ReductionRounds

    done = []

    def ok():
        for _ in range(3):
            all_reduce(torch.zeros(2), [])
        done.append(True)

    def bad():
        all_reduce(torch.zeros(1), [])
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        ReductionRounds().run([ok, bad, ok])
    assert not done
