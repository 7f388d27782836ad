"""The Mosaic GPU flash-attention backward kernels (kernels/attention/mosaic_bwd.py) in GPU
interpret mode on CPU: dq, dk, dv against float64 numpy gradients of softmax attention with the
explicit mask (o and lse from a float64 numpy forward, not from the forward kernel), exact zeros
for padded queries and keys, and the block pairs the kernels' loops visit against a numpy count.
(The numpy backward below was checked once against jax.grad of a float64 jnp attention: equal to
1e-15.)"""

import zlib
from typing import NamedTuple

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from relaymoe_jax.kernels.attention.blocks import PAD_KEY, PAD_QUERY
from relaymoe_jax.kernels.attention.common import MosaicConfig, prepare_masks
from relaymoe_jax.kernels.attention.mosaic_bwd import backward

BQ = 64
# error relative to max |grad| per dtype: 16-bit operands and outputs (seen: 2e-3 to 5e-3)
TOLS = {"bfloat16": 1.5e-2, "float16": 4e-3}


def np_mask(qi_bs, ki_bt, qseg_bs=None, kseg_bt=None):
    """bool [B, S, T]: query s sees key t."""
    mask_bst = ki_bt[:, None, :] <= qi_bs[:, :, None]
    if qseg_bs is not None:
        mask_bst &= qseg_bs[:, :, None] == kseg_bt[:, None, :]
    return mask_bst


def np_forward(q_bsnd, k_btkd, v_btkd, mask_bst, scale):
    """float64 (o [B, S, N, D], lse [B, N, S] (-inf for rows that see nothing), p [B, N, S, T])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bsnd, k_btkd, v_btkd))
    g = q.shape[2] // k.shape[2]
    k, v = (np.repeat(x, g, axis=2) for x in (k, v))
    mask_b1st = mask_bst[:, None]
    s_bnst = np.where(mask_b1st, np.einsum("bsnd,btnd->bnst", q, k) * scale, -np.inf)
    m_bns1 = s_bnst.max(-1, keepdims=True)
    m_bns1 = np.where(np.isfinite(m_bns1), m_bns1, 0.0)
    e_bnst = np.where(mask_b1st, np.exp(s_bnst - m_bns1), 0.0)
    l_bns = e_bnst.sum(-1)
    empty = l_bns == 0
    p_bnst = e_bnst / np.where(empty, 1.0, l_bns)[..., None]
    with np.errstate(divide="ignore"):
        lse_bns = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, l_bns)) + m_bns1[..., 0])
    return np.einsum("bnst,btnd->bsnd", p_bnst, v), lse_bns, p_bnst


def np_backward(q_bsnd, k_btkd, v_btkd, do_bsnd, mask_bst, scale):
    """float64 (dq, dk, dv) of sum(attention(q, k, v) * do); GQA heads summed into dk, dv."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q_bsnd, k_btkd, v_btkd, do_bsnd))
    o, _, p_bnst = np_forward(q, k, v, mask_bst, scale)
    b, t, kh, d = k.shape
    g = q.shape[2] // kh
    k_rep, v_rep = (np.repeat(x, g, axis=2) for x in (k, v))
    dv = np.einsum("bnst,bsnd->btnd", p_bnst, do)
    dp_bnst = np.einsum("bsnd,btnd->bnst", do, v_rep)
    delta_bns = np.einsum("bsnd,bsnd->bns", do, o)
    ds_bnst = p_bnst * (dp_bnst - delta_bns[..., None])
    dq = np.einsum("bnst,btnd->bsnd", ds_bnst, k_rep) * scale
    dk = np.einsum("bnst,bsnd->btnd", ds_bnst, q) * scale
    group_sum = lambda x: x.reshape(b, t, kh, g, d).sum(3)
    return dq, group_sum(dk), group_sum(dv)


def np_visible_blocks(mask_bst, block_k):
    """bool [nq, nk]: the block pair holds a visible (query, key) pair in some row."""
    b, s, t = mask_bst.shape
    return mask_bst.reshape(b, s // BQ, BQ, t // block_k, block_k).any(axis=(0, 2, 4))


def _pad(x_bs, size, fill):
    return np.pad(x_bs, ((0, 0), (0, size - x_bs.shape[1])), constant_values=fill)


def _docs(bounds, length):
    """int32 segment ids: document i covers [bounds[i], bounds[i + 1]), ids from 1."""
    seg = np.zeros(length, np.int32)
    for i, start in enumerate(bounds):
        seg[start:] = i + 1
    return seg


def _zigzag(length, chunks):
    """Token indices in the balanced zigzag order: chunk c, then chunk 2 C - 1 - c, ..."""
    pieces = np.arange(length).reshape(2 * chunks, -1)
    order = [c for i in range(chunks) for c in (i, 2 * chunks - 1 - i)]
    return pieces[order].reshape(-1).astype(np.int32)


class Case(NamedTuple):
    b: int
    s: int  # query tokens before padding
    t: int  # keys before padding
    n: int
    k: int
    d: int
    dtype: str
    layout: str  # the token indices and documents (`_indices`)
    heads_per_program: int = 1
    block_k: int = 64
    empty_lse: float = -np.inf  # lse given for rows that see no key
    detect_races: bool = False


CASES = {
    # several documents per row, one crossing query blocks, a padding segment (id 0) at the
    # row's end, rows padded from 200 to 256 (lse -inf there)
    "d128-docs-padded": Case(1, 200, 200, 2, 1, 128, "bfloat16", "docs"),
    # queries at an offset: qi = 128 + arange(128) over 256 keys, float16, MHA
    "d64-offset-f16": Case(1, 128, 256, 2, 2, 64, "float16", "offset"),
    # queries 0..99 (padded to 128, with a large negative lse instead of -inf) over 256 keys:
    # key blocks 2 and 3 see no query (an empty loop: dk = dv = 0)
    "d64-unseen-keys": Case(1, 100, 256, 1, 1, 64, "bfloat16", "prefix", empty_lse=-1e30),
    # GQA (G = 2, two warpgroups sharing the K/V slots in the dQ kernel, race detector on), the
    # zigzag token order (blocks hold the chunks 0, 3, 1, 2: query block 2 visits key blocks 0
    # and 2 only), other documents in each of the two rows
    "d64-gqa-zigzag": Case(2, 256, 256, 4, 2, 64, "bfloat16", "zigzag", 2, detect_races=True),
    # block_k = 128: two warpgroups (64 keys each) sharing the Q/dO slots in the dK/dV kernel,
    # race detector on; the zigzag order and documents as above (query block 0 skips key block
    # 1), GQA
    "d64-bk128-zigzag": Case(
        2, 256, 256, 2, 1, 64, "bfloat16", "zigzag", 2, block_k=128, detect_races=True
    ),
}


def _indices(c: Case):
    """qi [B, S], ki [B, T] and segment ids (or None) before padding."""
    if c.layout in ("offset", "prefix"):
        offset = 128 if c.layout == "offset" else 0
        qi = np.broadcast_to(offset + np.arange(c.s, dtype=np.int32), (c.b, c.s))
        return qi, np.broadcast_to(np.arange(c.t, dtype=np.int32), (c.b, c.t)), None, None
    if c.layout == "docs":
        seg = _docs([0, 40, 130, 170], c.s)
        seg[170:] = 0  # the padding segment
        qi = np.broadcast_to(np.arange(c.s, dtype=np.int32), (c.b, c.s))
        qseg = np.broadcast_to(seg, (c.b, c.s))
        return qi, qi, qseg, qseg
    # zigzag: row 0 has documents [0, 90), [90, 200), [200, S), row 1 [0, 150), [150, S)
    idx = _zigzag(c.s, 2)
    seg = np.stack([_docs([0, 90, 200], c.s)[idx], _docs([0, 150], c.s)[idx]])[: c.b]
    qi = np.broadcast_to(idx, (c.b, c.s))
    return qi, qi, seg, seg


def _case_inputs(name):
    c = CASES[name]
    qi, ki, qseg, kseg = _indices(c)
    s_pad, t_pad = -(-c.s // BQ) * BQ, -(-c.t // c.block_k) * c.block_k
    qi_np, ki_np = _pad(qi, s_pad, PAD_QUERY), _pad(ki, t_pad, PAD_KEY)
    has_seg = qseg is not None
    qseg_np = _pad(qseg, s_pad, -1) if has_seg else None
    kseg_np = _pad(kseg, t_pad, -2) if has_seg else None
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    # padded rows hold noise too: the kernels must ignore them
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), c.dtype)
    arrays = (draw(c.b, s_pad, c.n, c.d), draw(c.b, t_pad, c.k, c.d), draw(c.b, t_pad, c.k, c.d))
    arrays += (draw(c.b, s_pad, c.n, c.d),)  # the cotangent do
    to_jnp = lambda x: None if x is None else jnp.asarray(x)
    masks = prepare_masks(to_jnp(qi), to_jnp(ki), to_jnp(qseg), to_jnp(kseg), BQ, c.block_k)
    return arrays, masks, np_mask(qi_np, ki_np, qseg_np, kseg_np)


def _run(name):
    c = CASES[name]
    (q, k, v, do), masks, mask_bst = _case_inputs(name)
    scale = c.d**-0.5
    o, lse, _ = np_forward(q, k, v, mask_bst, scale)
    lse = np.where(np.isneginf(lse), c.empty_lse, lse)
    grads = backward(
        q,
        k,
        v,
        jnp.asarray(o, c.dtype),
        jnp.asarray(lse, jnp.float32),
        do,
        masks,
        scale=scale,
        config=MosaicConfig(BQ, c.block_k, c.heads_per_program),
        interpret=plgpu.InterpretGPUParams(detect_races=c.detect_races),
        count_visits=True,
    )
    return grads, np_backward(q, k, v, do, mask_bst, scale), mask_bst


def _check(c: Case, grads, want, mask_bst):
    dq, dk, dv, dq_visits, dkv_visits = (np.asarray(x) for x in grads)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert got.dtype == np.dtype(c.dtype) and got.shape == ref.shape, name
        got = got.astype(np.float64)
        assert np.isfinite(got).all(), name
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < TOLS[c.dtype], (name, err)
    # queries that see no key and keys no query sees (padding included): exactly zero
    blind_bs, unseen_bt = ~mask_bst.any(2), ~mask_bst.any(1)
    assert blind_bs[:, c.s :].all() and unseen_bt[:, c.t :].all()
    assert not dq[blind_bs].astype(np.float32).any()
    assert not dk[unseen_bt].astype(np.float32).any()
    assert not dv[unseen_bt].astype(np.float32).any()
    # visits: key blocks per (row, query head, query block); (query head, query block) steps
    # per (row, kv head, 64 keys of a key block)
    vis_ij = np_visible_blocks(mask_bst, c.block_k)
    nq = vis_ij.shape[0]
    np.testing.assert_array_equal(dq_visits, np.broadcast_to(vis_ij.sum(1), (c.b, c.n, nq)))
    steps_j = np.repeat(c.n // c.k * vis_ij.sum(0), c.block_k // 64)
    np.testing.assert_array_equal(dkv_visits, np.broadcast_to(steps_j, (c.b, c.k, steps_j.size)))


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_and_visits(name):
    _check(CASES[name], *_run(name))


def test_rejects_other_blocks():
    (q, k, v, do), masks, _ = _case_inputs("d64-offset-f16")
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="block_q = 64, block_k 64 or 128"):
        config = MosaicConfig(block_q=128)
        backward(q, k, v, q, lse, do, masks, scale=1.0, config=config, interpret=True)
