"""The e4m3 grouped matmul `out[M, N] = dequant(x)[rows of g] @ dequant(w[g])` as a Pallas Mosaic
GPU kernel (Hopper wgmma e4m3 x e4m3 -> f32), with DeepSeek-V3's blockwise scales: x per 1 x 128
tile (a scale per row and 128 channels of the contraction), w per 128 x 128 block (`quant.fp8`).

The shape is `mosaic_gmm`'s (its module doc: the work list, tiles straddling groups, the row
ladder of stores, `zero_padding`): warp-specialised, persistent, TMA into a multi-stage pipeline.
What differs:

- **Both operands K-major.** wgmma reads 8-bit operands with the contraction as the minor
  dimension only (PTX: no transpose for 8-bit types), so w comes as [G, N, K]. dx's
  `w[g].T` is that layout already (the weights `[G, N, K]` with N the output); the forward's
  w [G, K, N] is transposed by XLA first (`gmm_fp8_call`; a 128 x 128 block's scale survives the
  transpose), one e4m3 copy of the chunk's weights.
- **Promotion per K block.** A K step is one 128-wide scale block (`BK`): its wgmma runs into a
  fresh float32 accumulator, which is then scaled by the step's row scales (x's tile scales of
  the tile's rows, streamed with the operands: one TMA of `bm` floats per step) times the weight
  block's scale, and added to the running float32 sum in registers (DeepSeek-V3's promotion;
  Hopper's FP8 wgmma accumulates in about 22 bits, so a sum over all of K inside the tensor core
  loses precision, and the scales vary along K anyway). Two accumulators per consumer: 128 of
  its registers per thread at the 64 x 128 tile.
- **One wgmma in flight per consumer, none across steps**: the partial product is read before
  the next step's wgmma starts (the two consumers and the producer overlap each other instead).

The scales are powers of two (`quant.fp8`), so scaling is exact and the kernel computes what a
16-bit grouped matmul of the dequantised operands computes, up to the order of the float32 sums.
"""

from typing import NamedTuple

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.kernels.gmm.common import clamp_group_sizes, row_items
from relaymoe_jax.kernels.gmm.mosaic_common import (
    CONSUMERS,
    PRODUCER,
    ROW_ALIGN,
    MosaicConfig,
    Pipeline,
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
from relaymoe_jax.quant import fp8

BK = fp8.BLOCK  # a K step is one scale block
BN = fp8.BLOCK  # each consumer's columns: one weight block's
E4M3 = np.dtype(fp8.E4M3)
ROW = plgpu.Layout.WGMMA.reduce(1)  # a vector along an accumulator's rows


class _Spec(NamedTuple):
    """The static shape of one e4m3 gmm kernel."""

    m: int
    k: int
    n: int
    groups: int
    bm: int
    out_dtype: object
    stages: int
    sms: int

    @property
    def n_tiles(self) -> int:
        return self.n // (CONSUMERS * BN)

    @property
    def k_steps(self) -> int:
        return self.k // BK


def _scratch(sp: _Spec) -> dict:
    return {
        "x_s": plgpu.SMEM((sp.stages, sp.bm, BK), E4M3, transforms=tiles(E4M3, BK)),
        "w_s": plgpu.SMEM((sp.stages, CONSUMERS, BN, BK), E4M3, transforms=tiles(E4M3, BK)),
        "sx_s": plgpu.SMEM((sp.stages, sp.bm), jnp.float32),
        "o_s": plgpu.SMEM((CONSUMERS, sp.bm, BN), sp.out_dtype),  # row slices: no tiling
        # the TMA copies of a step: x, its row scales, one w block per consumer
        "full": plgpu.Barrier(num_arrivals=2 + CONSUMERS, num_barriers=sp.stages),
        "free": plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=sp.stages),
    }


def _smem_bytes(sp: _Spec) -> tuple[int, int]:
    """(bytes per pipeline slot, bytes of the output tiles)."""
    per_stage = sp.bm * BK + CONSUMERS * BN * BK + sp.bm * 4
    return per_stage, CONSUMERS * sp.bm * BN * np.dtype(sp.out_dtype).itemsize


def _consume(pipe: Pipeline, sp: _Spec, s: dict, wg, trips, step, w_scale):
    """Consumer `wg`'s K loop over `trips` steps from `step`: per step, wait for the slot, its
    wgmma into a fresh accumulator, free the slot, and add the partial product times its scales
    (the rows' x scales times the weight block's, `w_scale(j)`) to the float32 sum. Returns (the
    sum, the next step)."""
    shape = (sp.bm, BN)

    def body(j, carry):
        total, step = carry
        slot = pipe.slot(step)
        plgpu.barrier_wait(pipe.full.at[slot])

        def part(acc_ref):
            plgpu.wgmma(acc_ref, s["x_s"].at[slot], s["w_s"].at[slot, wg].T)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        p = pl.run_scoped(part, plgpu.ACC(shape, jnp.float32))
        rows = plgpu.load(s["sx_s"].at[slot], layout=ROW) * w_scale(j)
        plgpu.barrier_arrive(pipe.free.at[slot])  # its wgmma and the scale load have read it
        return total + p * lax.broadcast_in_dim(rows, shape, [0]), step + 1

    zero = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return lax.fori_loop(0, trips, body, (zero, step))


def _kernel(
    sp: _Spec,
    group_ref,
    row0_ref,
    lo_ref,
    hi_ref,
    count_ref,
    x_ref,
    sx_ref,
    w_ref,
    sw_ref,
    o_ref,
    **s,
):
    wg = lax.axis_index("wg")
    pipe = Pipeline(s["full"], s["free"], sp.stages)
    total = count_ref[0] * sp.n_tiles

    def producer(t, step):
        tl = row_tile(sp, group_ref, row0_ref, t)
        w_g = w_ref.at[jnp.minimum(tl.g, sp.groups - 1)]

        def issue(kk, slot, full):
            # the consumers read the row scales through the generic proxy (`plgpu.load`): order
            # those reads, which the free barrier passed on, before this TMA write (async proxy)
            plgpu.commit_smem()
            ks = pl.ds(kk * BK, BK)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tl.r0, sp.bm), ks], s["x_s"].at[slot], full)
            plgpu.copy_gmem_to_smem(sx_ref.at[kk, pl.ds(tl.r0, sp.bm)], s["sx_s"].at[slot], full)
            for c in range(CONSUMERS):
                cols = pl.ds((tl.nt * CONSUMERS + c) * BN, BN)
                plgpu.copy_gmem_to_smem(w_g.at[cols, ks], s["w_s"].at[slot, c], full)

        return produce(pipe, tl.trips, step, issue)

    def consumer(t, step):
        tl = row_tile(sp, group_ref, row0_ref, t)
        nb = tl.nt * CONSUMERS + wg  # this consumer's column block
        g = jnp.minimum(tl.g, sp.groups - 1)
        acc, step = _consume(pipe, sp, s, wg, tl.trips, step, lambda j: sw_ref[g, nb, j])
        lo, hi = lo_ref[tl.item], hi_ref[tl.item]
        store_tile(acc, s["o_s"].at[wg], o_ref, tl, lo, hi, pl.ds(nb * BN, BN), sp.bm)
        return step

    @pl.when(wg == PRODUCER)
    def _():
        persistent(total, sp.sms, producer)

    @pl.when(wg < CONSUMERS)
    def _():
        persistent(total, sp.sms, consumer)
        plgpu.wait_smem_to_gmem(0)


def gmm_fp8_call(
    x: fp8.Fp8, w: fp8.Fp8, group_sizes_g, transpose_rhs: bool, out_dtype, cfg: MosaicConfig
):
    """out[M, N] = dequantize(x) rows of group g @ dequantize(w)[g] (`.T` if `transpose_rhs`),
    in `out_dtype`: x [M, K] quantised in `fp8.TILE`s, w [G, K, N] ([G, N, K] if
    `transpose_rhs`) in 128 x 128 blocks. `api.gmm`'s contract on rows (zeros past
    sum(group_sizes) with cfg.zero_padding, NaN in padding rows never read into a stored row).
    Not differentiable. Shapes are padded with zeros to the tiles (M to a multiple of 8 and at
    least block_m, K to 128, N to 256: a copy)."""
    if x.block != fp8.TILE or w.block != (fp8.BLOCK, fp8.BLOCK):
        raise ValueError(
            f"gmm_fp8 takes x in {fp8.TILE} tiles and w in {(fp8.BLOCK, fp8.BLOCK)} blocks, got "
            f"{x.block} and {w.block}"
        )
    m, k = x.shape
    w_nk = w if transpose_rhs else w.transposed()  # [G, N, K]: K-major
    w_q, w_s = w_nk.q, w_nk.scale
    groups, n = w_q.shape[0], w_q.shape[1]
    if w_q.shape[2] != k:
        raise ValueError(f"gmm_fp8: x is [M, {k}] but w contracts over {w_q.shape[2]}")
    if m == 0 or n == 0 or k == 0 or groups == 0:
        return jnp.zeros((m, n), out_dtype)
    m_pad, k_pad, n_pad = max(padded(m, ROW_ALIGN), cfg.block_m), padded(k, BK), padded(n, 256)
    kb, nb = k_pad // BK, n_pad // BN
    x_q = pad_to(x.q, (m_pad, k_pad))
    sx_t = pad_to(x.scale.T, (kb, m_pad))  # [K/128, M]: a step's row scales are contiguous
    w_q = pad_to(w_q, (groups, n_pad, k_pad))
    w_s = pad_to(w_s, (groups, nb, kb))
    sms = num_sms(cfg)
    sp = _Spec(m_pad, k_pad, n_pad, groups, cfg.block_m, np.dtype(out_dtype), 2, sms)
    sp = sp._replace(stages=stages(cfg, *_smem_bytes(sp)))
    items = row_items(clamp_group_sizes(group_sizes_g, m), m_pad, cfg.block_m, cfg.zero_padding)
    out = launch(
        "relaymoe_gmm_fp8",
        _kernel,
        sp,
        _scratch,
        (m_pad, n_pad),
        sp.out_dtype,
        cfg.interpret,
        *items,
        x_q,
        sx_t,
        w_q,
        w_s,
    )
    return out[:m, :n] if (m_pad, n_pad) != (m, n) else out
