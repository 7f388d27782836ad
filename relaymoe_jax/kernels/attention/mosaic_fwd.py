"""Flash-attention forward as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma, mbarriers).

`forward` takes q [B, S, N, D] and k/v [B, T, K, D] (bf16 or f16, S and T whole blocks, K
divides N: query head n reads kv head n // (N // K)) with the `Masks` of `common.prepare_masks`,
and returns o [B, S, N, D] (q's dtype) and lse [B, N, S] (float32, natural log); padded or
otherwise fully masked query rows give o = 0 and lse = EMPTY_LSE (-inf).

Grid (N // H, S // block_q, B), H = heads_per_program (clipped to a divisor of N // K): a program
holds one query block of H query heads of one kv group, one warpgroup per head, sharing the K/V
tiles. Warpgroup 0 streams the key blocks `masks.keys.perm[start[i]:end[i]]` (query block i's
range, `common.Masks`: the block numbers read one by one as scalars from GPU memory, a
`fori_loop` with a traced trip count, so wholly masked key blocks are never loaded nor computed,
whatever the order of the tokens) through two SMEM slots by TMA; each
warpgroup waits on the slot's barrier, computes S = Q K^T by wgmma into an f32 accumulator, masks
it elementwise (`ki[t] <= qi[q]`, and `kseg[t] == qseg[q]` when there are segment ids), runs the
online softmax in f32 (log2 units; masked entries get p = 0 explicitly), writes P (16-bit) to SMEM
and adds P V (wgmma) to its f32 accumulator, then arrives on the slot's "free" barrier (H
arrivals) that warpgroup 0 waits on before refilling the slot. O goes out through the Q tile.

The interpreter (plgpu.InterpretGPUParams, which CI runs on CPU) shaped the code: `plgpu.kernel`
(pallas_call with BlockSpecs fails there), accumulators only through `pl.run_scoped(f,
plgpu.ACC)`, P through SMEM (wgmma with A in registers fails there), TMA barriers counting every
copy that signals them, H <= 2 warpgroups in CI (4 hung at times). Visits (`count_visits`): each
warpgroup counts its loop's iterations and stores the count as a 128-wide int32 splat (the
smallest splat Mosaic GPU stores besides one element) through SMEM and TMA.
"""

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.kernels.attention.common import EMPTY_LSE, Masks
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

NEG = -1e30  # the running max's start: finite, so exp2(NEG - NEG) is no NaN (p is masked anyway)


class _Spec(NamedTuple):
    """The static shape of one forward kernel."""

    n: int  # query heads
    g: int  # query heads per kv head
    h: int  # query heads (warpgroups) per program
    d: int
    bq: int
    bk: int
    dtype: object
    has_seg: bool
    count_visits: bool
    qk_scale: float  # softmax scale times log2(e)


def _scratch(sp: _Spec) -> dict:
    t = tiles(sp.dtype)
    h = sp.h
    s = {
        "q_s": plgpu.SMEM((h, sp.bq, sp.d), sp.dtype, transforms=t),  # Q, then O
        "k_s": plgpu.SMEM((2, sp.bk, sp.d), sp.dtype, transforms=t),
        "v_s": plgpu.SMEM((2, sp.bk, sp.d), sp.dtype, transforms=t),
        "p_s": plgpu.SMEM((h, sp.bq, sp.bk), sp.dtype, transforms=t),
        "lse_s": plgpu.SMEM((h, sp.bq), jnp.float32),
        "qi_s": plgpu.SMEM((h, sp.bq), jnp.int32),
        "ki_s": plgpu.SMEM((2, sp.bk), jnp.int32),
    }
    if sp.has_seg:
        s["qseg_s"] = plgpu.SMEM((h, sp.bq), jnp.int32)
        s["kseg_s"] = plgpu.SMEM((2, sp.bk), jnp.int32)
    if sp.count_visits:
        s["vis_s"] = plgpu.SMEM((h, VISITS_WIDTH), jnp.int32)
    # one arrival per TMA copy that signals the barrier
    s["bar_q"] = plgpu.Barrier(num_arrivals=3 if sp.has_seg else 2, num_barriers=h)
    s["bar_k"] = plgpu.Barrier(num_arrivals=3 if sp.has_seg else 2, num_barriers=2)
    s["bar_v"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)
    s["bar_free"] = plgpu.Barrier(num_arrivals=h, num_barriers=2)  # a slot's H readers are done
    return s


class _Refs(NamedTuple):
    q: object
    k: object
    v: object
    qi: object
    ki: object
    qseg: object
    kseg: object
    perm: object  # the key blocks in visiting order [nk]
    start: object  # query block i visits perm[start[i]:end[i]] ([nq] each)
    end: object
    o: object
    lse: object
    visits: object


def _split_refs(sp: _Spec, refs) -> _Refs:
    refs = list(refs)
    q, k, v, qi, ki = refs[:5]
    rest = refs[5:]
    qseg = kseg = visits = None
    if sp.has_seg:
        qseg, kseg, *rest = rest
    perm, start, end, o, lse, *rest = rest
    if sp.count_visits:
        (visits,) = rest
    return _Refs(q, k, v, qi, ki, qseg, kseg, perm, start, end, o, lse, visits)


def _kernel(sp: _Spec, *refs, **s):
    r = _split_refs(sp, refs)
    wg = lax.axis_index("wg") if sp.h > 1 else jnp.int32(0)
    hg, i, b = lax.axis_index("heads"), lax.axis_index("q_block"), lax.axis_index("batch")
    n = hg * sp.h + wg  # this warpgroup's query head
    kvh = lax.div(hg * sp.h, jnp.int32(sp.g))  # the program's kv head
    q0 = i * sp.bq
    q_w = s["q_s"].at[wg]
    rows = pl.ds(q0, sp.bq)

    plgpu.copy_gmem_to_smem(r.q.at[b, rows, n], q_w, s["bar_q"].at[wg])
    plgpu.copy_gmem_to_smem(r.qi.at[b, rows], s["qi_s"].at[wg], s["bar_q"].at[wg])
    if sp.has_seg:
        plgpu.copy_gmem_to_smem(r.qseg.at[b, rows], s["qseg_s"].at[wg], s["bar_q"].at[wg])
    start = r.start[i]
    count = r.end[i] - start

    def issue(t, slot):  # TMA of the t-th visited key block into `slot` (warpgroup 0 only)
        issue_key_block(r, s, sp.has_seg, b, kvh, r.perm[start + t], sp.bk, slot)

    @pl.when((count > 0) & (wg == 0))
    def _():
        issue(0, 0)

    plgpu.barrier_wait(s["bar_q"].at[wg])
    qi_v = s["qi_s"][wg]
    qseg_v = s["qseg_s"][wg] if sp.has_seg else None
    body = functools.partial(_step, sp, s, wg, count, issue, qi_v, qseg_v)
    acc = plgpu.layout_cast(jnp.zeros((sp.bq, sp.d), jnp.float32), plgpu.Layout.WGMMA)
    row = plgpu.Layout.WGMMA.reduce(1)
    m_i = plgpu.layout_cast(jnp.full((sp.bq,), NEG, jnp.float32), row)
    l_i = plgpu.layout_cast(jnp.zeros((sp.bq,), jnp.float32), row)
    acc, m_i, l_i, visits = lax.fori_loop(0, count, body, (acc, m_i, l_i, jnp.int32(0)))
    _finish(sp, r, s, wg, b, n, i, acc, m_i, l_i, visits)


def _step(sp: _Spec, s, wg, count, issue, qi_v, qseg_v, t, carry):
    """One visited key block: S = Q K^T, mask, online softmax, O += P V."""
    acc, m_i, l_i, visits = carry
    slot = lax.rem(t, jnp.int32(2))
    q_w, p_w = s["q_s"].at[wg], s["p_s"].at[wg]
    plgpu.barrier_wait(s["bar_k"].at[slot])

    s_qk = wgmma_value(q_w, s["k_s"].at[slot].T, (sp.bq, sp.bk)) * sp.qk_scale

    # prefetch block t + 1 into the other slot once its H readers released it (block t - 1)
    @pl.when((t + 1 < count) & (wg == 0))
    def _():
        if sp.h > 1:

            @pl.when(t > 0)
            def _():
                plgpu.barrier_wait(s["bar_free"].at[1 - slot])

        issue(t + 1, 1 - slot)

    shape = (sp.bq, sp.bk)
    kseg_v = s["kseg_s"][slot] if sp.has_seg else None
    mask = tile_mask(shape, s["ki_s"][slot], kseg_v, qi_v, qseg_v, k_dim=1)
    s_qk = jnp.where(mask, s_qk, NEG)
    m_new = jnp.maximum(m_i, s_qk.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s_qk - lax.broadcast_in_dim(m_new, shape, [0]))
    p = jnp.where(mask, p, 0.0)
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p_w[...] = p.astype(sp.dtype)
    plgpu.commit_smem()  # the generic-proxy stores of P, visible to wgmma (the async proxy)
    plgpu.barrier_wait(s["bar_v"].at[slot])

    acc = acc + wgmma_value(p_w, s["v_s"].at[slot], (sp.bq, sp.d))
    if sp.h > 1:
        plgpu.barrier_arrive(s["bar_free"].at[slot])
    return acc, m_new, l_i, visits + 1


def _finish(sp: _Spec, r: _Refs, s, wg, b, n, i, acc, m_i, l_i, visits):
    """O = acc / l through the Q tile, lse = m + log l (EMPTY_LSE where l = 0), visits."""
    q_w, lse_w = s["q_s"].at[wg], s["lse_s"].at[wg]
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    q_w[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(sp.dtype)
    lse_w[...] = jnp.where(empty, EMPTY_LSE, (m_i + jnp.log2(l_safe)) * (1.0 / LOG2E))
    if sp.count_visits:
        vis_w = s["vis_s"].at[wg]
        store_visits(vis_w, visits)
    plgpu.commit_smem()
    rows = pl.ds(i * sp.bq, sp.bq)
    plgpu.copy_smem_to_gmem(q_w, r.o.at[b, rows, n])
    plgpu.copy_smem_to_gmem(lse_w, r.lse.at[b, n, rows])
    if sp.count_visits:
        plgpu.copy_smem_to_gmem(vis_w, r.visits.at[b, n, i])
    plgpu.wait_smem_to_gmem(0)


def forward(q_bsnd, k_btkd, v_btkd, masks: Masks, *, scale, config, interpret, count_visits=False):
    """(o [B, S, N, D], lse [B, N, S] f32) and, with `count_visits`, int32 visits [B, N, S //
    block_q] (key blocks each (row, query head, query block) visited), on padded arrays."""
    b, s_len, n, d = q_bsnd.shape
    t_len, k = k_btkd.shape[1], k_btkd.shape[2]
    assert masks.qi_bs.shape == (b, s_len) and masks.ki_bt.shape == (b, t_len), "pad first"
    assert config.block_q == 64, "one wgmma M tile of 64 rows per warpgroup"
    assert s_len % config.block_q == 0 and t_len % config.block_k == 0
    h = heads_per_program(config, n // k)
    nq = s_len // config.block_q
    has_seg = masks.qseg_bs is not None
    sp = _Spec(
        n,
        n // k,
        h,
        d,
        config.block_q,
        config.block_k,
        q_bsnd.dtype,
        has_seg,
        count_visits,
        float(scale) * LOG2E,
    )
    out_type = [
        jax.ShapeDtypeStruct((b, s_len, n, d), q_bsnd.dtype),
        jax.ShapeDtypeStruct((b, n, s_len), jnp.float32),
    ]
    if count_visits:
        out_type.append(jax.ShapeDtypeStruct((b, n, nq, VISITS_WIDTH), jnp.int32))

    def flash_fwd(*refs, **scratch):  # the kernel's name in the HLO's op_name
        _kernel(sp, *refs, **scratch)

    call = plgpu.kernel(
        flash_fwd,
        out_type=tuple(out_type),
        grid=(n // h, nq, b),
        grid_names=("heads", "q_block", "batch"),
        num_threads=h if h > 1 else None,
        thread_name="wg" if h > 1 else None,
        scratch_types=_scratch(sp),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )
    i32 = lambda x: x.astype(jnp.int32)
    args = [q_bsnd, k_btkd, v_btkd, i32(masks.qi_bs), i32(masks.ki_bt)]
    if has_seg:
        args += [i32(masks.qseg_bs), i32(masks.kseg_bt)]
    args += [i32(x) for x in masks.keys]  # perm, start, end
    out = call(*args)
    if count_visits:
        return out[0], out[1], out[2][..., 0]
    return out[0], out[1]
