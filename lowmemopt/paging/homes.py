"""Homes of paged state: page-locked host tensors (``paged="cpu"``) or mapped files (``paged="disk"``), allocated and
freed by :class:`Homes`, and the copies (``pread`` / ``pwrite``, :func:`transfer`) that keep the process's memory
small. Why: docs/paging.md#how-a-step-runs.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
import secrets
import shutil
import sys
from typing import Callable, NamedTuple

import torch

__all__ = [
    "Homes",
    "CopyFiles",
    "transfer",
    "transfer_all",
    "drop_tensor_pages",
    "will_need",
    "layout_offsets",
    "layout_bytes",
    "ALIGN",
    "COPY_CHUNK_BYTES",
    "IO_CHUNK_BYTES",
]

COPY_CHUNK_BYTES = 2 << 20  # copies through a mapping (no pread/pwrite) go this far at a time, dropping pages behind
IO_CHUNK_BYTES = 1 << 30  # one pread / pwrite call at most (Linux caps a single call near 2 GiB)
_PAGE = mmap.PAGESIZE
#: tensors laid out in one buffer (an arena of homes, a device slot, a staging buffer) start at multiples of this
ALIGN = 256


def layout_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of ``sizes`` laid out one after another at multiples of :data:`ALIGN`, and the total."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


def layout_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes that ``tensors`` take laid out in one buffer (:func:`layout_offsets`)."""
    return layout_offsets([t.numel() * t.element_size() for t in tensors])[1]


_MADV_WILLNEED, _MADV_DONTNEED = 3, 4


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None  # elsewhere pages are left to the kernel
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


class _Owned(NamedTuple):
    path: str | None  # its file (disk tier)
    pinned: int  # address registered with cudaHostRegister (0: none)
    mapped_bytes: int  # bytes of its file mapping (disk tier), 0 otherwise


class Homes:
    """Allocator of home tensors for one optimizer, tracked by storage address."""

    def __init__(self) -> None:
        self._owned: dict[int, _Owned] = {}
        self._views: dict[int, int] = {}  # address of a home inside an arena -> the arena's storage address
        self._refs: dict[int, int] = {}  # arena storage address -> its homes not freed yet
        self._arenas: dict[int, torch.Tensor] = {}  # arena storage address -> the arena's buffer
        self._dirs: dict[str, str] = {}  # offload_dir -> this optimizer's directory in it
        self._count = 0

    # -- allocation ----------------------------------------------------------------------------------------------

    def host(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """An uninitialized host tensor; page-locked if ``pin`` (a page-aligned view of its own padded buffer)."""
        numel = torch.Size(shape).numel()
        if not (pin and numel):
            t = torch.empty(shape, dtype=dtype)
            self._owned[t.untyped_storage().data_ptr()] = _Owned(None, 0, 0)
            return t
        nbytes = numel * dtype.itemsize
        locked = -(-nbytes // _PAGE) * _PAGE
        buf = torch.empty(locked + _PAGE, dtype=torch.uint8)
        offset = -buf.data_ptr() % _PAGE
        t = buf[offset : offset + nbytes].view(dtype).view(shape)
        code = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), locked, 0))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {locked} bytes of optimizer state failed with CUDA error {code}")
        self._owned[buf.untyped_storage().data_ptr()] = _Owned(None, t.data_ptr(), 0)
        return t

    def arena(self, layout: list[tuple[torch.Size, torch.dtype]], pin: bool) -> list[torch.Tensor]:
        """Uninitialized host tensors of ``layout`` in one buffer, laid out as a slot; page-locked if ``pin``."""
        offsets, total = layout_offsets([torch.Size(shape).numel() * dtype.itemsize for shape, dtype in layout])
        if total == 0:
            return [self.host(shape, dtype, pin=False) for shape, dtype in layout]
        if pin:
            whole = self.host(torch.Size([total]), torch.uint8, pin=True)
        else:
            whole = torch.empty(total + ALIGN, dtype=torch.uint8)
            whole = whole[-whole.data_ptr() % ALIGN :][:total]
            self._owned[whole.untyped_storage().data_ptr()] = _Owned(None, 0, 0)
        base = whole.untyped_storage().data_ptr()
        self._arenas[base] = whole
        data = whole.numpy()
        out = []
        for (shape, dtype), offset in zip(layout, offsets):
            numel = torch.Size(shape).numel()
            if numel == 0:
                out.append(self.host(shape, dtype, pin=False))
                continue
            t = torch.from_numpy(data[offset : offset + numel * dtype.itemsize]).view(dtype).view(shape)
            self._views[t.data_ptr()] = base
            self._refs[base] = self._refs.get(base, 0) + 1
            out.append(t)
        return out

    def buffer_of(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The storage holding ``t`` and its neighbours (an arena's buffer, else ``t``), and ``t``'s byte offset."""
        base = self._views.get(t.data_ptr()) if t.device.type == "cpu" else None
        holder = t if base is None else self._arenas[base]
        return holder, t.data_ptr() - holder.untyped_storage().data_ptr()

    def file(self, shape: torch.Size, dtype: torch.dtype, offload_dir: str, label: str) -> torch.Tensor:
        """A zero-filled tensor mapped from a new file under ``offload_dir``, its space reserved.

        Raises:
            OSError: (errno kept) naming the directory and size; nothing is left behind.
        """
        numel = torch.Size(shape).numel()
        nbytes = numel * dtype.itemsize
        if numel == 0:
            return self.host(shape, dtype, pin=False)
        directory = self._directory(os.fspath(offload_dir))
        self._count += 1
        path = os.path.join(directory, f"{self._count:06d}-{re.sub(r'[^A-Za-z0-9._-]', '_', label)}.bin")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _reserve(fd, nbytes)
            finally:
                os.close(fd)
            t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        except (OSError, RuntimeError) as e:
            try:
                os.unlink(path)
            except OSError:
                pass
            code = getattr(e, "errno", None) or errno.EIO
            why = "no space left on the disk" if code == errno.ENOSPC else f"{type(e).__name__}: {e}"
            raise OSError(
                code,
                f"lowmemopt paging: cannot reserve {nbytes / 2**20:.1f} MiB for optimizer state in offload_dir "
                f"{offload_dir!r} ({why}); free some space or choose another offload_dir",
            ) from e
        self._owned[t.untyped_storage().data_ptr()] = _Owned(path, 0, -(-nbytes // _PAGE) * _PAGE)
        return t

    def _directory(self, offload_dir: str) -> str:
        directory = self._dirs.get(offload_dir)
        if directory is None or not os.path.isdir(directory):
            try:
                os.makedirs(offload_dir, exist_ok=True)
                name = f"lowmemopt-{_rank_tag()}{os.getpid()}-{secrets.token_hex(4)}"
                directory = os.path.join(offload_dir, name)
                os.mkdir(directory, 0o700)
            except OSError as e:
                raise PermissionError(
                    e.errno or errno.EACCES,
                    f"offload_dir {offload_dir!r} is not a writable directory ({type(e).__name__}: {e.strerror or e})",
                ) from e
            self._dirs[offload_dir] = directory
        return directory

    # -- queries -------------------------------------------------------------------------------------------------

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._owned

    def is_file(self, t: torch.Tensor) -> bool:
        owned = self._owned.get(t.untyped_storage().data_ptr())
        return owned is not None and owned.path is not None

    def path(self, t: torch.Tensor) -> str | None:
        owned = self._owned.get(t.untyped_storage().data_ptr())
        return None if owned is None else owned.path

    def directories(self) -> list[str]:
        return list(self._dirs.values())

    # -- release -------------------------------------------------------------------------------------------------

    def free(self, t: torch.Tensor, keep_file: bool = False) -> None:
        """Give back ``t``'s home (file deleted, page-lock undone); no copy may be in flight."""
        ptr = t.untyped_storage().data_ptr()
        base = self._views.pop(t.data_ptr(), None) if t.numel() else None
        if base is not None:  # a home in an arena: the arena goes with its last home
            self._refs[base] -= 1
            if self._refs[base]:
                return
            del self._refs[base]
            del self._arenas[base]
            ptr = base
        self._drop(ptr, keep_file)

    def _drop(self, ptr: int, keep_file: bool = False) -> None:
        owned = self._owned.pop(ptr, None)
        if owned is None:
            return
        if owned.path is not None:
            _advise(ptr, owned.mapped_bytes, 0, owned.mapped_bytes, _MADV_DONTNEED)
            if not keep_file:
                try:
                    os.unlink(owned.path)
                except FileNotFoundError:
                    pass
        if owned.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(owned.pinned)
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the memory is freed anyway
                pass

    def close(self, tensors: list[torch.Tensor], keep_files: bool = False, manifest: list[dict] | None = None) -> None:
        """Free ``tensors`` and all still owned; delete the directories unless ``keep_files``."""
        for t in tensors:
            self.free(t, keep_file=keep_files)
        for base in list(self._refs):  # arenas some of whose homes were not among ``tensors``
            self._drop(base)
        self._refs.clear()
        self._views.clear()
        self._arenas.clear()
        self._owned.clear()
        for directory in self._dirs.values():
            if keep_files:
                if manifest is not None and os.path.isdir(directory):
                    with open(os.path.join(directory, "manifest.json"), "w") as f:
                        json.dump([m for m in manifest if os.path.dirname(m["file"]) == directory], f, indent=1)
            else:
                shutil.rmtree(directory, ignore_errors=True)
        self._dirs.clear()

    # -- pages ---------------------------------------------------------------------------------------------------

    def mapping_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(address, bytes) of the file mapping that holds ``t``, or None if ``t`` is not file-backed."""
        ptr = t.untyped_storage().data_ptr()
        owned = self._owned.get(ptr)
        if owned is None or owned.path is None:
            return None
        return ptr, owned.mapped_bytes


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of disk blocks for the file (zeros): ENOSPC now rather than SIGBUS later."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, nbytes)
    else:  # macOS: no posix_fallocate; a sparse file (a full disk then shows up on write)
        os.ftruncate(fd, nbytes)


def _advise(base: int, length: int, lo: int, hi: int, advice: int) -> None:
    """madvise the whole pages of ``[base + lo, base + hi)``, clamped to the mapping."""
    if _madvise is None or hi <= lo:
        return
    a = max(0, lo // _PAGE * _PAGE)
    b = min(length, -(-hi // _PAGE) * _PAGE)
    if b > a:
        _madvise(base + a, b - a, advice)


def drop_tensor_pages(homes: Homes, t: torch.Tensor) -> None:
    """Unmap the pages of ``t``'s file from this process (they stay in the page cache). No-op unless file-backed."""
    mapping = homes.mapping_of(t)
    if mapping is not None:
        _advise(mapping[0], mapping[1], 0, mapping[1], _MADV_DONTNEED)


def will_need(homes: Homes, t: torch.Tensor) -> None:
    """Ask the kernel to read ``t``'s file ahead into the page cache (asynchronous; maps nothing)."""
    mapping = homes.mapping_of(t)
    if mapping is not None:
        _advise(mapping[0], mapping[1], 0, mapping[1], _MADV_WILLNEED)


def transfer(homes: Homes, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors where either may be a file home (``pread`` / ``pwrite``)."""
    dst_path, src_path = homes.path(dst), homes.path(src)
    for t, path in ((dst, dst_path), (src, src_path)):
        if path is not None and t.data_ptr() != t.untyped_storage().data_ptr():
            raise ValueError("transfer() takes whole file homes, not views into them")
    if dst_path is None and src_path is None:
        dst.copy_(src)
    elif hasattr(os, "pwrite") and (dst_path is None or src_path is None):
        if src_path is not None:
            target = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
            try:
                _file_io(src_path, target, write=False)
            except FileNotFoundError:  # (removed, by hand or a cleaner of its directory: its mapping still holds it)
                _copy_mapped(homes, target, src)
            if target is not dst:
                dst.copy_(target)
        else:
            _file_io(dst_path, src if src.is_contiguous() else src.contiguous(), write=True)
    else:
        _copy_mapped(homes, dst, src)


#: many whole files at once: ``[(path, tensor, write)]`` -> per request None or the OSError it failed with; or None (it
#: cannot: the caller copies one file after another). The CPU's: :func:`lowmemopt.cpu.fileio.copy_files`
CopyFiles = Callable[[list[tuple[str, torch.Tensor, bool]]], "list[OSError | None] | None"]


def transfer_all(
    homes: Homes,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    copy_files: CopyFiles | None = None,
) -> list[BaseException | None]:
    """:func:`transfer` of each ``(dst, src)``; per pair None or its error. ``copy_files``: whole file homes at once."""
    errors: list[BaseException | None] = [None] * len(pairs)
    todo = list(range(len(pairs)))
    if copy_files is not None and hasattr(os, "pwrite"):
        files, at = [], []
        for k, (dst, src) in enumerate(pairs):
            dst_path, src_path = homes.path(dst), homes.path(src)
            other = src if src_path is None else dst
            if (dst_path is None) == (src_path is None) or not other.is_contiguous() or other.device.type != "cpu":
                continue
            path, home = (dst_path, dst) if dst_path is not None else (src_path, src)
            if (
                home.data_ptr() != home.untyped_storage().data_ptr()
                or home.shape != other.shape
                or home.dtype != other.dtype
            ):
                continue  # (transfer() says what is wrong)
            files.append((path, other, dst_path is not None))
            at.append(k)
        done = copy_files(files) if files else None
        if done is not None:
            # (a file removed since it was made: read through its mapping, which still holds it, by transfer())
            taken = {k for k, (_, _, write), e in zip(at, files, done) if write or not isinstance(e, FileNotFoundError)}
            for k, e in zip(at, done):
                errors[k] = e if k in taken else None
            todo = [k for k in todo if k not in taken]
    for k in todo:
        try:
            transfer(homes, *pairs[k])
        except Exception as e:  # noqa: BLE001 - returned: the caller decides
            errors[k] = e
    return errors


def _file_io(path: str, t: torch.Tensor, write: bool) -> None:
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        done, base = 0, t.data_ptr()
        while done < nbytes:
            n = min(IO_CHUNK_BYTES, nbytes - done)
            view = (ctypes.c_char * n).from_address(base + done)
            got = os.pwrite(fd, view, done) if write else os.preadv(fd, [view], done)
            if got <= 0:
                raise OSError(errno.EIO, f"lowmemopt paging: short {'write to' if write else 'read from'} {path}")
            done += got
    finally:
        os.close(fd)


def _copy_mapped(homes: Homes, dst: torch.Tensor, src: torch.Tensor) -> None:
    dst_map, src_map = homes.mapping_of(dst), homes.mapping_of(src)
    d, s = dst.view(-1), src.reshape(-1)
    step = max(1, COPY_CHUNK_BYTES // max(1, dst.element_size()))
    for lo in range(0, d.numel(), step):
        hi = min(d.numel(), lo + step)
        d[lo:hi].copy_(s[lo:hi])
        for mapping, t in ((dst_map, d), (src_map, s)):
            if mapping is not None:
                off = t.data_ptr() - mapping[0]
                _advise(
                    mapping[0], mapping[1], off + lo * t.element_size(), off + hi * t.element_size(), _MADV_DONTNEED
                )


def _rank_tag() -> str:
    """``"rank00001-of-00002-"`` in a torch.distributed job (each rank's files in a directory of its own), else ""."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return ""
    return f"rank{dist.get_rank():05d}-of-{dist.get_world_size():05d}-"
