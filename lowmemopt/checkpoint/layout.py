"""The state file's layout: one safetensors file, its keys, its per-rank names, writing it atomically and opening it.

Tensors are keyed ``<param>/<state key>`` (``<param>``: the name in ``model.named_parameters()``, else
``<group>/<index>``); the JSON header lives under the safetensors metadata key :data:`META_KEY` with a CRC-32 of every
tensor (:func:`crc32`). See ``docs/state_format.md``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import stat
import sys
import zlib
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..distributed.files import process_rank, rank_path
from ..distributed.sharding import is_dtensor
from ..quant.convert import CheckpointError
from ..quant.formats import BF16, FP32

if TYPE_CHECKING:
    from ..optimizer import LowMemOptimizer

FILE_FORMAT = "lowmemopt.optimizer_state"
#: 2: 8-bit slots in the pow2 maps; 1: in bitsandbytes' dynamic maps (still read, re-encoded on load). Each slot's
#: metadata names its map either way.
FILE_VERSION = 2
READABLE_FILE_VERSIONS = (1, 2)
META_KEY = "lowmemopt"
DTYPES = {FP32: "F32", BF16: "BF16"}  # safetensors dtype names of the dense formats


def param_names(optimizer: LowMemOptimizer, model: torch.nn.Module | None) -> list[tuple[str, int, torch.Tensor]]:
    """(name, group index, param) for every param of the optimizer, in group order."""
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if model is None:
                out.append((f"{g}/{i}", g, p))
            elif id(p) in names:
                out.append((names[id(p)], g, p))
            else:
                raise CheckpointError(
                    f"parameter {i} of param group {g} (shape {tuple(p.shape)}) is not in model.named_parameters()"
                )
    return out


def sharded_path(optimizer: LowMemOptimizer, path: str | os.PathLike) -> tuple[str, dict[str, int] | None]:
    """This rank's file for an optimizer with DTensor parameters (and its ``sharding`` record), else ``path``."""
    if not any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
        return os.fspath(path), None
    rank, world = process_rank()
    return rank_path(path, rank, world), {"rank": rank, "world_size": world}


def crc32(t: torch.Tensor, value: int = 0) -> int:
    if t.numel() == 0:
        return value
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), value)


def atomic_save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """save_file to a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the directory. The file
    gets the mode a plain ``open(path, "w")`` would give it (0o666 less the umask), as ``torch.save``'s files do."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # reserve the name; the umask applies
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # read here: the umask without os.umask's process-wide race
    finally:
        os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)  # safetensors (0.8) replaces the file with a 0o600 one of its own
        os.chmod(tmp, mode)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    with suppress(OSError):  # make the rename durable (not possible on every platform)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def open_state_file(path: str) -> Iterator[Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no optimizer state file at {path!r}")
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: truncated or corrupt state file ({e})") from None
    with handle as f:
        yield f


def page_releaser(f: Any, path: str) -> Callable[[int, int], None]:
    """madvise(MADV_DONTNEED) for pages of the file's private read-only mapping, Linux only (elsewhere a no-op).

    Only enabled after checking that safe_open's tensors really are views of a mapping of this file, so it can only
    ever drop clean file pages, which the kernel re-reads from the file if they are touched again."""
    if not sys.platform.startswith("linux"):
        return lambda a, b: None
    keys = [k for k in f.keys() if 0 not in f.get_slice(k).get_shape()]
    if not keys:
        return lambda a, b: None
    ptr = f.get_tensor(keys[0]).data_ptr()
    inode = os.stat(path).st_ino
    try:
        with open("/proc/self/maps") as maps:
            mapped = any(_maps_line_covers(line, ptr, inode) for line in maps)
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return lambda a, b: None
    if not mapped:
        return lambda a, b: None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, dontneed = mmap.PAGESIZE, 4  # MADV_DONTNEED

    def release(a: int, b: int) -> None:
        a, b = -(-a // page) * page, b // page * page  # whole pages inside [a, b) only
        if b > a:
            madvise(a, b - a, dontneed)

    return release


def _maps_line_covers(line: str, ptr: int, inode: int) -> bool:
    fields = line.split()
    if len(fields) < 6 or fields[4] != str(inode):
        return False
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    return lo <= ptr < hi
