"""Static resources of every fused Triton kernel variant, compiled for sm_90 (H100) on the CPU: registers and spills,
shared memory, theoretical occupancy, and the memory instructions of the path a full tile takes. No GPU, no timing.

    cd /tmp && python /path/to/lowmemopt/bench/kernel_resources.py                 # every variant + AdamW tile sweep
    cd /tmp && python /path/to/lowmemopt/bench/kernel_resources.py --no-sweep --json resources.json

The variants are :data:`lowmemopt.kernels.variants.VARIANTS` (each kernel at the launchers' default tile and
``num_warps``; the GPU-compile test uses the same table) plus, unless ``--no-sweep``, 8-bit and 4-bit AdamW (no
amsgrad, bf16 parameters, fp32 gradients) over tile shapes x ``num_warps`` {4, 8}. Each is compiled by Triton's own
compiler and ptxas (``--jobs`` worker processes started without ``TRITON_INTERPRET``, on a fresh Triton cache so that
ptxas runs and its ``-v`` report can be read). Per variant:

* registers per thread, stack frame and spill stores / loads (bytes): ptxas's ``-v`` report of the very compile that
  produced the cubin; the cubin's static shared memory from ``cuobjdump --dump-resource-usage``;
* theoretical occupancy on an H100 (:data:`H100`): resident warps per SM and what limits them (regs, smem, threads,
  blocks), as CUDA's occupancy calculator computes it;
* global loads and stores by access width (128 / 64 / 32 / <=16 bits), atomics, shared-memory loads and stores and
  ``bar.sync``, counted in the PTX of the path a full tile executes: the tile kernels branch on ``if full:`` into an
  unmasked (vectorizable) body and a masked one, and the masked one is left out (kernels without that branch: all of
  it). Static counts: each instruction once, loops once;
* load bytes per program: the counted loads' widths x threads per program, and per tile element. That is what a
  program asks of the memory system (code-book gathers included, which should hit L1), not HBM traffic; when the
  loads issue relative to their first use is not derived;
* SASS instructions per thread on the same path and per tile element (``nvdisasm -gp``, Triton's bundled one): the
  issue budget. An H100 SM issues 128 thread instructions per clock and receives about 14.5 bytes of HBM bandwidth
  per clock, so a kernel that moves B bytes per element cannot reach the bandwidth above about 9 B instructions per
  element (8-bit AdamW, bf16 parameters and gradients: 10 B/element, 90).

Exit status: 0, 1 if a variant failed to compile, 2 without Triton's NVIDIA backend (ptxas).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

#: AdamW tile sweep: (format, (ROWS, BLOCK) per program) x num_warps. Rows are quantization blocks, so the q4 shapes
#: hold the q8 shapes' element counts at its 128-element block (and one at block 256).
SWEEP_TILES = {"q8": [(4, 256), (8, 256), (16, 256), (8, 512)], "q4": [(8, 128), (16, 128), (32, 128), (16, 256)]}
SWEEP_WARPS = (4, 8)
WIDTHS = (128, 64, 32, 16)  # access-width classes in bits; 16 counts every access of 16 bits or less


# ---------------------------------------------------------------------------------------------------------------------
# occupancy


@dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of a GPU model, as CUDA's occupancy calculator uses them."""

    name: str
    regs: int = 65536  # 32-bit registers per SM (and per block)
    reg_unit: int = 256  # registers are allocated per warp in units of this many
    warp_granularity: int = 4  # warps are allocated registers in groups of this many
    max_regs_per_thread: int = 255
    smem: int = 228 * 1024  # shared memory per SM (the largest carve-out)
    smem_per_block: int = 227 * 1024  # the most one block may use
    smem_unit: int = 128  # allocation unit
    reserved_smem: int = 1024  # the system's shared memory per block (compute capability >= 8.0)
    max_warps: int = 64  # 2048 threads
    max_blocks: int = 32


H100 = SMLimits("H100 (sm_90)")


@dataclass
class Occupancy:
    """Resident blocks and warps per SM of one kernel, and the resources that limit them."""

    blocks: int
    warps: int
    fraction: float  # warps / the SM's maximum
    limiter: str  # "regs", "smem", "threads", "blocks", several joined by "+" when they tie
    by: dict[str, int] = field(default_factory=dict)  # blocks per SM allowed by each resource


def occupancy(registers: int, smem_bytes: int, num_warps: int, sm: SMLimits = H100) -> Occupancy:
    """Theoretical occupancy of a kernel using ``registers`` per thread and ``smem_bytes`` of shared memory per block
    (static + dynamic; the system's reserved KiB is added here) in blocks of ``num_warps`` warps on ``sm``."""
    if registers > sm.max_regs_per_thread:
        raise ValueError(f"{registers} registers per thread: more than {sm.name} allows ({sm.max_regs_per_thread})")
    per_warp = math.ceil(registers * 32 / sm.reg_unit) * sm.reg_unit
    reg_warps = (sm.regs // per_warp) // sm.warp_granularity * sm.warp_granularity if per_warp else sm.max_warps
    smem = math.ceil((smem_bytes + sm.reserved_smem) / sm.smem_unit) * sm.smem_unit
    by = {
        "regs": reg_warps // num_warps,
        "smem": sm.smem // smem if smem <= sm.smem_per_block else 0,
        "threads": sm.max_warps // num_warps,
        "blocks": sm.max_blocks,
    }
    blocks = min(by.values())
    limiter = "+".join(name for name, n in by.items() if n == blocks)
    return Occupancy(blocks, blocks * num_warps, blocks * num_warps / sm.max_warps, limiter, by)


# ---------------------------------------------------------------------------------------------------------------------
# tools: ptxas (Triton's own) and cuobjdump


def ptxas_path() -> str | None:
    """The ptxas Triton compiles sm_90 with, or None without Triton's NVIDIA backend."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        takes_arch = "arch" in inspect.signature(get_ptxas).parameters
        return (get_ptxas(90) if takes_arch else get_ptxas()).path or None
    except Exception:  # noqa: BLE001 - no NVIDIA backend, or no ptxas in this Triton install
        return None


def cuobjdump_path() -> str | None:
    """Triton's cuobjdump (its ``knobs``), else one next to its ptxas or on ``PATH``; None if there is none."""
    try:
        from triton import knobs

        return knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 - Triton raises RuntimeError when its bundled binary is missing
        pass
    ptxas = ptxas_path()
    beside = os.path.join(os.path.dirname(ptxas), "cuobjdump") if ptxas else ""
    return beside if os.access(beside, os.X_OK) else shutil.which("cuobjdump")


def nvdisasm_path() -> str | None:
    """Triton's nvdisasm, beside its ptxas, else one on ``PATH``; None if there is none."""
    ptxas = ptxas_path()
    beside = os.path.join(os.path.dirname(ptxas), "nvdisasm") if ptxas else ""
    return beside if os.access(beside, os.X_OK) else shutil.which("nvdisasm")


# ---------------------------------------------------------------------------------------------------------------------
# registers, spills, static shared memory


def parse_ptxas_log(log: str, name: str) -> dict[str, int | None]:
    """Registers, barriers, stack frame and spill stores / loads (bytes) of entry function ``name`` from ptxas's ``-v``
    report (None for what it does not state)."""
    out: dict[str, int | None] = dict(registers=None, barriers=None, stack=None, spill_stores=None, spill_loads=None)
    props = re.search(
        rf"Function properties for {re.escape(name)}\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
        r"stores, (\d+) bytes spill loads",
        log,
    )
    if props:
        out.update(stack=int(props[1]), spill_stores=int(props[2]), spill_loads=int(props[3]))
    entry = log.find(f"Compiling entry function '{name}'")
    used = re.search(r"Used (\d+) registers(?:, used (\d+) barriers)?", log[entry:] if entry >= 0 else log)
    if used:
        out.update(registers=int(used[1]), barriers=int(used[2] or 0))
    return out


def parse_resource_usage(text: str, name: str) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of function ``name`` in ``cuobjdump --dump-resource-usage`` output
    (lower-case keys; {} if the function is not listed)."""
    m = re.search(rf"Function {re.escape(name)}:\s*\n\s*(.*)", text)
    if not m:
        return {}
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", m[1]))
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL") if k in fields}


def cubin_resources(cubin: bytes, name: str, cuobjdump: str) -> dict[str, int]:
    """:func:`parse_resource_usage` of a cubin (written to a temporary file for cuobjdump)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, timeout=120)
    return parse_resource_usage(out.stdout, name)


# ---------------------------------------------------------------------------------------------------------------------
# PTX: the full-tile path and its memory instructions

_LABEL = re.compile(r"^([$\w.]+):$")
_BRANCH = re.compile(r"^(@!?%\w+\s+)?bra(?:\.uni)?\s+([$\w.]+)\s*;")
_END = re.compile(r"^(?:@!?%\w+\s+)?(?:ret|exit|trap)\b")
_LOC = re.compile(r"^\.loc\s+(\d+)\s+(\d+)\s+\d+")
_INLINED = re.compile(r"inlined_at\s+(\d+)\s+(\d+)")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', flags=re.M)
_CALL_SITE = re.compile(r"([\w.+-]+\.py):(\d+):(\d+)")  # a call site in a .loc comment (file.py:line:column)
_MEM = re.compile(r"^(?:@!?%\w+\s+)?(ld|st|atom|red)\.(global|shared)(?:::\w+)?((?:\.[\w:]+)*)\s")
_BAR = re.compile(r"^(?:@!?%\w+\s+)?(?:bar|barrier)(?:\.cta)?\.sync\b")


@dataclass
class Block:
    """A PTX basic block: its lines, the labels it branches to, and whether it falls through to the next block."""

    name: str
    lines: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    falls_through: bool = True
    numbers: list[int] = field(default_factory=list)  # the lines' 1-based line numbers in the PTX text


def _numbered_body(ptx: str) -> list[tuple[int, str]]:
    """(1-based line number in ``ptx``, line) of :func:`entry_body`'s lines. A ``.loc`` line whose call sites are
    only in its comment (Triton 3.6 and older: ``// codec.py:355:92 @[ adamw.py:78:88 ]``; newer ones write
    ``inlined_at 1 78 88``) gets them as ``inlined_at`` clauses (:func:`_comment_call_sites`)."""
    start = ptx.index("{", ptx.index(".entry"))
    first = ptx.count("\n", 0, start) + 2  # the line after the one holding the "{"
    ids = _file_ids_by_name(ptx)
    lines = []
    for number, raw in enumerate(ptx[start + 1 :].splitlines()[1:], first):
        line, _, comment = raw.partition("//")
        line = line.strip()
        if line == "}":
            break
        if line.startswith(".loc") and "inlined_at" not in line:
            line += _comment_call_sites(comment, ids)
        if line:
            lines.append((number, line))
    return lines


def _file_ids_by_name(ptx: str) -> dict[str, int]:
    """File id of each ``.file`` directive's base name (names that two files share are left out: ambiguous)."""
    ids: dict[str, int] = {}
    for i, path in _FILE.findall(ptx):
        name = os.path.basename(path)
        ids[name] = -1 if name in ids else int(i)
    return {name: i for name, i in ids.items() if i >= 0}


def _comment_call_sites(comment: str, ids: dict[str, int]) -> str:
    """``, inlined_at F L C`` for each call site in a ``.loc`` comment's ``@[ file.py:L:C @[ ... ] ]`` chain whose
    file name is in ``ids``; "" if it has none."""
    _, at, chain = comment.partition("@[")
    if not at:
        return ""
    return "".join(f", inlined_at {ids[name]} {ln} {col}" for name, ln, col in _CALL_SITE.findall(chain) if name in ids)


def entry_body(ptx: str) -> list[str]:
    """The instruction and directive lines of the PTX's (first) entry function, comments and blanks removed."""
    return [line for _, line in _numbered_body(ptx)]


def basic_blocks(body: list[str], numbers: list[int] | None = None) -> list[Block]:
    """``body`` split into basic blocks at branch targets and after branches and returns; ``numbers``: the lines'
    line numbers, kept in :attr:`Block.numbers`."""
    targets = {m[2] for line in body if (m := _BRANCH.match(line))}
    blocks = [Block("#0")]
    for i, line in enumerate(body):
        label = _LABEL.match(line)
        if label and label[1] in targets:
            blocks.append(Block(label[1]))
            continue
        cur = blocks[-1]
        cur.lines.append(line)
        if numbers is not None:
            cur.numbers.append(numbers[i])
        branch = _BRANCH.match(line)
        if branch or _END.match(line):
            if branch:
                cur.targets.append(branch[2])
            cur.falls_through = line.startswith("@")  # a predicated branch or return may fall through
            blocks.append(Block(f"#{len(blocks)}"))
    return [b for b in blocks if b.lines or b.name in targets or b is blocks[0]]


def successors(blocks: list[Block]) -> dict[str, list[str]]:
    """Each block's successor names (branch targets, then the next block if it falls through)."""
    succ = {}
    for i, b in enumerate(blocks):
        nxt = [blocks[i + 1].name] if b.falls_through and i + 1 < len(blocks) else []
        succ[b.name] = b.targets + nxt
    return succ


def reachable(start: str, succ: dict[str, list[str]]) -> set[str]:
    """Names of the blocks reachable from ``start`` (itself included)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(succ.get(name, []))
    return seen


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def full_branch_lines(kernel: Any) -> tuple[str, int, range, range] | None:
    """(source file, line of the kernel's ``if full:``, lines of its then-body, lines of its else-body) of a tile
    kernel (:func:`lowmemopt.kernels.codec.tile_coords`' ``full``); None for a kernel without that branch."""
    fn = getattr(kernel, "fn", kernel)
    lines, first = inspect.getsourcelines(fn)
    starts = [i for i, line in enumerate(lines) if line.strip() == "if full:"]
    if not starts:
        return None
    i = starts[0]
    indent = _indent(lines[i])
    j = next((k for k in range(i + 1, len(lines)) if lines[k].strip() and _indent(lines[k]) <= indent), None)
    if j is None or lines[j].strip() != "else:":
        return None
    end = next((k for k in range(j + 1, len(lines)) if lines[k].strip() and _indent(lines[k]) <= indent), len(lines))
    return (
        os.path.realpath(inspect.getsourcefile(fn)),
        first + i,
        range(first + i + 1, first + j),
        range(first + j + 1, first + end),
    )


def _line_refs(lines: Iterable[str], file_id: int) -> list[int]:
    """Source lines of file ``file_id`` that ``.loc`` directives in ``lines`` name, as the location or the call site
    it was inlined at."""
    refs = []
    for line in lines:
        if (loc := _LOC.match(line)) is not None:
            pairs = [(int(loc[1]), int(loc[2]))] + [(int(a), int(b)) for a, b in _INLINED.findall(line)]
            refs += [ln for f, ln in pairs if f == file_id]
    return refs


def _last_loc(lines: list[str]) -> tuple[int, int] | None:
    """(file, line) of the last ``.loc`` directive in ``lines`` (where the code that follows it comes from)."""
    for line in reversed(lines):
        if (loc := _LOC.match(line)) is not None:
            return int(loc[1]), int(loc[2])
    return None


def full_tile_path(
    ptx: str, branch: tuple[str, int, range, range] | None, body: list[str] | None = None
) -> tuple[str, list[str]]:
    """("full", the PTX lines a full tile executes) for a tile kernel whose ``if full:`` is ``branch``
    (:func:`full_branch_lines`): every block except those only the branch's masked side reaches (the side whose
    ``.loc`` lines point into the ``else:`` body); ("all", every line) without that branch, or if it cannot be found
    in the PTX. ``body``: :func:`entry_body` of ``ptx``, when the caller has it."""
    if body is None:
        body = entry_body(ptx)
    blocks, masked = _masked_blocks(ptx, branch, body)
    if masked is None:
        return "all", body
    return "full", [ln for blk in blocks if blk.name not in masked for ln in blk.lines]


def masked_ptx_lines(ptx: str, branch: tuple[str, int, range, range] | None) -> set[int] | None:
    """Line numbers of the PTX text that only the masked side of ``branch`` reaches (:func:`full_tile_path`'s
    complement); None where :func:`full_tile_path` finds no branch."""
    numbered = _numbered_body(ptx)
    blocks, masked = _masked_blocks(ptx, branch, [line for _, line in numbered], [n for n, _ in numbered])
    return None if masked is None else {n for blk in blocks if blk.name in masked for n in blk.numbers}


def _masked_blocks(
    ptx: str, branch: tuple[str, int, range, range] | None, body: list[str], numbers: list[int] | None = None
) -> tuple[list[Block], set[str] | None]:
    """(the body's basic blocks, names of those only the masked side of ``branch`` reaches, or None)."""
    files = {path: int(i) for i, path in _FILE.findall(ptx)}
    file_id = next((i for path, i in files.items() if branch and os.path.realpath(path) == branch[0]), None)
    if branch is None or file_id is None:
        return [], None
    _, if_line, then_lines, else_lines = branch
    blocks = basic_blocks(body, numbers)
    succ = successors(blocks)
    by_name = {b.name: b for b in blocks}
    for i, b in enumerate(blocks):
        if not b.targets or not b.falls_through or _last_loc(b.lines) != (file_id, if_line):
            continue  # not a conditional branch at the kernel's `if full:`
        sides = [reachable(b.targets[0], succ), reachable(blocks[i + 1].name, succ)]
        only = [sides[0] - sides[1], sides[1] - sides[0]]
        score = []
        for names in only:
            refs = _line_refs((ln for n in names for ln in by_name[n].lines), file_id)
            score.append(sum(r in then_lines for r in refs) - sum(r in else_lines for r in refs))
        if (score[0] > 0) == (score[1] > 0):
            continue  # not told apart
        return blocks, only[0] if score[0] < score[1] else only[1]
    return blocks, None


def access_bits(modifiers: str) -> int:
    """Bits one PTX memory instruction moves per thread, from its modifiers (``.v4.b32`` -> 128, ``.add.f32`` -> 32)."""
    vec = re.search(r"\.v(\d+)", modifiers)
    elem = re.findall(r"\.[bsuf](\d+)\b", modifiers)
    return (int(vec[1]) if vec else 1) * (int(elem[-1]) if elem else 32)


def memory_counts(lines: Iterable[str]) -> dict[str, Any]:
    """Per-thread static counts of memory instructions in PTX ``lines``: global loads and stores by width class
    (bits: 128, 64, 32, and 16 for <= 16), global atomics, shared loads and stores, ``bar.sync``, and the bytes the
    global loads move."""
    counts: dict[str, Any] = dict(
        ld_global={w: 0 for w in WIDTHS},
        st_global={w: 0 for w in WIDTHS},
        atomics=0,
        ld_shared=0,
        st_shared=0,
        bar_sync=0,
        load_bytes=0,
    )
    for line in lines:
        if _BAR.match(line):
            counts["bar_sync"] += 1
            continue
        m = _MEM.match(line)
        if m is None:
            continue
        op, space, bits = m[1], m[2], access_bits(m[3])
        if space == "shared":
            if op in ("ld", "st"):
                counts[f"{op}_shared"] += 1
        elif op in ("atom", "red"):
            counts["atomics"] += 1
        else:
            counts[f"{op}_global"][max(w for w in WIDTHS if w <= max(bits, 16))] += 1
            if op == "ld":
                counts["load_bytes"] += bits // 8
    return counts


# ---------------------------------------------------------------------------------------------------------------------
# SASS: the machine instructions of the full-tile path

_SASS_INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
#: the PTX line an instruction comes from (``nvdisasm -gp``: line numbers of the embedded PTX text)
_SASS_PTX_LINE = re.compile(r'^\s*//## File "[^"]*", line (\d+)')
#: the label of a slow-path subroutine (IEEE division, square root) that ptxas places after the kernel's body
_SASS_SUBROUTINE = re.compile(r"^\$__internal\S*:$")


def sass_text(cubin: bytes, nvdisasm: str) -> str:
    """The cubin's SASS with the PTX line every instruction comes from (``nvdisasm -c -gp``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        out = subprocess.run([nvdisasm, "-c", "-gp", path], capture_output=True, text=True, timeout=300)
    return out.stdout


def sass_full_path(text: str, masked: set[int] | None) -> tuple[str, int]:
    """("full", instructions on the full-tile path) of :func:`sass_text`'s listing: every instruction of the kernel
    body except those made from a PTX line only the masked side reaches (``masked``: :func:`masked_ptx_lines`);
    ("all", every instruction) where ``masked`` is None. ``NOP`` padding and the slow-path subroutines after the
    body are not counted; their call sites are (static counts: an instruction once, whether or not a tile runs it)."""
    count = 0
    line = 0
    for raw in text.splitlines():
        if _SASS_SUBROUTINE.match(raw.strip()):
            break
        if (loc := _SASS_PTX_LINE.match(raw)) is not None:
            line = int(loc[1])
            continue
        if (insn := _SASS_INSN.match(raw)) is None or insn[1] == "NOP":
            continue
        count += not masked or line not in masked
    return ("all" if masked is None else "full"), count


# ---------------------------------------------------------------------------------------------------------------------
# one variant (worker side: needs compiled Triton kernels)


def sweep_variants() -> list[Any]:
    """8-bit and 4-bit AdamW (no amsgrad, decoupled decay, nearest rounding) over :data:`SWEEP_TILES` x
    :data:`SWEEP_WARPS`; 8-bit with each decode (``runtime.Q8_DECODE``: the code-book gather, ``-arith`` without
    books), in the tile layout the launchers give the installed Triton (``runtime.column_tiles``)."""
    from lowmemopt.kernels import adamw, runtime, variants
    from lowmemopt.kernels.codec import NEAREST, Q4, Q8

    flags = dict(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=NEAREST)
    out = []
    for fmt, shapes in SWEEP_TILES.items():
        for decode in ("table", "arithmetic") if fmt == "q8" else ("table",):
            books = dict(book_s=None, book_u=None) if decode == "arithmetic" else {}
            for rows, block in shapes:
                for warps in SWEEP_WARPS:
                    constexprs = variants.tile(
                        block,
                        **flags,
                        **books,
                        FMT=Q4 if fmt == "q4" else Q8,
                        ROWS=rows,
                        COLS=runtime.column_tiles(fmt),
                    )
                    label = f"adamw-{fmt}" + ("-arith" if books else "")
                    out.append(variants.Variant(label, adamw._adam_kernel, constexprs, warps))
    return out


def all_variants(sweep: bool) -> list[Any]:
    """The variants to report: the shared table, then the sweep."""
    from lowmemopt.kernels import variants

    return list(variants.VARIANTS) + (sweep_variants() if sweep else [])


_PTXAS_LOGS: dict[str, str] = {}  # compiled kernel hash -> its ptxas report (a variant equal to an earlier one)


def compile_logged(variant: Any) -> tuple[Any, str]:
    """(compiled kernel, ptxas's ``-v`` report of that compile): Triton prints the report when its
    ``dump_ptxas_log`` knob is on and ptxas runs (a fresh cache); a variant that compiles to a kernel compiled
    earlier in this process (Triton's cache: no ptxas run) takes that compile's report."""
    from triton import knobs

    from lowmemopt.kernels import variants

    knobs.nvidia.dump_ptxas_log = True
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        compiled = variants.compile_variant(variant)
    log, key = out.getvalue(), getattr(compiled.metadata, "hash", None)
    if key is not None:
        log = _PTXAS_LOGS.setdefault(key, log) if log else _PTXAS_LOGS.get(key, log)
    return compiled, log


def measure(variant: Any, cuobjdump: str | None, nvdisasm: str | None = None) -> dict[str, Any]:
    """Everything the report shows about one variant (see the module docstring); ``ok`` False and ``error`` if it
    does not compile."""
    rec: dict[str, Any] = dict(
        label=variant.label,
        kernel=variant.kernel.fn.__name__,
        tile=variant.tile(),
        num_warps=variant.num_warps,
        ok=False,
        error="",
    )
    try:
        compiled, log = compile_logged(variant)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        rec["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        return rec
    name = compiled.metadata.name
    rec.update(parse_ptxas_log(log, name))
    cubin = cubin_resources(compiled.asm["cubin"], name, cuobjdump) if cuobjdump else {}
    if rec["registers"] is None:
        rec["registers"] = cubin.get("reg")
    rec.update(shared_dynamic=compiled.metadata.shared, shared_static=cubin.get("shared"), local=cubin.get("local"))
    ptx = compiled.asm["ptx"]
    body = entry_body(ptx)
    branch = full_branch_lines(variant.kernel)
    rec["path"], lines = full_tile_path(ptx, branch, body)
    rec.update(memory_counts(lines))
    rec["whole_kernel"] = memory_counts(body)
    threads = variant.num_warps * 32
    rec["load_bytes_per_program"] = rec["load_bytes"] * threads
    elements = variant.elements()
    rec["load_bytes_per_element"] = rec["load_bytes_per_program"] / elements if elements else None
    rec["sass_path"], rec["sass"] = (
        sass_full_path(sass_text(compiled.asm["cubin"], nvdisasm), masked_ptx_lines(ptx, branch))
        if nvdisasm
        else (None, None)
    )
    rec["sass_per_element"] = rec["sass"] * threads / elements if elements and rec["sass"] else None
    if rec["registers"] is not None:
        occ = occupancy(rec["registers"], rec["shared_dynamic"] + (rec["shared_static"] or 0), variant.num_warps)
        rec["occupancy"] = asdict(occ)
    rec["ok"] = True
    return rec


def worker(index: int, count: int, sweep: bool) -> int:
    """Compile every ``count``-th variant from ``index`` and print one JSON line each (``{"fatal": ...}`` without
    the NVIDIA backend)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(json.dumps(dict(fatal="TRITON_INTERPRET=1: the kernels would be interpreted, not compiled")), flush=True)
        return 2
    ptxas = ptxas_path()
    if ptxas is None:
        print(json.dumps(dict(fatal="Triton's NVIDIA backend (ptxas) is not available")), flush=True)
        return 2
    import triton

    from lowmemopt.kernels import variants

    cuobjdump, nvdisasm = cuobjdump_path(), nvdisasm_path()
    print(
        json.dumps(
            dict(
                info=dict(
                    triton=triton.__version__,
                    ptxas=ptxas,
                    cuobjdump=cuobjdump,
                    nvdisasm=nvdisasm,
                    target=f"sm_{variants.SM90.arch}",
                )
            )
        ),
        flush=True,
    )
    for i, variant in enumerate(all_variants(sweep)):
        if i % count == index:
            print(json.dumps(dict(index=i, **measure(variant, cuobjdump, nvdisasm))), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# the parent: workers, table, JSON


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """``proc``'s exit status; killed (status -9) if it runs past ``timeout`` seconds."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


def run_workers(jobs: int, sweep: bool, timeout: float = 900) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """Run ``jobs`` worker processes (without ``TRITON_INTERPRET``, each with a fresh Triton cache of its own, so
    that every compile runs ptxas in the process that reports it; output to files) and gather their lines: (info,
    records in variant order, error text: fatal messages and failed workers)."""
    base_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    info: dict[str, Any] = {}
    records, errors = [], []
    with tempfile.TemporaryDirectory(prefix="kernel-resources-") as work:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
        procs = []
        for i in range(jobs):
            env = dict(base_env, TRITON_CACHE_DIR=os.path.join(work, f"cache-{i}"))
            with open(os.path.join(work, f"{i}.out"), "w") as out, open(os.path.join(work, f"{i}.err"), "w") as err:
                procs.append(
                    subprocess.Popen(
                        cmd + [str(i), str(jobs)] + ([] if sweep else ["--no-sweep"]),
                        env=env,
                        cwd=work,
                        stdout=out,
                        stderr=err,
                        text=True,
                    )
                )
        for i, proc in enumerate(procs):
            rc = _wait(proc, timeout)
            with open(os.path.join(work, f"{i}.out")) as out, open(os.path.join(work, f"{i}.err")) as err:
                lines = [json.loads(line) for line in out if line.startswith("{")]
                stderr = err.read()
            fatal = [line["fatal"] for line in lines if "fatal" in line]
            errors += fatal
            info.update(next((line["info"] for line in lines if "info" in line), {}))
            records += [line for line in lines if "index" in line]
            if rc and not fatal:
                errors.append(f"worker {i} exit {rc}: {stderr.strip()[-2000:]}")
    records.sort(key=lambda r: r["index"])
    return info, records, "; ".join(dict.fromkeys(errors))


def _widths(counts: dict[Any, int]) -> str:
    return "/".join(str(counts.get(w, counts.get(str(w), 0))) for w in WIDTHS)


def table_row(r: dict[str, Any]) -> str:
    """One markdown table row of a measured variant."""
    head = f"| {r['label']} | {r['tile']} | {r['num_warps']} |"
    if not r["ok"]:
        return head + f" compile error: {r['error'].splitlines()[0][:120] if r['error'] else '?'} |" + " |" * 12
    spill = "?" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
    smem = r["shared_dynamic"] + (r["shared_static"] or 0)
    occ = r.get("occupancy")
    warps = f"{occ['warps']} ({occ['fraction']:.0%})" if occ else "?"
    per_el = r["load_bytes_per_element"]
    sass = (
        "?"
        if r.get("sass") is None
        else f"{r['sass']:,}" + (f" ({r['sass_per_element']:.1f})" if r.get("sass_per_element") is not None else "")
    )
    return head + "".join(
        f" {x} |"
        for x in (
            r["registers"] if r["registers"] is not None else "?",
            spill,
            smem,
            warps,
            occ["limiter"] if occ else "?",
            r["path"],
            _widths(r["ld_global"]),
            _widths(r["st_global"]),
            r["atomics"],
            f"{r['ld_shared']}/{r['st_shared']}",
            r["bar_sync"],
            f"{r['load_bytes_per_program']:,}" + (f" ({per_el:.1f})" if per_el is not None else ""),
            sass,
        )
    )


LEGEND = """\
- **regs**: registers per thread; **spill st/ld**: ptxas's spill stores / loads in bytes (per thread; `?`: no ptxas
  report). **smem**: shared memory per block in bytes (Triton's dynamic + the cubin's static; the occupancy adds the
  system's reserved 1 KiB per block).
- **warps/SM**: resident warps per SM on an H100 (of 64) and the resource that limits them: `regs` (65,536 per SM,
  allocated per warp in units of 256), `smem` (228 KiB per SM), `threads` (2,048 per SM), `blocks` (32 per SM).
- **path**: `full` = the instructions of the full-tile path (the `if full:` branch's unmasked body plus the code
  around it), `all` = the whole kernel (no such branch). Counts are static and per thread: each instruction once, a
  loop body once.
- **ld/st.global 128/64/32/16**: global loads / stores by access width in bits (16 = 16 bits or less: 8- and 16-bit
  accesses); **atom**: global atomics; **ld/st.shared**, **bar.sync**: shared-memory loads / stores and barriers
  (cross-warp reductions and layout conversions).
- **load B/program (B/elem)**: bytes the counted global loads request per program (x 32 threads x warps) and per tile
  element. Code-book gathers (`book[codes]` from a 1 KiB or 64 B table) and loads that several threads repeat
  (absmax, launch-table entries) count in full, though they are expected to hit L1: what the loads request, not HBM
  bytes.
- **SASS (per elem)**: machine instructions per thread on the same path (`nvdisasm -gp` names the PTX line each
  comes from; those of the masked side's PTX blocks are left out), and per tile element (x threads / elements).
  Static: each instruction once, a division's slow-path call site counted though a tile rarely takes it.
  An H100 SM issues 4 warp instructions (128 thread instructions) per clock; at 3.35 TB/s over 132 SMs it delivers
  about 14.5 bytes per clock, so a kernel moving B bytes per element is issue-bound above about 9 x B instructions
  per element (8-bit AdamW with bf16 parameters and gradients: 10 B, 90 instructions).
- Not measured: time, achieved bandwidth, cache hit rates, instruction latency or issue order (whether the loads are
  all in flight before their first use): a static report of the compiled code, not a profile.
"""


def render(info: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """The markdown report: a heading line, the table, the legend."""
    head = (
        f"Static resources of lowmemopt's Triton kernels compiled for {info.get('target', 'sm_90')} on the CPU "
        f"(Triton {info.get('triton', '?')}; occupancy for {H100.name}). No GPU, no timing.\n"
    )
    if not info.get("cuobjdump"):
        head += (
            "\ncuobjdump not found (Triton's bundled one, next to ptxas, or on PATH): static shared memory is "
            "not counted.\n"
        )
    cols = [
        "variant",
        "tile",
        "warps",
        "regs",
        "spill st/ld",
        "smem",
        "warps/SM",
        "limiter",
        "path",
        "ld.global 128/64/32/16",
        "st.global 128/64/32/16",
        "atom",
        "ld/st.shared",
        "bar.sync",
        "load B/program (B/elem)",
        "SASS (per elem)",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * 3 + " ---: |" * 4 + " --- | --- |" + " ---: |" * 7]
    return "\n".join([head, *lines, *(table_row(r) for r in records), "", LEGEND])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-sweep", action="store_true", help="only the shared variant table, no AdamW tile sweep")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--json", metavar="PATH", help="write every record (and the tools used) here")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("INDEX", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], not args.no_sweep)
    info, records, error = run_workers(max(1, args.jobs), not args.no_sweep)
    if error:
        print(f"kernel_resources: {error}", file=sys.stderr)
        if not records:
            return 2
    print(render(info, records))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(info=info, limits=asdict(H100), variants=records), fh, indent=1)
    failed = [r["label"] for r in records if not r["ok"]]
    if failed:
        print(f"kernel_resources: failed to compile: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or error else 0


if __name__ == "__main__":
    sys.exit(main())
