"""Distributed SGD recipes: DDP + lowmemopt (mlbench's centralized optimizers), PowerSGD, sparsified SGD with error
feedback (``lowmemopt.distributed.sparsified``), gossip averaging (``lowmemopt.distributed.gossip``), and the
GradScaler settings that replace mlbench's FP16Optimizer loss scaler. See ``docs/distributed_recipes.md``.

The multi-process cases live in ``tests/distsgd_worker.py``: one spawned job of 2 gloo processes runs them all, one of
4 runs those where the number of ranks matters (summation order, graphs with more than one neighbour).
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

import distsgd_worker
from spawn import check_ranks, run_job
import lowmemopt
from lowmemopt.distributed.gossip import mixing_weights, ring, torus
from lowmemopt.distributed.sparsified import SparsifiedState, select

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distsgd_worker.py")
needs_dist = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TWO_RANK_CASES = [c for c in distsgd_worker.CASES if c != "gossip_irregular_graph"]  # a 4-node graph


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job(WORKER, tmp_path_factory.mktemp("distsgd2"), 2, TWO_RANK_CASES)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_job(WORKER, tmp_path_factory.mktemp("distsgd4"), 4, distsgd_worker.FOUR_RANK_CASES)


@needs_dist
@pytest.mark.parametrize("name", TWO_RANK_CASES)
def test_two_ranks(two_ranks, name):
    check_ranks(two_ranks, name)


@needs_dist
@pytest.mark.parametrize("name", distsgd_worker.FOUR_RANK_CASES)
def test_four_ranks(four_ranks, name):
    check_ranks(four_ranks, name)


# ---------------------------------------------------------------------------------------------------------------------
# single process: selection, graphs, arguments


def test_select():
    acc = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2, 1.0])
    assert sorted(select(acc, 2, "top").tolist()) == [1, 3]
    gen = torch.Generator().manual_seed(0)
    idx = select(acc, 4, "random", gen)
    assert len(set(idx.tolist())) == 4 and all(0 <= i < 6 for i in idx.tolist())
    starts = {int(select(acc, 4, "block", gen)) for _ in range(50)}
    assert starts == {0, 1, 2}  # every block of 4 inside 6 elements, none past the end


def test_top_k_of_a_large_bucket_is_exact():
    """The sampled-threshold top-k (CPU, large buckets) returns exactly torch.topk's set, also when the strided sample
    misjudges the threshold (only sampled elements are large) or most values tie at zero."""
    gen = torch.Generator().manual_seed(2)
    n, k = 1 << 18, 1000
    x = torch.randn(n, generator=gen)
    assert set(select(x, k, "top").tolist()) == set(torch.topk(x.abs(), k).indices.tolist())
    fooled = torch.rand(n, generator=gen)
    fooled[:: n // (1 << 16)] += 10.0  # the sample sees only large values: too few candidates, full topk
    assert set(select(fooled, k, "top").tolist()) == set(torch.topk(fooled, k).indices.tolist())
    sparse = torch.zeros(n)
    sparse[torch.randperm(n, generator=gen)[:5000]] = torch.randn(5000, generator=gen)
    assert set(select(sparse, k, "top").tolist()) == set(torch.topk(sparse.abs(), k).indices.tolist())


def test_random_k_is_uniform():
    """random-k draws k distinct coordinates with every coordinate and every pair equally likely (the fast path for
    k <= n / 4 and the randperm path), and handles buckets of 1e7 elements without an O(n) permutation."""
    gen = torch.Generator().manual_seed(1)
    for n, k, draws in ((16, 3, 4000), (7, 3, 3000)):
        counts = torch.zeros(n)
        pairs = torch.zeros(n, n)
        for _ in range(draws):
            idx = select(torch.zeros(n), k, "random", gen)
            assert idx.unique().numel() == k
            counts[idx] += 1
            pairs[idx[:, None], idx[None, :]] += 1
        p = k / n
        sd = (draws * p * (1 - p)) ** 0.5
        assert (counts - draws * p).abs().max() < 5 * sd, counts
        off = pairs[~torch.eye(n, dtype=torch.bool)]
        q = k * (k - 1) / (n * (n - 1))
        assert (off - draws * q).abs().max() < 5 * (draws * q * (1 - q)) ** 0.5, off
    big = select(torch.zeros(10_000_000), 1000, "random", gen)
    assert big.unique().numel() == 1000 and int(big.max()) < 10_000_000


def test_sparsified_state():
    assert SparsifiedState(ratio=0.01).k_for(1000) == 10
    assert SparsifiedState(ratio=0.01).k_for(50) == 1
    assert SparsifiedState(k=20).k_for(7) == 7
    for kw, word in [
        (dict(), "exactly one"),
        (dict(ratio=0.1, k=3), "exactly one"),
        (dict(ratio=0), "ratio"),
        (dict(ratio=1.5), "ratio"),
        (dict(k=0), "k must"),
        (dict(k=2.5), "k must"),
        (dict(ratio=0.1, method="topk"), "method"),
        (dict(ratio=0.1, start_iter=1), "start_iter"),
    ]:
        with pytest.raises(ValueError, match=word):
            SparsifiedState(**kw)
    state = SparsifiedState(ratio=0.5, method="random")
    state.error_dict[0] = torch.arange(4.0)
    state.generator(torch.device("cpu"))
    back = pickle.loads(pickle.dumps(state))
    assert back.process_group is None and torch.equal(back.error_dict[0], torch.arange(4.0))
    gen = back.generator(torch.device("cpu"))
    same = state.generator(torch.device("cpu"))
    assert torch.equal(torch.randperm(9, generator=gen), torch.randperm(9, generator=same))


def test_graphs():
    assert ring(1) == [[]] and ring(2) == [[1], [0]] and ring(4)[0] == [1, 3]
    assert torus(2, 3)[0] == [1, 2, 3] and torus(1, 4) == ring(4) and torus(3, 3)[4] == [1, 3, 5, 7]
    irregular = [[1, 2, 3], [0, 2], [0, 1], [0]]
    rows = [mixing_weights(irregular, i) for i in range(4)]
    matrix = torch.tensor([[row.get(j, 0.0) for j in range(4)] for row in rows], dtype=torch.float64)
    assert torch.allclose(matrix, matrix.T) and torch.allclose(matrix.sum(0), torch.ones(4, dtype=torch.float64))
    assert (matrix >= 0).all() and torch.allclose(matrix.sum(1), torch.ones(4, dtype=torch.float64))
    assert mixing_weights(ring(5), 0, "uniform") == {4: 1 / 3, 1: 1 / 3, 0: 1 - 2 / 3}
    for graph, word in [
        ([[1], [0, 2], [1], [0]], "undirected"),
        ([[0]], "itself"),
        ([[1], [0], [3], [2]], "connected"),
        ([[5], []], "not a rank"),
        ([[1, 1], [0]], "twice"),
    ]:
        with pytest.raises(ValueError, match=word):
            mixing_weights(graph, 0)
    with pytest.raises(ValueError, match="regular"):
        mixing_weights(irregular, 0, "uniform")
    with pytest.raises(ValueError, match="weights"):
        mixing_weights(ring(3), 0, "equal")
    with pytest.raises(ValueError, match="rows"):
        torus(0, 3)


# ---------------------------------------------------------------------------------------------------------------------
# mlbench's FP16Optimizer loss scaler -> torch.amp.GradScaler


class MlbenchScaler:
    """mlbench's DynamicLossScaler (mlbench_core/optim/pytorch/fp_optimizers.py), restated: the reference."""

    def __init__(self, init_scale, scale_factor, scale_window, max_scale):
        self.loss_scale, self.factor, self.window, self.max_scale = init_scale, scale_factor, scale_window, max_scale
        self.iter, self.last_overflow = 0, -1

    def update(self, overflow):
        if overflow:
            self.loss_scale /= self.factor
            self.last_overflow = self.iter
        elif (self.iter - self.last_overflow) % self.window == 0:
            self.loss_scale *= self.factor
            if self.max_scale is not None:
                self.loss_scale = min(self.loss_scale, self.max_scale)
        self.iter += 1


def test_grad_scaler_replaces_mlbench_fp16_scaler():
    """GradScaler(init_scale, growth_factor=f, backoff_factor=1/f, growth_interval=window), plus a clamp after
    update() for max_scale and a check for min_scale: the same scale sequence and the same skipped steps as mlbench's
    FP16Optimizer, with a lowmemopt optimizer."""
    init, factor, window, max_scale, min_scale = 1024.0, 2.0, 3, 2048.0, 1e-4
    overflows = [False] * 7 + [True, False, True, True] + [False] * 9 + [True] + [False] * 4
    p = torch.nn.Parameter(torch.ones(3))
    opt = lowmemopt.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init, growth_factor=factor, backoff_factor=1 / factor, growth_interval=window
    )
    ref = MlbenchScaler(init, factor, window, max_scale)
    clamped = 0
    for t, overflow in enumerate(overflows):
        assert scaler.get_scale() == ref.loss_scale, f"step {t}"
        before = p.detach().clone()
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        if overflow:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() > max_scale:  # max_scale: no GradScaler option
            scaler.update(new_scale=max_scale)
            clamped += 1
        assert scaler.get_scale() > min_scale  # min_scale: mlbench raises there
        ref.update(overflow)
        assert torch.equal(p.detach(), before) == overflow, f"step {t}: skipped {torch.equal(p.detach(), before)}"
    assert scaler.get_scale() == ref.loss_scale and clamped >= 1
