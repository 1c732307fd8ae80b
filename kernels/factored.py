"""Fused Adafactor and CAME steps in multi-tensor passes (references: ``optim.adafactor.adafactor_math``,
``optim.came.came_math``): row/column statistics, factors, the clip's sums, the update.

The passes, their bytes per element, CAME's fp64 moment form (and the direct form where fp64 is slow) and the wide
matrices' factor indexing: docs/kernels.md#kernels.
"""

from __future__ import annotations

from typing import Any, Mapping

import math

import torch

from lowmemopt.work import capture

from . import runtime
from .codec import FORMAT_CODES
from .factored_math import _RES, _SQ
from .factored_passes import apply_kernel, factors_kernel, moments_kernel, stats_kernel, sumsq_kernel
from .launch import TL_DTYPES, Bucket, Update, scalar, scalars
from .registry import Kernel
from .table import aligned


def adafactor_slots(hyper: Mapping[str, Any], p: torch.Tensor) -> tuple[str, ...]:
    first = ("exp_avg",) if hyper["beta1"] is not None else ()
    return first + (("exp_avg_sq_row", "exp_avg_sq_col") if p.dim() >= 2 else ("exp_avg_sq",))


def came_slots(hyper: Mapping[str, Any], p: torch.Tensor) -> tuple[str, ...]:
    if p.dim() >= 2:
        return ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col")
    return ("exp_avg", "exp_avg_sq")


def wide(params: list[torch.Tensor], block: int) -> bool:
    """Whether every matrix's rows hold at least ``block`` elements (:func:`factor_coords`'s ``WIDE``)."""
    return all(p.shape[-1] >= block for p in params)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _rows(bucket: Bucket, factored: bool) -> tuple[list[list[int]], list[tuple[int, int, int]], int, int]:
    """Launch-table rows (columns ``_M`` ... ``_COFF``), (batch, R, C) per tensor, and the scratch sizes."""
    rows, shapes = [], []
    n_rows = n_cols = 0
    for p, g, st in zip(bucket.params, bucket.grads, bucket.states):

        def slot(name):
            if name + ".codes" in st:
                return [st[name + ".codes"].data_ptr(), st[name + ".absmax"].data_ptr()]
            if name + ".nibbles" in st:
                return [st[name + ".nibbles"].data_ptr(), st[name + ".absmax"].data_ptr()]
            return [_ptr(st.get(name)), 0]

        row = [p.data_ptr(), g.data_ptr(), p.numel()] + slot("exp_avg")
        if factored:
            batch, R, C = math.prod(p.shape[:-2]), p.shape[-2], p.shape[-1]
            row += [
                0,
                0,
                R,
                C,
                _ptr(st["exp_avg_sq_row"]),
                _ptr(st["exp_avg_sq_col"]),
                _ptr(st.get("exp_avg_res_row")),
                _ptr(st.get("exp_avg_res_col")),
                n_rows,
                n_cols,
            ]
            shapes.append((batch, R, C))
            n_rows += batch * R
            n_cols += batch * C
        else:
            row += slot("exp_avg_sq") + [0] * 8
            shapes.append((1, 1, p.numel()))
        rows.append(row)
    return rows, shapes, n_rows, n_cols


def _layout(bucket: Bucket, factored: bool, rows_per_tile: int, lay: tuple) -> tuple:
    """A bucket's launch layout, kept in ``Bucket.memo`` (with the device tables of its passes, keys ``lay + ...``)."""
    rows, shapes, n_rows, n_cols = _rows(bucket, factored)
    # (every tensor's data aligned: the parameters, the gradients and every state tensor)
    tensors = list(bucket.params) + bucket.grads
    tensors += [t for st in bucket.states for t in st.values() if isinstance(t, torch.Tensor)]
    flat = bucket.constexprs((), aligned(tensors), rows_per_tile)
    flat["WIDE"] = factored and wide(bucket.params, flat["BLOCK"])
    # programs per tensor: flat tiles, 2-D tiles of its matrices, one per matrix (the tables of the passes kept)
    by_flat = ([p.numel() for p in bucket.params], flat["ROWS"] * flat["BLOCK"])
    if factored:
        passes = (by_flat, (shapes, runtime.TILE_2D), ([b for b, _, _ in shapes], 1))
        flat_counts, counts_2d, counts_mat = bucket.keep_tables(
            rows, [lay + _FLAT, lay + _TILES_2D, lay + _MATRICES], passes
        )
    else:
        (flat_counts,) = bucket.keep_tables(rows, [lay + _FLAT], [by_flat])
        counts_2d = counts_mat = []  # (no 2-D passes)
    return rows, n_rows, n_cols, flat, flat_counts, counts_2d, counts_mat


#: the launch-table keys of the passes (after the layout's): 2-D tiles, one program per matrix, flat tiles
_TILES_2D, _MATRICES, _FLAT = ("2-D",), ("matrices",), ("flat",)


def _launch(
    bucket: Bucket,
    *,
    came: bool,
    has_m: bool,
    scale_param: bool,
    decay: bool,
    eps1: float,
    eps2: float,
    beta1: float,
    beta2: float,
    beta3: float,
    clip: float,
    lr: float,
    neg_wd: float,
    neg_wd_lr: float,
    scal: torch.Tensor | None = None,
) -> None:
    """The passes of one bucket; ``scal`` (capturable): per-tensor step scalars on the device."""
    sums = bucket.accumulators(2)
    dev = sums.device  # (the bucket's)
    factored = bucket.params[0].dim() >= 2
    tr, bc = runtime.TILE_2D
    rows_per_tile, _, fast_fp64 = runtime.launch_settings(bucket.block_size, dev, None)
    lay = ("factored", rows_per_tile, tr, bc)  # (the tables are kept by this key too)
    layout = bucket.memo.get(lay)
    if layout is None:
        layout = bucket.memo[lay] = _layout(bucket, factored, rows_per_tile, lay)
    rows, n_rows, n_cols, flat, flat_counts, counts_2d, counts_mat = layout
    weight = bucket.weights is not None and scale_param and not came
    if weight:
        sums[:, 0] = bucket.weights
    n = n_rows + n_cols
    # CAME's instability from fp64 moments in the clip pass (one pass over g and m fewer), where fp64 is fast
    moments = factored and came and fast_fp64
    scratch = torch.zeros((2 if came and not moments else 1) * n, dtype=torch.float32, device=dev)  # row/col sums
    factors = torch.empty((2 if came else 1) * n, dtype=torch.float32, device=dev)
    rsum, csum = scratch[:n_rows], scratch[n_rows:n]
    rsum2, csum2 = (scratch[n : n + n_rows], scratch[n + n_rows :]) if came and not moments else (rsum, csum)
    rfac, cfac = factors[:n_rows], factors[n_rows:n]
    rfac2, cfac2 = (factors[n : n + n_rows], factors[n + n_rows :]) if came else (rfac, cfac)
    if not factored:  # the scratch pointers are unused; any valid tensor will do
        rsum = csum = rsum2 = csum2 = rfac = cfac = rfac2 = cfac2 = sums
    g_dtype = TL_DTYPES[bucket.grads[0].dtype]
    fmt = FORMAT_CODES[bucket.fmt]
    tiles_2d = dict(FMT=fmt, G_DTYPE=g_dtype, QBLOCK=bucket.block_size, TR=tr, BC=bc)
    by_matrix = dict(FB=runtime.STATS_BLOCK)

    def stats(rs, cs, eps, residual):  # pass 1, or CAME's direct instability pass
        bucket.launch(
            stats_kernel,
            rows,
            counts_2d,
            (rs, cs, rfac, cfac, sums, eps, beta1, 1.0 - beta1, clip),
            writes=False,
            memo_key=lay + _TILES_2D,
            RESIDUAL=residual,
            **tiles_2d,
        )

    def factors_of(rs, cs, rf, cf, stat, beta, eps=0.0, from_moments=False):  # pass 2 / 4
        bucket.launch(
            factors_kernel,
            rows,
            counts_mat,
            (rs, cs, rf, cf, sums, beta, 1.0 - beta, eps, beta1, clip),
            writes=True,
            memo_key=lay + _MATRICES,
            STAT=stat,
            MOMENTS=from_moments,
            **by_matrix,
            scal=scal if stat == _SQ.value else None,  # (CAME's beta3: a constant)
        )

    if factored:
        stats(rsum, csum, eps1, False)
        factors_of(rsum, csum, rfac, cfac, _SQ.value, beta2)
    if moments:
        sums_64 = torch.zeros(3 * n, dtype=torch.float64, device=dev)  # [row or column, (u^2, u m, m^2)]
        rmom, cmom = sums_64[: 3 * n_rows], sums_64[3 * n_rows :]
        bucket.launch(
            moments_kernel,
            rows,
            counts_2d,
            (rfac, cfac, sums, rmom, cmom),
            writes=False,
            memo_key=lay + _TILES_2D,
            **tiles_2d,
        )
        factors_of(rmom, cmom, rfac2, cfac2, _RES.value, beta3, eps2, True)
    else:
        bucket.launch(
            sumsq_kernel,
            rows,
            flat_counts,
            (rfac, cfac, sums, eps1, beta2, 1.0 - beta2),
            writes=False,
            memo_key=lay + _FLAT,
            FACTORED=factored,
            SUM_P=scale_param and not came and not weight,
            **flat,
            scal=scal,
        )
        if factored and came:
            stats(rsum2, csum2, eps2, True)
            factors_of(rsum2, csum2, rfac2, cfac2, _RES.value, beta3)
    args = (
        rfac,
        cfac,
        rfac2,
        cfac2,
        sums,
        eps1,
        eps2,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        clip,
        lr,
        neg_wd,
        neg_wd_lr,
    )
    bucket.launch(
        apply_kernel,
        rows,
        flat_counts,
        args,
        writes=True,
        memo_key=lay + _FLAT,
        FACTORED=factored,
        CAME=came,
        HAS_M=has_m,
        SCALE_PARAM=scale_param and not came,
        DECAY=decay,
        WEIGHT=weight,
        **flat,
        scal=scal,
    )


def launch_adafactor(u: Update, bucket: Bucket) -> None:
    """Adafactor (transformers semantics); step scalars as ``adafactor_math``'s."""
    hyper, step = u.record.hyper, u.step
    eps1, eps2 = hyper["eps"]
    wd = scalar(hyper["weight_decay"])
    beta1 = hyper["beta1"]
    scal = None
    if u.steps is None:
        rho = hyper["lr"]
        if hyper["relative_step"]:
            rho = min(1e-6 * step if hyper["warmup_init"] else 1e-2, 1.0 / math.sqrt(step))
        rho = scalar(rho)
        beta2 = 1.0 - math.pow(step, hyper["decay_rate"])
    else:
        steps = u.steps
        rho = capture.device_value(hyper["lr"], bucket.device)
        if hyper["relative_step"]:
            rho = (
                torch.minimum(1e-6 * steps, 1.0 / steps.sqrt())
                if hyper["warmup_init"]
                else (1.0 / steps.sqrt()).clamp(max=1e-2)
            )
        beta2_t = 1.0 - steps.pow(hyper["decay_rate"])
        scal = bucket.scalars(rho, -wd * rho, beta2_t, 1.0 - beta2_t)
        rho = beta2 = 0.0  # read from scal
    _launch(
        bucket,
        came=False,
        has_m=beta1 is not None,
        scale_param=bool(hyper["scale_parameter"]),
        decay=wd != 0,
        eps1=eps1,
        eps2=eps2,
        beta1=0.0 if beta1 is None else beta1,
        beta2=beta2,
        beta3=0.0,
        clip=scalar(hyper["clip_threshold"]),
        lr=rho,
        neg_wd=-wd,
        neg_wd_lr=-wd * rho,
        scal=scal,
    )


def launch_came(u: Update, bucket: Bucket) -> None:
    """CAME (came_pytorch semantics)."""
    hyper = u.record.hyper
    eps1, eps2 = hyper["eps"]
    beta1, beta2, beta3 = hyper["betas"]
    if u.steps is None:
        wd, lr, clip = scalars(hyper["weight_decay"], hyper["lr"], hyper["clip_threshold"])
        scal = None
    else:  # a capturable step: the lr from the device (CAME's other scalars do not change with the step)
        wd, clip = scalars(hyper["weight_decay"], hyper["clip_threshold"])
        lr = capture.device_value(hyper["lr"], bucket.device)
        scal = bucket.scalars(lr, -wd * lr, beta2, 1.0 - beta2)
        lr = 0.0
    _launch(
        bucket,
        came=True,
        has_m=True,
        scale_param=False,
        decay=wd != 0,
        eps1=eps1,
        eps2=eps2,
        beta1=beta1,
        beta2=beta2,
        beta3=beta3,
        clip=clip,
        lr=lr,
        neg_wd=-wd,
        neg_wd_lr=-wd * lr,
        scal=scal,
    )


#: the kernels as :func:`.registry.lookup` finds them (``KernelSet(triton="factored:ADAFACTOR")``, ``"factored:CAME"``)
ADAFACTOR = Kernel(adafactor_slots, launch_adafactor, matrices_apart=True)
CAME = Kernel(came_slots, launch_came, matrices_apart=True)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("stats", stats_kernel, v.stats(v.Q8, 256, G_DTYPE=v.tl.bfloat16, RESIDUAL=False)),
        v.Variant("stats-residual", stats_kernel, v.stats(v.Q8, 256, RESIDUAL=True)),
        v.Variant("moments", moments_kernel, v.stats(v.Q8, 256)),
        v.Variant("factors", factors_kernel, dict(W=15, STAT=9, FB=v.runtime.STATS_BLOCK, MOMENTS=False)),
        v.Variant("factors-moments", factors_kernel, dict(W=15, STAT=11, FB=v.runtime.STATS_BLOCK, MOMENTS=True)),
        v.Variant(
            "factors-capturable",
            factors_kernel,
            dict(W=15, STAT=9, FB=v.runtime.STATS_BLOCK, MOMENTS=False, DEVICE_SCALARS=True),
        ),
        v.Variant("sumsq", sumsq_kernel, v.tile(FACTORED=False, WIDE=False, SUM_P=True)),
        v.Variant("sumsq-factored", sumsq_kernel, v.tile(FACTORED=True, WIDE=True, SUM_P=True)),
        # matrices of rows >= the tile's row (WIDE: the factor indices per segment), and narrower ones
        v.Variant(
            "apply-came",
            apply_kernel,
            v.tile(FACTORED=True, WIDE=True, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True),
        ),
        v.Variant(
            "apply-came-narrow",
            apply_kernel,
            v.tile(FACTORED=True, WIDE=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True),
        ),
        v.Variant(
            "apply-adafactor",
            apply_kernel,
            v.tile(FACTORED=False, WIDE=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True),
        ),
        v.Variant(
            "apply-adafactor-factored",
            apply_kernel,
            v.tile(FACTORED=True, WIDE=True, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True),
        ),
        v.Variant(
            "apply-adafactor-capturable",
            apply_kernel,
            v.tile(
                FACTORED=False, WIDE=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True, DEVICE_SCALARS=True
            ),
        ),
        v.Variant("stats-q4", stats_kernel, v.stats(v.Q4, v.Q4_BLOCK, RESIDUAL=True)),
        v.Variant("moments-q4", moments_kernel, v.stats(v.Q4, v.Q4_BLOCK)),
        v.Variant(
            "apply-came-q4",
            apply_kernel,
            v.tile4(FACTORED=False, WIDE=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True),
        ),
    ]
