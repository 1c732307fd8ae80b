"""Communication-compressed data parallelism: the compressed all-reduce, 1-bit Adam, 0/1 Adam and 1-bit LAMB on gloo,
2 and 4 processes.

The cases live in ``tests/onebit_worker.py``; one spawned job per world size runs them all, and each test here reports
one case. Every case checks each rank against a single-process simulation of the N workers, bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import onebit_worker
from spawn import check_ranks, run_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onebit_worker.py")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

#: the cases that also run with 4 ranks (padding and rank order with more than two workers)
FOUR_RANK_CASES = ["compressed_allreduce_matches_simulation", "onebit_adam_matches_reference"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job(WORKER, tmp_path_factory.mktemp("onebit2"), 2, list(onebit_worker.CASES))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_job(WORKER, tmp_path_factory.mktemp("onebit4"), 4, FOUR_RANK_CASES)


@pytest.mark.parametrize("name", list(onebit_worker.CASES))
def test_two_ranks(two_ranks, name):
    check_ranks(two_ranks, name)


@pytest.mark.parametrize("name", FOUR_RANK_CASES)
def test_four_ranks(four_ranks, name):
    check_ranks(four_ranks, name)


def test_needs_torch_distributed():
    import lowmemopt

    if dist.is_initialized():
        pytest.skip("a process group is initialized")
    with pytest.raises(ValueError, match="init_process_group"):
        lowmemopt.OnebitAdam([torch.nn.Parameter(torch.zeros(3))])


def test_layout_pads_to_blocks_and_bytes():
    from lowmemopt.distributed.compression import Layout, pack_signs, unpack_signs

    lay = Layout.of([1000, 3, 4096], 4, [256, 8, 128])
    assert lay.chunks == (256, 8, 1024)
    assert lay.padded == (1024, 32, 4096) and lay.numel == 5152 and lay.server_numel == 1288
    assert lay.offsets == (0, 1024, 1056)
    assert Layout.of([5], 3).chunks == (8,)  # whole bytes of signs per server chunk
    x = torch.tensor([0.0, -1, 2, -0.0, -3, 4, 5, -6, 1, 1, 1, 1, 1, 1, 1, -1])
    packed = pack_signs(x)
    assert packed.tolist() == [0b10110110, 0b11111110]
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    with pytest.raises(ValueError, match="aligns"):
        Layout.of([4], 2, [0])


def test_state_files_from_another_world_size(tmp_path):
    """Per-rank files saved by W ranks are found at another world size (rank r reads rank r mod W's file)."""
    from lowmemopt.checkpoint.load import other_world_path
    from lowmemopt.distributed import rank_path

    base = tmp_path / "opt.safetensors"
    for r in range(2):
        open(rank_path(base, r, 2), "w").close()
    got = other_world_path(rank_path(base, 3, 4), {"rank": 3, "world_size": 4})
    assert got == (rank_path(base, 1, 2), {"rank": 1, "world_size": 2})
    missing = tmp_path / "none.safetensors"
    assert other_world_path(rank_path(missing, 0, 2), {"rank": 0, "world_size": 2})[0] == rank_path(missing, 0, 2)


def test_zero_one_adam_math_traces_with_tensor_scalars():
    """The compiled CPU step passes ``lr`` and the bias corrections as 0-dim tensors (``compiled.RUNTIME_SCALARS``):
    the math must not branch on them (a data-dependent branch breaks the graph, and the step falls back to eager)."""
    from lowmemopt.optim.zero_one_adam import zero_one_adam_math

    def fresh_state():
        return {
            "exp_avg": torch.full((8,), 0.1),
            "exp_avg_sq": torch.full((8,), 0.2),
            "momentum_accumulator": torch.zeros(8),
        }

    p, g = torch.linspace(-1, 1, 8), torch.linspace(1, -1, 8)
    kw = dict(betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0.01, phase="local")
    traced = torch.compile(zero_one_adam_math, backend="eager", fullgraph=True)
    got = traced(
        p,
        g,
        fresh_state(),
        lr=torch.tensor(1e-2),
        bias_correction1=torch.tensor(0.19),
        bias_correction2_sqrt=torch.tensor(0.3),
        **kw,
    )
    want = zero_one_adam_math(p, g, fresh_state(), lr=1e-2, bias_correction1=0.19, bias_correction2_sqrt=0.3, **kw)
    torch.testing.assert_close(got, want)
