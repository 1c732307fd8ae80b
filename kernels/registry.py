"""The dispatch registry: (algorithm, format) -> fused kernel.

An *algorithm* is a name (``"adam"``, ``"sgd"``, ``"signsgd"`` (SGD's kernel with its ``SIGN`` flag), ``"lion"``,
``"lamb"``, ``"lars"``, ``"adafactor"``, ``"came"``) that an algorithm marks its pure math with
(:func:`lowmemopt.pipeline.algorithm.fused`); the algorithm decides which name it runs
(:func:`lowmemopt.pipeline.algorithm.fused_name`: one that changes the math or how the update is applied runs none).
Nothing here knows the optimizer classes.
A *format* is the storage format of the parameter's full-size state slots: ``fp32``, ``bf16``, ``q8`` or ``q4`` (a
parameter without full-size slots, e.g. SGD without momentum, counts as ``fp32``). Every algorithm has a kernel for
every format: the kernels' slot access (:func:`.codec.load_slot`, :func:`.codec.store_slot`,
:func:`.codec.load_slot_at`) takes the format as a compile-time code.

A :class:`Kernel` names the state slots it expects for a param group (the dispatcher checks the declared slots
against them) and launches one bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Kernel", "register", "lookup", "registered", "ALGORITHMS", "FORMATS"]

#: every algorithm name a kernel exists for
ALGORITHMS = ("adam", "sgd", "signsgd", "lion", "lamb", "lars", "adafactor", "came")
ALGORITHMS += ("ademamix",)
#: algorithms whose kernels write bf16 / fp16 parameters with any ``bf16_update`` (:func:`.codec.store_param_as`);
#: the others round to nearest only, so the dispatcher leaves such a parameter with another mode to the reference path
UPDATE_ALGORITHMS = frozenset({"adam", "sgd", "signsgd", "lion"})
UPDATE_ALGORITHMS |= {"ademamix"}
#: every state format a kernel exists for (:data:`.codec.FORMAT_CODES`)
FORMATS = ("fp32", "bf16", "q8", "q4")


@dataclass(frozen=True)
class Kernel:
    algorithm: str
    fmt: str
    #: the slot names the kernel reads and writes, in launch-table order, for a bucket's hyper-parameters
    #: (:attr:`~lowmemopt.work.record.BucketRecord.hyper`) and parameter
    slots: Callable[[Mapping[str, Any], Any], tuple[str, ...]]
    #: launch(update, bucket): run the fused step for every tensor of the bucket (update: a pipeline ``Update``)
    launch: Callable[..., None]
    #: bucket(p) -> hashable: parameters with different values take separate launches (e.g. factored or not)
    layout: Callable[[Any], Any] = lambda p: None


_REGISTRY: dict[tuple[str, str], Kernel] = {}
_loaded = False


def register(kernel: Kernel) -> Kernel:
    _REGISTRY[(kernel.algorithm, kernel.fmt)] = kernel
    return kernel


def _load() -> None:
    """Import the kernel modules (Triton compiles nothing until a launch) and fill the registry."""
    global _loaded
    if _loaded:
        return
    from . import adamw, factored, lamb, lars, lion, sgd

    for fmt in FORMATS:
        register(Kernel("adam", fmt, lambda g, p: adamw.slots(g), adamw.launch))
        register(Kernel("sgd", fmt, lambda g, p: sgd.slots(g), sgd.launch))
        register(Kernel("signsgd", fmt, lambda g, p: sgd.slots(g), sgd.launch))
        register(Kernel("lion", fmt, lambda g, p: lion.slots(g), lion.launch))
        register(Kernel("lamb", fmt, lambda g, p: lamb.slots(g), lamb.launch))
        register(Kernel("lars", fmt, lambda g, p: lars.slots(g), lars.launch))
        register(Kernel("adafactor", fmt, factored.adafactor_slots, factored.launch_adafactor, factored.layout))
        register(Kernel("came", fmt, factored.came_slots, factored.launch_came, factored.layout))
    from . import ademamix

    for fmt in FORMATS:
        register(Kernel("ademamix", fmt, lambda g, p: ademamix.slots(g), ademamix.launch))
    _loaded = True


def lookup(algorithm: str, fmt: str) -> Kernel | None:
    _load()
    return _REGISTRY.get((algorithm, fmt))


def registered() -> list[tuple[str, str]]:
    """Every (algorithm, format) pair with a kernel."""
    _load()
    return sorted(_REGISTRY)
