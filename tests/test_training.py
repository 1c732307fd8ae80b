"""End-to-end: a small byte-level language model trained on real text (the Python standard library's source, present
offline on every machine). Each 8-bit optimizer's final loss must stay within a stated tolerance of its 32-bit twin."""

from __future__ import annotations

import pytest
from optim_info import OPTIMIZERS

from lowmemopt.demo import train_bytes

TRAIN_KW = {
    "AdamW": dict(lr=3e-3, weight_decay=0.01),
    "Adam": dict(lr=3e-3),
    "SGD": dict(lr=0.3, momentum=0.9, nesterov=True),
    "Lion": dict(lr=3e-4, weight_decay=0.01),
    "LAMB": dict(lr=2e-2, weight_decay=0.01, bias_correction=True),
    "LARS": dict(lr=0.5, momentum=0.9, eeta=1e-2),
}
TOLERANCE = 0.02  # |loss_8bit - loss_32bit| / loss_32bit


def train(name: str, bits: int, steps: int, seed: int = 0) -> float:
    cls = {info.name: info.cls for info in OPTIMIZERS}[name]
    return train_bytes(lambda params: cls(params, state_bits=bits, **TRAIN_KW[name]), steps, seed=seed)["final"]


def _check(name: str, steps: int) -> None:
    initial = train(name, 32, 1)
    l32, l8 = train(name, 32, steps), train(name, 8, steps)
    assert l32 < 0.8 * initial, f"{name} did not train: {initial:.3f} -> {l32:.3f}"
    assert abs(l8 - l32) / l32 < TOLERANCE, f"{name}: 8-bit {l8:.4f} vs 32-bit {l32:.4f}"


@pytest.mark.parametrize("name", list(TRAIN_KW))
def test_8bit_training_matches_32bit(name):
    _check(name, steps=150)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN_KW))
def test_8bit_training_matches_32bit_long(name):
    _check(name, steps=1000)
