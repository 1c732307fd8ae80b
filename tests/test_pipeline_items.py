"""The update stage's per-tensor entries take what the Triton backend takes: the items of one bucket and an
``update_for(item, step)`` giving its Update (``lowmemopt.pipeline.backends.step_per_tensor``, the native CPU bucket's
``lowmemopt.pipeline.native.step_native_bucket``), and step exactly as the per-tensor functions they call."""

from __future__ import annotations

import copy

import pytest
import torch

import lowmemopt
from lowmemopt import cpu
from lowmemopt.pipeline import backends, native
from lowmemopt.pipeline.plan import update_of
from lowmemopt.work import BucketRecord, Item


def _items(cls, shapes, bad=(), **kw):
    """One optimizer's items (state made, step 1), gradients NaN at the indices ``bad``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = cls(params, lr=1e-2, min_quant_numel=0, **kw)
    record = BucketRecord.of(opt.param_groups[0])
    items = []
    for k, p in enumerate(params):
        g = torch.randn(p.shape)
        if k in bad:
            g.view(-1)[3] = float("nan")
        slots = opt.algorithm.slots(record.hyper, p)
        state = backends.init_state(p.data, record, slots, {})
        state["step"] = 1
        items.append(
            Item(param=p, group=opt.param_groups[0], target=p.data, grad=g, state=state, slots=slots, record=record)
        )
    return opt.algorithm, items


def _snapshot(items):
    return [(it.target.clone(), copy.deepcopy(it.state)) for it in items]


def _assert_same(a, b):
    for (pa, sa), (pb, sb) in zip(a, b):
        assert torch.equal(pa, pb)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k], k


@pytest.mark.parametrize(
    "cls,bits", [(lowmemopt.AdamW, 8), (lowmemopt.CAME, 8), (lowmemopt.Lion, 4), (lowmemopt.LAMB, 32)]
)
def test_step_items_equals_update_flat(cls, bits):
    algorithm, items = _items(cls, [(16, 24), (40,)], state_bits=bits)
    twins = _items(cls, [(16, 24), (40,)], state_bits=bits)[1]
    calls = []

    def update_for(it, step):
        calls.append(step)
        return update_of(algorithm, it, step)

    assert backends.step_per_tensor(algorithm, items, update_for) == [None, None]
    assert calls == [1, 1]
    for it in twins:
        backends.update_flat(
            algorithm,
            it.target,
            it.target.view(-1),
            it.grad.view(-1),
            it.state,
            it.slots,
            it.record,
            1,
            algorithm.decay_factor(it.record.hyper),
        )
    _assert_same(_snapshot(items), _snapshot(twins))
    assert not torch.equal(items[0].target, _items(cls, [(16, 24), (40,)], state_bits=bits)[1][0].target)


@pytest.mark.skipif(not cpu.available(), reason="no native CPU kernels")
@pytest.mark.parametrize("cls", [lowmemopt.CAME, lowmemopt.AdamW])
def test_step_items_check_skips_a_nonfinite_gradient(cls):
    algorithm, items = _items(cls, [(16, 24), (20, 8)], bad=(1,), state_bits=8)
    before = _snapshot(items)
    ok = backends.step_per_tensor(algorithm, items, lambda it, step: update_of(algorithm, it, step), check=True)
    assert ok == [True, False]
    _assert_same(_snapshot(items[1:]), before[1:])  # the skipped one: nothing written
    assert not torch.equal(items[0].target, before[0][0])


@pytest.mark.skipif(not cpu.available(), reason="no native CPU kernels")
def test_native_step_items_results():
    algorithm, items = _items(lowmemopt.AdamW, [(16, 24), (16, 32), (40,)], bad=(1,), state_bits=8)
    twins = _items(lowmemopt.AdamW, [(16, 24), (16, 32), (40,)], bad=(1,), state_bits=8)[1]
    # the third item's bucket has a tensor learning rate, which the native kernels do not take
    group = dict(items[2].group, lr=torch.tensor(1e-2))
    items[2].record = twins[2].record = BucketRecord.of(group)
    before = _snapshot(items)
    out = native.step_native_bucket(
        algorithm, items, lambda it, step: update_of(algorithm, it, step), [True, True, True]
    )
    assert out == [True, False, None]
    _assert_same(_snapshot(items[1:]), before[1:])  # skipped and not taken: untouched
    backends.step_per_tensor(algorithm, twins[:1], lambda it, step: update_of(algorithm, it, step))
    _assert_same(_snapshot(items[:1]), _snapshot(twins[:1]))  # the native bucket equals the per-tensor step
