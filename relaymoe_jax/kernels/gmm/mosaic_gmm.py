"""The grouped matmul `out[M, N] = x[rows of g] @ w[g]` (or `w[g].T`: dx) as a Pallas Mosaic GPU
kernel: warp-specialised, persistent, TMA and wgmma (`mosaic_common`'s module doc).

Work list. The rows are cut into tiles of `block_m`; a work item is one (row tile, group) pair
whose rows meet, so a tile shared by two groups is computed once per group (tiles straddle
groups: at most G extra tiles, about 12% at M=8192, G=16, block_m=64; padding each group to the
tile instead would need a re-laid-out copy of x and of the output). With `zero_padding` the rows
[sum(group_sizes), M) are one more group (G) whose items run no K step and store zeros; without
it they get no item and stay unwritten. The list (`pallas_kernels.gmm_items`, shared with the
Triton kernel) is built by XLA; the kernel reads its length as a scalar, so a program takes only
real items. An output tile is one item times 2 x block_n columns (a half per consumer).

Rows. Every TMA load reads a whole tile of `block_m` rows inside [0, M): the last tile is moved
up to end at row M (M >= block_m; the wrapper pads smaller inputs), so nothing is read out of
bounds. Rows of the tile outside the item's [lo, hi) multiply too (their products are never
stored: a row's output reads only that row, so NaN in a padding row stays in it) and only rows
[lo, hi) are stored, by a ladder of TMA copies of static power-of-two sizes (`store_rows`), so
two items sharing a tile never write the same element and every row of [0, M) is written once
(with `zero_padding`).
"""

from typing import NamedTuple

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.kernels.gmm.common import clamp_group_sizes, operand_dtype, row_items
from relaymoe_jax.kernels.gmm.mosaic_common import (
    CONSUMERS,
    MIN_N_MINOR,
    PRODUCER,
    ROW_ALIGN,
    MosaicConfig,
    Pipeline,
    check_dtype,
    consume,
    fit,
    launch,
    num_sms,
    pad_to,
    padded,
    persistent,
    produce,
    row_tile,
    stages,
    store_tile,
    tiles,
)


class _Spec(NamedTuple):
    """The static shape of one gmm kernel."""

    m: int
    k: int
    n: int
    groups: int
    bm: int
    bn: int
    bk: int
    transpose_rhs: bool
    dtype: object
    out_dtype: object
    stages: int
    sms: int

    @property
    def n_tiles(self) -> int:
        return self.n // (CONSUMERS * self.bn)

    @property
    def k_steps(self) -> int:
        return self.k // self.bk


def _scratch(sp: _Spec) -> dict:
    w_shape = (sp.bn, sp.bk) if sp.transpose_rhs else (sp.bk, sp.bn)
    return {
        "x_s": plgpu.SMEM((sp.stages, sp.bm, sp.bk), sp.dtype, transforms=tiles(sp.dtype, sp.bk)),
        "w_s": plgpu.SMEM(
            (sp.stages, CONSUMERS, *w_shape), sp.dtype, transforms=tiles(sp.dtype, w_shape[1])
        ),
        "o_s": plgpu.SMEM((CONSUMERS, sp.bm, sp.bn), sp.out_dtype),  # row slices: no tiling
        "full": plgpu.Barrier(num_arrivals=1 + CONSUMERS, num_barriers=sp.stages),  # TMA copies
        "free": plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=sp.stages),
    }


def _smem_bytes(sp: _Spec) -> tuple[int, int]:
    """(bytes per pipeline slot, bytes of the output tiles)."""
    item = np.dtype(sp.dtype).itemsize
    per_stage = (sp.bm * sp.bk + CONSUMERS * sp.bk * sp.bn) * item
    return per_stage, CONSUMERS * sp.bm * sp.bn * np.dtype(sp.out_dtype).itemsize


def _kernel(sp: _Spec, group_ref, row0_ref, lo_ref, hi_ref, count_ref, x_ref, w_ref, o_ref, **s):
    wg = lax.axis_index("wg")
    pipe = Pipeline(s["full"], s["free"], sp.stages)
    total = count_ref[0] * sp.n_tiles

    def producer(t, step):
        tl = row_tile(sp, group_ref, row0_ref, t)
        w_g = w_ref.at[jnp.minimum(tl.g, sp.groups - 1)]

        def issue(kk, slot, full):
            ks = pl.ds(kk * sp.bk, sp.bk)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tl.r0, sp.bm), ks], s["x_s"].at[slot], full)
            for c in range(CONSUMERS):
                cols = pl.ds((tl.nt * CONSUMERS + c) * sp.bn, sp.bn)
                src = w_g.at[cols, ks] if sp.transpose_rhs else w_g.at[ks, cols]
                plgpu.copy_gmem_to_smem(src, s["w_s"].at[slot, c], full)

        return produce(pipe, tl.trips, step, issue)

    def consumer(t, step):
        tl = row_tile(sp, group_ref, row0_ref, t)

        def multiply(kk, slot, acc_ref):
            w = s["w_s"].at[slot, wg]
            plgpu.wgmma(acc_ref, s["x_s"].at[slot], w.T if sp.transpose_rhs else w)

        acc, step = consume(pipe, (sp.bm, sp.bn), tl.trips, step, multiply)
        cols = pl.ds((tl.nt * CONSUMERS + wg) * sp.bn, sp.bn)
        lo, hi = lo_ref[tl.item], hi_ref[tl.item]
        store_tile(acc, s["o_s"].at[wg], o_ref, tl, lo, hi, cols, sp.bm)
        return step

    @pl.when(wg == PRODUCER)
    def _():
        persistent(total, sp.sms, producer)

    @pl.when(wg < CONSUMERS)
    def _():
        persistent(total, sp.sms, consumer)
        plgpu.wait_smem_to_gmem(0)


def _launch(items, x, w, transpose_rhs: bool, out_dtype, cfg: MosaicConfig, bn: int, bk: int):
    """out[M, N] of the kernel for work `items` (`common.RowItems`) on x [M, K] (M >= block_m, a
    multiple of ROW_ALIGN) and w [G, K, N] ([G, N, K] if `transpose_rhs`), one 16-bit dtype, K a
    multiple of `bk` and N of 2 `bn`."""
    m, k = x.shape
    groups = w.shape[0]
    n = w.shape[1] if transpose_rhs else w.shape[2]
    sms = num_sms(cfg)
    sp = _Spec(m, k, n, groups, cfg.block_m, bn, bk, transpose_rhs, x.dtype, out_dtype, 2, sms)
    sp = sp._replace(stages=stages(cfg, *_smem_bytes(sp)))

    return launch(
        "relaymoe_gmm", _kernel, sp, _scratch, (m, n), out_dtype, cfg.interpret, *items, x, w
    )


def gmm_call(x, w, group_sizes_g, rows_m, transpose_rhs: bool, out_dtype, cfg: MosaicConfig):
    """out[M, N] of the kernel (not differentiable; `pallas_kernels.gmm_call`'s contract), M =
    len(rows_m) if given. Hopper's TMA cannot gather rows, so `rows_m` is gathered by XLA here
    (one [M, K] buffer per call: a ring chunk's rows). Shapes the kernel does not tile are padded
    with zeros first (a copy): M up to a multiple of ROW_ALIGN and at least block_m, K up to a
    multiple of 64 and N of 128 (`MIN_N_MINOR`), of 16 and 32 with `transpose_rhs`."""
    if rows_m is not None:
        x = jnp.take(x, jnp.clip(rows_m, 0, max(x.shape[0] - 1, 0)), axis=0)
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    if m == 0 or n == 0 or k == 0 or w.shape[0] == 0:
        return jnp.zeros((m, n), out_dtype)
    compute = check_dtype(operand_dtype(x.dtype, w.dtype))
    x, w = x.astype(compute), w.astype(compute)
    narrow = 16 if transpose_rhs else MIN_N_MINOR  # the narrowest tile of w that compiles
    k_pad = k if fit(cfg.block_k, k, narrow) else padded(k, narrow)
    n_pad = padded(n, CONSUMERS * narrow)
    m_pad = max(padded(m, ROW_ALIGN), cfg.block_m)
    bk = fit(cfg.block_k, k_pad, narrow)
    bn = fit(cfg.block_n, n_pad // CONSUMERS, narrow)
    x = pad_to(x, (m_pad, k_pad))
    w = pad_to(w, (w.shape[0], n_pad, k_pad) if transpose_rhs else (w.shape[0], k_pad, n_pad))
    items = row_items(clamp_group_sizes(group_sizes_g, m), m_pad, cfg.block_m, cfg.zero_padding)
    out = _launch(items, x, w, transpose_rhs, np.dtype(out_dtype), cfg, bn, bk)
    return out[:m, :n] if (m_pad, n_pad) != (m, n) else out
