"""Host side of a fused step: a *bucket* (the parameters of one param group that share device, dtypes, state format
and step count) becomes launch tables and kernel launches.

Launch-table layout for tile passes (see :mod:`lowmemopt.kernels.table`): one row per tensor,
``[param, grad, numel, slot0, slot0_aux, slot1, slot1_aux, ...]``; a q8 slot's two columns are its codes and absmax, a
q4 slot's its nibbles and absmax, a dense slot's its data and 0. Algorithms may append columns (row/column statistics
of factored parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import triton.language as tl

from lowmemopt import rounding

from . import runtime
from lowmemopt.work.items import Update

from .codec import FORMAT_CODES, KAHAN, NEAREST, STOCHASTIC, maps
from .table import aligned, ceil_div, device_table, flagged_table, unit_map

__all__ = ["Bucket", "Unsupported", "Update", "scalar", "TL_DTYPES"]

_UPDATE_CODES = {"nearest": NEAREST, "stochastic": STOCHASTIC, "kahan": KAHAN}

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class Unsupported(Exception):
    """This bucket cannot take the kernel path; raised before anything is written, so the reference path takes it."""


def scalar(x: Any) -> float:
    """A hyper-parameter as a Python float. A CPU tensor is read (no device sync); a device tensor is Unsupported."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise Unsupported("hyper-parameter is a device tensor (reading it would synchronize)")
        return float(x)
    return float(x)


_SLOT_KEYS: dict[tuple[str, tuple[str, ...]], tuple[tuple[str, str | None], ...]] = {}


def _slot_keys(fmt: str, slots: tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    """The state keys of each slot's two table columns in format ``fmt`` (as :meth:`Bucket.slot_tensors`), memoized
    (a few formats x slot lists): the rows of a launch look them up per tensor."""
    keys = _SLOT_KEYS.get((fmt, slots))
    if keys is None:
        data, aux = {"q8": (".codes", ".absmax"), "q4": (".nibbles", ".absmax")}.get(fmt, ("", None))
        keys = _SLOT_KEYS[(fmt, slots)] = tuple((name + data, None if aux is None else name + aux) for name in slots)
    return keys


@dataclass
class Bucket:
    """Tensors stepped by one set of launches: ``params`` (what the kernel updates in place: parameters, or GaLore's
    low-rank update buffers), their gradients and their optimizer-state dicts (already initialized)."""

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
    #: the flagged tables made so far (:func:`.table.flagged_table`): a bucket's passes share their rows
    flagged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: loss scaling: the gradients' multiplier (fp32 on the device), passed to every kernel that loads a gradient
    #: (``gmul``, ``G_MULT``: :func:`.codec.load_grad`)
    grad_mult: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def slot_tensors(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(data, absmax or None) of slot ``name`` for every parameter."""
        (data, aux), = _slot_keys(self.fmt, (name,))
        return [(st[data], None if aux is None else st[aux]) for st in self.states]

    def rows(self, slots: Sequence[str], extra: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """Launch-table rows: param, grad, numel, two columns per slot (:meth:`slot_tensors`), then ``extra[i]``."""
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

    def param_update(self, group: dict[str, Any], step: int) -> tuple[list[list[int]] | None, int]:
        """``(extra table columns, UPDATE code)`` for :func:`.codec.store_param_as`: per parameter the row's last two
        columns, its stochastic hash key of this step and its first element's index in the whole parameter, or 0 and
        its Kahan buffer's address; ``(None, NEAREST)`` when the bucket's parameters round to nearest. Makes missing
        ``bf16_update`` state (a mode changed since)."""
        mode = rounding.mode_of(group, self.params[0])
        if mode == "nearest":
            return None, NEAREST
        cols = []
        bases = self.index_bases or [0] * len(self.params)
        for p, st, base in zip(self.params, self.states, bases):
            rounding.init_state(st, p, group)
            if mode == "stochastic":
                if base is None:
                    raise Unsupported("a shard whose elements are not one range of its parameter")
                cols.append([rounding.step_key(st[rounding.SEED], step), base])
            else:
                c = st[rounding.KAHAN]
                if c.dtype != p.dtype or c.shape != p.shape or c.device != p.device or not c.is_contiguous():
                    raise Unsupported("Kahan buffer not laid out as its parameter")
                cols.append([0, c.data_ptr()])
        return cols, _UPDATE_CODES[mode]

    def aligned(self, slots: Sequence[str]) -> bool:
        tensors: list[torch.Tensor | None] = list(self.params) + self.grads
        for name in slots:
            tensors += [data for data, _ in self.slot_tensors(name)]
        return aligned(tensors)

    def constexprs(self, slots: Sequence[str], aligned: bool | None = None) -> dict[str, Any]:
        """Compile-time arguments shared by the tile kernels: formats, dtypes, alignment (``aligned``, or
        :meth:`aligned` of ``slots``), tile shape."""
        block = self.block_size
        return dict(
            FMT=FORMAT_CODES[self.fmt],
            P_DTYPE=TL_DTYPES[self.params[0].dtype],
            G_DTYPE=TL_DTYPES[self.grads[0].dtype],
            ALIGNED=self.aligned(slots) if aligned is None else aligned,
            ROWS=runtime.rows_per_tile(block, self.device),
            BLOCK=block,
        )

    def tile_launch(self, kernel, slots: Sequence[str], args: Sequence[Any], *, writes: bool,
                    extra: Sequence[Sequence[int]] | None = None, **flags: Any) -> None:
        """Launch ``kernel`` over every tile of every tensor: ``kernel(units, table, *maps, *args, W=..., ...,
        COLS=..., **flags)``; the table rows are :meth:`rows` ``(slots, extra)``; ``COLS``: the tiles' layout for the
        bucket's state format (:func:`.runtime.column_tiles`). ``writes``: this pass writes params or state (see
        :class:`Unsupported`)."""
        rows = self.rows(slots, extra)
        # :meth:`aligned` read off the rows' addresses: param, grad and each slot's data (columns 0, 1, 3, 5, ...)
        columns = (0, 1, *range(3, 3 + 2 * len(slots), 2))
        meta = self.constexprs(slots, all(row[c] % 16 == 0 for row in rows for c in columns))
        tile = meta["ROWS"] * meta["BLOCK"]
        counts = [ceil_div(row[2], tile) for row in rows]
        self.launch(kernel, rows, counts, args, writes=writes, **meta, COLS=runtime.column_tiles(self.fmt), **flags)

    def launch(self, kernel, rows: list[list[int]], counts: Sequence[int], args: Sequence[Any], *, writes: bool,
               **meta: Any) -> None:
        """Launch ``kernel`` with ``counts[i]`` programs for tensor ``i`` (table row ``rows[i]``):
        ``kernel(units, table, *maps, *args, W=len(row), **meta)``; ``maps``: the bucket format's books and tables
        (:func:`.codec.maps`)."""
        if not sum(counts):
            return
        table, units = self.tables(rows, counts)
        if writes:
            self.written = True
        if self.grad_mult is not None and "G_MULT" in getattr(kernel, "arg_names", ()):
            meta = dict(meta, gmul=self.grad_mult, G_MULT=True)
        # no FP contraction: the reference's roundings, and bit-identical recomputation across passes
        kernel[(sum(counts),)](units, table, *maps(self.device, self.fmt), *args, W=len(rows[0]), **meta,
                               num_warps=runtime.tile_shape(self.device)[1], enable_fp_fusion=False)

    def tables(self, rows: list[list[int]], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The launch's ``(table, units)`` on the device (:func:`.table.device_table`, :func:`.table.unit_map`),
        the table's element counts multiplied by the tensors' finiteness flags where the bucket has them."""
        device = self.device
        if self.flags is None:
            table = device_table(rows, device)
        else:  # skipped on the device: a non-finite gradient's tensor counts 0 elements (one op on the device)
            table = flagged_table(rows, device, self.flags, self.flag_rows, self.flagged)
        return table, unit_map(counts, device)

    def scalars(self, *columns: Any) -> torch.Tensor:
        """A capturable step's per-tensor scalars (:func:`.codec.tensor_scalar`): fp32 ``[T, K]`` on the device, column
        ``k`` ``columns[k]`` for every tensor (a ``[T]`` or 0-dim tensor on the device, or a number), made in fp64 and
        rounded to fp32 once, as a Python float argument is: the same values as the host's. Device operations only
        (fills and copies), so a captured graph recomputes them from the step counters and the learning rate."""
        out = torch.empty(len(self.params), len(columns), dtype=torch.float64, device=self.device)
        for k, column in enumerate(columns):
            out[:, k] = column
        return out.to(torch.float32)

    @staticmethod
    def scalar_args(scal: torch.Tensor | None) -> dict[str, Any]:
        """The launch keywords of a kernel that takes device scalars: ``scal`` (:meth:`scalars`, or None for an
        ordinary step, whose scalars are arguments) and its ``DEVICE_SCALARS`` flag."""
        return dict(scal=scal, DEVICE_SCALARS=scal is not None)

    def accumulators(self, n: int) -> torch.Tensor:
        """Zeroed fp32 [T, n] per-tensor sums (norms) for a reduction pre-pass."""
        return torch.zeros(len(self.params), n, dtype=torch.float32, device=self.device)
