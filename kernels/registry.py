"""The dispatch registry: (algorithm, format) -> fused kernel.

An *algorithm* is named by the pure math an optimizer class runs: its ``math`` function when it uses the base class's
``_update`` (AdamW/Adam, SGD, Lion, LAMB, LARS), else its ``_update`` method (Adafactor, CAME). A subclass that
changes either, or how the update is applied (``_apply_update``, e.g. transformers-style AdamW's decay after the
update), gets no kernel (it would no longer be the math the kernel reproduces) and takes the reference path.
A *format* is the storage format of the parameter's full-size state slots: ``fp32``, ``bf16`` or ``q8`` (a parameter
without full-size slots, e.g. SGD without momentum, counts as ``fp32``).

A :class:`Kernel` names the state slots it expects for a param group (the dispatcher checks the optimizer's
``_slots`` against them) and launches one bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lowmemopt.optimizer import LowMemOptimizer

__all__ = ["Kernel", "register", "lookup", "algorithm_of", "registered"]


@dataclass(frozen=True)
class Kernel:
    algorithm: str
    fmt: str
    #: the slot names the kernel reads and writes, in launch-table order, for a param group and parameter
    slots: Callable[[dict[str, Any], Any], tuple[str, ...]]
    #: launch(optimizer, group, bucket, step): run the fused step for every parameter of the bucket
    launch: Callable[..., None]
    #: bucket(p) -> hashable: parameters with different values take separate launches (e.g. factored or not)
    layout: Callable[[Any], Any] = lambda p: None


_REGISTRY: dict[tuple[str, str], Kernel] = {}
_ALGORITHMS: dict[Callable, str] = {}
_loaded = False


def register(kernel: Kernel) -> Kernel:
    _REGISTRY[(kernel.algorithm, kernel.fmt)] = kernel
    return kernel


def _load() -> None:
    """Import the kernel modules (Triton compiles nothing until a launch) and fill the registry."""
    global _loaded
    if _loaded:
        return
    from lowmemopt.optim import CAME, Adafactor
    from lowmemopt.optim.adamw import adam_math
    from lowmemopt.optim.lamb import lamb_math
    from lowmemopt.optim.lars import lars_math
    from lowmemopt.optim.lion import lion_math
    from lowmemopt.optim.sgd import sgd_math

    from . import adamw, factored, lamb, lars, lion, sgd

    _ALGORITHMS.update({
        adam_math: "adam", sgd_math: "sgd", lion_math: "lion", lamb_math: "lamb", lars_math: "lars",
        Adafactor._update: "adafactor", CAME._update: "came",
    })
    for fmt in ("fp32", "bf16", "q8"):
        register(Kernel("adam", fmt, lambda g, p: adamw.slots(g), adamw.launch))
        register(Kernel("sgd", fmt, lambda g, p: sgd.slots(g), sgd.launch))
        register(Kernel("lion", fmt, lambda g, p: lion.slots(g), lion.launch))
        register(Kernel("lamb", fmt, lambda g, p: lamb.slots(g), lamb.launch))
        register(Kernel("lars", fmt, lambda g, p: lars.slots(g), lars.launch))
        register(Kernel("adafactor", fmt, factored.adafactor_slots, factored.launch_adafactor, factored.layout))
        register(Kernel("came", fmt, factored.came_slots, factored.launch_came, factored.layout))
    _loaded = True


def algorithm_of(optimizer: LowMemOptimizer | type) -> str | None:
    """The registered algorithm an optimizer (instance or class) runs, or None. A class that overrides how the update
    is computed or applied (``_run_update``, ``_apply_update``) runs something the kernels do not reproduce."""
    _load()
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for hook in ("_run_update", "_apply_update"):
        if getattr(cls, hook, None) is not getattr(LowMemOptimizer, hook, None):
            return None
    fn = cls._update
    if fn is LowMemOptimizer._update:
        fn = cls.math
    return _ALGORITHMS.get(fn)


def lookup(algorithm: str, fmt: str) -> Kernel | None:
    _load()
    return _REGISTRY.get((algorithm, fmt))


def registered() -> list[tuple[str, str]]:
    """Every (algorithm, format) pair with a kernel."""
    _load()
    return sorted(_REGISTRY)
