"""Drop-in names for users migrating from bitsandbytes, galore-torch and friends: each is a change of defaults only.

``AdamW8bit(params, lr=...)`` is exactly ``AdamW(params, lr=..., state_bits=8)``; any keyword may still be overridden.
``PagedAdamW8bit`` adds ``paged=True`` (state in host RAM between steps, see :mod:`lowmemopt.paging`).
"""

from __future__ import annotations

from typing import Any

from .optim import CAME, LAMB, LARS, Adafactor, Adam, AdamW, Lion

__all__ = [
    "Adafactor8bit", "Adam8bit", "AdamW8bit", "CAME8bit", "LAMB8bit", "LARS8bit", "Lion8bit", "PagedAdamW",
    "PagedAdamW8bit",
]


def _alias(base: type, name: str, **fixed: Any) -> type:
    def __init__(self, params, *args, **kwargs):
        for key, value in fixed.items():
            kwargs.setdefault(key, value)
        base.__init__(self, params, *args, **kwargs)

    settings = ", ".join(f"{k}={v!r}" for k, v in fixed.items())
    doc = f"``{base.__name__}`` with ``{settings}`` by default (a drop-in alias).\n\n{base.__doc__}"
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


Adam8bit = _alias(Adam, "Adam8bit", state_bits=8)
AdamW8bit = _alias(AdamW, "AdamW8bit", state_bits=8)
LAMB8bit = _alias(LAMB, "LAMB8bit", state_bits=8)
LARS8bit = _alias(LARS, "LARS8bit", state_bits=8)
Lion8bit = _alias(Lion, "Lion8bit", state_bits=8)
Adafactor8bit = _alias(Adafactor, "Adafactor8bit", state_bits=8)
CAME8bit = _alias(CAME, "CAME8bit", state_bits=8)
# bitsandbytes' paged optimizers keep state in CUDA managed memory; ours page it to pinned host RAM (see
# docs/paging.md): paged="disk" with offload_dir= and page_budget_bytes= are available on any optimizer
PagedAdamW = _alias(AdamW, "PagedAdamW", paged=True)
PagedAdamW8bit = _alias(AdamW, "PagedAdamW8bit", state_bits=8, paged=True)
