"""The state file's layout: one safetensors file, its keys, its per-rank names, writing it atomically and opening it.

Tensors are keyed ``<param>/<state key>`` (``<param>``: the name in ``model.named_parameters()``, else
``<group>/<index>``); the JSON header lives under the safetensors metadata key :data:`META_KEY` with a CRC-32 of every
tensor (:func:`crc32`). See ``docs/state_format.md``.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import sys
import zlib
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator

import torch

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
    """This rank's file for an optimizer with DTensor parameters or per-rank state (``per_rank_files``: the 1-bit
    optimizers' error buffers), and its ``sharding`` record; else ``path``."""
    if not (getattr(optimizer, "per_rank_files", False)
            or any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"])):
        return os.fspath(path), None
    rank, world = process_rank()
    return rank_path(path, rank, world), {"rank": rank, "world_size": world}


def crc32(t: torch.Tensor, value: int = 0) -> int:
    if t.numel() == 0:
        return value
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), value)


def atomic_save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Write a safetensors file (:func:`write_safetensors`) to a temporary file beside ``path``, fsync it, rename it
    over ``path``, fsync the directory: an interrupted save leaves the previous file as it was. The file keeps the mode of
    the file it replaces (as ``torch.save``, which writes in place, does); a new file gets the mode a plain
    ``open(path, "w")`` would give it (0o666 less the umask). Temporary files of saves that were killed (their process
    gone) are removed first (:func:`_remove_stale_temporaries`)."""
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _remove_stale_temporaries(directory, base)
    tmp = os.path.join(directory, f".{base}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # reserve the name; the umask applies
    try:
        with suppress(FileNotFoundError):
            existing = os.stat(path)
            if stat.S_ISREG(existing.st_mode):
                os.chmod(tmp, stat.S_IMODE(existing.st_mode))  # before any data is written
        with os.fdopen(fd, "wb") as fh:
            fd = -1
            write_safetensors(fh, tensors, metadata)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with suppress(OSError):
            os.unlink(tmp)
        raise
    with suppress(OSError):  # make the rename durable (not possible on every platform)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


_HOST = socket.gethostname().replace("-", "_").replace(os.sep, "_")


def _remove_stale_temporaries(directory: str, base: str) -> None:
    """Remove the temporary files that saves to ``base`` killed before their rename left behind: those named for this
    host and a process that no longer runs. A save in progress (its process alive) is never touched. POSIX only."""
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
            with suppress(OSError):
                os.unlink(os.path.join(directory, name))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def write_safetensors(fh: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, contiguous; F32, BF16, F16 or U8) and ``metadata`` to ``fh`` as a safetensors file,
    byte for byte what ``safetensors.torch.save_file`` writes (tensors ordered by dtype, then name; the JSON header
    padded with spaces to 8 bytes), streamed from the tensors' memory without a copy of the whole file."""
    items = sorted(tensors.items(), key=lambda kv: (_DTYPE_ORDER[kv[1].dtype], kv[0]))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    for _, t in items:
        if t.numel():
            fh.write(t.reshape(-1).view(torch.uint8).numpy().data)


#: the dtypes of state files (F16: an fp16 parameter's bf16_update.kahan buffer)
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.uint8: "U8"}  # (F64: a float64 parameter's full-precision state)
#: safetensors' order: its dtype enum's, descending
_DTYPE_ORDER = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.uint8: 4}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100_000_000  # as safetensors


class StateFile:
    """A state file opened once: the header is read from the open file and its data memory-mapped from the same
    descriptor (a private mapping, never written), so a save that replaces the path meanwhile is never half-seen.

    The safetensors header is checked whole on opening (lengths, dtypes, shapes, the tensors' byte ranges tiling the
    data exactly): a damaged one is a :class:`CheckpointError`, never a misread."""

    def __init__(self, fh: BinaryIO, path: str):
        self.path = path
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: truncated or corrupt state file (not a safetensors file: a header of "
                                  f"{n if n >= 0 else 'no'} bytes in {size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: truncated or corrupt state file (its safetensors header is not JSON: "
                                  f"{type(e).__name__})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt state file (its safetensors header is a {type(header).__name__})")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{path}: corrupt state file (its safetensors metadata is not a map of strings)")
        self._metadata: dict[str, str] = meta
        self._tensors = {key: self._entry(key, value) for key, value in header.items()}
        end = 0
        for key, (_, _, a, b) in sorted(self._tensors.items(), key=lambda kv: kv[1][2:]):
            if a != end:
                raise CheckpointError(f"{path}: corrupt state file (tensor {key!r} at bytes {a}..{b} of the data, "
                                      f"expected to start at {end})")
            end = b
        self._start = 8 + n
        if self._start + end != size:
            raise CheckpointError(f"{path}: truncated or corrupt state file ({size - self._start} bytes of data, the "
                                  f"header describes {end})")
        self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # writable to torch, never written
        self._base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()

    def _entry(self, key: str, value: Any) -> tuple[str, list[int], int, int]:
        try:
            dtype, shape, (a, b) = value["dtype"], value["shape"], value["data_offsets"]
            numel = 1
            for d in shape:
                if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                    raise ValueError(d)
                numel *= d
            ok = dtype in _TORCH_DTYPES and all(type(x) is int for x in (a, b)) and 0 <= a
            ok = ok and b - a == numel * _TORCH_DTYPES[dtype].itemsize
        except (TypeError, ValueError, KeyError):
            ok = False
        if not ok:
            raise CheckpointError(f"{self.path}: corrupt state file (tensor {key!r}: {str(value)[:200]})")
        return dtype, shape, a, b

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def keys(self) -> list[str]:
        return list(self._tensors)

    def dtype_shape(self, key: str) -> tuple[str, list[int]]:
        dtype, shape, _, _ = self._tensors[key]
        return dtype, shape

    def get_tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key``: a view of the mapping (no bytes read until it is used)."""
        dtype, shape, a, b = self._tensors[key]
        if a == b:
            return torch.empty(shape, dtype=_TORCH_DTYPES[dtype])
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=b - a, offset=self._start + a)
        return flat.view(_TORCH_DTYPES[dtype]).view(shape)

    def release(self, a: int, b: int) -> None:
        """Drop the pages of the mapping inside addresses [a, b) from the process (clean file pages: they are re-read
        from the file if touched again). Linux only; elsewhere a no-op."""
        if _DONTNEED is None:
            return
        page = mmap.PAGESIZE
        lo, hi = -(-(a - self._base) // page) * page, (b - self._base) // page * page  # whole pages inside only
        if hi > lo:
            self._map.madvise(_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        with suppress(BufferError):  # views still referenced: the mapping closes when they are gone
            self._map.close()


_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if sys.platform.startswith("linux") else None


@contextmanager
def open_state_file(path: str) -> Iterator[StateFile]:
    """The state file at ``path``, opened once (:class:`StateFile`). A missing, unreadable or directory path raises
    the OSError that says so."""
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
