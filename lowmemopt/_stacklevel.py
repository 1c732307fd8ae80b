"""The ``stacklevel`` that makes a warning point at the user's line, not at lowmemopt or torch.

``optimizer.step()`` reaches lowmemopt through torch's wrappers (``torch.no_grad``'s decorator in
``torch/utils/_contextlib.py``, the step hooks' wrapper in ``torch/optim/optimizer.py``), and a hook such as
``step_in_backward``'s runs under ``loss.backward()``'s frames; how many there are depends on the torch version. So the
level is counted, at the time of the warning, by walking out of the calling frame past every frame in torch's or
lowmemopt's source. (Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` does the same but needs ``stacklevel``
unset and is not in 3.10 / 3.11; one path for every version keeps it tested.)

    warnings.warn(message, RuntimeWarning, stacklevel=external_stacklevel())
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

__all__ = ["external_stacklevel", "internal_prefixes"]


def internal_prefixes() -> tuple[str, ...]:
    """Folders whose frames are skipped: torch's, lowmemopt's and lowmemopt's kernels' (a folder of its own in an
    editable install), as their real paths. A module file is resolved before its folder is taken: a package reached
    through links to its files (``scripts/gpu-check``'s folder of links) has its real folder elsewhere."""
    kernels = importlib.util.find_spec("lowmemopt.kernels")  # found, not imported
    folders = {os.path.dirname(os.path.realpath(torch.__file__)), os.path.dirname(os.path.realpath(__file__))}
    folders.update(os.path.realpath(f) for f in (kernels.submodule_search_locations or () if kernels else ()))
    return tuple(os.path.join(f, "") for f in sorted(folders))


_prefixes: tuple[str, ...] | None = None


def external_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` call made by the caller of this function: 1 names the caller's own
    line, 2 its caller's, ...; the first frame outside torch and lowmemopt. If every frame is internal (a thread started
    by torch, say), the outermost one."""
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
