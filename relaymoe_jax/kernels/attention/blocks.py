"""Blocks of queries and keys, and which (query block, key block) pairs attention must visit.

Every token carries an index (its place in the sequence: causality is `key index <= query
index`) and, with packed documents, a segment id (attention stays within equal ids). The
blockwise attentions (`models/attention_xla.py`, the Mosaic GPU kernels here) cut the queries
into blocks of `block_q` and the keys into blocks of `block_k`, padding each side to a whole
number of blocks:

- padded queries get index -1 (they see no key) and segment id -1;
- padded keys get index `PAD_KEY` (after every query: no query sees them) and segment id -2.

`visible_blocks` says which pairs hold at least one visible (query, key) pair, from each block's
index and segment-id ranges: a pair is skipped when its keys' smallest index is above its
queries' largest (causal), or when the segment-id ranges do not meet (documents). The test is
conservative, so skipping never drops a visible pair: it is exact for the causal rule on sorted
indices and for documents whose ids grow along the row (what packing writes), and only visits
more pairs otherwise. Within a visited pair every (query, key) is masked elementwise
(`pair_mask`).
"""

import jax
import jax.numpy as jnp
from jax import lax

PAD_QUERY = -1  # the index of a padded query: below every key's
PAD_KEY = jnp.iinfo(jnp.int32).max  # the index of a padded key: above every query's
PAD_QUERY_SEG, PAD_KEY_SEG = -1, -2


def blocks(x_bs, size: int, fill):
    """[B, S, ...] -> [S_pad / size, B, size, ...], padding S with `fill` to a multiple."""
    b, s = x_bs.shape[:2]
    pad = -s % size
    if pad:
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x_bs.ndim - 2)
        x_bs = jnp.pad(x_bs, widths, constant_values=fill)
    x = x_bs.reshape(b, (s + pad) // size, size, *x_bs.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def unblocks(x_ib, s: int):
    """Inverse of `blocks`: [n, B, size, ...] -> [B, S, ...], dropping the padding."""
    n, b, size = x_ib.shape[:3]
    return jnp.moveaxis(x_ib, 0, 1).reshape(b, n * size, *x_ib.shape[3:])[:, :s]


def default_index(b: int, s: int, offset=0):
    """int32 [B, S] token indices offset, offset + 1, ... (the natural order)."""
    return jnp.broadcast_to(offset + jnp.arange(s, dtype=jnp.int32), (b, s))


def visible_blocks(qi_ibq, ki_jbt, qseg_ibq=None, kseg_jbt=None):
    """bool [nq, nk]: whether query block i and key block j share any visible (query, key) pair,
    in any row, from blocked indices (`blocks` with PAD_QUERY / PAD_KEY) and segment ids."""
    qmax_ib = qi_ibq.max(-1)
    kmin_jb = ki_jbt.min(-1)
    vis_ijb = kmin_jb[None] <= qmax_ib[:, None]
    if qseg_ibq is not None:
        big = jnp.iinfo(jnp.int32).max
        q_real, k_real = qi_ibq != PAD_QUERY, ki_jbt != PAD_KEY
        qlo_ib = jnp.where(q_real, qseg_ibq, big).min(-1)
        qhi_ib = jnp.where(q_real, qseg_ibq, -big).max(-1)
        klo_jb = jnp.where(k_real, kseg_jbt, big).min(-1)
        khi_jb = jnp.where(k_real, kseg_jbt, -big).max(-1)
        meet_ijb = (qlo_ib[:, None] <= khi_jb[None]) & (klo_jb[None] <= qhi_ib[:, None])
        vis_ijb = vis_ijb & meet_ijb
    return vis_ijb.any(-1)


def pair_mask(qi_bq, ki_bt, qseg_bq=None, kseg_bt=None, anchor=None):
    """bool [B, bq, bk]: query q sees key t (causal, and within its segment).

    `anchor` (a block of keys or queries) passes through an optimization barrier with the
    indices, so that the mask depends on the data as far as JAX's partial evaluation can tell.
    Otherwise, inside a differentiated layer scan, masks built from iota-made indices are
    "known" values: JAX hoists them out of the rematerialised backward and stores every block's
    mask as a residual (75 GiB per device at 12 x 40,960 tokens on 8 GPUs, found once). The
    barrier is free at run time."""
    if anchor is not None:
        qi_bq, ki_bt, _ = lax.optimization_barrier((qi_bq, ki_bt, anchor))
    mask = ki_bt[:, None, :] <= qi_bq[:, :, None]
    if qseg_bq is not None:
        mask = mask & (qseg_bq[:, :, None] == kseg_bt[:, None, :])
    return mask


def varying_like(x, *refs):
    """`x` varying over every manual axis any of `refs` varies over (inside a shard_map, a cond's
    branches and a scan's carry must agree on that; outside one, `x` itself)."""
    vma = lambda a: jax.typeof(a).manual_axis_type.varying
    missing = tuple(sorted(frozenset().union(*map(vma, refs)) - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x
