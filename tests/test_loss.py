"""The chunked LM head + cross-entropy (`relaymoe_jax.models.loss.lm_loss`) against float64
numpy, value and gradients, on sharded meshes and chunk sizes that do and do not divide the
tokens; its compiled memory has no [tokens, vocab] buffer; the trainer's loss equals the model's
full-logits loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relaymoe_jax.models import rules_for
from relaymoe_jax.models.loss import lm_loss

H, V = 16, 40


def reference(x, w, t, wt):
    """(loss, dloss/dx, dloss/dw) in float64 numpy."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    logits = np.einsum("bsh,hv->bsv", x, w)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    onehot = np.eye(w.shape[1])[np.asarray(t)]
    wt = np.asarray(wt, np.float64)
    loss = -np.sum(np.sum(logp * onehot, -1) * wt)
    dlogits = wt[..., None] * (np.exp(logp) - onehot)
    return loss, np.einsum("bsv,hv->bsh", dlogits, w), np.einsum("bsh,bsv->hv", x, dlogits)


def case(b, s, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, s, H)).astype(np.float32)
    w = rng.normal(size=(H, V)).astype(np.float32)
    t = rng.integers(0, V, (b, s)).astype(np.int32)
    wt = (rng.random((b, s)) < 0.8).astype(np.float32)  # some positions have no target
    wt[0, -1] = 0.0
    return x, w, t, wt


@pytest.mark.parametrize(
    "shape,names,b,s,chunk",
    [
        ((8,), ("expert",), 8, 6, 4),  # batch over expert, 6 local tokens, chunk 4: padded
        ((2, 4), ("data", "context"), 2, 16, 3),  # folded: batch over data, seq over context
        ((2, 4), ("data", "context"), 2, 16, 64),  # chunk larger than the local tokens
        ((8,), ("expert",), 2, 5, 2),  # batch 2 does not divide 8: replicated
    ],
)
def test_matches_float64(shape, names, b, s, chunk):
    rules = rules_for(jax.make_mesh(shape, names))
    x, w, t, wt = case(b, s)
    f = jax.jit(
        jax.value_and_grad(lambda x, w: lm_loss(x, w, t, wt, rules, chunk=chunk), argnums=(0, 1))
    )
    with jax.set_mesh(rules.mesh):
        loss, (dx, dw) = f(jnp.asarray(x), jnp.asarray(w))
    ref_loss, ref_dx, ref_dw = reference(x, w, t, wt)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(dw, ref_dw, rtol=2e-5, atol=2e-6)


def test_every_position_counts():
    """Changing one target (or zeroing one weight) changes the loss by that position's term."""
    rules = rules_for(jax.make_mesh((8,), ("expert",)))
    x, w, t, wt = case(8, 4, seed=1)
    wt[:] = 1.0
    f = jax.jit(lambda t, wt: lm_loss(jnp.asarray(x), jnp.asarray(w), t, wt, rules, chunk=3))
    with jax.set_mesh(rules.mesh):
        base = float(f(t, wt))
        for b, s in [(0, 0), (7, 3), (3, 2)]:
            t2, wt2 = t.copy(), wt.copy()
            t2[b, s] = (t[b, s] + 1) % V
            wt2[b, s] = 0.0
            np.testing.assert_allclose(
                float(f(t2, wt)) - base,
                reference(x, w, t2, wt)[0] - reference(x, w, t, wt)[0],
                rtol=1e-4,
                atol=1e-5,
            )
            np.testing.assert_allclose(float(f(t, wt2)), reference(x, w, t, wt2)[0], rtol=2e-6)


def test_bad_input():
    rules = rules_for(jax.make_mesh((8,), ("expert",)))
    x, w, t, wt = case(8, 4)
    with pytest.raises(ValueError, match=r"chunk=0: expected a positive int"):
        lm_loss(x, w, t, wt, rules, chunk=0)
    with pytest.raises(ValueError, match=r"head weight shape \(40, 16\): expected \[16, vocab\]"):
        lm_loss(x, w.T, t, wt, rules)
    with pytest.raises(ValueError, match=r"targets shape \(8, 3\): expected \(8, 4\)"):
        lm_loss(x, w, t[:, :3], wt, rules)


def test_no_full_logits_buffer():
    """XLA's buffer assignment: loss and both gradients at 2,048 tokens per device and a
    16,384-entry vocabulary need well under one [tokens, vocab] float32 buffer (128 MiB) of
    temporaries with chunks of 128; the full-logits formula needs several."""
    rules = rules_for(jax.make_mesh((8,), ("expert",)))
    b, s, h, v = 8, 2048, 64, 16384
    args = (
        jax.ShapeDtypeStruct((b, s, h), jnp.bfloat16),
        jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, s), jnp.int32),
        jax.ShapeDtypeStruct((b, s), jnp.float32),
    )
    shard = lambda a, spec: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=jax.NamedSharding(rules.mesh, spec)
    )
    P = jax.P
    args = (
        shard(args[0], P("expert", None, None)),
        shard(args[1], P()),
        shard(args[2], P("expert", None)),
        shard(args[3], P("expert", None)),
    )

    def full(x, w, t, wt):
        logp = jax.nn.log_softmax(jnp.einsum("bsh,hv->bsv", x, w).astype(jnp.float32))
        return -jnp.sum(jnp.take_along_axis(logp, t[..., None], -1)[..., 0] * wt)

    def temp(f):
        g = jax.jit(jax.grad(f, argnums=(0, 1)))
        with jax.set_mesh(rules.mesh):
            return g.trace(*args).lower().compile().memory_analysis().temp_size_in_bytes

    logits_bytes = s * v * 4
    chunked = temp(lambda x, w, t, wt: lm_loss(x, w, t, wt, rules, chunk=128))
    assert temp(full) > 2 * logits_bytes
    assert chunked < logits_bytes / 4, (chunked, logits_bytes)
