"""Flash-attention backward as two Pallas Mosaic GPU kernels (Hopper: TMA, wgmma, mbarriers).

`backward` takes the forward's inputs q [B, S, N, D], k/v [B, T, K, D] (bf16 or f16, whole
blocks, K divides N: query head n reads kv head n // (N // K)), its output o and log-sum-exp
lse [B, N, S] (float32, natural log; padded or fully masked rows may hold -inf or any large
negative value), the cotangent do, and the `Masks` of `common.prepare_masks`; it returns dq, dk,
dv in the inputs' dtypes. FlashAttention-2's split, f32 accumulation, 16-bit wgmma operands:

- delta = rowsum(do * o) [B, N, S] (f32) in XLA, and lse in log2 units.
- dK/dV kernel, grid (K, T // block_k, B), W = block_k // 64 warpgroups (1 or 2), each owning
  64 keys of key block j of kv head kvh (its K, V tiles in SMEM) with its own f32 dK and dV
  accumulators. The program walks the G = N // K query heads of the group times the query
  blocks `masks.queries.perm[start[j]:end[j]]` (key block j's range, `common.Masks`; one flat
  `fori_loop` with a traced trip count, block numbers read as scalars from GPU memory).
  Warpgroup 0 streams Q, dO, lse, delta and the query indices (and segment ids) of each step
  by TMA through two SMEM slots shared by the W warpgroups: step s + 1 is issued after step
  s's first wgmma was waited on (with W = 2, also
  after both warpgroups arrived on the slot's "free" barrier once their step s - 1 wgmmas were
  retired). Per step: sT = K Q^T [64, block_q] (so no transposed A operand is needed),
  pT = exp2(sT - lse) masked elementwise with a select (0 where masked: padded or fully masked
  rows give nothing, even with lse = -inf), dV += pT dO, dpT = V dO^T, dsT = pT (dpT - delta),
  dK += dsT Q; pT then dsT go through one 16-bit SMEM tile (wgmma's A operand). dK and dV are
  wgmma accumulators that live across the whole loop (`pl.run_scoped(..., plgpu.ACC,
  plgpu.ACC)` around it; wgmma adds into them in place). dK is scaled at the end.
- dQ kernel, grid (N // H, S // block_q, B) like the forward, H = heads_per_program query heads
  of one kv group per program (one warpgroup each, sharing the K/V tiles, which warpgroup 0
  streams through two SMEM slots from `masks.keys.perm[start[i]:end[i]]`; a slot is refilled after
  its H readers arrived on its "free" barrier). Per step: s = Q K^T, p = exp2(s - lse) masked,
  dp = dO V^T, ds = p (dp - delta), dQ += ds K (dS through SMEM; the dQ accumulator lives
  across the loop). With block_k = 128, H = 1 (below).

Registers and SMEM (deviceless ptxas for H100, bf16, B = 1, S = T = 4096, N = 32, K = 4, with
segment ids, measured again with the block ranges: at most 4 registers apart from the block
lists' figures, the same SMEM; no spills in any configuration the code runs):
- block_k = 64: dK/dV 248 registers per thread at D = 128 (168 at D = 64), 110 KB of SMEM
  (so two programs fit an SM); dQ 205 registers at D = 128 with H = 1 (218 with H = 2; 157 and
  159 at D = 64), 110 KB of SMEM (150 KB with H = 2).
- block_k = 128: dK/dV (two warpgroups) 254 registers at D = 128 (172 at D = 64), 150 KB; dQ
  255 registers at D = 128 (H = 1), 182 KB. Its [64, 128] f32 s, p, dp, ds fill a warpgroup's
  registers, and with H = 2 its tiles overflow SMEM at D = 128 (235,584 > 232,448 bytes) and it
  spills at D = 64, hence H = 1. A single warpgroup holding all 128 keys in the dK/dV kernel
  spilled (1088 bytes at D = 128): hence one warpgroup per 64 keys.
Every wgmma is m64n{64,128}k16 with f32 accumulation and 16-bit (bf16/f16) operands.

The interpreter (plgpu.InterpretGPUParams) shaped the code as in the forward: `plgpu.kernel`,
accumulators only through `pl.run_scoped(f, plgpu.ACC)`, 16-bit A operands from SMEM, TMA
barriers counting every copy that signals them. Visits (`count_visits`): each loop counts its
iterations; the count is stored as a 128-wide int32 splat through SMEM and TMA.
"""

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.kernels.attention.common import (
    Masks,
    MosaicConfig,
    check_dtype,
    check_head_dim,
)
from relaymoe_jax.kernels.attention.mosaic_common import (
    LOG2E,
    VISITS_WIDTH,
    heads_per_program,
    interpret_params,
    issue_key_block,
    store_visits,
    tile_mask,
    tiles,
    wgmma_value,
)

KEYS_PER_WG = 64  # keys per warpgroup in the dK/dV kernel (its wgmma M tile)
ROW = plgpu.Layout.WGMMA.reduce(1)  # a vector along an accumulator's rows (one per row)
COL = plgpu.Layout.WGMMA.reduce(0)  # a vector along an accumulator's columns


class _Spec(NamedTuple):
    """The static shape of one backward kernel."""

    g: int  # query heads per kv head
    h: int  # query heads (warpgroups) per dQ program
    w: int  # warpgroups per dK/dV program (block_k // 64), one per 64 keys
    d: int
    bq: int
    bk: int
    dtype: object
    has_seg: bool
    count_visits: bool
    qk_scale: float  # softmax scale times log2(e)
    scale: float


class _Refs(NamedTuple):
    q: object
    k: object
    v: object
    do: object
    lse: object
    delta: object
    qi: object
    ki: object
    qseg: object
    kseg: object
    perm: object  # the other side's blocks in visiting order
    start: object  # this block's range of perm: perm[start[x]:end[x]]
    end: object
    outs: tuple  # (dq,) or (dk, dv)
    visits: object


def _split_refs(sp: _Spec, n_outs: int, refs) -> _Refs:
    q, k, v, do, lse, delta, qi, ki, *rest = list(refs)
    qseg = kseg = visits = None
    if sp.has_seg:
        qseg, kseg, *rest = rest
    perm, start, end, *rest = rest
    outs, rest = tuple(rest[:n_outs]), rest[n_outs:]
    if sp.count_visits:
        (visits,) = rest
    return _Refs(q, k, v, do, lse, delta, qi, ki, qseg, kseg, perm, start, end, outs, visits)


# ---------------------------------------------------------------------------- dK / dV kernel


def _dkv_scratch(sp: _Spec) -> dict:
    t = tiles(sp.dtype)
    w, kw = sp.w, KEYS_PER_WG
    s = {
        "k_s": plgpu.SMEM((w, kw, sp.d), sp.dtype, transforms=t),  # K, then dK (per warpgroup)
        "v_s": plgpu.SMEM((w, kw, sp.d), sp.dtype, transforms=t),  # V, then dV
        "q_s": plgpu.SMEM((2, sp.bq, sp.d), sp.dtype, transforms=t),  # shared, 2 slots
        "do_s": plgpu.SMEM((2, sp.bq, sp.d), sp.dtype, transforms=t),
        # pT, then dsT: dsT is stored after dpT's wait, which retires the wgmma reading pT
        "p_s": plgpu.SMEM((w, kw, sp.bq), sp.dtype, transforms=t),
        "lse_s": plgpu.SMEM((2, sp.bq), jnp.float32),
        "delta_s": plgpu.SMEM((2, sp.bq), jnp.float32),
        "qi_s": plgpu.SMEM((2, sp.bq), jnp.int32),
        "ki_s": plgpu.SMEM((w, kw), jnp.int32),
    }
    if sp.has_seg:
        s["qseg_s"] = plgpu.SMEM((2, sp.bq), jnp.int32)
        s["kseg_s"] = plgpu.SMEM((w, kw), jnp.int32)
    if sp.count_visits:
        s["vis_s"] = plgpu.SMEM((w, VISITS_WIDTH), jnp.int32)
    # one arrival per TMA copy that signals the barrier
    s["bar_kv"] = plgpu.Barrier(num_arrivals=4 if sp.has_seg else 3, num_barriers=w)
    s["bar_q"] = plgpu.Barrier(num_arrivals=6 if sp.has_seg else 5, num_barriers=2)
    if w > 1:
        s["bar_free"] = plgpu.Barrier(num_arrivals=w, num_barriers=2)  # a slot's W readers done
    return s


def _dkv_kernel(sp: _Spec, *refs, **s):
    r = _split_refs(sp, 2, refs)
    wg = lax.axis_index("wg") if sp.w > 1 else jnp.int32(0)
    kvh, j, b = lax.axis_index("kv_heads"), lax.axis_index("k_block"), lax.axis_index("batch")
    keys = pl.ds(j * sp.bk + wg * KEYS_PER_WG, KEYS_PER_WG)  # this warpgroup's keys
    bar_kv = s["bar_kv"].at[wg]
    plgpu.copy_gmem_to_smem(r.k.at[b, keys, kvh], s["k_s"].at[wg], bar_kv)
    plgpu.copy_gmem_to_smem(r.v.at[b, keys, kvh], s["v_s"].at[wg], bar_kv)
    plgpu.copy_gmem_to_smem(r.ki.at[b, keys], s["ki_s"].at[wg], bar_kv)
    if sp.has_seg:
        plgpu.copy_gmem_to_smem(r.kseg.at[b, keys], s["kseg_s"].at[wg], bar_kv)
    start = r.start[j]
    count = r.end[j] - start
    total = count * sp.g  # steps: the group's query heads times the visible query blocks

    def issue(step, slot):  # TMA of step `step`'s query-side tiles into `slot` (warpgroup 0)
        t = lax.rem(step, count)
        n = kvh * sp.g + lax.div(step, count)
        rows = pl.ds(r.perm[start + t] * sp.bq, sp.bq)
        bar = s["bar_q"].at[slot]
        plgpu.copy_gmem_to_smem(r.q.at[b, rows, n], s["q_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(r.do.at[b, rows, n], s["do_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(r.lse.at[b, n, rows], s["lse_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(r.delta.at[b, n, rows], s["delta_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(r.qi.at[b, rows], s["qi_s"].at[slot], bar)
        if sp.has_seg:
            plgpu.copy_gmem_to_smem(r.qseg.at[b, rows], s["qseg_s"].at[slot], bar)

    @pl.when((total > 0) & (wg == 0))
    def _():
        issue(0, 0)

    plgpu.barrier_wait(bar_kv)
    ki_v = s["ki_s"][wg]
    kseg_v = s["kseg_s"][wg] if sp.has_seg else None
    body = functools.partial(_dkv_step, sp, s, wg, total, issue, ki_v, kseg_v)

    def accumulate(dk_ref, dv_ref):
        visits = lax.fori_loop(0, total, functools.partial(body, dk_ref, dv_ref), jnp.int32(0))
        return dk_ref[...], dv_ref[...], visits

    acc = plgpu.ACC((KEYS_PER_WG, sp.d), jnp.float32)
    dk, dv, visits = pl.run_scoped(accumulate, acc, acc)
    _dkv_finish(sp, r, s, wg, kvh, j, b, dk, dv, visits)


def _dkv_step(sp: _Spec, s, wg, total, issue, ki_v, kseg_v, dk_ref, dv_ref, step, visits):
    """One (query head, query block): sT, pT, dV += pT dO, dpT, dsT, dK += dsT Q."""
    slot = lax.rem(step, jnp.int32(2))
    q_w, do_w, p_w = s["q_s"].at[slot], s["do_s"].at[slot], s["p_s"].at[wg]
    plgpu.barrier_wait(s["bar_q"].at[slot])
    shape = (KEYS_PER_WG, sp.bq)
    s_t = wgmma_value(s["k_s"].at[wg], q_w.T, shape) * sp.qk_scale

    # refill the other slot (step - 1's) once its W readers released it; with one warpgroup,
    # the wait above on sT retired every earlier wgmma
    @pl.when((step + 1 < total) & (wg == 0))
    def _():
        if sp.w > 1:

            @pl.when(step > 0)
            def _():
                plgpu.barrier_wait(s["bar_free"].at[1 - slot])

        issue(step + 1, 1 - slot)

    qseg_v = s["qseg_s"][slot] if sp.has_seg else None
    mask = tile_mask(shape, ki_v, kseg_v, s["qi_s"][slot], qseg_v, k_dim=0)
    lse_v = plgpu.load(s["lse_s"].at[slot], layout=COL)
    p_t = jnp.where(mask, jnp.exp2(s_t - lax.broadcast_in_dim(lse_v, shape, [1])), 0.0)
    p_w[...] = p_t.astype(sp.dtype)
    plgpu.commit_smem()  # the generic-proxy stores, visible to wgmma (the async proxy)
    plgpu.wgmma(dv_ref, p_w, do_w)
    dp_t = wgmma_value(s["v_s"].at[wg], do_w.T, shape)
    delta_v = plgpu.load(s["delta_s"].at[slot], layout=COL)
    ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta_v, shape, [1]))
    p_w[...] = ds_t.astype(sp.dtype)
    plgpu.commit_smem()
    plgpu.wgmma(dk_ref, p_w, q_w)
    if sp.w > 1:
        plgpu.wgmma_wait(0)  # this warpgroup's reads of the slot are done
        plgpu.barrier_arrive(s["bar_free"].at[slot])
    return visits + 1


def _dkv_finish(sp: _Spec, r: _Refs, s, wg, kvh, j, b, dk, dv, visits):
    """dK (times the scale) and dV out through the K and V tiles; the visits."""
    k_w, v_w = s["k_s"].at[wg], s["v_s"].at[wg]
    k_w[...] = (dk * sp.scale).astype(sp.dtype)
    v_w[...] = dv.astype(sp.dtype)
    if sp.count_visits:
        store_visits(s["vis_s"].at[wg], visits)
    plgpu.commit_smem()
    keys = pl.ds(j * sp.bk + wg * KEYS_PER_WG, KEYS_PER_WG)
    dk_ref, dv_ref = r.outs
    plgpu.copy_smem_to_gmem(k_w, dk_ref.at[b, keys, kvh])
    plgpu.copy_smem_to_gmem(v_w, dv_ref.at[b, keys, kvh])
    if sp.count_visits:
        plgpu.copy_smem_to_gmem(s["vis_s"].at[wg], r.visits.at[b, kvh, j * sp.w + wg])
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------------- dQ kernel


def _dq_scratch(sp: _Spec) -> dict:
    t = tiles(sp.dtype)
    h = sp.h
    s = {
        "q_s": plgpu.SMEM((h, sp.bq, sp.d), sp.dtype, transforms=t),  # Q, then dQ
        "do_s": plgpu.SMEM((h, sp.bq, sp.d), sp.dtype, transforms=t),
        "ds_s": plgpu.SMEM((h, sp.bq, sp.bk), sp.dtype, transforms=t),
        "k_s": plgpu.SMEM((2, sp.bk, sp.d), sp.dtype, transforms=t),
        "v_s": plgpu.SMEM((2, sp.bk, sp.d), sp.dtype, transforms=t),
        "lse_s": plgpu.SMEM((h, sp.bq), jnp.float32),
        "delta_s": plgpu.SMEM((h, sp.bq), jnp.float32),
        "qi_s": plgpu.SMEM((h, sp.bq), jnp.int32),
        "ki_s": plgpu.SMEM((2, sp.bk), jnp.int32),
    }
    if sp.has_seg:
        s["qseg_s"] = plgpu.SMEM((h, sp.bq), jnp.int32)
        s["kseg_s"] = plgpu.SMEM((2, sp.bk), jnp.int32)
    if sp.count_visits:
        s["vis_s"] = plgpu.SMEM((h, VISITS_WIDTH), jnp.int32)
    # one arrival per TMA copy that signals the barrier
    s["bar_q"] = plgpu.Barrier(num_arrivals=6 if sp.has_seg else 5, num_barriers=h)
    s["bar_k"] = plgpu.Barrier(num_arrivals=3 if sp.has_seg else 2, num_barriers=2)  # k, ki
    s["bar_v"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)
    s["bar_free"] = plgpu.Barrier(num_arrivals=h, num_barriers=2)  # a slot's H readers are done
    return s


def _dq_load_queries(sp: _Spec, r: _Refs, s, wg, n, i, b):
    rows = pl.ds(i * sp.bq, sp.bq)
    bar = s["bar_q"].at[wg]
    plgpu.copy_gmem_to_smem(r.q.at[b, rows, n], s["q_s"].at[wg], bar)
    plgpu.copy_gmem_to_smem(r.do.at[b, rows, n], s["do_s"].at[wg], bar)
    plgpu.copy_gmem_to_smem(r.lse.at[b, n, rows], s["lse_s"].at[wg], bar)
    plgpu.copy_gmem_to_smem(r.delta.at[b, n, rows], s["delta_s"].at[wg], bar)
    plgpu.copy_gmem_to_smem(r.qi.at[b, rows], s["qi_s"].at[wg], bar)
    if sp.has_seg:
        plgpu.copy_gmem_to_smem(r.qseg.at[b, rows], s["qseg_s"].at[wg], bar)


def _dq_kernel(sp: _Spec, *refs, **s):
    r = _split_refs(sp, 1, refs)
    wg = lax.axis_index("wg") if sp.h > 1 else jnp.int32(0)
    hg, i, b = lax.axis_index("heads"), lax.axis_index("q_block"), lax.axis_index("batch")
    n = hg * sp.h + wg  # this warpgroup's query head
    kvh = lax.div(hg * sp.h, jnp.int32(sp.g))  # the program's kv head
    _dq_load_queries(sp, r, s, wg, n, i, b)
    start = r.start[i]
    count = r.end[i] - start

    def issue(t, slot):  # TMA of the t-th visited key block into `slot` (warpgroup 0 only)
        issue_key_block(r, s, sp.has_seg, b, kvh, r.perm[start + t], sp.bk, slot)

    @pl.when((count > 0) & (wg == 0))
    def _():
        issue(0, 0)

    plgpu.barrier_wait(s["bar_q"].at[wg])
    q_side = (
        s["qi_s"][wg],
        s["qseg_s"][wg] if sp.has_seg else None,
        plgpu.load(s["lse_s"].at[wg], layout=ROW),
        plgpu.load(s["delta_s"].at[wg], layout=ROW),
    )
    body = functools.partial(_dq_step, sp, s, wg, count, issue, q_side)

    def accumulate(dq_ref):
        visits = lax.fori_loop(0, count, functools.partial(body, dq_ref), jnp.int32(0))
        return dq_ref[...], visits

    dq, visits = pl.run_scoped(accumulate, plgpu.ACC((sp.bq, sp.d), jnp.float32))
    _dq_finish(sp, r, s, wg, n, i, b, dq, visits)


def _dq_step(sp: _Spec, s, wg, count, issue, q_side, dq_ref, t, visits):
    """One visited key block: s, p, dp, ds, dQ += ds K."""
    qi_v, qseg_v, lse_v, delta_v = q_side
    slot = lax.rem(t, jnp.int32(2))
    q_w, do_w, ds_w = s["q_s"].at[wg], s["do_s"].at[wg], s["ds_s"].at[wg]
    k_w, v_w = s["k_s"].at[slot], s["v_s"].at[slot]
    plgpu.barrier_wait(s["bar_k"].at[slot])
    shape = (sp.bq, sp.bk)
    s_qk = wgmma_value(q_w, k_w.T, shape) * sp.qk_scale

    # prefetch block t + 1 into the other slot once its H readers released it (block t - 1)
    @pl.when((t + 1 < count) & (wg == 0))
    def _():
        if sp.h > 1:

            @pl.when(t > 0)
            def _():
                plgpu.barrier_wait(s["bar_free"].at[1 - slot])

        issue(t + 1, 1 - slot)

    kseg_v = s["kseg_s"][slot] if sp.has_seg else None
    mask = tile_mask(shape, s["ki_s"][slot], kseg_v, qi_v, qseg_v, k_dim=1)
    p = jnp.where(mask, jnp.exp2(s_qk - lax.broadcast_in_dim(lse_v, shape, [0])), 0.0)
    plgpu.barrier_wait(s["bar_v"].at[slot])
    dp = wgmma_value(do_w, v_w.T, shape)
    ds = p * (dp - lax.broadcast_in_dim(delta_v, shape, [0]))
    ds_w[...] = ds.astype(sp.dtype)
    plgpu.commit_smem()  # the generic-proxy stores, visible to wgmma (the async proxy)
    plgpu.wgmma(dq_ref, ds_w, k_w)
    if sp.h > 1:
        plgpu.wgmma_wait(0)  # this warpgroup's reads of the slot are done
        plgpu.barrier_arrive(s["bar_free"].at[slot])
    return visits + 1


def _dq_finish(sp: _Spec, r: _Refs, s, wg, n, i, b, dq, visits):
    """dQ (times the scale) out through the Q tile; the visits."""
    q_w = s["q_s"].at[wg]
    q_w[...] = (dq * sp.scale).astype(sp.dtype)
    if sp.count_visits:
        store_visits(s["vis_s"].at[wg], visits)
    plgpu.commit_smem()
    (dq_ref,) = r.outs
    plgpu.copy_smem_to_gmem(q_w, dq_ref.at[b, pl.ds(i * sp.bq, sp.bq), n])
    if sp.count_visits:
        plgpu.copy_smem_to_gmem(s["vis_s"].at[wg], r.visits.at[b, n, i])
    plgpu.wait_smem_to_gmem(0)


# ------------------------------------------------------------------------------------- entry


def _check(q_bsnd, k_btkd, v_btkd, do_bsnd, lse_bns, masks: Masks, config: MosaicConfig):
    b, s_len, n, d = q_bsnd.shape
    t_len, k = k_btkd.shape[1], k_btkd.shape[2]
    if masks.qi_bs.shape != (b, s_len) or masks.ki_bt.shape != (b, t_len):
        raise ValueError("backward takes arrays padded to whole blocks (the masks' shapes)")
    if config.block_q != 64 or config.block_k not in (64, 128):
        raise ValueError(f"the backward kernels take block_q = 64, block_k 64 or 128: {config}")
    if s_len % config.block_q or t_len % config.block_k or n % k:
        raise ValueError(f"S={s_len}, T={t_len} whole blocks and K={k} dividing N={n}")
    if v_btkd.shape != k_btkd.shape or do_bsnd.shape != q_bsnd.shape:
        raise ValueError("v shaped like k, do like q")
    check_head_dim(d)
    for name, x in (("q", q_bsnd), ("k", k_btkd), ("v", v_btkd), ("do", do_bsnd)):
        check_dtype(name, x.dtype)
        if x.dtype != q_bsnd.dtype:
            raise ValueError(f"{name}: {x.dtype}, q: {q_bsnd.dtype} (one dtype for all)")
    if lse_bns.shape != (b, n, s_len):
        raise ValueError(f"lse [B, N, S] = {(b, n, s_len)}, got {lse_bns.shape}")


def _mask_args(masks: Masks):
    i32 = lambda x: x.astype(jnp.int32)
    args = [i32(masks.qi_bs), i32(masks.ki_bt)]
    if masks.qseg_bs is not None:
        args += [i32(masks.qseg_bs), i32(masks.kseg_bt)]
    return args


def _call(sp: _Spec, kernel, scratch, out_type, grid, grid_names, interpret, h=1):
    return plgpu.kernel(
        functools.partial(kernel, sp),
        kernel_name=f"attention_bwd{kernel.__name__.removesuffix('_kernel')}",
        out_type=tuple(out_type),
        grid=grid,
        grid_names=grid_names,
        num_threads=h if h > 1 else None,
        thread_name="wg" if h > 1 else None,
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )


def backward(
    q_bsnd,
    k_btkd,
    v_btkd,
    o_bsnd,
    lse_bns,
    do_bsnd,
    masks: Masks,
    *,
    scale,
    config: MosaicConfig,
    interpret,
    count_visits=False,
):
    """(dq [B, S, N, D], dk [B, T, K, D], dv [B, T, K, D]) in the inputs' dtypes, on padded
    arrays; with `count_visits` also int32 visits: dq_visits [B, N, S // block_q] (key blocks
    each (row, query head, query block) visited) and dkv_visits [B, K, T // 64] ((query head,
    query block) steps of each (row, kv head, 64 keys: one warpgroup's): G times the number of
    query blocks its key block visits)."""
    _check(q_bsnd, k_btkd, v_btkd, do_bsnd, lse_bns, masks, config)
    b, s_len, n, d = q_bsnd.shape
    t_len, k = k_btkd.shape[1], k_btkd.shape[2]
    nq, nk = s_len // config.block_q, t_len // config.block_k
    g = n // k
    # block_k = 128: [64, 128] f32 s, p, dp and ds fill one warpgroup's registers (255 per
    # thread), and two warpgroups' tiles overflow SMEM at D = 128: one query head per program
    h = heads_per_program(config, g) if config.block_k == KEYS_PER_WG else 1
    sp = _Spec(
        g,
        h,
        config.block_k // KEYS_PER_WG,
        d,
        config.block_q,
        config.block_k,
        q_bsnd.dtype,
        masks.qseg_bs is not None,
        count_visits,
        float(scale) * LOG2E,
        float(scale),
    )
    f32 = jnp.float32
    delta_bns = jnp.einsum("bsnd,bsnd->bns", o_bsnd.astype(f32), do_bsnd.astype(f32))
    lse2_bns = lse_bns.astype(f32) * LOG2E  # log2 units (-inf stays -inf)
    i32 = lambda x: x.astype(jnp.int32)
    args = [q_bsnd, k_btkd, v_btkd, do_bsnd, lse2_bns, delta_bns, *_mask_args(masks)]
    sds = jax.ShapeDtypeStruct
    vis = lambda heads, blocks: [sds((b, heads, blocks, VISITS_WIDTH), jnp.int32)]

    dq_out = [sds(q_bsnd.shape, q_bsnd.dtype)] + (vis(n, nq) if count_visits else [])
    dq_call = _call(
        sp,
        _dq_kernel,
        _dq_scratch(sp),
        dq_out,
        (n // h, nq, b),
        ("heads", "q_block", "batch"),
        interpret,
        h,
    )
    dq_res = dq_call(*args, *map(i32, masks.keys))

    kv = sds(k_btkd.shape, k_btkd.dtype)
    dkv_out = [kv, kv] + (vis(k, nk * sp.w) if count_visits else [])
    dkv_call = _call(
        sp,
        _dkv_kernel,
        _dkv_scratch(sp),
        dkv_out,
        (k, nk, b),
        ("kv_heads", "k_block", "batch"),
        interpret,
        sp.w,
    )
    dkv_res = dkv_call(*args, *map(i32, masks.queries))
    grads = (dq_res[0], dkv_res[0], dkv_res[1])
    if count_visits:
        return (*grads, dq_res[1][..., 0], dkv_res[2][..., 0])
    return grads
