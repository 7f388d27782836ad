"""The weight gradient `out[g] = x[rows of g].T @ y[rows of g]` ([G, K, N], a ragged
contraction) as a Pallas Mosaic GPU kernel: warp-specialised, persistent, TMA and wgmma
(`mosaic_common`'s module doc).

Output tiles: (group, 64 rows of K, 2 x block_n columns of N), group-major, so the SMs working
at once read the same rows. A tile's pipeline walks the group's rows in blocks of `block_m`
aligned to the block grid, from the block holding its first row to the block holding its last;
the last block of the array is moved up to end at row M (M >= block_m; the wrapper pads), so
nothing is read out of bounds. Only a group's first and last blocks hold rows of other groups
or padding: there (and only there) the consumers zero the rows outside the group in SMEM with a
select (NaN in a padding row never leaks: 0 * NaN would) before the wgmma; warpgroup 0 masks the
x block, each consumer its half of the y block, and both meet at a barrier before multiplying.
Interior blocks go to wgmma as loaded. An empty group runs no step and stores zeros.

`acc` (optional [G, K, N]): out = acc + the product; each tile's acc block is loaded by TMA at
the tile's start and added in the epilogue, so every tile is written once (a group with no rows
copies its acc block through). out is acc's own buffer, updated in place (an input-output
alias of the custom call, `mosaic_common.launch(inplace=True)`), so a loop-carried float32 sum
(the ring's dW) keeps one buffer, as the Triton kernel's `input_output_aliases` do: each tile's
acc block is read whole before the tile's store writes it, and no other tile touches it.
"""

from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.kernels.gmm.common import clamp_group_bounds, operand_dtype
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
    row_mask,
    stages,
    tiles,
)

BLOCK_K = 64  # rows of K per output tile: one wgmma M tile per consumer


class _Spec(NamedTuple):
    """The static shape of one tgmm kernel."""

    m: int
    k: int
    n: int
    groups: int
    bm: int
    bn: int
    dtype: object
    out_dtype: object
    accumulate: bool
    stages: int
    sms: int

    @property
    def k_tiles(self) -> int:
        return self.k // BLOCK_K

    @property
    def n_tiles(self) -> int:
        return self.n // (CONSUMERS * self.bn)


def _scratch(sp: _Spec) -> dict:
    s = {
        "x_s": plgpu.SMEM(
            (sp.stages, sp.bm, BLOCK_K), sp.dtype, transforms=tiles(sp.dtype, BLOCK_K)
        ),
        "y_s": plgpu.SMEM(
            (sp.stages, CONSUMERS, sp.bm, sp.bn), sp.dtype, transforms=tiles(sp.dtype, sp.bn)
        ),
        "o_s": plgpu.SMEM(
            (CONSUMERS, BLOCK_K, sp.bn), sp.out_dtype, transforms=tiles(sp.out_dtype, sp.bn)
        ),
        "full": plgpu.Barrier(num_arrivals=1 + CONSUMERS, num_barriers=sp.stages),  # TMA copies
        "free": plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=sp.stages),
        "masked": plgpu.Barrier(num_arrivals=CONSUMERS),  # both consumers masked a block
    }
    if sp.accumulate:
        s["acc_in"] = plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS)
    return s


def _smem_bytes(sp: _Spec) -> tuple[int, int]:
    """(bytes per pipeline slot, bytes of the output tiles)."""
    item = np.dtype(sp.dtype).itemsize
    per_stage = (sp.bm * BLOCK_K + CONSUMERS * sp.bm * sp.bn) * item
    return per_stage, CONSUMERS * BLOCK_K * sp.bn * np.dtype(sp.out_dtype).itemsize


class _Tile(NamedTuple):
    """One output tile: group g's rows [start, end) in `trips` blocks from block `first`, rows
    kt of K, column pair nt of N."""

    g: jax.Array
    kt: jax.Array
    nt: jax.Array
    start: jax.Array
    end: jax.Array
    first: jax.Array
    trips: jax.Array


def _tile(sp: _Spec, start_ref, end_ref, t) -> _Tile:
    per_group = sp.k_tiles * sp.n_tiles
    g, rest = lax.div(t, jnp.int32(per_group)), lax.rem(t, jnp.int32(per_group))
    kt, nt = lax.div(rest, jnp.int32(sp.n_tiles)), lax.rem(rest, jnp.int32(sp.n_tiles))
    start, end = start_ref[g], end_ref[g]
    first = lax.div(start, jnp.int32(sp.bm))
    trips = jnp.where(end > start, lax.div(end - 1, jnp.int32(sp.bm)) - first + 1, 0)
    return _Tile(g, kt, nt, start, end, first, trips)


def _block_rows(sp: _Spec, tl: _Tile, j):
    """(b0, r0): block j's first row, and the row it is loaded from: the last block of the array
    ends at row M (a multiple of 8 rows, as TMA into (8, x) tiles needs: M is one)."""
    b0 = (tl.first + j) * sp.bm
    return b0, pl.multiple_of(jnp.minimum(b0, sp.m - sp.bm), ROW_ALIGN)


def _mask_boundary(sp: _Spec, s, wg, tl: _Tile, j, x_s, y_s) -> None:
    """On a group's first and last blocks, rows outside the group to zero in SMEM by a select
    (warpgroup 0 the x block, each consumer its y half), then both consumers meet."""
    b0, r0 = _block_rows(sp, tl, j)
    lo, hi = jnp.maximum(tl.start, b0), jnp.minimum(tl.end, b0 + sp.bm)

    @pl.when((b0 < tl.start) | (b0 + sp.bm > tl.end))
    def _():
        @pl.when(wg == 0)
        def _():
            keep = row_mask((sp.bm, BLOCK_K), r0, lo, hi)
            x_s[...] = jnp.where(keep, plgpu.load(x_s, layout=plgpu.Layout.WGMMA), 0)

        keep = row_mask((sp.bm, sp.bn), r0, lo, hi)
        y_s[...] = jnp.where(keep, plgpu.load(y_s, layout=plgpu.Layout.WGMMA), 0)
        plgpu.commit_smem()
        plgpu.barrier_arrive(s["masked"])
        plgpu.barrier_wait(s["masked"])


def _kernel(sp: _Spec, start_ref, end_ref, x_ref, y_ref, *refs, **s):
    acc_ref, o_ref = refs if sp.accumulate else (None, *refs)
    wg = lax.axis_index("wg")
    pipe = Pipeline(s["full"], s["free"], sp.stages)
    total = jnp.int32(sp.groups * sp.k_tiles * sp.n_tiles)

    def producer(t, step):
        tl = _tile(sp, start_ref, end_ref, t)

        def issue(j, slot, full):
            rows = pl.ds(_block_rows(sp, tl, j)[1], sp.bm)
            ks = pl.ds(tl.kt * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(x_ref.at[rows, ks], s["x_s"].at[slot], full)
            for c in range(CONSUMERS):
                cols = pl.ds((tl.nt * CONSUMERS + c) * sp.bn, sp.bn)
                plgpu.copy_gmem_to_smem(y_ref.at[rows, cols], s["y_s"].at[slot, c], full)

        return produce(pipe, tl.trips, step, issue)

    def consumer(t, step):
        tl = _tile(sp, start_ref, end_ref, t)
        o_s = s["o_s"].at[wg]
        block = (
            tl.g,
            pl.ds(tl.kt * BLOCK_K, BLOCK_K),
            pl.ds((tl.nt * CONSUMERS + wg) * sp.bn, sp.bn),
        )
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read o_s
        if sp.accumulate:
            plgpu.copy_gmem_to_smem(acc_ref.at[block], o_s, s["acc_in"].at[wg])

        def multiply(j, slot, acc):
            x_s, y_s = s["x_s"].at[slot], s["y_s"].at[slot, wg]
            _mask_boundary(sp, s, wg, tl, j, x_s, y_s)
            plgpu.wgmma(acc, x_s.T, y_s)

        prod, step = consume(pipe, (BLOCK_K, sp.bn), tl.trips, step, multiply)
        if sp.accumulate:
            plgpu.barrier_wait(s["acc_in"].at[wg])
            prod = prod + plgpu.load(o_s, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        o_s[...] = prod.astype(sp.out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[block])
        return step

    @pl.when(wg == PRODUCER)
    def _():
        persistent(total, sp.sms, producer)

    @pl.when(wg < CONSUMERS)
    def _():
        persistent(total, sp.sms, consumer)
        plgpu.wait_smem_to_gmem(0)


def _launch(start_g, end_g, x, y, out_dtype, cfg: MosaicConfig, bn: int, acc):
    """out[G, K, N] (+ `acc`) for the groups' rows [start_g, end_g) of x [M, K] and y [M, N] (one
    16-bit dtype, M >= block_m and a multiple of ROW_ALIGN, K a multiple of 64, N of 2 `bn`)."""
    m, k = x.shape
    n = y.shape[1]
    groups = start_g.shape[0]
    sms = num_sms(cfg)
    sp = _Spec(m, k, n, groups, cfg.block_m, bn, x.dtype, out_dtype, acc is not None, 2, sms)
    sp = sp._replace(stages=stages(cfg, *_smem_bytes(sp)))

    operands = (start_g, end_g, x, y, *(() if acc is None else (acc,)))
    shape = (groups, k, n)
    return launch(
        "relaymoe_tgmm",
        _kernel,
        sp,
        _scratch,
        shape,
        out_dtype,
        cfg.interpret,
        *operands,
        inplace=acc is not None,
    )


def tgmm_call(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg: MosaicConfig, acc=None):
    """out[G, K, N] (+ `acc`) of the kernel (not differentiable; `pallas_kernels.tgmm_call`'s
    contract). Row gathers are XLA's (`mosaic_gmm.gmm_call`); shapes the kernel does not tile are
    padded with zeros first (a copy): M up to a multiple of ROW_ALIGN and at least block_m, K up
    to a multiple of 64, N of 128 (`MIN_N_MINOR`)."""
    if x_rows_m is not None:
        x = jnp.take(x, jnp.clip(x_rows_m, 0, max(x.shape[0] - 1, 0)), axis=0)
    if y_rows_m is not None:
        y = jnp.take(y, jnp.clip(y_rows_m, 0, max(y.shape[0] - 1, 0)), axis=0)
    m, k = x.shape
    n = y.shape[1]
    groups = group_sizes_g.shape[0]
    if m == 0 or n == 0 or k == 0 or groups == 0:
        return jnp.zeros((groups, k, n), out_dtype) if acc is None else acc
    compute = check_dtype(operand_dtype(x.dtype, y.dtype))
    x, y = x.astype(compute), y.astype(compute)
    m_pad, k_pad = max(padded(m, ROW_ALIGN), cfg.block_m), padded(k, BLOCK_K)
    n_pad = padded(n, CONSUMERS * MIN_N_MINOR)
    bn = fit(cfg.block_n, n_pad // CONSUMERS, MIN_N_MINOR)
    x, y = pad_to(x, (m_pad, k_pad)), pad_to(y, (m_pad, n_pad))
    if acc is not None:
        acc = pad_to(acc, (groups, k_pad, n_pad))
    start_g, end_g = clamp_group_bounds(group_sizes_g, m)  # padded rows are in no group
    out = _launch(start_g, end_g, x, y, np.dtype(out_dtype), cfg, bn, acc)
    return out[:, :k, :n] if (k_pad, n_pad) != (k, n) else out
