"""The block ranges of `kernels/attention/blocks.py` (`key_ranges`, `query_ranges`, through
`common.prepare_masks`, which both attention cores' blocking matches) against numpy brute force
from the elementwise mask, on random cases: natural and zigzag token orders, queries at a
device's share of the keys, packed documents (other documents in each row), a trailing padding
segment, sequences padded to whole blocks, non-monotone segment ids, rows with other indices.
The ranges must cover every block pair holding a visible (query, key) pair in some row (and
every pair the block test passes), and hold exactly those pairs for the causal rule on the
natural or zigzag order and for segment ids growing along each row. Then: the XLA core compiled
at 262,144 tokens holds no [nq, nk]-sized array (the old block lists were 64 MiB there)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relaymoe_jax.kernels.attention.blocks import PAD_KEY, PAD_QUERY
from relaymoe_jax.kernels.attention.common import prepare_masks

BIG = np.iinfo(np.int32).max


def _zigzag(length, chunks):
    """Token indices in the zigzag order of `models/context.py` (pieces c, 2C - 1 - c, ...)."""
    pieces = np.arange(length).reshape(2 * chunks, -1)
    order = [p for c in range(chunks) for p in (c, 2 * chunks - 1 - c)]
    return pieces[order].reshape(-1).astype(np.int32)


def _docs(rng, length, pad=0):
    """int32 segment ids 1, 2, ... of random documents along a row (in index order), then `pad`
    tokens of a padding segment 0."""
    cuts = np.sort(rng.choice(np.arange(1, length), size=rng.integers(0, 7), replace=False))
    seg = (1 + np.searchsorted(cuts, np.arange(length), side="right")).astype(np.int32)
    if pad:
        seg[length - pad :] = 0
    return seg


# name: (order, documents, queries, exact); every case also runs with rows of other documents
CASES = {
    "natural": ("natural", None, "all", True),
    "natural-share": ("natural", None, "share", True),
    "zigzag": ("zigzag", None, "all", True),
    "zigzag-share": ("zigzag", None, "share", True),
    "packed": ("natural", "packed", "all", True),
    "packed-share": ("natural", "packed", "share", True),
    "zigzag-packed-share": ("zigzag", "packed", "share", True),
    "padded-ragged": ("natural", "packed", "ragged", True),
    # conservative only
    "trailing-padding-segment": ("natural", "padding", "all", False),
    "zigzag-trailing-padding-share": ("zigzag", "padding", "share", False),
    "random-ids": ("natural", "random", "all", False),
    "zigzag-pieces-across-blocks": ("zigzag-ragged", "packed", "all", False),
    "rows-with-other-indices": ("rows-apart", "packed", "all", False),
}


def _case(name, seed):
    """qi [B, S], ki [B, T], qseg, kseg (or None), block_q, block_k."""
    order, docs, queries, _ = CASES[name]
    rng = np.random.default_rng(seed)
    b, chunks = int(rng.integers(1, 4)), int(rng.choice([2, 4]))
    bq, bk = int(rng.choice([8, 16])), int(rng.choice([8, 16]))
    piece = 16 * int(rng.integers(1, 4))  # whole blocks (`zigzag-ragged`: not)
    t = 2 * chunks * piece
    if order == "zigzag-ragged":
        t = 2 * chunks * 12  # pieces of 12 tokens: blocks hold parts of two pieces
    ki = _zigzag(t, chunks) if order.startswith("zigzag") else np.arange(t, dtype=np.int32)
    ki = np.stack([ki] * b)
    if order == "rows-apart":  # each row its own indices: row r shifted by 5 r, then reversed
        ki = np.stack([(ki[r] + 5 * r)[:: 1 - 2 * (r % 2)] for r in range(b)])
    kseg = None
    if docs is not None:
        if docs == "random":
            kseg = rng.integers(0, 3, (b, t)).astype(np.int32)
        else:
            pad = int(rng.integers(1, t // 3)) if docs == "padding" else 0
            natural = np.stack([_docs(rng, t, pad) for _ in range(b)])
            kseg = np.take_along_axis(natural, ki - ki.min(1, keepdims=True), axis=1)
    if queries == "all":
        sl = slice(0, t)
    elif queries == "share":  # one device's share under context parallelism
        share = t // chunks
        c = int(rng.integers(0, chunks))
        sl = slice(c * share, (c + 1) * share)
    else:  # ragged: S and T not whole blocks (the cores pad them)
        t -= int(rng.integers(1, 8))
        ki, kseg = ki[:, :t], kseg[:, :t]
        sl = slice(0, t)
    qi, qseg = ki[:, sl], None if kseg is None else kseg[:, sl]
    return qi, ki, qseg, kseg, bq, bk


def _pad_blocks(x_bs, size, fill):
    pad = -x_bs.shape[1] % size
    x = np.pad(x_bs, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(x.shape[0], -1, size)


def np_visible(qi, ki, qseg, kseg, bq, bk):
    """bool [nq, nk]: the block pair holds a visible (query, key) pair in some row."""
    mask = ki[:, None, :] <= qi[:, :, None]
    if qseg is not None:
        mask &= qseg[:, :, None] == kseg[:, None, :]
    b, s, t = mask.shape
    full = np.zeros((b, -(-s // bq) * bq, -(-t // bk) * bk), bool)
    full[:, :s, :t] = mask
    return full.reshape(b, full.shape[1] // bq, bq, full.shape[2] // bk, bk).any(axis=(0, 2, 4))


def np_block_test(qi, ki, qseg, kseg, bq, bk):
    """bool [nq, nk]: the block test in some row (keys' smallest index <= queries' largest, the
    segment-id ranges of the real tokens meet): what the ranges must hold at least."""
    qi_b, ki_b = _pad_blocks(qi, bq, PAD_QUERY), _pad_blocks(ki, bk, int(PAD_KEY))
    vis = ki_b.min(-1)[:, None, :] <= qi_b.max(-1)[:, :, None]
    if qseg is not None:
        qs, ks = _pad_blocks(qseg, bq, -1), _pad_blocks(kseg, bk, -2)
        q_real, k_real = qi_b != PAD_QUERY, ki_b != PAD_KEY
        qlo, qhi = np.where(q_real, qs, BIG).min(-1), np.where(q_real, qs, -BIG).max(-1)
        klo, khi = np.where(k_real, ks, BIG).min(-1), np.where(k_real, ks, -BIG).max(-1)
        vis &= (qlo[:, :, None] <= khi[:, None]) & (klo[:, None] <= qhi[:, :, None])
    return vis.any(0)


def _pairs(ranges, n, m, transpose):
    """bool [n, m] of the pairs the ranges visit (block i visits perm[start[i]:end[i]])."""
    perm, start, end = (np.asarray(x) for x in ranges)
    assert sorted(perm.tolist()) == list(range(m))  # a permutation of the other side's blocks
    assert start.shape == end.shape == (n,)
    assert (0 <= start).all() and (start <= end).all() and (end <= m).all()
    assert (start[start == end] == 0).all()  # an empty range is 0, 0
    out = np.zeros((n, m), bool)
    for i in range(n):
        out[i, perm[start[i] : end[i]]] = True
    return out.T if transpose else out


@functools.partial(jax.jit, static_argnums=(4, 5))
def _masks(qi, ki, qseg, kseg, bq, bk):
    return prepare_masks(qi, ki, qseg, kseg, bq, bk)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(CASES))
def test_ranges_cover_the_visible_pairs_and_are_exact_where_documented(name, seed):
    qi, ki, qseg, kseg, bq, bk = _case(name, seed)
    to_jnp = lambda x: None if x is None else jnp.asarray(x)
    masks = _masks(*map(to_jnp, (qi, ki, qseg, kseg)), bq, bk)
    nq, nk = -(-qi.shape[1] // bq), -(-ki.shape[1] // bk)
    fwd = _pairs(masks.keys, nq, nk, transpose=False)  # each query block's key blocks
    bwd = _pairs(masks.queries, nk, nq, transpose=True)  # each key block's query blocks
    visible = np_visible(qi, ki, qseg, kseg, bq, bk)
    block_test = np_block_test(qi, ki, qseg, kseg, bq, bk)
    assert (block_test >= visible).all()
    for got in (fwd, bwd):
        assert (got >= block_test).all()  # conservative: nothing visible is skipped
    if CASES[name][3]:
        np.testing.assert_array_equal(fwd, visible)
        np.testing.assert_array_equal(bwd, visible)


def test_ranges_are_sorted_orders_of_the_blocks():
    """Zigzag keys (pieces 0, 3, 1, 2 of 4, one block each): the key blocks in order of smallest
    index, and the last query block (piece 2) visits pieces 0, 1, 2: one range."""
    ki = jnp.asarray(_zigzag(64, 2))[None]
    masks = _masks(ki, ki, None, None, 16, 16)
    np.testing.assert_array_equal(masks.keys.perm, [0, 2, 3, 1])
    np.testing.assert_array_equal(masks.keys.start, [0, 0, 0, 0])
    np.testing.assert_array_equal(masks.keys.end, [1, 4, 2, 3])
    np.testing.assert_array_equal(masks.queries.perm, [0, 2, 3, 1])  # by largest index
    np.testing.assert_array_equal(masks.queries.start, [0, 3, 1, 2])
    np.testing.assert_array_equal(masks.queries.end, [4, 4, 4, 4])


def _shapes(hlo_text):
    """Every array shape in an HLO module's text, as (dtype, dims)."""
    found = re.findall(r"\b(pred|s32|u32|s64|f32|bf16)\[([0-9,]*)\]", hlo_text)
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in found]


def test_the_xla_core_holds_nothing_of_size_nq_times_nk():
    """The chunked XLA core's forward + backward at 262,144 tokens (blocks of 64: nq = nk = 4,096,
    nq x nk = 16.8 M; default iota indices, so a table built from them would be a compile-time
    constant): no array in the optimized HLO, constant or not, has nq x nk / 4 elements (the
    largest are the 262,144 x 8 q, k, v, o and dq, nq x nk / 8; the old block lists were
    [4096, 4096] int32 and bool, 64 + 16 MiB), and the compiled temporaries are two float32
    [S, 8] arrays (16 MiB: dq and one more) and 1 MiB (the tree before the ranges: 300 MiB)."""
    from relaymoe_jax.models.attention import chunked_causal_attention

    s, d, block = 262_144, 8, 64
    nq = nk = s // block
    sds = jax.ShapeDtypeStruct((1, s, 1, d), jnp.float32)

    def loss(q, k, v):
        o = chunked_causal_attention(q, k, v, block_k=block, block_q=block)
        return jnp.sum(o * q)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(sds, sds, sds).compile()
    sizes = [(t, dims) for t, dims in _shapes(compiled.as_text()) if np.prod(dims) >= nq * nk / 4]
    assert not sizes, sizes
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"\nXLA core fwd+bwd at S={s}, blocks of {block}: temp {temp / 2**20:.1f} MiB")
    assert temp <= 2 * s * d * 4 + 2**20, temp
