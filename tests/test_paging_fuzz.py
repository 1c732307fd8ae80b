"""A seeded differential fuzz of paged optimizer state: a paged optimizer and the same optimizer unpaged take the same
random sequence of steps and edits, and must stay bit-identical (parameters and every state entry) after each.

Each sequence draws an optimizer, parameters (fp32 / bf16 / fp16 / float64, some non-contiguous, some of one
element), one to three param groups (each with its own state_bits, block_size, min_quant_numel, bf16_update, tier and
page_budget_bytes: 0, an int, or "auto" on a mocked device reading) and edits between steps: NaN and missing
gradients, state_dict round trips, the state moved into an optimizer paged otherwise (another tier, unpaged) by
load_state_dict or a safetensors checkpoint, a parameter's state deleted, a param group added, a group's paging
changed, the device's free memory or peak changed (evictions). (Found this way: stochastic-rounding seeds drawn in
another order when paged; a group's paging turned off and on again.)
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
from test_paging import _state_equal
from test_paging_auto import FakeDevice

import lowmemopt

CLASSES = {
    "AdamW": (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Lion": (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    "SGD": (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "Adafactor": (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
}
DTYPES = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float16, torch.float64]
OPS = ["step"] * 5 + ["state_dict", "rehome", "checkpoint", "reset", "add_group", "toggle", "memory"]


def _param(rng: random.Random, gen: torch.Generator) -> torch.nn.Parameter:
    dtype = rng.choice(DTYPES)
    if rng.random() < 0.15:
        return torch.nn.Parameter(torch.randn(1, generator=gen).to(dtype))
    rows, cols = rng.randint(2, 40), rng.randint(2, 30)
    if rng.random() < 0.2:  # a transposed view: not contiguous
        return torch.nn.Parameter(torch.randn(cols, rows, generator=gen).to(dtype).t())
    return torch.nn.Parameter(torch.randn(rows, cols, generator=gen).to(dtype))


class _Sequence:
    """One fuzzed sequence: the paged optimizer ``opt`` over ``paged`` and the unpaged ``ref`` over ``plain``."""

    def __init__(self, seed: int, tmp, device: FakeDevice) -> None:
        self.rng, self.seed, self.tmp, self.device, self.t = random.Random(seed), seed, tmp, device, 0
        self.cls, self.kw = CLASSES[self.rng.choice(sorted(CLASSES))]
        n = self.rng.randint(2, 5)
        self.paged = [_param(self.rng, torch.Generator().manual_seed(seed + i)) for i in range(n)]
        self.plain = [torch.nn.Parameter(p.detach().clone()) for p in self.paged]
        cuts = sorted(self.rng.sample(range(1, n), self.rng.randint(0, min(2, n - 1))))
        bounds = [0, *cuts, n]
        groups = [self._options() for _ in cuts + [n]]
        self.opt = self.cls(
            [dict(params=self.paged[lo:hi], **s, **pg) for (lo, hi), (s, pg) in zip(zip(bounds, bounds[1:]), groups)],
            **self.kw,
        )
        self.ref = self.cls(
            [dict(params=self.plain[lo:hi], **s) for (lo, hi), (s, _) in zip(zip(bounds, bounds[1:]), groups)],
            **self.kw,
        )

    def _options(self) -> tuple[dict, dict]:
        rng = self.rng
        bits = rng.choice([32, 16, 8, 4])
        storage = dict(
            state_bits=bits,
            min_quant_numel=rng.choice([16, 4096]),
            bf16_update=rng.choice(["nearest", "stochastic", "stochastic", "kahan"]),
        )
        if bits < 16 and rng.random() < 0.5:
            storage["block_size"] = rng.choice([16, 64])
        return storage, self._paging()

    def _paging(self) -> dict:
        tier = self.rng.choice(["cpu", "disk", False])
        return dict(
            paged=tier,
            offload_dir=os.path.join(self.tmp, self.rng.choice("ab")),
            page_budget_bytes=self.rng.choice([0, self.rng.randint(1, 8000), "auto"]),
            page_headroom_bytes=self.rng.choice([None, 0, 5000]),
        )

    def check(self, what: str) -> None:
        for i, (a, b) in enumerate(zip(self.paged, self.plain)):
            assert torch.equal(a, b), f"seed {self.seed}, after {what}: parameter {i}"
            assert _state_equal(dict(self.opt.state.get(a, {})), dict(self.ref.state.get(b, {}))), (
                f"seed {self.seed}, after {what}: state of parameter {i}"
            )
        str(self.opt.paging_report())

    def step(self) -> None:
        gen = torch.Generator().manual_seed(self.seed * 1000 + self.t)
        for a, b in zip(self.paged, self.plain):
            g = None if self.rng.random() < 0.1 else torch.randn(a.shape, generator=gen).to(a.dtype)
            if g is not None and self.rng.random() < 0.05:
                g.view(-1)[0] = float("nan")
            a.grad, b.grad = g, None if g is None else g.clone()
        for o in (self.opt, self.ref):
            torch.manual_seed(self.seed + self.t)  # (stochastic rounding's seeds)
            o.step()
        self.t += 1

    def state_dict(self) -> None:
        self.opt.load_state_dict(self.opt.state_dict())

    def _replace(self, load) -> None:
        groups = [
            dict({k: v for k, v in g.items() if k != "params"}, params=g["params"], **self._paging())
            for g in self.opt.param_groups
        ]
        new = self.cls(groups, **self.kw)
        load(new)
        self.opt.close()
        self.opt = new

    def rehome(self) -> None:
        sd = self.opt.state_dict()
        self._replace(lambda new: new.load_state_dict(sd))

    def checkpoint(self) -> None:
        path = os.path.join(self.tmp, f"state-{self.t}.safetensors")
        lowmemopt.save_state(self.opt, path)
        self._replace(lambda new: lowmemopt.load_state(new, path))

    def reset(self) -> None:
        i = self.rng.randrange(len(self.paged))
        self.opt.state.pop(self.paged[i], None)
        self.ref.state.pop(self.plain[i], None)

    def add_group(self) -> None:
        a = _param(self.rng, torch.Generator().manual_seed(self.seed + 100 + self.t))
        b = torch.nn.Parameter(a.detach().clone())
        storage, paging_kw = self._options()
        self.opt.add_param_group(dict(params=[a], **storage, **paging_kw))
        self.ref.add_param_group(dict(params=[b], **storage))
        self.paged.append(a)
        self.plain.append(b)

    def toggle(self) -> None:
        """A group's paging changed: turned off, or on again (to a tier, budget and headroom drawn anew)."""
        group = self.rng.choice(self.opt.param_groups)
        was = group["paged"]
        group.update(self._paging())
        if was:
            group["paged"] = False
        elif not group["paged"]:
            group["paged"] = "cpu"
        self.step()

    def memory(self) -> None:
        if self.rng.random() < 0.5:
            self.device.peak += self.rng.randint(0, 200_000)
        else:
            self.device.free = max(0, self.device.free - self.rng.randint(0, 200_000))


@pytest.mark.parametrize("chunk", range(8))
def test_paged_matches_unpaged_through_random_edits(chunk, tmp_path, monkeypatch):
    """200 sequences (25 per chunk) of a first step and 16 random edits, each followed by the check."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (NaN gradients: skipped, as unpaged)
        for seed in range(25 * chunk, 25 * chunk + 25):
            (tmp_path / str(seed)).mkdir()
            with monkeypatch.context() as patch:
                _run(seed, tmp_path / str(seed), patch)


def _run(seed: int, tmp, monkeypatch) -> None:
    device = FakeDevice(monkeypatch)  # "auto" on the CPU, with a reading the sequence changes
    device.free = device.peak + random.Random(seed).choice([0, 50_000, 10**6]) + int(0.1 * device.total)
    fuzz = _Sequence(seed, str(tmp), device)
    done = []
    try:
        fuzz.step()
        fuzz.check("the first step")
        for _ in range(16):
            op = fuzz.rng.choice(OPS)
            done.append(op)
            getattr(fuzz, op)()
            fuzz.check(" | ".join(done))
    finally:
        fuzz.opt.close()
