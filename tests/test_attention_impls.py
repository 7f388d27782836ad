"""The attention implementations behind `attention_impl` meet: "auto" resolves by platform,
head_dim and dtype; the Pallas kernel ("pallas-interpret": the Mosaic GPU interpreter on CPU)
under the context-parallel shard_map and inside the model equals the dense reference and the
chunked path; a rematerialised layer scan keeps none of its block ranges.

The kernel's own values, gradients and visited blocks against float64 numpy are in
tests/test_attention_pallas.py and tests/test_attention_pallas_bwd.py; its XLA:GPU compile in
tests/test_attention_gpu_compile.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import callback as jax_callback
from jax._src import effects as jax_effects
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.models import QwenMoe
from relaymoe_jax.models.attention import blockwise_attention
from relaymoe_jax.models.config_files import load_config
from relaymoe_jax.models.context import zigzag_order
from relaymoe_jax.models.layers import resolve_attention_impl

BF16 = jnp.bfloat16


def context_mesh(c=4):
    return jax.make_mesh((c,), ("context",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_auto_is_the_kernel_on_gpus_only():
    """ "auto": "chunked" on CPU; "pallas" where the code compiles for a GPU (the deviceless GPU
    mesh in context) and the kernel takes head_dim and the dtype; the other names are kept."""
    assert resolve_attention_impl("auto", 128, BF16) == "chunked"
    if gpu_mesh.plugin_available():
        with jax.set_mesh(gpu_mesh.mesh((1,), ("data",))):
            assert resolve_attention_impl("auto", 128, BF16) == "pallas"
            assert resolve_attention_impl("auto", 64, jnp.float16) == "pallas"
            assert resolve_attention_impl("auto", 96, BF16) == "chunked"  # head_dim
            assert resolve_attention_impl("auto", 128, jnp.float32) == "chunked"  # dtype
            assert resolve_attention_impl("xla", 128, BF16) == "xla"
    for impl in ("xla", "chunked", "pallas", "pallas-interpret"):
        assert resolve_attention_impl(impl, 16, jnp.float32) == impl


def dense_reference(q, k, v, qi, ki, qseg, kseg):
    """float32 masked softmax attention over all [S, T] pairs (jnp: differentiable)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    mask = (ki[:, None, :] <= qi[:, :, None]) & (qseg[:, :, None] == kseg[:, None, :])
    s = jnp.einsum("bsnd,btnd->bnst", q, k) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bnst,btnd->bsnd", jnp.where(mask[:, None], p, 0.0), v)


def _packed(b, s, seed):
    """Segment ids 1, 1, ..., 2, 2, ... (documents of random lengths, crossing blocks)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, s), size=3, replace=False))
    return jnp.asarray(np.broadcast_to(np.searchsorted(cuts, np.arange(s), "right"), (b, s)))


def test_kernel_in_zigzag_order_equals_the_dense_reference():
    """`blockwise_attention(kernel="pallas-interpret")` on a packed row in the zigzag order of
    context=4 (each token at its index, as the model passes them): o, dq, dk, dv equal the
    dense reference's (float32 on the same bf16 inputs) to bf16 rounding."""
    b, s, n, kv, d = 1, 256, 2, 1, 64
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.normal(size=(b, s, h, d)), BF16) for h in (n, kv, kv, n))
    order = jnp.asarray(zigzag_order(s, 4))
    idx = jnp.broadcast_to(order, (b, s)).astype(jnp.int32)
    seg = _packed(b, s, seed=1)[:, order].astype(jnp.int32)

    def kernel(q, k, v):
        kw = dict(block_k=64, scale=None, seg_bs=seg, seg_kv=seg, kernel="pallas-interpret")
        return blockwise_attention(q, k, v, q_index=idx, k_index=idx, **kw)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_vjp(fn, do):  # one compiled program each (eagerly: one per op)
        o, vjp = jax.vjp(fn, q, k, v)
        return o, *vjp(do)

    dense = lambda *a: dense_reference(*a, idx, idx, seg, seg)
    want = value_and_vjp(dense, do.astype(jnp.float32))
    for name, g, w in zip(("o", "dq", "dk", "dv"), value_and_vjp(kernel, do), want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-2, (name, err)


def test_the_interpreter_on_a_context_mesh_is_refused():
    """jax 0.12's Mosaic GPU interpreter checks its barriers across devices, so one kernel run
    on several devices at once waits forever inside it: q sharded along the sequence is refused
    first, in one line (the compiled kernel under the shard_map:
    tests/test_attention_gpu_compile.py; other meshes: tests/test_attention_interpret.py)."""
    m = context_mesh()
    q = jnp.zeros((1, 256, 2, 64), BF16)
    k = jnp.zeros((1, 256, 1, 64), BF16)
    with jax.set_mesh(m):
        q = jax.device_put(q, NamedSharding(m, P(None, "context")))
        with pytest.raises(ValueError, match="'pallas-interpret' on a mesh of 4 devices: jax"):
            blockwise_attention(
                q, k, k, block_k=64, scale=None, seg_bs=None, seg_kv=None, kernel="pallas-interpret"
            )


def test_a_rematerialised_layer_scan_keeps_no_block_ranges():
    """Inside a differentiated layer scan with the attention rematerialised, the kernel path
    stacks nothing but the checkpoint's inputs over the layers: no block ranges (int32 per block),
    no log-sum-exp, no output (the compiled kernel, traced; the interpreter's io effects would
    keep its outputs)."""
    b, s, n, kv, d, layers = 1, 256, 2, 1, 64, 3
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), BF16) for h in (n, kv, kv))
    attn = jax.checkpoint(
        lambda q, k, v: blockwise_attention(
            q, k, v, block_k=64, scale=None, seg_bs=None, seg_kv=None, kernel="pallas"
        ),
        policy=jax.checkpoint_policies.nothing_saveable,
    )

    def loss(q, k, v):
        def body(x, _):
            return x + attn(q + x, k + x[..., :kv, :], v), None

        out = jax.lax.scan(body, jnp.zeros_like(q), None, length=layers)[0]
        return jnp.sum(out.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    stacked = set()

    def walk(jx):
        for eqn in jx.eqns:
            for var in eqn.outvars:
                shape = getattr(getattr(var, "aval", None), "shape", ())
                if len(shape) > 1 and shape[0] == layers:
                    stacked.add((tuple(shape), str(var.aval.dtype)))
            for p in eqn.params.values():
                for j in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(j, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    inputs = {((layers, b, s, n, d), "bfloat16"), ((layers, b, s, kv, d), "bfloat16")}
    assert stacked == inputs, stacked


def test_model_with_the_kernel_equals_the_chunked_model(monkeypatch):
    """The tiny model (head_dim 64, bf16, packed documents: segment ids and positions), its
    attention rematerialised (`jax.checkpoint` around the interpreted kernel): loss and
    gradients with attention_impl="pallas-interpret" equal "chunked"'s to bf16 rounding. jax
    refuses the interpreter's ordered-IO effect in a checkpoint's AD unless it is allowed: it
    is disallowed here as in a fresh process, and the model allows it itself. One layer: the
    second of configs/tiny.yaml ran the same kernel, remat and packing path again (a second
    interpreted kernel and its backward in the one compiled step); layers stacked under a
    rematerialised scan: test_a_rematerialised_layer_scan_keeps_no_block_ranges."""
    types = jax_effects.remat_allowed_effects._effect_types
    fresh = {t for t in types if t is not jax_callback.OrderedIOEffect}
    monkeypatch.setattr(jax_effects.remat_allowed_effects, "_effect_types", fresh)
    b, s, packed = 2, 128, True
    m = jax.make_mesh((1,), ("expert",))
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 256, size=(b, s)), jnp.int32)
    seg = pos = None
    if packed:
        seg = _packed(b, s, seed=4).astype(jnp.int32)
        starts = np.searchsorted(np.asarray(seg[0]), np.asarray(seg[0]), "left")
        pos = jnp.broadcast_to(jnp.asarray(np.arange(s) - starts, jnp.int32), (b, s))
    got = {}
    for impl in ("chunked", "pallas-interpret"):
        extra = dict(attention_block_k=64) if impl == "chunked" else {}
        cfg = load_config(
            "configs/tiny.yaml",
            head_dim=64,
            num_hidden_layers=1,
            attention_impl=impl,
            attention_remat="full",
            **extra,
        )
        model = QwenMoe(cfg, mesh=m, rngs=nnx.Rngs(0), dtype=BF16)

        def loss(model, ids):
            logits, aux = model(ids, segment_ids=seg, positions=pos)
            x = logits.astype(jnp.float32)
            targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
            nll = -jnp.sum(jax.nn.log_softmax(x) * jax.nn.one_hot(targets, x.shape[-1]), -1)
            return jnp.mean(nll[:, :-1]) + aux.router_loss

        value, grads = nnx.jit(nnx.value_and_grad(loss))(model, ids)
        got[impl] = (float(value), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)])
    (v_c, g_c), (v_p, g_p) = got["chunked"], got["pallas-interpret"]
    assert abs(v_p - v_c) <= 2e-3 * abs(v_c), (v_p, v_c)
    for a, c in zip(g_p, g_c):
        assert np.abs(a - c).max() <= 3e-2 * max(np.abs(c).max(), 1e-12)
