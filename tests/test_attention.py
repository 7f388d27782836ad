"""chunked_causal_attention: values against a float64 numpy reference, gradients against
jax.nn.dot_product_attention, finiteness, compiled memory, and the context-parallel sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models.attention import chunked_causal_attention

F32, BF16 = jnp.float32, jnp.bfloat16

# id: (B, S, N, K, D, block_k, dtype, scale, q_gain)
CASES = {
    "f32-gqa-b2-divisible": (2, 64, 4, 2, 16, 16, F32, None, 1.0),
    "f32-mha-b1-padded-scale": (1, 50, 4, 4, 8, 16, F32, 0.3, 1.0),
    "f32-gqa-b1-block-ge-s": (1, 40, 4, 2, 8, 64, F32, None, 1.0),
    "f32-gqa-b2-large-logits": (2, 48, 4, 2, 16, 16, F32, None, 50.0),
    "bf16-gqa-b2-padded": (2, 56, 4, 2, 16, 16, BF16, None, 1.0),
}
# (value, gradient) tolerances, relative to the reference's largest magnitude
TOLS = {"float32": (1e-5, 1e-5), "bfloat16": (1e-2, 2e-2), "large": (5e-5, 5e-5)}


def _inputs(b, s, n, k, d, dtype, q_gain=1.0, seed=0):
    """q, k, v in `dtype` and a float32 cotangent w [B, S, N, D], standard normal."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q = jnp.asarray(q_gain * draw(b, s, n, d), dtype)
    return (
        q,
        jnp.asarray(draw(b, s, k, d), dtype),
        jnp.asarray(draw(b, s, k, d), dtype),
        jnp.asarray(draw(b, s, n, d)),
    )


def reference_np(q_bsnd, k_bskd, v_bskd, scale):
    """Causal GQA attention in float64 numpy: query head n reads kv head n // (N // K)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bsnd, k_bskd, v_bskd))
    s, n = q.shape[1], q.shape[2]
    k, v = (np.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    scores_bnst = np.einsum("bsnd,btnd->bnst", q, k) * scale
    scores_bnst = np.where(np.tril(np.ones((s, s), bool)), scores_bnst, -np.inf)
    p_bnst = np.exp(scores_bnst - scores_bnst.max(-1, keepdims=True))
    p_bnst /= p_bnst.sum(-1, keepdims=True)
    return np.einsum("bnst,btnd->bsnd", p_bnst, v)


def _loss_grads(attn, q, k, v, w):
    """Gradients of the linear functional sum(attn(q, k, v) * w) w.r.t. q, k, v."""
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(F32) * w)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _jit_grads(attn, q, k, v, w):
    """`_loss_grads` as one compiled program (eagerly, each of its dozens of ops compiled on
    its own: the tests' compile time)."""
    return jax.jit(lambda q, k, v, w: _loss_grads(attn, q, k, v, w))(q, k, v, w)


def _jit_value_and_grads(attn, q, k, v, w):
    """attn(q, k, v) and `_loss_grads(attn, q, k, v, w)` from one compiled program (the
    gradient's program holds the forward anyway: one compile instead of two)."""

    def fn(q, k, v, w):
        def out(q, k, v):
            o = attn(q, k, v)
            return o.astype(F32), o

        _, vjp, o = jax.vjp(out, q, k, v, has_aux=True)
        return o, vjp(w)

    return jax.jit(fn)(q, k, v, w)


def _rel_err(got, want):
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def _all_finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients(case):
    b, s, n, kv, d, block_k, dtype, scale, q_gain = CASES[case]
    q, k, v, w = _inputs(b, s, n, kv, d, dtype, q_gain)
    scale_or_default = d**-0.5 if scale is None else scale
    attn = lambda q, k, v: chunked_causal_attention(q, k, v, block_k=block_k, scale=scale)
    ref = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale_or_default, is_causal=True
    )
    o, grads = _jit_value_and_grads(attn, q, k, v, w)
    up = lambda x: x.astype(F32)
    ref_grads = _jit_grads(ref, up(q), up(k), up(v), w)
    val_tol, grad_tol = TOLS["large" if q_gain > 1 else jnp.dtype(dtype).name]

    assert o.dtype == dtype and o.shape == q.shape
    assert [g.dtype for g in grads] == [dtype] * 3
    assert _all_finite((o, grads))
    assert _rel_err(o, reference_np(q, k, v, scale_or_default)) < val_tol
    for name, got, want in zip("qkv", grads, ref_grads):
        assert _rel_err(got, want) < grad_tol, name


def test_rejects_bad_shapes():
    q, k, v, _ = _inputs(1, 8, 3, 2, 4, F32)
    with pytest.raises(ValueError, match="must divide"):
        chunked_causal_attention(q, k, v)
    with pytest.raises(ValueError, match=r"\[B, T, K, D\]"):
        chunked_causal_attention(q, k[:, :, :, :2], v)


def _temp_bytes(attn, b, s, n, kv, d):
    """Compiled (CPU) temp bytes of the value and q/k/v-gradients of sum(attn(q, k, v) * w)."""
    sds = lambda heads: jax.ShapeDtypeStruct((b, s, heads, d), F32)
    fn = lambda q, k, v, w: jax.value_and_grad(
        lambda q, k, v: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2)
    )(q, k, v)
    compiled = jax.jit(fn).lower(sds(n), sds(kv), sds(kv), sds(n)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_is_linear_in_block_not_quadratic():
    b, s, n, kv, d, block_k = 1, 4096, 4, 2, 32, 512
    chunked = lambda bk: lambda q, k, v: chunked_causal_attention(q, k, v, block_k=bk)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    temp = _temp_bytes(chunked(block_k), b, s, n, kv, d)
    temp_half = _temp_bytes(chunked(block_k // 2), b, s, n, kv, d)
    temp_ref = _temp_bytes(ref, b, s, n, kv, d)
    block_bytes, scores_bytes = s * block_k * n * 4, b * n * s * s * 4
    print(
        f"\nfwd+bwd temp bytes at B={b} S={s} N={n} K={kv} D={d} f32: chunked(block_k="
        f"{block_k}) {temp} = {temp / block_bytes:.2f} x S*block_k*N*4; chunked(block_k="
        f"{block_k // 2}) {temp_half}; dot_product_attention {temp_ref} = "
        f"{temp_ref / scores_bytes:.2f} x B*N*S*S*4"
    )
    assert temp < 8 * block_bytes
    assert temp < scores_bytes / 1.5 and temp * 5 < temp_ref
    assert temp_half < 0.6 * temp  # the temporaries scale with block_k


@pytest.mark.parametrize("under_set_mesh", [False, True])
def test_context_parallel_sharding_matches_unsharded(under_set_mesh):
    b, s, n, kv, d, block_k = 2, 56, 4, 2, 8, 16  # 56 = 4 * 14 rows per context shard, padded
    q, k, v, w = _inputs(b, s, n, kv, d, F32, seed=1)
    attn = lambda q, k, v: chunked_causal_attention(q, k, v, block_k=block_k)
    fn = jax.jit(lambda q, k, v, w: (attn(q, k, v), _loss_grads(attn, q, k, v, w)))
    want = fn(q, k, v, w)

    mesh = jax.make_mesh((2, 4), ("data", "context"))  # Explicit axis types
    q_spec, kv_spec = P("data", "context", None, None), P("data", None, None, None)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(w, q_spec))
    if under_set_mesh:
        with jax.set_mesh(mesh):
            got = fn(*args)
    else:
        got = fn(*args)

    o, (dq, dk, dv) = got
    assert [x.sharding.spec for x in (o, dq, dk, dv)] == [q_spec, q_spec, kv_spec, kv_spec]
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel_err(g, w_) < 1e-5


def test_no_mask_residuals_in_a_rematerialised_layer_scan():
    """Inside a differentiated layer scan with the attention rematerialised (the model's
    scan_layers + attention_remat=full), JAX must not hoist the causal masks out of the
    backward as stacked [blocks, B, block_q, block_k] residuals (found at full size: 75 GiB per
    device); the barrier in `blocks.pair_mask` makes them depend on the keys. Nor may
    it keep every pair's scores (a `lax.cond` per pair did: [nq, nk, B, block_q, K, G, block_k]
    float32, 16 GiB buffers at 32,768 tokens per device). Read from the jaxpr: no bool array
    there of rank >= 4 leads with a number of blocks, and no array of rank >= 5 with both."""
    b, s, n, kv, d, block = 2, 64, 4, 2, 8, 16
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for h in (n, kv, kv))
    attn = jax.checkpoint(
        lambda q, k, v: chunked_causal_attention(q, k, v, block_k=block),
        policy=jax.checkpoint_policies.nothing_saveable,
    )

    def layers(q, k, v):
        def body(x, _):
            return x + attn(q + x, k + x[..., :kv, :], v), None

        return jnp.sum(jax.lax.scan(body, jnp.zeros_like(q), None, length=3)[0] ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(layers, argnums=(0, 1, 2)))(q, k, v)
    shapes = set()

    def walk(jx):
        for eqn in jx.eqns:
            for var in eqn.outvars:
                aval = getattr(var, "aval", None)
                if aval is not None and hasattr(aval, "shape"):
                    shapes.add((tuple(aval.shape), aval.dtype == jnp.bool_))
            for p in eqn.params.values():
                for j in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(j, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    assert ((b, block, block), True) in shapes, shapes  # the walk sees the per-block masks
    nb = s // block
    stacked = [sh for sh, is_bool in shapes if is_bool and len(sh) >= 4 and sh[0] == nb]
    assert not stacked, stacked
    pairs = [sh for sh, _ in shapes if len(sh) >= 5 and sh[:2] == (nb, nb)]
    assert not pairs, pairs


# ------------------------------------------------------------------ packed documents


def _segments(b, s, seed=0):
    """[B, S] int32 segment ids: each row a few documents of random lengths, then padding (0)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((b, s), np.int32)
    for r in range(b):
        pos, seg = 0, 1
        while pos < s - 4:
            n = int(rng.integers(1, s // 2))
            out[r, pos : pos + n] = seg
            pos, seg = pos + n, seg + 1
    return out


def masked_reference_np(q_bsnd, k_bskd, v_bskd, seg_bs, scale):
    """Causal GQA attention within equal segment ids, float64 numpy."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bsnd, k_bskd, v_bskd))
    s, n = q.shape[1], q.shape[2]
    k, v = (np.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    allowed_bst = np.tril(np.ones((s, s), bool))[None] & (seg_bs[:, :, None] == seg_bs[:, None, :])
    scores_bnst = np.einsum("bsnd,btnd->bnst", q, k) * scale
    scores_bnst = np.where(allowed_bst[:, None], scores_bnst, -np.inf)
    p_bnst = np.exp(scores_bnst - scores_bnst.max(-1, keepdims=True))
    p_bnst /= p_bnst.sum(-1, keepdims=True)
    return np.einsum("bnst,btnd->bsnd", p_bnst, v)


@pytest.mark.parametrize("impl", ["chunked", "xla"])
def test_segment_ids_keep_attention_inside_each_document(impl):
    """Values against float64 numpy; gradients against a dense float32 masked softmax written
    here (an independent program); and each document's output equals that document run alone
    (so no query reads another document's keys)."""
    from relaymoe_jax.models.layers import causal_attention

    b, s, n, kv, d = 2, 50, 4, 2, 8  # S not a multiple of the key block
    q, k, v, w = _inputs(b, s, n, kv, d, F32, seed=3)
    seg = _segments(b, s, seed=3)
    attn = lambda q, k, v: causal_attention(q, k, v, impl, block_k=16, segment_ids=jnp.asarray(seg))
    got, grads = _jit_value_and_grads(attn, q, k, v, w)
    want = masked_reference_np(q, k, v, seg, d**-0.5)
    assert _rel_err(got, want) < 1e-5

    def dense(q, k, v):
        g = n // kv
        kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        sc = jnp.einsum("bsnd,btnd->bnst", q, kk, precision="highest") * d**-0.5
        ok = jnp.tril(jnp.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])
        p = jax.nn.softmax(jnp.where(ok[:, None], sc, -jnp.inf), axis=-1)
        return jnp.einsum("bnst,btnd->bsnd", p, vv, precision="highest")

    for g_got, g_want in zip(grads, _jit_grads(dense, q, k, v, w)):
        assert _rel_err(g_got, g_want) < 1e-5
    # Each document alone, as one batch row of its own padded at the end to S (causal: the
    # document's outputs read none of the padding after it), all in one call and one compile.
    r, ids = 0, seg[0]
    slices = [np.flatnonzero(ids == doc) for doc in sorted(set(ids[ids > 0].tolist()))]

    def lone(x):  # [documents, S, heads, D] in numpy (eager jnp: one compile per document)
        x = np.asarray(x)
        out = np.zeros((len(slices), *x.shape[1:]), x.dtype)
        for i, sl in enumerate(slices):
            out[i, : len(sl)] = x[r, sl]
        return out

    alone = jax.jit(causal_attention, static_argnums=(3, 4))(lone(q), lone(k), lone(v), impl, 16)
    for i, sl in enumerate(slices):
        assert _rel_err(got[r, sl], alone[i, : len(sl)]) < 1e-5


@pytest.mark.parametrize("name", ["segment_ids", "q_index", "k_index"])
def test_bad_per_token_arrays_are_refused(name):
    q, k, v, _ = _inputs(1, 8, 2, 2, 4, F32)
    with pytest.raises(ValueError, match=rf"{name}: shape \(1, 7\), expected \[batch, seq\]"):
        chunked_causal_attention(q, k, v, **{name: jnp.zeros((1, 7), jnp.int32)})
    with pytest.raises(ValueError, match=f"{name}: expected an integer dtype, got float32"):
        chunked_causal_attention(q, k, v, **{name: jnp.zeros((1, 8))})


# ------------------------------------------------------------------ indices and block skipping


def indexed_reference_np(q_bsnd, k_btkd, v_btkd, qi_bs, ki_bt, qseg_bs, kseg_bt, scale):
    """GQA attention in float64 numpy where query i sees key j iff ki[j] <= qi[i] and their
    segment ids are equal; a query that sees no key gives 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bsnd, k_btkd, v_btkd))
    n = q.shape[2]
    k, v = (np.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    ok_bst = (ki_bt[:, None, :] <= qi_bs[:, :, None]) & (qseg_bs[:, :, None] == kseg_bt[:, None])
    scores_bnst = np.einsum("bsnd,btnd->bnst", q, k) * scale
    scores_bnst = np.where(ok_bst[:, None], scores_bnst, -np.inf)
    top = np.where(ok_bst[:, None].any(-1, keepdims=True), scores_bnst.max(-1, keepdims=True), 0)
    p_bnst = np.exp(scores_bnst - top)
    p_bnst /= np.maximum(p_bnst.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bnst,btnd->bsnd", p_bnst, v)


def _doc_ids(b, t, lengths, pad):
    """[B, T] segment ids 1, 2, ... of documents with these lengths (cycled), then `pad`
    padding tokens with id 0."""
    out = np.zeros((b, t), np.int32)
    for r in range(b):
        pos, doc = 0, 1
        while pos < t - pad:
            n = lengths[(r + doc) % len(lengths)]
            out[r, pos : min(pos + n, t - pad)] = doc
            pos, doc = pos + n, doc + 1
    return out


def _visible_pairs_np(qi_bs, ki_bt, qseg_bs, kseg_bt, bq, bk):
    """The exact number of (query block, key block) pairs holding a visible (query, key) pair in
    some row, from the dense [B, S, T] mask."""
    ok_bst = (ki_bt[:, None, :] <= qi_bs[:, :, None]) & (qseg_bs[:, :, None] == kseg_bt[:, None])
    s, t = ok_bst.shape[1:]
    nq, nk = -(-s // bq), -(-t // bk)
    return sum(
        ok_bst[:, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
        for i in range(nq)
        for j in range(nk)
    )


# id: (S queries, T keys, query offset, doc lengths, padding tokens, block_q, block_k)
INDEXED = {
    "causal-all": (64, 64, 0, (64,), 0, 16, 16),
    "docs-cross-blocks": (64, 64, 0, (11, 23, 7), 0, 16, 16),
    "docs-padding": (60, 60, 0, (13, 9), 6, 16, 8),
    "query-offset-docs": (24, 64, 33, (10, 21), 0, 8, 16),
}


@pytest.mark.parametrize("case", list(INDEXED))
def test_indexed_documents_values_gradients_and_visited_blocks(case):
    """Queries at explicit indices (a slab of the sequence, as one device holds under context
    parallelism) against all keys, with documents crossing blocks and a padding segment: values
    against float64 numpy, q/k/v gradients against a dense masked softmax in float32 (an
    independent program); the forward and the backward each visit exactly the block pairs that
    hold a visible pair (a numpy count from the dense mask), and fewer than all of them. A
    padding segment (id 0 after the documents) adds pairs that hold none, never fewer: the
    block where it starts meets every document, so the backward's range of each earlier key
    block reaches it (`blocks.query_ranges`)."""
    from relaymoe_jax.models import attention_xla

    s, t, offset, lengths, pad, bq, bk = INDEXED[case]
    b, n, kv, d = 2, 4, 2, 8
    rng = np.random.default_rng(5)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    q, k, v, w = draw(b, s, n, d), draw(b, t, kv, d), draw(b, t, kv, d), draw(b, s, n, d)
    kseg = _doc_ids(b, t, lengths, pad)
    qseg = kseg[:, offset : offset + s]
    ki = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    qi = ki[:, offset : offset + s]
    given = dict(segment_ids=qseg, kv_segment_ids=kseg, q_index=qi, k_index=ki)
    attn = lambda q, k, v: chunked_causal_attention(q, k, v, block_k=bk, block_q=bq, **given)
    got, grads = _jit_value_and_grads(attn, q, k, v, w)
    assert _rel_err(got, indexed_reference_np(q, k, v, qi, ki, qseg, kseg, d**-0.5)) < 1e-5

    def dense(q, k, v):
        g = n // kv
        kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        sc = jnp.einsum("bsnd,btnd->bnst", q, kk, precision="highest") * d**-0.5
        ok = (ki[:, None, :] <= qi[:, :, None]) & (qseg[:, :, None] == kseg[:, None])
        p = jax.nn.softmax(jnp.where(ok[:, None], sc, -jnp.inf), axis=-1)
        return jnp.einsum("bnst,btnd->bsnd", p, vv, precision="highest")

    for g_got, g_want in zip(grads, _jit_grads(dense, q, k, v, w)):
        assert _rel_err(g_got, g_want) < 1e-5

    arrays = (q, k, v, *map(jnp.asarray, (qi, ki, qseg, kseg)))

    @jax.jit
    def visits(arrays, w):  # the forward's and the backward's counts, one compiled program
        o, lse, fwd_visits = attention_xla.forward(*arrays, bq, bk, d**-0.5)
        res = (*arrays[:3], *arrays[3:5], *arrays[5:], o, lse)
        return fwd_visits, attention_xla.backward(bq, bk, d**-0.5, res, w)[1]

    fwd_visits, bwd_visits = visits(arrays, w)
    exact = _visible_pairs_np(qi, ki, qseg, kseg, bq, bk)
    total = -(-s // bq) * -(-t // bk)
    print(f"\n{case}: visited {int(fwd_visits)} / {total} block pairs, {exact} hold a visible pair")
    assert exact <= int(fwd_visits) < total and exact <= int(bwd_visits) < total
    if not pad:
        assert int(fwd_visits) == int(bwd_visits) == exact


def test_keys_apart_from_queries_need_their_indices_and_blocks_are_checked():
    q, k, v, _ = _inputs(1, 8, 2, 2, 4, F32)
    with pytest.raises(ValueError, match="k has 8 positions and q 4: give q_index"):
        chunked_causal_attention(q[:, :4], k, v)
    with pytest.raises(ValueError, match="block_q must be a positive int, got 0"):
        chunked_causal_attention(q, k, v, block_q=0)
