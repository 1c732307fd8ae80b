"""The constructor signatures users see: every optimizer class's own parameters and the storage options, by name.

An optimizer class takes the storage options through ``**storage`` (they are the base class's keyword-only
parameters: :class:`lowmemopt.optimizer.LowMemOptimizer`). ``LowMemOptimizer.__init_subclass__`` calls
:func:`set_signature` on every class, the drop-in aliases included, so ``inspect.signature(lowmemopt.AdamW)``,
``help()`` and completion in an interactive session show ``state_bits=32, block_size=None, ...`` instead of
``**storage``; an alias shows the defaults it changes (``AdamW8bit``: ``state_bits=8``). For static tools (an editor's
completion, type checkers) each class annotates ``**storage: Unpack[StorageOptions]`` (PEP 692), the same options as a
``TypedDict``; a test keeps :class:`StorageOptions` equal to the base class's keyword-only parameters.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, TypedDict

__all__ = ["StorageOptions", "constructor_signature", "set_signature"]


class StorageOptions(TypedDict, total=False):
    """The storage and execution keywords every optimizer takes (``LowMemOptimizer``'s docstring says what each
    does)."""

    state_bits: int
    block_size: int | None
    min_quant_numel: int
    paged: bool | str
    offload_dir: str | os.PathLike | None
    page_budget_bytes: int
    bf16_update: str
    capturable: bool
    foreach: bool | None
    fused: bool | None
    differentiable: bool


def constructor_signature(init: Callable[..., Any], base_init: Callable[..., Any],
                          defaults: dict[str, Any] | None = None) -> inspect.Signature:
    """``init``'s signature (``self`` first) with its ``**storage`` replaced by the keyword-only parameters of
    ``base_init`` (the storage options) that it does not name itself; ``defaults``: parameters whose defaults differ
    (an alias's ``state_bits=8``)."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    if len(params) < len(sig.parameters):
        named = {p.name for p in params}
        params += [p for p in inspect.signature(base_init).parameters.values()
                   if p.kind is p.KEYWORD_ONLY and p.name not in named]
    if defaults:
        unknown = set(defaults) - {p.name for p in params}
        if unknown:
            raise TypeError(f"no parameter {sorted(unknown)} to give a default")
        params = [p.replace(default=defaults[p.name]) if p.name in defaults else p for p in params]
    return sig.replace(parameters=params)


def set_signature(cls: type, base_init: Callable[..., Any]) -> None:
    """Give ``cls`` (and its own ``__init__``, which ``help()`` lists) the signature :func:`constructor_signature`
    makes of its ``__init__``."""
    sig = constructor_signature(cls.__init__, base_init)
    init = cls.__dict__.get("__init__")
    if init is not None:
        init.__signature__ = sig
    cls.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])  # (without self)
