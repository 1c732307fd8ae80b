"""The state file's layout: keys ``<param>/<state key>``, the JSON header under :data:`META_KEY` with a CRC-32 per
tensor, per-rank names, the atomic write and the one-time open (the safetensors library reads and writes the format).
Docs: docs/state_format.md#writing.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import zlib
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, BinaryIO, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..distributed.files import process_rank, rank_path
from ..distributed.sharding import is_dtensor
from ..quant.convert import CheckpointError
from ..quant.formats import BF16, FP32, FP64

if TYPE_CHECKING:
    from ..optimizer import LowMemOptimizer

FILE_FORMAT = "lowmemopt.optimizer_state"
#: 3: the metadata has a CRC-32 of its own (:data:`META_CRC_KEY`) and names the optimizer's ``algorithm``; 2: 8-bit
#: slots in the pow2 maps; 1: in bitsandbytes' dynamic maps (still read, re-encoded on load). Each slot's metadata names
#: its map either way.
FILE_VERSION = 3
READABLE_FILE_VERSIONS = (1, 2, 3)
META_KEY = "lowmemopt"
META_CRC_KEY = "lowmemopt.crc32"  # the CRC-32 of META_KEY's value (UTF-8), as a decimal string
DTYPES = {FP32: "F32", FP64: "F64", BF16: "BF16"}  # safetensors dtype names of the dense formats


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
    """This rank's file and ``sharding`` record for sharded or per-rank state; else ``path``."""
    if not (
        getattr(optimizer, "per_rank_files", False)
        or any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"])
    ):
        return os.fspath(path), None
    rank, world = process_rank()
    return rank_path(path, rank, world), {"rank": rank, "world_size": world}


def crc32(t: torch.Tensor, value: int = 0) -> int:
    if t.numel() == 0:
        return value
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), value)


def atomic_save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Write a safetensors file atomically: into a temporary folder beside ``path``
    (``.<name>.tmp-<host>-<pid>-<random>/``, mode 0o700), fsync, rename over ``path``, fsync the directory.

    The file keeps the mode of the one it replaces (a new one: 0o666 less the umask); killed saves' folders are
    removed first (:func:`_remove_stale_temporaries`).
    """
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _remove_stale_temporaries(directory, base)
    folder = os.path.join(directory, f".{base}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(folder, 0o700)
    tmp = os.path.join(folder, base)
    try:
        mode = _mode_for(path, tmp)
        write_safetensors(tmp, tensors, metadata)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    with suppress(OSError):
        os.rmdir(folder)
    with suppress(OSError):  # make the rename durable (not possible on every platform)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _mode_for(path: str, tmp: str) -> int:
    """The saved file's mode: that of the file at ``path``, else what ``open(path, "w")`` gives."""
    with suppress(FileNotFoundError):
        existing = os.stat(path)
        if stat.S_ISREG(existing.st_mode):
            return stat.S_IMODE(existing.st_mode)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


_HOST = socket.gethostname().replace("-", "_").replace(os.sep, "_")


def _remove_stale_temporaries(directory: str, base: str) -> None:
    """Remove what killed saves to ``base`` left behind (this host, process gone); never a live save's. POSIX only."""
    if os.name != "posix":
        return
    pattern = re.compile(rf"\.{re.escape(base)}\.tmp-{re.escape(_HOST)}-(\d+)-[0-9a-f]{{8}}")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match and not _process_alive(int(match.group(1))):
            where = os.path.join(directory, name)
            if os.path.isdir(where) and not os.path.islink(where):
                shutil.rmtree(where, ignore_errors=True)
            else:
                with suppress(OSError):
                    os.unlink(where)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` and ``metadata`` with ``safetensors.torch.save_file``."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), f"{os.strerror(int(code.group(1)))} (safetensors: {e})", path) from e


class StateFile:
    """A state file opened once and read by ``safetensors.safe_open`` through the same descriptor, so a save that
    replaces the path meanwhile is never half-seen; tensors are views of a private read-only map. A damaged header is
    a :class:`CheckpointError`."""

    def __init__(self, fh: BinaryIO, path: str):
        self.path = path
        self._stat = os.fstat(fh.fileno())
        try:
            self._file = safe_open(_same_file(fh, path), framework="pt")
        except SafetensorError as e:
            raise CheckpointError(f"{path}: truncated or corrupt state file ({e})") from None
        self._metadata: dict[str, str] = self._file.metadata() or {}
        self._mapped = (0, 0)  # the file's mapping (release), found when first needed

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def keys(self) -> list[str]:
        return self._file.keys()

    def dtype_shape(self, key: str) -> tuple[str, list[int]]:
        """The safetensors dtype name (``F32``, ``U8``, ...) and shape of ``key``; reads no data."""
        view = self._file.get_slice(key)
        return view.get_dtype(), view.get_shape()

    def get_tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key``: a view of the mapping (no bytes read until it is used)."""
        return self._file.get_tensor(key)

    def release(self, a: int, b: int) -> None:
        """Drop this file's mapped pages in addresses [a, b) from the process (Linux only)."""
        if _DONTNEED is None:
            return
        if not self._mapped[0] <= a < self._mapped[1]:
            self._mapped = _mapping_of(a, self._stat)
        page = mmap.PAGESIZE
        lo = max(-(-a // page) * page, self._mapped[0])  # whole pages inside only
        hi = min(b // page * page, self._mapped[1])
        if hi > lo:
            _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _DONTNEED)

    def close(self) -> None:
        self._file.__exit__(None, None, None)  # the views handed out keep their mapping


def _same_file(fh: BinaryIO, path: str) -> str:
    """A name that opens the very file ``fh`` has open (``/proc/self/fd/<n>``, ``/dev/fd/<n>``), else ``path``."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{fh.fileno()}"
    return path


def _mapping_of(address: int, st: os.stat_result) -> tuple[int, int]:
    """The address range of the mapping of the file ``st`` that holds ``address`` (``/proc/self/maps``), or (0, 0)."""
    device = (os.major(st.st_dev), os.minor(st.st_dev))
    with suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                if (major, minor) == device and int(fields[4]) == st.st_ino:
                    return lo, hi
                break
    return 0, 0


_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if sys.platform.startswith("linux") else None
_LIBC = ctypes.CDLL(None, use_errno=True) if _DONTNEED is not None else None
if _LIBC is not None:
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@contextmanager
def open_state_file(path: str) -> Iterator[StateFile]:
    """The state file at ``path`` opened once; a missing, unreadable or directory path raises its OSError."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no optimizer state file", path) from None
    with fh:
        f = StateFile(fh, path)
        try:
            yield f
        finally:
            f.close()
