"""The Mosaic GPU flash-attention kernels (relaymoe_jax.kernels.attention) in the Mosaic GPU
interpreter on CPU: the forward's o and lse against a float64 numpy reference with the explicit
mask (packed documents crossing query blocks, a padding segment, S padded to whole blocks,
queries at an offset, zigzag token order, GQA/MQA, head_dim 64 and 128, the race detector on),
the key blocks the kernel's own loop visited against a numpy count of the blocks holding a
visible pair, the input errors, and the gradients against float64 numpy.

Each interpreted call takes seconds: the shapes are tiny and each case runs once (a
module-scoped fixture)."""

import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from relaymoe_jax.kernels.attention import MosaicConfig, flash_attention
from relaymoe_jax.kernels.attention.api import flash_attention_visits

BLOCK = 64


def reference_np(q, k, v, qi, ki, qseg, kseg, scale):
    """float64 o [B, S, N, D], lse [B, N, S] (-inf for rows that see no key) and the mask."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    mask = ki[:, None, :] <= qi[:, :, None]  # [B, S, T]
    if qseg is not None:
        mask &= qseg[:, :, None] == kseg[:, None, :]
    s = np.where(mask[:, None], np.einsum("bsnd,btnd->bnst", q, kk) * scale, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = p.sum(-1, keepdims=True)
    o = np.einsum("bnst,btnd->bsnd", p / np.where(total == 0, 1.0, total), vv)
    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + np.where(np.isfinite(m[..., 0]), m[..., 0], 0.0)
    return o, lse, mask


def reference_grads_np(q, k, v, do, mask, scale):
    """float64 dq, dk, dv of sum(o * do) (dk, dv summed over each kv head's query heads)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    n, kh = q.shape[2], k.shape[2]
    g = n // kh
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.where(mask[:, None], np.einsum("bsnd,btnd->bnst", q, kk) * scale, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    dv = np.einsum("bnst,bsnd->btnd", p, do)
    dp = np.einsum("bsnd,btnd->bnst", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bnst,btnd->bsnd", ds, kk)
    dk = np.einsum("bnst,bsnd->btnd", ds, q)
    fold = lambda x: x.reshape(*x.shape[:2], kh, g, -1).sum(3)
    return dq, fold(dk), fold(dv)


def visible_block_count(mask, s_pad, t_pad):
    """int [nq]: key blocks holding a visible pair in some row, per query block (numpy)."""
    b, s, t = mask.shape
    full = np.zeros((b, s_pad, t_pad), bool)
    full[:, :s, :t] = mask
    blk = full.reshape(b, s_pad // BLOCK, BLOCK, t_pad // BLOCK, BLOCK).any(axis=(2, 4))
    return blk.any(0).sum(-1)


def _zigzag(s):
    """Token indices in zigzag order: blocks 0, 3, 1, 2 of four."""
    c = s // 4
    return np.concatenate([np.arange(c * j, c * (j + 1)) for j in (0, 3, 1, 2)]).astype(np.int32)


def _case(name):
    """(B, N, K, D, qi [B, S], ki [B, T], qseg, kseg, heads_per_program, dtype). Token indices are
    places in the row and documents are segment ids growing along it (what packing writes)."""
    if name == "packed128":
        # S = 200 (padded to 256): documents of 50, 30, 70 tokens (the third crosses query blocks
        # 1 and 2), then a padding segment of 50 tokens that attends to nothing (query index -1,
        # key index int32 max: as the kernel's own padding): rows with o = 0, lse = -inf
        seg = np.repeat(np.arange(1, 5, dtype=np.int32), [50, 30, 70, 50])
        pad = seg == 4
        qi = np.where(pad, -1, np.arange(200)).astype(np.int32)
        ki = np.where(pad, np.iinfo(np.int32).max, np.arange(200)).astype(np.int32)
        return 1, 4, 2, 128, qi[None], ki[None], seg[None], seg[None], 2, jnp.bfloat16
    if name == "offset128":  # 128 queries at indices 128.. over 256 keys, GQA
        qi, ki = 128 + np.arange(128, dtype=np.int32), np.arange(256, dtype=np.int32)
        return 1, 4, 2, 128, qi[None], ki[None], None, None, 2, jnp.bfloat16
    if name == "zigzag64":  # zigzag token order, two rows with different documents, MQA, f16
        qi = np.stack([_zigzag(256)] * 2)
        seg = np.stack([1 + (qi[0] >= 100), 1 + (qi[1] >= 40) + (qi[1] >= 100)]).astype(np.int32)
        return 2, 2, 1, 64, qi, qi, seg, seg, 1, jnp.float16
    raise KeyError(name)


CASES = ("packed128", "offset128", "zigzag64")


def _inputs(name, seed=0):
    """q, k, v, the kernel's other arguments, its config, and the case's numpy arrays."""
    b, n, kh, d, qi, ki, qseg, kseg, h, dtype = _case(name)
    rng = np.random.default_rng(seed)
    draw = lambda s, heads: jnp.asarray(rng.standard_normal((b, s, heads, d)), dtype)
    q, k, v = draw(qi.shape[1], n), draw(ki.shape[1], kh), draw(ki.shape[1], kh)
    seg = lambda x: None if x is None else jnp.asarray(x)
    args = (q, k, v, jnp.asarray(qi), jnp.asarray(ki), seg(qseg), seg(kseg))
    return args, MosaicConfig(heads_per_program=h), (qi, ki, qseg, kseg)


def _run(name, interpret=True):
    args, config, (qi, ki, qseg, kseg) = _inputs(name)
    q, k, v = args[:3]
    o, lse, visits = flash_attention_visits(*args, config=config, interpret=interpret)
    ro, rlse, mask = reference_np(q, k, v, qi, ki, qseg, kseg, 1 / math.sqrt(q.shape[3]))
    got = dict(o=np.asarray(o, np.float64), lse=np.asarray(lse), visits=np.asarray(visits))
    return got | dict(ro=ro, rlse=rlse, mask=mask, dtype=q.dtype, s=q.shape[1], t=k.shape[1])


@pytest.fixture(scope="module")
def results():
    """Each case once; packed128 (two warpgroups sharing K/V) with the race detector on."""
    out = {name: _run(name) for name in ("offset128", "zigzag64")}
    out["packed128"] = _run("packed128", interpret=plgpu.InterpretGPUParams(detect_races=True))
    return out


def _rounding(x, dtype):
    """The largest error of rounding float64 `x` to `dtype`."""
    return np.abs(np.asarray(jnp.asarray(x, dtype), np.float64) - x).max()


@pytest.mark.parametrize("name", CASES)
def test_forward_values_and_lse(results, name):
    r = results[name]
    assert not np.isnan(r["o"]).any()
    assert np.abs(r["o"] - r["ro"]).max() <= 2 * _rounding(r["ro"], r["dtype"]) + 1e-3
    seen = np.isfinite(r["rlse"])
    assert np.abs(r["lse"][seen] - r["rlse"][seen]).max() < 1e-4
    assert np.all(np.isneginf(r["lse"][~seen]))  # EMPTY_LSE
    assert np.all(r["o"].transpose(0, 2, 1, 3)[~seen] == 0.0)


def test_cases_hold_what_they_claim(results):
    """S padded, rows seeing no key, queries at an offset."""
    assert results["packed128"]["s"] % BLOCK != 0
    assert np.isneginf(results["packed128"]["rlse"]).sum() == 4 * 50
    assert results["offset128"]["t"] != results["offset128"]["s"]


@pytest.mark.parametrize("name", CASES)
def test_visits_counted_by_the_kernel(results, name):
    """The kernel's loop ran once per key block holding a visible pair (union over the batch,
    which shares the block ranges) for every row, head and query block: exactly these, so a
    skipped visible block or a visited masked one changes the count."""
    r = results[name]
    pad = lambda x: -(-x // BLOCK) * BLOCK
    want = visible_block_count(r["mask"], pad(r["s"]), pad(r["t"]))
    assert r["visits"].shape[2] == want.shape[0]
    np.testing.assert_array_equal(r["visits"], np.broadcast_to(want, r["visits"].shape))


def test_masked_blocks_are_skipped(results):
    """In zigzag order (blocks of indices 0, 3, 1, 2) the first query block sees key block 0
    only; the padding segment's key block is never visited."""
    np.testing.assert_array_equal(results["zigzag64"]["visits"][..., 0], 1)
    assert results["zigzag64"]["visits"].sum() < 2 * 2 * 4 * 4
    np.testing.assert_array_equal(results["packed128"]["visits"][0, 0], [1, 2, 2, 0])


def _arrays(d=128, dtype=jnp.bfloat16, s=64):
    q = jnp.zeros((1, s, 2, d), dtype)
    kv = jnp.zeros((1, s, 1, d), dtype)
    i = jnp.zeros((1, s), jnp.int32)
    return q, kv, kv, i, i


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(d=96), "head_dim=96"),
        (dict(dtype=jnp.float32), "q: the pallas attention kernel takes bfloat16 or float16"),
    ],
)
def test_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*_arrays(**change), interpret=True)


def test_segment_ids_on_one_side():
    q, k, v, qi, ki = _arrays()
    with pytest.raises(ValueError, match="segment ids: give both"):
        flash_attention(q, k, v, qi, ki, qi, None, interpret=True)


def test_float_indices():
    q, k, v, qi, ki = _arrays()
    with pytest.raises(ValueError, match="qi: expected integer"):
        flash_attention(q, k, v, qi.astype(jnp.float32), ki, interpret=True)


def test_gradients_against_numpy():
    """jax.grad through flash_attention (forward and backward kernels, the custom_vjp, the
    padding of S = 200) on the packed head_dim-128 case: dq, dk, dv against float64 numpy, to
    1% of each gradient's largest magnitude (bf16 operands: P and dS are rounded to bf16)."""
    args, config, (qi, ki, qseg, kseg) = _inputs("packed128", seed=1)
    q, k, v = args[:3]
    do = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

    def loss(q, k, v):
        o = flash_attention(q, k, v, *args[3:], config=config, interpret=True)
        return jnp.sum(o.astype(jnp.float32) * do)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    mask = reference_np(q, k, v, qi, ki, qseg, kseg, 1.0)[2]
    want = reference_grads_np(q, k, v, do, mask, 1 / math.sqrt(q.shape[3]))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        got = np.asarray(got, np.float64)
        assert got.shape == ref.shape and not np.isnan(got).any(), name
        assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max(), name
