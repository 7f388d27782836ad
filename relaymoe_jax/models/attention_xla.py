"""The chunked attention's XLA core: a `custom_vjp` over query blocks x key blocks that computes
only the pairs of blocks the block test of `kernels/attention/blocks.py` passes, forward and
backward.

Forward: a scan over query blocks; for each, a `fori_loop` over its key blocks only (its range
`perm[start_i:end_i]` of the key blocks sorted by smallest index, `blocks.key_ranges`: O(nq + nk)
int32, built from the indices as data), each updating the block's online softmax
(running max m, sum l, accumulator acc, all float32):
    s = scale * q_i k_j^T (masked elementwise: causal, same segment)
    m' = max(m, rowmax s);  p = exp(s - m');  l' = l e^(m - m') + rowsum p
    acc' = acc e^(m - m') + p v_j
and o_i = acc / l, lse_i = m + log l.
Backward: a scan over key blocks; for each, a `fori_loop` over the query blocks that see it
(its range of the query blocks sorted by largest index, `blocks.query_ranges`), which
recomputes p = exp(s - lse) and, with delta = rowsum(do * o):
    dv_j += p^T do;  dp = do v_j^T;  ds = p (dp - delta)
    dk_j += scale ds^T q_i;  dq_i += scale ds k_j
dk_j and dv_j are the inner loop's carry; dq ([B, S, N, D] float32) is the outer scan's carry,
updated one query block at a time.

Loops, not `lax.cond`: inside a differentiated layer scan, JAX's partial evaluation gave a cond
per pair residuals of its own (every pair's [B, block_q, N, block_k] scores, stacked over both
block loops: 16 GiB buffers at 32,768 tokens per device); a `fori_loop` with a traced trip
count is a while loop, which partial evaluation keeps whole.

The FLOPs are those of the visited pairs: causal about half of S_q x S_k (the diagonal blocks
partly masked), and with documents only the blocks that share one. Temporaries are a few
[B, block_q, N, block_k] float32 blocks; residuals are q, k, v, o and the float32 log-sum-exp
[B, S, K, G] (`K` kv heads, `G = N // K` query heads per kv head), which the forward names
"attn_out" and "attn_lse" for the remat policies.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from relaymoe_jax.kernels.attention.blocks import (
    PAD_KEY,
    PAD_KEY_SEG,
    PAD_QUERY,
    PAD_QUERY_SEG,
    blocks,
    key_ranges,
    pair_mask,
    query_ranges,
    unblocks,
)
from relaymoe_jax.util.late import late_zero
from relaymoe_jax.util.typed import sharded_like, varying_like

F32 = jnp.float32
NEG = -1e30  # finite "minus infinity": masked scores never make inf - inf = NaN


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def attention(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, block_q, block_k, scale):
    """o [B, S, N, D] in q's dtype. q [B, S, N, D], k and v [B, T, K, D]; qi [B, S] and ki
    [B, T] int32 token indices; qseg [B, S] and kseg [B, T] int32 segment ids, or both None;
    `block_q`, `block_k` and `scale` static Python numbers."""
    args = (q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt)
    return forward(*args, block_q, block_k, scale)[0]


def _attention_fwd(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, block_q, block_k, scale):
    o_bsnd, lse_bskg, _ = forward(
        q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, block_q, block_k, scale
    )
    o_bsnd, lse_bskg = checkpoint_name(o_bsnd, "attn_out"), checkpoint_name(lse_bskg, "attn_lse")
    return o_bsnd, (q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, o_bsnd, lse_bskg)


def _group(x_bsnd, kv_heads):
    """[B, S, N, D] -> [B, S, K, G, D]: the G = N // K query heads that share one kv head."""
    b, s, n, d = x_bsnd.shape
    return x_bsnd.reshape(b, s, kv_heads, n // kv_heads, d)


def _zeros_like(x):
    """float32 zeros shaped and sharded like `x`, made once `x` exists (`late_zero`;
    `jnp.zeros_like` would drop an Explicit sharding outside a `jax.set_mesh` context)."""
    return jnp.where(True, late_zero(jnp.asarray(0.0, F32), x), x.astype(F32))


def _key_side(k_btkd, v_btkd, ki_bt, kseg_bt, block_k):
    """The key blocks: k, v [nk, B, bk, K, D], indices and segment ids [nk, B, bk]."""
    kseg = None if kseg_bt is None else blocks(kseg_bt, block_k, PAD_KEY_SEG)
    return (
        blocks(k_btkd, block_k, 0),
        blocks(v_btkd, block_k, 0),
        blocks(ki_bt, block_k, PAD_KEY),
        kseg,
    )


def _query_side(qi_bs, qseg_bs, block_q):
    qseg = None if qseg_bs is None else blocks(qseg_bs, block_q, PAD_QUERY_SEG)
    return blocks(qi_bs, block_q, PAD_QUERY), qseg


def _scores(q_bqkgd, k_btkd, mask_bqt, scale):
    """Masked scaled scores [B, bq, K, G, bk] in float32 (masked ones are NEG)."""
    s_bqkgt = jnp.einsum("bqkgd,btkd->bqkgt", q_bqkgd, k_btkd, preferred_element_type=F32)
    return jnp.where(mask_bqt[:, :, None, None, :], s_bqkgt * scale, NEG)


def forward(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, block_q, block_k, scale):
    """o [B, S, N, D], lse [B, S, K, G] (float32) over the visible block pairs, and the number
    of pairs visited (int32: each loop step counts itself)."""
    b, s, n, d = q_bsnd.shape
    q_ibqkgd = blocks(_group(q_bsnd, k_btkd.shape[2]), block_q, 0)
    qi_ibq, qseg_ibq = _query_side(qi_bs, qseg_bs, block_q)
    k_jbtkd, v_jbtkd, ki_jbt, kseg_jbt = _key_side(k_btkd, v_btkd, ki_bt, kseg_bt, block_k)
    keys = key_ranges(qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, anchor=k_jbtkd)

    def q_block(visits, xs):
        start, end, q_bqkgd, qi_bq, qseg_bq = xs

        def visit(t, carry):
            m_bqkg, l_bqkg, acc_bqkgd, visits = carry
            j = keys.perm[t]
            k_btkd, v_btkd, ki_bt = k_jbtkd[j], v_jbtkd[j], ki_jbt[j]
            kseg_bt = None if kseg_jbt is None else kseg_jbt[j]
            mask_bqt = pair_mask(qi_bq, ki_bt, qseg_bq, kseg_bt, anchor=k_btkd)
            s_bqkgt = _scores(q_bqkgd, k_btkd, mask_bqt, scale)
            m_new = jnp.maximum(m_bqkg, s_bqkgt.max(-1))
            p_bqkgt = jnp.where(
                mask_bqt[:, :, None, None, :], jnp.exp(s_bqkgt - m_new[..., None]), 0.0
            )
            corr_bqkg = jnp.exp(m_bqkg - m_new)
            pv_bqkgd = jnp.einsum(
                "bqkgt,btkd->bqkgd",
                p_bqkgt.astype(v_btkd.dtype),
                v_btkd,
                preferred_element_type=F32,
            )
            l_new = l_bqkg * corr_bqkg + p_bqkgt.sum(-1)
            return m_new, l_new, acc_bqkgd * corr_bqkg[..., None] + pv_bqkgd, visits + 1

        stat_bqkg = q_bqkgd[..., 0]
        init = (_zeros_like(stat_bqkg) + NEG, _zeros_like(stat_bqkg), _zeros_like(q_bqkgd))
        m_bqkg, l_bqkg, acc_bqkgd, visits = lax.fori_loop(start, end, visit, (*init, visits))
        seen_bqkg = l_bqkg > 0  # a query that sees no key (padding) gets o = 0
        l_safe = jnp.where(seen_bqkg, l_bqkg, 1.0)
        o_bqkgd = (acc_bqkgd / l_safe[..., None]).astype(q_bsnd.dtype)
        return visits, (o_bqkgd, jnp.where(seen_bqkg, m_bqkg + jnp.log(l_safe), NEG))

    xs = (keys.start, keys.end, q_ibqkgd, qi_ibq, qseg_ibq)
    visits, (o_ibqkgd, lse_ibqkg) = lax.scan(q_block, jnp.int32(0), xs)
    return unblocks(o_ibqkgd, s).reshape(b, s, n, d), unblocks(lse_ibqkg, s), visits


def _attention_bwd(block_q, block_k, scale, res, do_bsnd):
    return backward(block_q, block_k, scale, res, do_bsnd)[0]


def backward(block_q, block_k, scale, res, do_bsnd):
    """The cotangents of q, k, v (and None for the indices and segment ids), and the number of
    block pairs visited."""
    q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, o_bsnd, lse_bskg = res
    b, s, n, d = q_bsnd.shape
    t, kv = k_btkd.shape[1], k_btkd.shape[2]
    q_bskgd, do_bskgd = _group(q_bsnd, kv), _group(do_bsnd.astype(q_bsnd.dtype), kv)
    delta_bskg = jnp.sum(do_bskgd.astype(F32) * _group(o_bsnd, kv).astype(F32), axis=-1)
    q_ibqkgd, do_ibqkgd = blocks(q_bskgd, block_q, 0), blocks(do_bskgd, block_q, 0)
    lse_ibqkg, delta_ibqkg = blocks(lse_bskg, block_q, 0), blocks(delta_bskg, block_q, 0)
    qi_ibq, qseg_ibq = _query_side(qi_bs, qseg_bs, block_q)
    k_jbtkd, v_jbtkd, ki_jbt, kseg_jbt = _key_side(k_btkd, v_btkd, ki_bt, kseg_bt, block_k)
    queries = query_ranges(qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, anchor=k_jbtkd)

    def k_block(carry_k, xs):
        dq_ibqkgd, visits = carry_k
        start, end, k_btkd, v_btkd, ki_bt, kseg_bt = xs

        def visit(u, carry):
            dq_ibqkgd, dk_btkd, dv_btkd, visits = carry
            i = queries.perm[u]
            q_bqkgd, do_bqkgd, qi_bq = q_ibqkgd[i], do_ibqkgd[i], qi_ibq[i]
            lse_bqkg, delta_bqkg = lse_ibqkg[i], delta_ibqkg[i]
            qseg_bq = None if qseg_ibq is None else qseg_ibq[i]
            mask_bqt = pair_mask(qi_bq, ki_bt, qseg_bq, kseg_bt, anchor=k_btkd)
            s_bqkgt = _scores(q_bqkgd, k_btkd, mask_bqt, scale)
            p_bqkgt = jnp.where(
                mask_bqt[:, :, None, None, :], jnp.exp(s_bqkgt - lse_bqkg[..., None]), 0.0
            )
            dv_btkd = dv_btkd + jnp.einsum(
                "bqkgt,bqkgd->btkd",
                p_bqkgt.astype(do_bqkgd.dtype),
                do_bqkgd,
                preferred_element_type=F32,
            )
            dp_bqkgt = jnp.einsum("bqkgd,btkd->bqkgt", do_bqkgd, v_btkd, preferred_element_type=F32)
            ds_bqkgt = (p_bqkgt * (dp_bqkgt - delta_bqkg[..., None])).astype(q_bqkgd.dtype)
            dq_bqkgd = scale * jnp.einsum(
                "bqkgt,btkd->bqkgd", ds_bqkgt, k_btkd, preferred_element_type=F32
            )
            dk_btkd = dk_btkd + scale * jnp.einsum(
                "bqkgt,bqkgd->btkd", ds_bqkgt, q_bqkgd, preferred_element_type=F32
            )
            return dq_ibqkgd.at[i].add(dq_bqkgd), dk_btkd, dv_btkd, visits + 1

        zero_k = varying_like(_zeros_like(k_btkd), q_ibqkgd, k_btkd)
        zero_v = varying_like(_zeros_like(v_btkd), q_ibqkgd, v_btkd)
        init = (dq_ibqkgd, zero_k, zero_v, visits)
        dq_ibqkgd, dk_btkd, dv_btkd, visits = lax.fori_loop(start, end, visit, init)
        return (dq_ibqkgd, visits), (dk_btkd.astype(k_btkd.dtype), dv_btkd.astype(v_btkd.dtype))

    xs_k = (queries.start, queries.end, k_jbtkd, v_jbtkd, ki_jbt, kseg_jbt)
    init = (_zeros_like(q_ibqkgd), jnp.int32(0))
    (dq_ibqkgd, visits), (dk_jbtkd, dv_jbtkd) = lax.scan(k_block, init, xs_k)
    dq_bsnd = unblocks(dq_ibqkgd, s).astype(q_bsnd.dtype).reshape(b, s, n, d)
    dk_btkd, dv_btkd = unblocks(dk_jbtkd, t), unblocks(dv_jbtkd, t)
    dq_bsnd, dk_btkd, dv_btkd = map(sharded_like, (dq_bsnd, dk_btkd, dv_btkd), res[:3])
    grads = (dq_bsnd, dk_btkd, dv_btkd, None, None, None, None)
    return grads, visits


attention.defvjp(_attention_fwd, _attention_bwd)
