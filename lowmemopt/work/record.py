"""A bucket's options, resolved once per group and step (:meth:`lowmemopt.pipeline.plan.Plan.record_of`) into a
:class:`BucketRecord` that the step's items and updates carry instead of the param group: ``hyper`` (a read-only view
of the group's values), the storage options and rounding mode, GaLore's ``rank``, and ``version``
(:func:`group_values`: equal records share a bucket). The diagram: ``docs/pipeline.md`` ("The plan, and the layers").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .. import rounding
from ..quant.formats import Slot, StateFormat, choose_format

__all__ = ["BucketRecord", "group_values", "param_place"]


@dataclass(frozen=True, eq=False)
class BucketRecord:
    """One param group's options for one step (module docstring). ``hyper``: a read-only view of its entries;
    ``block_size``, ``state_bits``, ``min_quant_numel``: the storage options the state formats follow (None where
    the optimizer has none); ``rounding``: ``bf16_update`` (``"nearest"``, ``"stochastic"`` or ``"kahan"``) for its
    16-bit parameters; ``rank``: GaLore's projection rank, None for a full-rank group."""

    hyper: Mapping[str, Any]
    block_size: int | None = None
    state_bits: int | None = None
    min_quant_numel: int | None = None
    rounding: str = "nearest"
    rank: int | None = None

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> BucketRecord:
        """The record of ``group`` as it stands (the one place a param group's options are read)."""
        get = group.get
        return cls(
            MappingProxyType(group),
            get("block_size"),
            get("state_bits"),
            get("min_quant_numel"),
            get("bf16_update", "nearest"),
            get("rank"),
        )

    def rounding_of(self, p: torch.Tensor) -> str:
        """How ``p``'s fp32 result is stored: :attr:`rounding` for a bfloat16 / float16 ``p``, else ``"nearest"``."""
        return self.rounding if p.dtype in rounding.DTYPES else "nearest"

    def format_for(self, slot: Slot, numel: int, param_dtype: torch.dtype) -> StateFormat:
        """The storage format of ``slot`` for a tensor of ``numel`` elements (the whole parameter's, for a shard)."""
        return choose_format(self.state_bits, numel, self.min_quant_numel, slot.quantize, slot.dtype, param_dtype)

    @cached_property
    def version(self) -> tuple:
        """:func:`group_values` of the group when first asked (once per record: buckets are keyed by it)."""
        return group_values(self.hyper)


#: param-group entries that are not values a kernel reads: the parameters themselves (and torch's names of them)
_NOT_VALUES = frozenset({"params", "param_names"})
_PLAIN = frozenset({int, bool, str, type(None)})


def group_values(group: Mapping[str, Any]) -> tuple:
    """A param group's entries as a hashable, parameters left out: equal for groups whose every hyper-parameter,
    storage option and other entry is equal, so that they share a bucket (one kernel launch) although they are
    separate groups (u-muP's ``scaled_parameters`` makes one group per parameter). Numbers compare by value, except
    that -0.0 and NaN stand apart from other floats; a tensor (a learning rate given as one) or any other unhashable
    value by identity, so groups share it only if they hold the same object (a scheduler's in-place change then
    reaches them all). Anything a kernel or the ``update_for`` callback reads of a group is one of these entries."""
    out = []
    for k, v in group.items():  # (a loop, not a generator of _frozen calls: per-parameter groups pay it per item)
        t = type(v)
        if t in _PLAIN or (t is float and v == v and v != 0.0):
            out += (k, v)
        elif k not in _NOT_VALUES:
            out += (k, _frozen(v))
    return tuple(out)


def _frozen(v: Any) -> Any:
    t = type(v)
    if t is float:
        return v if v == v and v != 0.0 else ("float", v.hex())  # -0.0 is not 0.0 here, NaN equals NaN
    if t is int or t is bool or t is str or v is None:
        return v
    if t is tuple or t is list:
        return (t.__name__,) + tuple(_frozen(x) for x in v)
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (t.__qualname__, v)


def param_place(groups: Any, p: torch.Tensor) -> str:
    """``p`` in words, for messages: its place among ``groups`` (param groups), e.g. "parameter 3 of param group 0"."""
    for gi, group in enumerate(groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return f"parameter {pi} of param group {gi}"
    return "a parameter"
