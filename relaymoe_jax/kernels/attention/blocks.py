"""Blocks of queries and keys, and which (query block, key block) pairs attention must visit.

Every token carries an index (its place in the sequence: causality is `key index <= query
index`) and, with packed documents, a segment id (attention stays within equal ids). The
blockwise attentions (`models/attention_xla.py`, the Mosaic GPU kernels here) cut the queries
into blocks of `block_q` and the keys into blocks of `block_k`, padding each side to a whole
number of blocks:

- padded queries get index -1 (they see no key) and segment id -1;
- padded keys get index `PAD_KEY` (after every query: no query sees them) and segment id -2.

The block test: a (query block, key block) pair is visited in a row unless its keys' smallest
index is above its queries' largest (causal), or the blocks' segment-id ranges (over their real
tokens) do not meet (documents). Within a visited pair every (query, key) is masked elementwise
(`pair_mask`), so visiting more pairs than needed costs time, never correctness.

`key_ranges` and `query_ranges` give the visited pairs as one range per block, O(nq + nk)
int32 (`BlockRanges`), never an [nq, nk] table: the key blocks are sorted once by their
smallest index (the query blocks, for the backward, by their largest), and query block i
visits the key blocks `perm[start[i]:end[i]]` (key block j, for the backward, the query blocks
in its range of the other order). Each condition of the block test (the causal one, and each
side of "the segment ranges meet") is of the form c[p] <= y[i] for a value c of the other
side's block p and y of this block, in each row. Its blocks, in sorted order, lie between the
first p whose prefix-min of c is <= y and the last p whose suffix-min of c is <= y (both
monotone in p: a binary search each); the range is the intersection of these hulls, per row,
and then the hull over the rows that visit anything. So the range holds every pair the block
test passes, and so every block holding a visible (query, key) pair: it is conservative.

It holds exactly the block test's pairs when, in each row, each condition's blocks are
contiguous in the sorted order: the causal rule on blocks of consecutive indices in any order
(natural, the zigzag order of `models/context.py` with pieces of whole blocks, queries at an
offset), and segment ids growing along the row (what packing writes). There the block test is
exact too, so the ranges hold exactly the blocks with a visible pair
(tests/test_attention_blocks.py); and the hull over rows adds nothing, every row's range
holding the block's own tokens (queries among the keys: self-attention, a device's share).
Otherwise it visits more: rows with other indices, ids in another order, blocks across two
zigzag pieces, or a trailing padding segment with a lower id (0 after documents 1, 2, ...):
the block where it starts spans every id, so while the forward's ranges are the block test's,
each earlier key block's range of query blocks reaches that block, through the later
documents (the block test's own pairs are no single range there).

The ranges are computed from the indices as data: they pass through an optimization barrier
(with an `anchor`, as in `pair_mask`), since from iota-made indices XLA would otherwise
constant-fold them while compiling (the [nq, nk] tables before them took XLA:GPU seconds to fold
at 1,048,576 tokens and more) and JAX's partial evaluation would take them for known values.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from relaymoe_jax.util.sorted_search import count_at_most_bisect

PAD_QUERY = -1  # the index of a padded query: below every key's
PAD_KEY = jnp.iinfo(jnp.int32).max  # the index of a padded key: above every query's
PAD_QUERY_SEG, PAD_KEY_SEG = -1, -2
_BIG = jnp.iinfo(jnp.int32).max  # the segment-id range of a block with no real token: empty


class BlockRanges(NamedTuple):
    """The blocks each block of one side visits on the other, as ranges: block i visits
    `perm[start[i]]`, `perm[start[i] + 1]`, ..., `perm[end[i] - 1]` (int32; `perm` [n_other] a
    permutation of the other side's blocks, `start` <= `end` [n]; an empty range is 0, 0)."""

    perm: object
    start: object
    end: object


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


class _Summary(NamedTuple):
    """Per block and row ([n, B] int32): the queries' largest index or the keys' smallest
    (`edge`), and the smallest and largest segment id of the block's real tokens (None without
    segment ids; an all-padding block's range is empty: lo = int32 max, hi = -lo)."""

    edge: object
    lo: object
    hi: object


def _summary(i_nbx, seg_nbx, pad: int, reduce):
    if seg_nbx is None:
        return _Summary(reduce(i_nbx, -1), None, None)
    real = i_nbx != pad
    lo = jnp.where(real, seg_nbx, _BIG).min(-1)
    hi = jnp.where(real, seg_nbx, -_BIG).max(-1)
    return _Summary(reduce(i_nbx, -1), lo, hi)


def _summaries(qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, anchor):
    qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, _ = lax.optimization_barrier(
        (qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, anchor)
    )
    q = _summary(qi_ibq, qseg_ibq, PAD_QUERY, jnp.max)
    k = _summary(ki_jbt, kseg_jbt, PAD_KEY, jnp.min)
    return q, k


def _ranges(perm, conds) -> BlockRanges:
    """The range over `perm` (the other side's blocks, int32 [n]) of each block of this side:
    `conds` are pairs (c [n, B], y [m, B]); block p is visited by block i in row b only if
    c[p, b] <= y[i, b] for every pair."""
    n = perm.shape[0]
    start = end = None
    for c_pb, y_ib in conds:
        c_pb = c_pb[perm]
        prefix_min, suffix_min = lax.cummin(c_pb, 0), lax.cummin(c_pb, 0, reverse=True)
        # the first p with c <= y (n: none), and one past the last (0: none)
        first = n - count_at_most_bisect(prefix_min[::-1], y_ib)
        stop = count_at_most_bisect(suffix_min, y_ib)
        start = first if start is None else jnp.maximum(start, first)
        end = stop if end is None else jnp.minimum(end, stop)
    visits = start < end  # [m, B]: the rows in which block i visits anything
    start = jnp.where(visits, start, n).min(1)
    end = jnp.where(visits, end, 0).max(1)
    return BlockRanges(perm, jnp.minimum(start, end), end)


def _segment_conds(this: _Summary, other: _Summary):
    """The segment ranges meet: other.lo <= this.hi and this.lo <= other.hi (as c <= y)."""
    if this.lo is None:
        return []
    return [(other.lo, this.hi), (~other.hi, ~this.lo)]  # ~ reverses the order of int32


def key_ranges(qi_ibq, ki_jbt, qseg_ibq=None, kseg_jbt=None, anchor=None) -> BlockRanges:
    """For each query block, the key blocks it visits: `BlockRanges` over the key blocks sorted
    by their smallest index (over rows), from blocked indices [n, B, size] (`blocks` with
    PAD_QUERY / PAD_KEY) and segment ids (both or neither). `anchor` (an array the result should
    depend on, e.g. the keys) passes through the optimization barrier with them."""
    q, k = _summaries(qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, anchor)
    perm = jnp.argsort(k.edge.min(1), stable=True).astype(jnp.int32)
    return _ranges(perm, [(k.edge, q.edge), *_segment_conds(q, k)])


def query_ranges(qi_ibq, ki_jbt, qseg_ibq=None, kseg_jbt=None, anchor=None) -> BlockRanges:
    """For each key block, the query blocks that visit it: `BlockRanges` over the query blocks
    sorted by their largest index (over rows); arguments as `key_ranges`'."""
    q, k = _summaries(qi_ibq, ki_jbt, qseg_ibq, kseg_jbt, anchor)
    perm = jnp.argsort(q.edge.max(1), stable=True).astype(jnp.int32)
    return _ranges(perm, [(~q.edge, ~k.edge), *_segment_conds(k, q)])


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
