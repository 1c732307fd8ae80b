"""Build and load the C kernels (``kernels.c``) at first use.

The source is compiled once per (source, compiler, flags, CPU) with the system C compiler -- no torch headers, about a
second -- into ``~/.cache/lowmemopt/cpu-<hash>/`` (``$LOWMEMOPT_CACHE`` overrides the root, ``$CC`` the compiler) and
loaded with :mod:`ctypes`. ``-march=native`` ties a build to the CPU it was made on, so the CPU model and feature flags
are part of the hash. The build writes to a temporary name and renames, so concurrent first uses cannot load a half
written library. ``-fopenmp`` links ``libgomp.so.1``, the OpenMP runtime torch's CPU wheels already loaded: the kernels
share torch's thread pool. A compiler without OpenMP gets a second, single-threaded build.

If there is no compiler, or the build or the load fails, :func:`library` returns None and says why in
:data:`build_error`; the callers then keep to the existing (compiled / eager) paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ABI_VERSION", "SOURCE", "build_error", "cache_dir", "compile_library", "library"]

ABI_VERSION = 11  # must equal LMO_ABI_VERSION in kernels.c
SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
OPENMP = ["-fopenmp"]

_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("LOWMEMOPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lowmemopt")
    return Path(root)


def _cpu_signature() -> str:
    """CPU model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _compiler_version(cc: list[str]) -> str:
    out = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


def _compile(cc: list[str], flags: list[str], out: Path) -> None:
    tmp = tempfile.NamedTemporaryFile(dir=out.parent, prefix=out.name + ".", suffix=".tmp", delete=False)
    tmp.close()
    try:
        cmd = cc + flags + ["-o", tmp.name, str(SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{res.stderr.strip()[-2000:]}")
        os.replace(tmp.name, out)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)


def compile_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find in the cache) and load the kernels with ``extra_flags`` appended to the compiler flags (the
    tests build a variant without AVX-512 this way). Raises RuntimeError if no build works."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler ({(cc or [''])[0]!r} not found; set $CC)")
    source = SOURCE.read_bytes()
    version = _compiler_version(cc)
    errors = []
    for flags in (FLAGS + OPENMP + list(extra_flags), FLAGS + list(extra_flags)):
        key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in
                                        (source, " ".join(cc), version, " ".join(flags), _cpu_signature())))
        out = cache_dir() / f"cpu-{key.hexdigest()[:20]}" / "lowmemopt_cpu.so"
        try:
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                _compile(cc, flags, out)
            lib = ctypes.CDLL(str(out))
            if lib.lmo_abi_version() != ABI_VERSION:
                raise RuntimeError(f"{out}: ABI version {lib.lmo_abi_version()}, expected {ABI_VERSION}")
            return lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    raise RuntimeError("; ".join(errors))


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None if it cannot be built (see :data:`build_error`)."""
    global _lib, _tried, build_error
    if not _tried:
        _tried = True
        try:
            _lib = compile_library()
        except Exception as exc:  # noqa: BLE001 - any failure means: no C kernels, fall back
            build_error = str(exc)
            _lib = None
    return _lib
