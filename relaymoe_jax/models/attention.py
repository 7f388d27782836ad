"""Memory-efficient causal grouped-query attention for long sequences, in pure JAX.

`chunked_causal_attention(q_bsnd, k_bskd, v_bskd, block_k=512)` equals
`jax.nn.dot_product_attention(q, k, v, is_causal=True)` (N query heads, K kv heads, K divides N,
query head n reads kv head n // (N // K)) without ever building the [B, N, S, S] scores.

Forward: one `lax.scan` over key blocks of `block_k` keys; every step takes all S queries at once
and updates an online softmax: a running max m, a running sum l and an output accumulator acc,
all float32:
    s = scale * q k_j^T (masked: query i sees key j only if j <= i)
    m' = max(m, rowmax s);  p = exp(s - m');  l' = l e^(m - m') + rowsum p
    acc' = acc e^(m - m') + p v_j
and finally o = acc / l, lse = m + log l.
Backward (a `jax.custom_vjp`): a second scan over the same key blocks recomputes
p = exp(s - lse) per block, with delta = rowsum(do * o):
    dv_j = p^T do;  dp = do v_j^T;  ds = p (dp - delta)
    dq += scale ds k_j (carried, float32);  dk_j = scale ds^T q (a scan output)
where dk_j and dv_j sum over the query heads of each kv group.

Memory. Residuals kept between forward and backward: q, k, v, o and lse [B, S, N] float32,
nothing of size S x S. The forward names o and lse "attn_out" and "attn_lse"
(`checkpoint_name`): under a `jax.checkpoint` policy that saves both, the backward starts from
them; otherwise the forward scan runs again in the backward to rebuild them. Each scan step
holds a few [B, S, N, block_k] float32 blocks (scores, probabilities and in the backward their
gradients), so the temporaries are O(S * block_k) per head, plus the float32 carries (acc or dq,
[B, S, N, D]) and dk, dv.
All queries are processed against every key block (masked), so it does the full S^2 FLOPs,
twice the causal minimum; it trades FLOPs for simplicity, not for memory.

Packed sequences. With `segment_ids` [B, S] (int; documents packed into one row, e.g. 1, 1, 2, 2,
2, 0 for padding), query i also sees key j only if segment_ids[i] == segment_ids[j]: attention
stays inside a document. The ids travel with the keys in blocks, like k and v, and get no
gradient. Without them the program is the plain causal one.

Sequence length. S need not be a multiple of `block_k`: the keys and values are padded with zeros
to one internally, and the padded keys sit at positions >= S, which the causal mask already hides
from every query (their probability is exactly zero). Queries are never padded. `block_k` >= S
means a single block of S keys.

Sharding. It works on global arrays, with Explicit (or Auto) mesh axes, e.g. the model's context
parallel layout: q sharded along S, k and v replicated along S. The contractions over the query
positions (dk, dv) are given the sharding of k and v as `out_sharding`, since an Explicit mesh
asks for it when the contracted axis is sharded. k and v must not be sharded along S (they are
cut into key blocks). The head axes may be sharded too (tensor parallel; checked with N=8, K=4 on a
2-way axis), as long as the [N] -> [K, N // K] reshape keeps the sharding on K.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from relaymoe_jax.util.late import late_zero

F32 = jnp.float32
NEG = -1e30  # finite "minus infinity": masked scores never make inf - inf = NaN


def chunked_causal_attention(
    q_bsnd, k_bskd, v_bskd, *, block_k: int = 512, scale=None, segment_ids=None, kv_segment_ids=None
):
    """Causal GQA attention o [B, S, N, D] in the inputs' dtype, blockwise over `block_k` keys.

    q [B, S, N, D], k and v [B, S, K, D] with K dividing N; `scale` defaults to D**-0.5;
    `segment_ids` [B, S] int, optional: attention within equal ids only (packed documents);
    `kv_segment_ids` the same ids sharded like the keys where they are not like the queries
    (context parallelism: the queries' sequence sharded, the keys' gathered), default
    `segment_ids`.
    Softmax statistics and accumulators are float32. Differentiable (custom VJP; the backward
    recomputes the probabilities block by block).
    """
    seg_bs = seg_kv = None
    if segment_ids is not None:
        b, s = q_bsnd.shape[:2]
        seg_bs = check_segment_ids(segment_ids, (b, s))
        seg_kv = check_segment_ids(
            segment_ids if kv_segment_ids is None else kv_segment_ids, (b, s)
        )
    return blockwise_attention(
        q_bsnd, k_bskd, v_bskd, block_k=block_k, scale=scale, seg_bs=seg_bs, seg_kv=seg_kv
    )


def blockwise_attention(q_bsnd, k_bskd, v_bskd, *, block_k: int, scale, seg_bs, seg_kv):
    """`chunked_causal_attention` on segment ids already checked (`check_segment_ids`: int32
    [B, S] for the queries and the keys, or both None): what the model calls in every layer,
    having checked its segment ids once at its entry."""
    b, s, n, d = q_bsnd.shape
    if k_bskd.shape != v_bskd.shape or k_bskd.shape[:2] != (b, s) or k_bskd.shape[3] != d:
        raise ValueError(
            f"k {k_bskd.shape} and v {v_bskd.shape} must be [B, S, K, D] with "
            f"B, S, D of q {q_bsnd.shape}"
        )
    if n % k_bskd.shape[2]:
        raise ValueError(f"kv heads {k_bskd.shape[2]} must divide query heads {n}")
    if block_k < 1:
        raise ValueError(f"block_k must be positive, got {block_k}")
    scale = d**-0.5 if scale is None else float(scale)
    return _attention(q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, min(block_k, s), scale)


def check_per_token(name: str, a, shape):
    """`a`, one integer per token (segment ids, positions), as int32 [B, S]: a ValueError names
    another shape or a non-integer dtype (a float would be truncated)."""
    got = getattr(a, "shape", None)
    if got is None or tuple(got) != tuple(shape):
        raise ValueError(f"{name}: shape {got}, expected [batch, seq] = {tuple(shape)}")
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer dtype, got {a.dtype}")
    return a.astype(jnp.int32)


def check_segment_ids(segment_ids, shape):
    """`segment_ids` as int32 [B, S] (`check_per_token`)."""
    return check_per_token("segment_ids", segment_ids, shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, block_k, scale):
    """The custom-VJP core; `block_k` (<= S) and `scale` are static Python numbers; `seg_bs`
    and `seg_kv` the segment ids on the queries' and the keys' sharding, or None."""
    return _forward(q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, block_k, scale)[0]


def _attention_fwd(q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, block_k, scale):
    """Forward pass saving q, k, v, the segment ids, o and lse only."""
    o_bsnd, lse_bskg = _forward(q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, block_k, scale)
    o_bsnd, lse_bskg = checkpoint_name(o_bsnd, "attn_out"), checkpoint_name(lse_bskg, "attn_lse")
    return o_bsnd, (q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, o_bsnd, lse_bskg)


def _group(x_bsnd, kv_heads):
    """[B, S, N, D] -> [B, S, K, G, D]: the G = N // K query heads that share one kv head."""
    b, s, n, d = x_bsnd.shape
    return x_bsnd.reshape(b, s, kv_heads, n // kv_heads, d)


def _to_blocks(x_bskd, block_k):
    """[B, S, K, D] -> [S_pad / block_k, B, block_k, K, D], zero-padding S to a multiple."""
    b, s, kv, d = x_bskd.shape
    pad = -s % block_k
    if pad:
        x_bskd = jnp.pad(x_bskd, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x_bskd.reshape(b, (s + pad) // block_k, block_k, kv, d).transpose(1, 0, 2, 3, 4)


def _seg_blocks(seg_bs, block_k):
    """Segment ids [B, S] -> [S_pad / block_k, B, block_k] (padded with -1), or None."""
    if seg_bs is None:
        return None
    b, s = seg_bs.shape
    pad = -s % block_k
    if pad:
        seg_bs = jnp.pad(seg_bs, ((0, 0), (0, pad)), constant_values=-1)
    return seg_bs.reshape(b, (s + pad) // block_k, block_k).transpose(1, 0, 2)


def _block_mask(j, k_btkd, s, block_k, seg_bs, seg_bt):
    """The mask of key block j broadcastable to [B, S, K, G, block_k]: causal, and within the
    query's segment when there are segment ids."""
    causal_st = _mask_st(j, k_btkd, s, block_k)
    if seg_bs is None:
        return causal_st[None, :, None, None, :]
    same_bst = seg_bs[:, :, None] == seg_bt[:, None, :]
    return (causal_st[None] & same_bst)[:, :, None, None, :]


def _from_blocks(x_jbtkd, s):
    """Inverse of `_to_blocks`: [J, B, block_k, K, D] -> [B, S, K, D], dropping the padding."""
    j, b, t, kv, d = x_jbtkd.shape
    return x_jbtkd.transpose(1, 0, 2, 3, 4).reshape(b, j * t, kv, d)[:, :s]


def _full_like(x, value):
    """float32 `value` shaped and sharded like `x` (`jnp.full_like` drops an Explicit sharding
    outside a `jax.set_mesh` context, which would break the scan carry's type)."""
    return jnp.where(True, late_zero(jnp.asarray(value, F32), x), x.astype(F32))


def _out_sharding(x):
    """`x`'s sharding on a mesh with Explicit axes (for einsums contracting a sharded axis)."""
    sharding = jax.typeof(x).sharding
    return sharding if sharding.mesh.explicit_axes else None


def _mask_st(j, k_btkd, s, block_k):
    """Causal mask [S, block_k] of key block j: query i sees key j * block_k + t iff <= i.

    `j` passes through an optimization barrier with the key block, so that the mask depends on
    the keys as far as JAX's partial evaluation can tell. Otherwise, inside a differentiated
    layer scan, the masks (a function of the block index only) are "known" values: JAX hoists
    them out of the rematerialised backward and stores every block's mask broadcast to
    [B, S, K, G, block_k] as a residual (75 GiB per device at 12 x 40,960 tokens on 8 GPUs).
    The barrier is free at run time."""
    j, _ = lax.optimization_barrier((j, k_btkd))
    k_pos_t = j * block_k + jnp.arange(block_k)
    return k_pos_t[None, :] <= jnp.arange(s)[:, None]


def _scores(q_bskgd, k_btkd, mask, scale):
    """Masked scaled scores [B, S, K, G, block_k] in float32 (masked ones are NEG)."""
    s_bskgt = jnp.einsum("bskgd,btkd->bskgt", q_bskgd, k_btkd, preferred_element_type=F32)
    return jnp.where(mask, s_bskgt * scale, NEG)


def _forward(q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, block_k, scale):
    """Online-softmax scan over key blocks: o [B, S, N, D] and lse [B, S, K, G] (float32)."""
    b, s, n, d = q_bsnd.shape
    q_bskgd = _group(q_bsnd, k_bskd.shape[2])
    k_jbtkd, v_jbtkd = _to_blocks(k_bskd, block_k), _to_blocks(v_bskd, block_k)

    def step(carry, xs):
        m_bskg, l_bskg, acc_bskgd = carry
        j, k_btkd, v_btkd, seg_bt = xs
        mask = _block_mask(j, k_btkd, s, block_k, seg_bs, seg_bt)
        s_bskgt = _scores(q_bskgd, k_btkd, mask, scale)
        m_new = jnp.maximum(m_bskg, s_bskgt.max(-1))
        p_bskgt = jnp.where(mask, jnp.exp(s_bskgt - m_new[..., None]), 0.0)
        corr_bskg = jnp.exp(m_bskg - m_new)
        l_new = l_bskg * corr_bskg + p_bskgt.sum(-1)
        pv_bskgd = jnp.einsum(
            "bskgt,btkd->bskgd", p_bskgt.astype(v_btkd.dtype), v_btkd, preferred_element_type=F32
        )
        return (m_new, l_new, acc_bskgd * corr_bskg[..., None] + pv_bskgd), None

    stat_bskg = q_bskgd[..., 0]
    init = (_full_like(stat_bskg, NEG), _full_like(stat_bskg, 0.0), _full_like(q_bskgd, 0.0))
    xs = (jnp.arange(k_jbtkd.shape[0]), k_jbtkd, v_jbtkd, _seg_blocks(seg_kv, block_k))
    (m_bskg, l_bskg, acc_bskgd), _ = lax.scan(step, init, xs)
    o_bsnd = (acc_bskgd / l_bskg[..., None]).astype(q_bsnd.dtype).reshape(b, s, n, d)
    return o_bsnd, m_bskg + jnp.log(l_bskg)


def _attention_bwd(block_k, scale, res, do_bsnd):
    """Second scan over key blocks: dq carried in float32, dk and dv emitted per block."""
    q_bsnd, k_bskd, v_bskd, seg_bs, seg_kv, o_bsnd, lse_bskg = res
    b, s, n, d = q_bsnd.shape
    kv = k_bskd.shape[2]
    q_bskgd, do_bskgd = _group(q_bsnd, kv), _group(do_bsnd.astype(q_bsnd.dtype), kv)
    delta_bskg = jnp.sum(do_bskgd.astype(F32) * _group(o_bsnd, kv).astype(F32), axis=-1)
    k_jbtkd, v_jbtkd = _to_blocks(k_bskd, block_k), _to_blocks(v_bskd, block_k)

    def step(dq_bskgd, xs):
        j, k_btkd, v_btkd, seg_bt = xs
        kv_sharding = _out_sharding(k_btkd)
        mask = _block_mask(j, k_btkd, s, block_k, seg_bs, seg_bt)
        s_bskgt = _scores(q_bskgd, k_btkd, mask, scale)
        p_bskgt = jnp.where(mask, jnp.exp(s_bskgt - lse_bskg[..., None]), 0.0)
        dv_btkd = jnp.einsum(
            "bskgt,bskgd->btkd",
            p_bskgt.astype(do_bskgd.dtype),
            do_bskgd,
            preferred_element_type=F32,
            out_sharding=kv_sharding,
        )
        dp_bskgt = jnp.einsum("bskgd,btkd->bskgt", do_bskgd, v_btkd, preferred_element_type=F32)
        ds_bskgt = (p_bskgt * (dp_bskgt - delta_bskg[..., None])).astype(q_bskgd.dtype)
        dq_bskgd = dq_bskgd + scale * jnp.einsum(
            "bskgt,btkd->bskgd", ds_bskgt, k_btkd, preferred_element_type=F32
        )
        dk_btkd = scale * jnp.einsum(
            "bskgt,bskgd->btkd",
            ds_bskgt,
            q_bskgd,
            preferred_element_type=F32,
            out_sharding=kv_sharding,
        )
        return dq_bskgd, (dk_btkd.astype(k_btkd.dtype), dv_btkd.astype(v_btkd.dtype))

    xs = (jnp.arange(k_jbtkd.shape[0]), k_jbtkd, v_jbtkd, _seg_blocks(seg_kv, block_k))
    dq_bskgd, (dk_jbtkd, dv_jbtkd) = lax.scan(step, _full_like(q_bskgd, 0.0), xs)
    dq_bsnd = dq_bskgd.astype(q_bsnd.dtype).reshape(b, s, n, d)
    return dq_bsnd, _from_blocks(dk_jbtkd, s), _from_blocks(dv_jbtkd, s), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
