"""The ``stacklevel`` that makes a warning point at the user's line: counted at warning time, past every frame in
torch's or lowmemopt's source (torch's wrappers and ``backward()``'s frames vary with the version; 3.12's
``skip_file_prefixes`` is not in 3.10 / 3.11)::

    warnings.warn(message, RuntimeWarning, stacklevel=external_stacklevel())
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

__all__ = ["external_stacklevel", "internal_prefixes"]


def internal_prefixes() -> tuple[str, ...]:
    """The real folders of torch, lowmemopt and its kernels, whose frames are skipped."""
    kernels = importlib.util.find_spec("lowmemopt.kernels")  # found, not imported
    folders = {os.path.dirname(os.path.realpath(torch.__file__)), os.path.dirname(os.path.realpath(__file__))}
    folders.update(os.path.realpath(f) for f in (kernels.submodule_search_locations or () if kernels else ()))
    return tuple(os.path.join(f, "") for f in sorted(folders))


_prefixes: tuple[str, ...] | None = None


def external_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside torch and lowmemopt (1: the caller's line)."""
    global _prefixes
    if _prefixes is None:
        _prefixes = internal_prefixes()
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename, _prefixes):
        frame = frame.f_back
        level += 1
    return level


def _internal(filename: str, prefixes: tuple[str, ...]) -> bool:
    return os.path.realpath(filename).startswith(prefixes) if os.path.isabs(filename) else False
