"""Balanced context parallelism (`models/context.py`): the zigzag order and its moves against
numpy, the per-device causal work it balances, and the whole model's loss, gradients, logits
and router logits equal to the contiguous layout's, on `context=4` and `data=2,context=4`, with
and without packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_models import input_ids, lm_loss, mesh, tiny

from relaymoe_jax.kernels.attention.blocks import PAD_KEY, PAD_QUERY, blocks, key_ranges
from relaymoe_jax.models import QwenMoe, context
from relaymoe_jax.models.sharding import rules_for


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_zigzag_order_gives_device_c_pieces_c_and_2c_minus_1_minus_c(c):
    s = 2 * c * 3
    order = context.zigzag_order(s, c)
    assert sorted(order.tolist()) == list(range(s))  # a permutation
    share = order.reshape(c, 2, 3)  # [device, slot, token]
    for d in range(c):
        assert share[d, 0].tolist() == [3 * d + t for t in range(3)]
        assert share[d, 1].tolist() == [3 * (2 * c - 1 - d) + t for t in range(3)]
    with pytest.raises(ValueError, match="seq 10 is not a multiple of 2 x context = 8"):
        context.zigzag_order(10, 4)


@pytest.mark.parametrize("shape,names", [((4,), ("context",)), ((2, 4), ("data", "context"))])
def test_moves_equal_numpy_and_their_gradient_is_the_inverse(shape, names):
    m = mesh(shape, names)
    rules = rules_for(m)
    c, b = rules.size("seq"), 2
    s = 2 * c * 5
    spec = P(rules.fit((b, s), "batch", "seq")[0], "context", None)
    x_np = np.random.default_rng(0).standard_normal((b, s, 3)).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(m, spec))
    order = context.zigzag_order(s, c)
    z = jax.jit(lambda x: context.to_zigzag(x, rules))(x)
    np.testing.assert_array_equal(np.asarray(z), x_np[:, order])
    back = jax.jit(lambda x: context.from_zigzag(x, rules))(z)
    np.testing.assert_array_equal(np.asarray(back), x_np)
    w = jax.device_put(np.arange(b * s * 3, dtype=np.float32).reshape(b, s, 3), x.sharding)
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(context.to_zigzag(x, rules) * w)))(x, w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[:, np.argsort(order)])


def _per_device_pairs(order, c, block):
    """Block pairs each device's queries visit against all keys (in `order`), causal: the
    lengths of the key-block ranges (`key_ranges`) of its query blocks."""
    s = order.size
    k_idx = jnp.asarray(order)[None]
    ki = blocks(k_idx, block, PAD_KEY)
    share = s // c
    out = []
    for d in range(c):
        qi = blocks(k_idx[:, d * share : (d + 1) * share], block, PAD_QUERY)
        ranges = key_ranges(qi, ki)
        out.append(int((ranges.end - ranges.start).sum()))
    return np.asarray(out)


def test_zigzag_balances_the_causal_work_over_8_devices():
    """Per-device attention work (block pairs visited, each 4·block²·N·D FLOPs forward) at
    C = 8, 16 query blocks per device: contiguous max / mean = 2C / (C + 1) ≈ 1.78; zigzag
    ≤ 1.05 (equal but for the diagonal blocks)."""
    c, block = 8, 128
    s = 2 * c * 8 * block
    contiguous = _per_device_pairs(np.arange(s, dtype=np.int32), c, block)
    zigzag = _per_device_pairs(context.zigzag_order(s, c), c, block)
    print(f"\nblock pairs per device, C=8, S={s}: contiguous {contiguous.tolist()}")
    print(f"zigzag {zigzag.tolist()}")
    assert contiguous.sum() == zigzag.sum()  # the same pairs, spread otherwise
    assert contiguous.max() / contiguous.mean() > 1.7
    assert zigzag.max() / zigzag.mean() <= 1.05


def _packed(b, s, seed):
    """Segment ids [B, S] (documents of 5-17 tokens, then 3 padding tokens) and positions
    restarting at each document."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((b, s), np.int32), np.zeros((b, s), np.int32)
    for r in range(b):
        start, doc = 0, 1
        while start < s - 3:
            n = min(int(rng.integers(5, 18)), s - 3 - start)
            seg[r, start : start + n], pos[r, start : start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
        pos[r, s - 3 :] = np.arange(3)
    return jnp.asarray(seg), jnp.asarray(pos)


# One decoder layer, and the dense reference dispatcher, whose program compiles in about half the
# ring's time: the zigzag order is the model's and the attention's (`QwenMoe.hidden`, the
# decoder's positions); the MoE block is per token, whichever dispatcher, and the ring in the
# zigzag order trains to the EP=8 losses in
# tests/test_train_mesh.py::test_packed_documents_under_context_parallelism_match_ep8[chunked].
SMALL = dict(num_hidden_layers=1, dispatcher="reference")

# Each mesh once, each with or without packed documents: the packed case on the mesh that also
# shards the batch (its segment ids and positions move over data and context).
MODEL_CASES = [((4,), ("context",), False), ((2, 4), ("data", "context"), True)]


@pytest.mark.parametrize(
    "shape,names,packed", MODEL_CASES, ids=["context4-unpacked", "data2_context4-packed"]
)
def test_the_model_in_zigzag_order_equals_the_contiguous_layout(shape, names, packed):
    """Loss, gradients and logits of the tiny model (`SMALL`: one decoder layer; chunked attention,
    8-token blocks: each device's two pieces are one block each) in the zigzag layout equal the
    contiguous one's; the router logits come back in the natural order.

    Also covers the former cases [shape0-names0-packed] (packed documents: here on
    data=2,context=4, where the segment ids move over both axes) and [shape1-names1-unpacked]
    (the (data, context) mesh: here packed; unpacked on context=4). One layer: the zigzag
    order is entered before the first layer and left after the last, and a second layer would
    run the same attention and MoE again (the layer-to-layer path is the residual stream)."""
    m = mesh(shape, names)
    b, s = 2, 64
    assert context.zigzag_size("zigzag", "chunked", rules_for(m), b, s) == 4  # it applies
    assert context.zigzag_size("zigzag", "xla", rules_for(m), b, s) is None
    ids = input_ids(seed=2, b=b, s=s)
    seg, pos = _packed(b, s, seed=3) if packed else (None, None)
    got = {}
    for layout in ("zigzag", "contiguous"):
        cfg = tiny(attention_impl="chunked", attention_block_k=8, context_layout=layout, **SMALL)
        model = QwenMoe(cfg, mesh=m, rngs=nnx.Rngs(0))

        def loss(model, ids):
            logits, aux = model(ids, segment_ids=seg, positions=pos, return_router_logits=True)
            x = logits.astype(jnp.float32)
            targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
            nll = -jnp.sum(jax.nn.log_softmax(x) * jax.nn.one_hot(targets, x.shape[-1]), -1)
            mask = (jnp.arange(s) < s - 1).astype(jnp.float32)
            return jnp.sum(nll * mask) / (b * (s - 1)) + aux.router_loss, (logits, aux)

        (value, (logits, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, ids)
        got[layout] = (value, logits, aux.router_logits, nnx.state(grads))
    (v_z, l_z, r_z, g_z), (v_c, l_c, r_c, g_c) = got["zigzag"], got["contiguous"]
    np.testing.assert_allclose(float(v_z), float(v_c), rtol=1e-6)
    scale = np.abs(np.asarray(l_c)).max()
    assert np.abs(np.asarray(l_z) - np.asarray(l_c)).max() <= 1e-5 * scale
    np.testing.assert_allclose(np.asarray(r_z), np.asarray(r_c), atol=1e-5)
    for a, c_ in zip(jax.tree.leaves(g_z), jax.tree.leaves(g_c)):
        a, c_ = np.asarray(a, np.float64), np.asarray(c_, np.float64)
        assert np.abs(a - c_).max() <= 1e-5 * max(np.abs(c_).max(), 1e-12)
    # and the contiguous layout is the unsharded model's (the reference of both)
    plain = QwenMoe(
        tiny(attention_impl="chunked", attention_block_k=8, **SMALL),
        mesh=mesh(),
        rngs=nnx.Rngs(0),
    )
    ref = nnx.jit(lambda mo, i: lm_loss(mo, i))(plain, ids) if not packed else None
    if ref is not None:
        np.testing.assert_allclose(float(v_c), float(ref), rtol=1e-5)
