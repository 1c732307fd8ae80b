"""lowmemopt.cpu.fileio: many files read and written at once on the OpenMP threads (the CPU disk tier's copies),
against the files' bytes, with each request's own error. Skipped where no C compiler can build the library."""

from __future__ import annotations

import errno
import os
import resource

import pytest
import torch

import lowmemopt.cpu as cpu
from lowmemopt.cpu import build
from lowmemopt.cpu.fileio import copy_files

PIECE = 1 << 20  # LMO_IO_PIECE
SIZES = [0, 1, 4095, PIECE, PIECE + 1, 3 * PIECE - 7, 100_000]


@pytest.fixture(autouse=True)
def _native():
    if not cpu.available():
        pytest.skip(f"native CPU kernels unavailable: {build.build_error}")


def _files(tmp_path, sizes):
    g = torch.Generator().manual_seed(len(sizes))
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    paths = [str(tmp_path / f"{k}.bin") for k in range(len(sizes))]
    for path in paths:
        open(path, "wb").close()
    return paths, tensors


@pytest.mark.parametrize("threads", [1, 3])
def test_writes_and_reads_many_files_in_pieces(tmp_path, threads):
    paths, tensors = _files(tmp_path, SIZES)
    assert copy_files([(p, t, True) for p, t in zip(paths, tensors)], threads) == [None] * len(SIZES)
    for path, t in zip(paths, tensors):
        with open(path, "rb") as f:
            assert f.read() == t.numpy().tobytes()
    back = [torch.full_like(t, 7) for t in tensors]
    as_floats = torch.empty((3 * PIECE - 8) // 4, dtype=torch.float32)  # any dtype: bytes are bytes
    with open(paths[5], "rb") as f:
        expect = torch.frombuffer(bytearray(f.read()[: as_floats.numel() * 4]), dtype=torch.float32)
    requests = [(p, t, False) for p, t in zip(paths, back)] + [(paths[5], as_floats, False)]
    assert copy_files(requests, threads) == [None] * (len(SIZES) + 1)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    assert torch.equal(as_floats.view(torch.int32), expect.view(torch.int32))


def test_each_request_keeps_its_own_error_and_the_others_are_done(tmp_path):
    paths, tensors = _files(tmp_path, [PIECE + 5, 10])
    assert copy_files([(p, t, True) for p, t in zip(paths, tensors)]) == [None, None]
    past_the_end = torch.empty(11, dtype=torch.uint8)
    good = torch.zeros(PIECE + 5, dtype=torch.uint8)
    errors = copy_files(
        [(paths[1], past_the_end, False), (paths[0], good, False), (str(tmp_path / "missing.bin"), good, False)], 2
    )
    assert isinstance(errors[0], OSError) and errors[0].errno == errno.EIO and paths[1] in str(errors[0])
    assert errors[1] is None and torch.equal(good, tensors[0])
    assert isinstance(errors[2], FileNotFoundError)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        copy_files([(paths[0], torch.zeros(4, 4, dtype=torch.uint8).t(), False)])


def test_a_write_the_system_refuses_is_that_requests_error(tmp_path):
    """A real error from pwrite itself: beyond the process's file size limit (RLIMIT_FSIZE) the kernel refuses the
    write with EFBIG (Python ignores the SIGXFSZ that comes with it); the pieces below the limit are written."""
    paths, tensors = _files(tmp_path, [3 * PIECE, 100])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * PIECE, hard))
    except (ValueError, OSError) as e:
        pytest.skip(f"cannot lower RLIMIT_FSIZE here: {e}")
    try:
        errors = copy_files([(p, t, True) for p, t in zip(paths, tensors)], 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert isinstance(errors[0], OSError) and errors[0].errno == errno.EFBIG and errors[1] is None
    assert os.path.getsize(paths[0]) == 2 * PIECE and os.path.getsize(paths[1]) == 100
