"""Host side of a fused step: a *bucket* (the parameters of one param group that share device, dtypes, state format
and step count) becomes launch tables and kernel launches. A tile pass's table has one row per tensor,
``[param, grad, numel, slot0, slot0_aux, ...]`` (a q8 / q4 slot: codes and absmax; dense: data and 0), then the
algorithm's columns (:mod:`lowmemopt.kernels.table`; docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import triton.language as tl

from lowmemopt import rounding

from . import runtime
from lowmemopt.work.items import Update
from lowmemopt.work.record import BucketRecord

from .codec import FORMAT_CODES, KAHAN, NEAREST, STOCHASTIC, maps
from .table import aligned, device_tables, launch_tables, masked_table, tile_counts, unit_map

__all__ = ["Bucket", "Unsupported", "Update", "scalar", "scalars", "TL_DTYPES"]

_UPDATE_CODES = {"nearest": NEAREST, "stochastic": STOCHASTIC, "kahan": KAHAN}

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class Unsupported(Exception):
    """This bucket cannot take the kernel path; raised before anything is written, so the reference path takes it."""


def scalar(x: Any) -> float:
    """A hyper-parameter as a float: a CPU tensor is read (no sync); a device tensor is Unsupported."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise Unsupported("hyper-parameter is a device tensor (reading it would synchronize)")
        return float(x)
    return float(x)


def scalars(*values: Any) -> tuple[float, ...]:
    """:func:`scalar` of each of ``values`` (a launch's hyper-parameters, in one call)."""
    return tuple(map(scalar, values))


_SLOT_KEYS: dict[tuple[str, tuple[str, ...]], tuple[tuple[str, str | None], ...]] = {}


def _slot_keys(fmt: str, slots: tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    keys = _SLOT_KEYS.get((fmt, slots))
    if keys is None:
        data, aux = {"q8": (".codes", ".absmax"), "q4": (".nibbles", ".absmax")}.get(fmt, ("", None))
        keys = _SLOT_KEYS[(fmt, slots)] = tuple((name + data, None if aux is None else name + aux) for name in slots)
    return keys


@dataclass
class Bucket:
    """Tensors stepped by one set of launches: ``params`` (updated in place: parameters, or GaLore's low-rank
    buffers), their gradients and their initialized state dicts."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: list[dict[str, Any]]
    fmt: str  # "fp32" | "bf16" | "q8" | "q4": format of the full-size state slots
    block_size: int  # the quantization block (q8, q4): one row of a tile
    written: bool = field(default=False)  # a launch that writes params or state has started
    #: per param, the flat index of its first element in the whole parameter (an FSDP2 shard's offset: the stochastic
    #: rounding hash's counter; None: not one range, so no stochastic rounding here); empty: all 0
    index_bases: list[int | None] = field(default_factory=list)
    #: GaLore stand-ins: per tensor, the statistic of the full weight that the math reads (||p||, RMS(p)), fp32 [T]
    weights: torch.Tensor | None = None
    #: the step's gradient finiteness flags on the device (uint8, :mod:`lowmemopt.pipeline.finite`) and each tensor's
    #: row in them: a launch multiplies the tensors' element counts by their flags (0: every access masked off)
    flags: torch.Tensor | None = None
    flag_rows: list[int] = field(default_factory=list)
    #: this step's flagged tables by id of the table they mask (:meth:`tables`): a bucket's passes share their rows
    flagged: dict[int, torch.Tensor] = field(default_factory=dict)
    #: loss scaling: the gradients' multiplier (fp32 on the device), passed to every kernel that loads a gradient
    #: (``gmul``, ``G_MULT``: :func:`.codec.load_grad`)
    grad_mult: torch.Tensor | None = None
    #: what the launches built from the bucket's tensors (table rows, alignment, program counts, device tables), kept
    #: while they stay the same: a bucket stepped again (:mod:`lowmemopt.pipeline.program`) builds nothing anew unless
    #: a gradient moved (:meth:`set_grads`)
    memo: dict = field(default_factory=dict)
    _grad_ptrs: list[int] | None = None  # the gradients' addresses that the memo was built for (set_grads)
    _rows_made: list = field(default_factory=list)  # table rows kept in the memo (keep_rows)
    #: how the kernels store 16-bit params (the bucket's ``bf16_update`` as its dtype applies it: dispatch resolves
    #: it); None: read off the update's record (:meth:`param_update`)
    rounding: str | None = None

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def run(
        self,
        launch: Any,
        update: Update,
        flags: torch.Tensor | None,
        flag_rows: Sequence[int],
        weights: torch.Tensor | None = None,
        grad_mult: torch.Tensor | None = None,
    ) -> None:
        """One step of the bucket: this step's inputs (finiteness ``flags`` and each tensor's row in them, GaLore's
        ``weights``, loss scaling's ``grad_mult``), then the kernel's ``launch(update, bucket)``."""
        self.written = False
        self.weights = weights
        self.grad_mult = grad_mult
        self.set_flags(flags, flag_rows)
        launch(update, self)

    def set_grads(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> None:
        """This step's gradients; what the launches built is kept if every gradient is where the last one was."""
        if ptrs != self._grad_ptrs:
            if self._grad_ptrs is not None or ptrs != [g.data_ptr() for g in self.grads]:
                self.memo.clear()
                self._rows_made = []
            self._grad_ptrs = ptrs
        self.grads = list(grads)

    def set_tensors(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """This step's targets and gradients (same shapes): what was built is kept, its addresses moved on the device,
        if every target moved by one offset and every gradient by another."""
        old_t, old_g = [t.data_ptr() for t in self.params], [g.data_ptr() for g in self.grads]
        new_t, new_g = [t.data_ptr() for t in params], [g.data_ptr() for g in grads]
        self.params, self.grads = list(params), list(grads)
        if new_t == old_t and new_g == old_g:
            return
        dt, dg = new_t[0] - old_t[0], new_g[0] - old_g[0]
        if (
            dt % 16
            or dg % 16
            or any(a - b != dt for a, b in zip(new_t, old_t))
            or any(a - b != dg for a, b in zip(new_g, old_g))
        ):
            self.memo.clear()
            self._rows_made = []
            return
        self._relocate(dt, dg)

    def _relocate(self, dt: int, dg: int) -> None:
        if not (dt or dg):
            return
        for rows in self._rows_made:  # (kept rows make the tables of launches not made yet)
            for row in rows:
                row[0] += dt
                row[1] += dg
        for key, value in self.memo.items():
            if type(key) is tuple and key and key[0] == "table":
                both = value[1]
                if dt:
                    both[:, :, 0].add_(dt)
                if dg:
                    both[:, :, 1].add_(dg)

    def move_tensors(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], dt: int, dg: int) -> None:
        """:meth:`set_tensors` where the caller knows the offsets ``dt``, ``dg``: no address is compared."""
        self.params, self.grads = list(params), list(grads)
        if dt % 16 or dg % 16:
            self.memo.clear()
            self._rows_made = []
            return
        self._relocate(dt, dg)

    def reset_tensors(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """New targets and gradients whose predecessors' memory is gone: what was built is dropped."""
        self.params, self.grads = list(params), list(grads)
        self.memo.clear()
        self._rows_made = []

    def keep_rows(self, rows: list[list[int]]) -> list[list[int]]:
        """Keep table ``rows`` in :attr:`memo` (their address columns move with :meth:`set_tensors`)."""
        self._rows_made.append(rows)
        return rows

    def set_flags(self, flags: torch.Tensor | None, rows: Sequence[int]) -> None:
        """This step's finiteness flags and each tensor's row in them (a ``range``: a slice, no gather); None: none."""
        self.flags, self.flag_rows = flags, rows
        self.flagged = {}

    def slot_tensors(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(data, absmax or None) of slot ``name`` for every parameter."""
        ((data, aux),) = _slot_keys(self.fmt, (name,))
        return [(st[data], None if aux is None else st[aux]) for st in self.states]

    def rows(self, slots: Sequence[str], extra: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """Launch-table rows: param, grad, numel, two columns per slot, then ``extra[i]``."""
        keys = _slot_keys(self.fmt, tuple(slots))
        out = []
        for i, (p, g, st) in enumerate(zip(self.params, self.grads, self.states)):
            row = [p.data_ptr(), g.data_ptr(), p.numel()]
            for data, aux in keys:
                row.append(st[data].data_ptr())
                row.append(0 if aux is None else st[aux].data_ptr())
            if extra is not None:
                row += extra[i]
            out.append(row)
        return out

    def param_update(self, record: BucketRecord, step: int) -> tuple[list[list[int]] | None, int]:
        """``(extra table columns, UPDATE code)`` for :func:`.codec.store_param_as`: per parameter its
        stochastic hash key and first element's index, or 0 and its Kahan buffer's address; ``(None, NEAREST)`` for
        round-to-nearest. Makes missing ``bf16_update`` state."""
        mode = self.rounding if self.rounding is not None else record.rounding_of(self.params[0])
        if mode == "nearest":
            return None, NEAREST
        cols = []
        bases = self.index_bases or [0] * len(self.params)
        for p, st, base in zip(self.params, self.states, bases):
            rounding.init_state(st, p, mode)
            if mode == "stochastic":
                if base is None:
                    raise Unsupported("a shard whose elements are not one range of its parameter")
                cols.append([rounding.step_key(st[rounding.SEED], step), base])
            else:
                c = st[rounding.KAHAN]
                if c.dtype != p.dtype or c.numel() != p.numel() or c.device != p.device or not c.is_contiguous():
                    raise Unsupported("Kahan buffer not laid out as its parameter")
                cols.append([0, c.data_ptr()])
        return cols, _UPDATE_CODES[mode]

    def aligned(self, slots: Sequence[str]) -> bool:
        tensors: list[torch.Tensor | None] = list(self.params) + self.grads
        for name in slots:
            tensors += [data for data, _ in self.slot_tensors(name)]
        return aligned(tensors)

    def constexprs(self, slots: Sequence[str], aligned: bool | None = None, rows: int | None = None) -> dict[str, Any]:
        """Compile-time arguments shared by the tile kernels: formats, dtypes, alignment, tile shape (``rows``: rows
        per tile, where the caller asked)."""
        block = self.block_size
        return dict(
            FMT=FORMAT_CODES[self.fmt],
            P_DTYPE=TL_DTYPES[self.params[0].dtype],
            G_DTYPE=TL_DTYPES[self.grads[0].dtype],
            ALIGNED=self.aligned(slots) if aligned is None else aligned,
            ROWS=runtime.rows_per_tile(block, self.device) if rows is None else rows,
            BLOCK=block,
        )

    def tile_launch(
        self,
        kernel,
        slots: Sequence[str],
        args: Sequence[Any],
        *,
        writes: bool,
        update: Update | None = None,
        **flags: Any,
    ) -> None:
        """Launch ``kernel`` over every tile of every tensor; ``writes``: this pass writes params or state;
        ``update``: this pass stores the params as :meth:`param_update` says for its step; ``scal`` among
        ``flags``: a capturable step's device scalars, or None (:meth:`launch`)."""
        rows_per_tile, cols, _ = runtime.launch_settings(self.block_size, self.device, self.fmt)
        extra = None
        if update is not None:
            extra, flags["UPDATE"] = self.param_update(update.record, update.step)

        tile = rows_per_tile * self.block_size
        # (rows with extra columns, e.g. stochastic rounding's per-step keys, are made anew)
        key = None if extra is not None else ("tile", tuple(slots), rows_per_tile)
        made = None if key is None else self.memo.get(key)
        if made is None:
            rows = self.rows(slots, extra)
            # :meth:`aligned` read off the rows' addresses: param, grad and each slot's data (columns 0, 1, 3, ...)
            columns = (0, 1, *range(3, 3 + 2 * len(slots), 2))
            is_aligned = all(row[c] % 16 == 0 for row in rows for c in columns)
            if key is None:
                made = rows, is_aligned, tile_counts([row[2] for row in rows], tile)
            else:  # (the device tables too, kept with the rows)
                counts = self.keep_tables(rows, [key], [([row[2] for row in rows], tile)])[0]
                made = self.memo[key] = rows, is_aligned, counts
        rows, is_aligned, counts = made
        meta = self.constexprs(slots, is_aligned, rows_per_tile)
        self.launch(kernel, rows, counts, args, writes=writes, memo_key=key, **meta, COLS=cols, **flags)

    def launch(
        self,
        kernel,
        rows: list[list[int]],
        counts: Sequence[int],
        args: Sequence[Any],
        *,
        writes: bool,
        memo_key: Any = None,
        **meta: Any,
    ) -> None:
        """Launch ``kernel`` with ``counts[i]`` programs for tensor ``i``; ``memo_key``: keep the device tables."""
        if not sum(counts):
            return
        table, units = self.tables(rows, counts, memo_key)
        if writes:
            self.written = True
        if "scal" in meta:  # a kernel taking device scalars (capturable steps): told whether it has them
            meta["DEVICE_SCALARS"] = meta["scal"] is not None
        if self.grad_mult is not None and "G_MULT" in getattr(kernel, "arg_names", ()):
            meta = dict(meta, gmul=self.grad_mult, G_MULT=True)
        # no FP contraction: the reference's roundings, and bit-identical recomputation across passes
        kernel[(sum(counts),)](
            units,
            table,
            *maps(self.device, self.fmt),
            *args,
            W=len(rows[0]),
            **meta,
            num_warps=runtime.tile_shape(self.device)[1],
            enable_fp_fusion=False,
        )

    def tables(
        self, rows: list[list[int]], counts: Sequence[int], memo_key: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The launch's device ``(table, units)``; a tensor with a non-finite gradient counts 0 elements (one
        device op). ``memo_key``: keep them in :attr:`memo` (``rows`` and ``counts`` then the same at every launch of
        the key)."""
        device = self.device
        if memo_key is None:
            table, skipped = device_tables(rows, device)
            units = unit_map(counts, device)
        else:
            hit = self.memo.get(("tables", memo_key))
            if hit is None:  # (tables of the bucket's own: set_tensors moves their addresses in place)
                shared = self.memo.get(("table", id(rows)))
                if shared is None or shared[0] is not rows:
                    self._make_tables(rows, [memo_key], [(counts, 1)])
                else:  # (another pass's over the same rows)
                    self.memo[("tables", memo_key)] = (shared[2], shared[3], unit_map(counts, device))
                hit = self.memo[("tables", memo_key)]
            table, skipped, units = hit
        if self.flags is None:
            return table, units
        masked = self.flagged.get(id(table))
        if masked is None:
            masked = self.flagged[id(table)] = masked_table(table, skipped, self.flags, self.flag_rows, device)
        return masked, units

    def keep_tables(self, rows: list[list[int]], keys: Sequence[Any], passes: Sequence[tuple]) -> list[list[int]]:
        """Keep ``rows`` and the device tables of the passes over them in :attr:`memo`, built in one call: the
        launches of ``keys[i]``, programs per tensor as ``passes[i]`` says (:func:`.table.launch_tables`). The
        passes share the table (and this step's flagged copy). Returns each pass's counts."""
        self.keep_rows(rows)
        return self._make_tables(rows, keys, passes)

    def _make_tables(self, rows: list[list[int]], keys: Sequence[Any], passes: Sequence[tuple]) -> list[list[int]]:
        counts, both, units, masked = launch_tables(rows, self.device, passes, self.flags, self.flag_rows)
        table, skipped = both[0], both[1]
        self.memo[("table", id(rows))] = (rows, both, table, skipped)
        for key, pass_units in zip(keys, units):
            self.memo[("tables", key)] = (table, skipped, pass_units)
        if masked is not None:
            self.flagged[id(table)] = masked
        return counts

    def scalars(self, *columns: Any) -> torch.Tensor:
        """A capturable step's per-tensor scalars, fp32 ``[T, K]``, made on the device (fp64, rounded once)."""
        out = torch.empty(len(self.params), len(columns), dtype=torch.float64, device=self.device)
        for k, column in enumerate(columns):
            out[:, k] = column
        return out.to(torch.float32)

    def accumulators(self, n: int) -> torch.Tensor:
        """Zeroed fp32 [T, n] per-tensor sums (norms) for a reduction pre-pass."""
        return torch.zeros(len(self.params), n, dtype=torch.float32, device=self.device)
