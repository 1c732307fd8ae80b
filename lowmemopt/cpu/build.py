"""Build and load the C kernels (``csrc/``, one translation unit ``library.c``) at first use with the system C compiler,
cached in ``~/.cache/lowmemopt/cpu-<hash>/`` and loaded with :mod:`ctypes`; one build per instruction set
(:data:`ISAS`: ``avx512``, ``avx2``, ``scalar``, identical results). Without a compiler, or on a failed build,
:func:`library` returns None and :data:`build_error` says why. Flags, cache key and ISAs: docs/cpu_kernels.md#build.
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

__all__ = [
    "ABI_VERSION",
    "HEADERS",
    "ISAS",
    "SOURCE",
    "UNITS",
    "build_error",
    "cache_dir",
    "compile_library",
    "cpu_isas",
    "isa_of",
    "library",
    "requested_isa",
    "source_key",
]

ABI_VERSION = 18  # must equal LMO_ABI_VERSION in csrc/lmo.h
#: the kernels' instruction sets, best first: name -> (LMO_ISA in csrc/lmo.h, extra compiler flags, CPU flags needed)
ISAS: dict[str, tuple[int, tuple[str, ...], frozenset[str]]] = {
    "avx512": (2, ("-DLMO_ISA=2",), frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    "avx2": (1, ("-mno-avx512f", "-DLMO_ISA=1"), frozenset({"avx2", "fma", "f16c"})),
    "scalar": (0, ("-DLMO_ISA=0",), frozenset()),
}
CSRC = Path(__file__).with_name("csrc")
#: what the compiler is given: the units below as one translation unit (it includes them in this order)
SOURCE = CSRC / "library.c"
#: the C units, by family
UNITS = tuple(CSRC / name for name in ("runner.c", "elementwise.c", "codec.c", "factored.c", "fileio.c"))
#: the headers they include
HEADERS = tuple(CSRC / name for name in ("lmo.h", "vectors_avx512.h", "vectors_avx2.h", "vectors_scalar.h"))
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


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith(("flags", "Features")):
                    return set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_isas() -> list[str]:
    """The instruction sets of :data:`ISAS` this CPU runs, best first (unknown flags: all; the builds decide)."""
    flags = _cpu_flags()
    return [name for name, (_, _, need) in ISAS.items() if flags is None or need <= flags]


def requested_isa() -> str | None:
    """The instruction set ``$LOWMEMOPT_CPU_ISA`` forces, None for ``auto`` / unset; ValueError for another value."""
    name = os.environ.get("LOWMEMOPT_CPU_ISA", "").strip().lower()
    if name in ("", "auto"):
        return None
    if name not in ISAS:
        raise ValueError(f"LOWMEMOPT_CPU_ISA={name!r}: expected one of {', '.join(ISAS)} or auto")
    return name


def isa_of(lib: ctypes.CDLL) -> str:
    """The instruction set a loaded kernel library was built for."""
    code = lib.lmo_isa()
    return next(name for name, (c, _, _) in ISAS.items() if c == code)


def _compiler_version(cc: list[str]) -> str:
    out = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


def source_key() -> bytes:
    """Every source and header file, name and contents (any change makes a new build)."""
    files = sorted({SOURCE, *UNITS, *HEADERS} | set(CSRC.glob("*.[ch]")))
    return b"\0".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


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


def compile_library(extra_flags: tuple[str, ...] = (), isa: str | None = None) -> ctypes.CDLL:
    """Build (or find in the cache) and load the kernels for ``isa`` (None: forced or best), ``extra_flags`` appended.

    Raises:
        RuntimeError: no build works. ValueError: an unknown ``isa``.
    """
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa={isa!r}: expected one of {', '.join(ISAS)}")
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler ({(cc or [''])[0]!r} not found; set $CC)")
    forced = isa or requested_isa()
    if forced is not None:
        have = cpu_isas()
        if forced not in have:
            raise RuntimeError(f"instruction set {forced!r} requested, but this CPU runs only {', '.join(have)}")
        candidates = [forced]
    else:
        candidates = cpu_isas()
    source = source_key()
    version = _compiler_version(cc)
    errors = []
    for name in candidates:
        code, isa_flags, _ = ISAS[name]
        for flags in (
            FLAGS + OPENMP + list(isa_flags) + list(extra_flags),
            FLAGS + list(isa_flags) + list(extra_flags),
        ):
            key = hashlib.sha256(
                b"\0".join(
                    x.encode() if isinstance(x, str) else x
                    for x in (source, " ".join(cc), version, " ".join(flags), _cpu_signature())
                )
            )
            out = cache_dir() / f"cpu-{key.hexdigest()[:20]}" / "lowmemopt_cpu.so"
            try:
                if not out.exists():
                    out.parent.mkdir(parents=True, exist_ok=True)
                    _compile(cc, flags, out)
                lib = ctypes.CDLL(str(out))
                if lib.lmo_abi_version() != ABI_VERSION:
                    raise RuntimeError(f"{out}: ABI version {lib.lmo_abi_version()}, expected {ABI_VERSION}")
                if lib.lmo_isa() != code:
                    raise RuntimeError(f"{out}: built for LMO_ISA {lib.lmo_isa()}, expected {code} ({name})")
                return lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
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
