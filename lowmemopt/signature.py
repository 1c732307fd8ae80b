"""The constructor signatures users see: every optimizer class's own parameters and the storage options, by name.

An optimizer class takes the storage options through ``**storage`` (they are the base class's keyword-only
parameters: :class:`lowmemopt.optimizer.LowMemOptimizer`). ``LowMemOptimizer.__init_subclass__`` calls
:func:`set_signature` on every class, the drop-in aliases included, so ``inspect.signature(lowmemopt.AdamW)``,
``help()`` and completion in an interactive session show ``state_bits=32, block_size=None, ...`` instead of
``**storage``; an alias shows the defaults it changes (``AdamW8bit``: ``state_bits=8``). For static tools (an editor's
completion, type checkers) each class annotates ``**storage: Unpack[StorageOptions]`` (PEP 692), the same options as a
``TypedDict``; a test keeps :class:`StorageOptions` equal to the base class's keyword-only parameters.

:func:`checked_init` wraps the ``__init__`` of lowmemopt's own classes so that a misspelt keyword is a TypeError naming
the class and its closest keyword (Python would name ``LowMemOptimizer.__init__``, where ``**storage`` lands).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from typing import Any, Callable, TypedDict

__all__ = ["StorageOptions", "checked_init", "constructor_signature", "set_signature"]


class StorageOptions(TypedDict, total=False):
    """The storage and execution keywords every optimizer takes (``LowMemOptimizer``'s docstring says what each
    does)."""

    state_bits: int
    block_size: int | None
    min_quant_numel: int
    paged: bool | str
    offload_dir: str | os.PathLike | None
    page_budget_bytes: int | str
    page_headroom_bytes: int | None
    bf16_update: str
    capturable: bool
    foreach: bool | None
    fused: bool | None
    differentiable: bool


def constructor_signature(
    init: Callable[..., Any], base_init: Callable[..., Any], defaults: dict[str, Any] | None = None
) -> inspect.Signature:
    """``init``'s signature, ``**storage`` replaced by ``base_init``'s storage options (``defaults``: changed ones)."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    if len(params) < len(sig.parameters):
        named = {p.name for p in params}
        params += [
            p
            for p in inspect.signature(base_init).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in named
        ]
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


def checked_init(cls: type, init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (its signature set), refusing first a keyword ``cls.__signature__`` does not name, with a suggestion."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs:
            owner = type(self) if type(self).__init__ is __init__ else cls  # (a class that inherits this __init__)
            names = owner.__signature__.parameters  # type: ignore[attr-defined]
            for key in kwargs:
                if key not in names:
                    hint = getattr(owner, "_keyword_hints", {}).get(key)
                    raise TypeError(f"{owner.__name__}: {hint}" if hint else unexpected_keyword(owner, key, names))
        init(self, *args, **kwargs)

    return __init__


def unexpected_keyword(cls: type, key: str, names: Any) -> str:
    """Python's words for ``cls(..., key=...)``, with the closest of ``names`` (the keywords ``cls`` takes)."""
    choices = [n for n in names if n != "self"][1:]  # (not the parameters)
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"{cls.__name__} takes {', '.join(choices)}"
    return (
        f"{cls.__name__}.__init__() got an unexpected keyword argument {key!r}: {hint} "
        f"(inspect.signature(lowmemopt.{cls.__name__}) lists them)"
    )
