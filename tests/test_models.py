"""The Flax NNX Qwen-MoE model on 8 emulated CPU devices: dispatchers agree (values and all
gradients), the router and its losses against numpy, the expert bias, layer placement, remat
names, and the (data, expert) and folded (data, context) meshes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from relaymoe_jax.models import ModelConfig, QwenMoe, rules_for
from relaymoe_jax.models import router_losses as router
from relaymoe_jax.models.decoder import DenseMLP
from relaymoe_jax.models.moe_layer import MoELayer
from relaymoe_jax.models.sharding import from_tokens, to_tokens

B, S = 2, 8  # 16 tokens: 2 per device on 8 devices

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    initializer_range=0.2,
    router_z_loss_coef=1e-3,
    router_aux_loss_coef=1e-2,
)


@functools.cache
def mesh(shape=(8,), names=("expert",)):
    return jax.make_mesh(shape, names)


def tiny(**kw):
    return ModelConfig.from_dict({**TINY, **kw})


def input_ids(seed=0, b=B, s=S, vocab=TINY["vocab_size"]):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, s)), jnp.int32)


def lm_loss(model, ids, return_outputs=False):
    """Next-token cross-entropy plus the router losses (no slicing of the possibly seq-sharded
    logits: the last position is masked instead)."""
    logits, aux = model(ids, return_router_logits=return_outputs)
    s = ids.shape[1]
    targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1]), axis=-1)
    mask = (jnp.arange(s) < s - 1).astype(jnp.float32)
    loss = jnp.sum(nll * mask) / (ids.shape[0] * (s - 1)) + aux.router_loss
    return (loss, (logits, aux)) if return_outputs else loss


@nnx.jit
def forward(model, ids):
    return model(ids, return_router_logits=True)


@nnx.jit
def loss_and_grads(model, ids):
    """((loss, (logits, aux)), grads): one compile for values and gradients."""
    return nnx.value_and_grad(lambda m: lm_loss(m, ids, True), has_aux=True)(model)


def flat(state):
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(state)
    }


def transplant(src, dst, mesh_):
    """Copy src's parameters into dst (possibly abstract: `nnx.eval_shape`), each placed on
    dst's own sharding over `mesh_`."""
    src_vars = dict(nnx.iter_graph(src))
    for path, var in nnx.iter_graph(dst):
        if isinstance(var, nnx.Variable):
            target = NamedSharding(mesh_, var.get_value().sharding.spec)
            var.set_value(jax.device_put(np.asarray(src_vars[path].get_value()), target))
    return dst


def assert_close(a, b, rel=1e-5, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    scale = max(np.max(np.abs(b)), 1e-30)
    err = np.max(np.abs(a - b)) / scale
    assert err <= rel, f"{what}: max|a-b|/max|b| = {err:.2e} > {rel}"


# ---------------------------------------------------------------------------------------------
# dispatchers


# The dispatchers are compared on one-layer models (a second layer runs the same op again and
# doubles each compile); the router losses and the expert bias on two layers (`bias_run`).
DISPATCH_LAYERS = 1
MESHES = {
    "expert8": ((8,), ("expert",)),
    "data2_expert4": ((2, 4), ("data", "expert")),
    "folded_data2_context4": ((2, 4), ("data", "context")),
}


@functools.cache
def reference_run(arch):
    extra = dict(shared_expert_intermediate_size=24) if arch == "qwen2_moe" else {}
    cfg = tiny(arch=arch, dispatcher="reference", num_hidden_layers=DISPATCH_LAYERS, **extra)
    model = QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0))
    ids = input_ids()
    (loss, (logits, aux)), grads = loss_and_grads(model, ids)
    return model, ids, logits, aux, loss, flat(grads)


DISPATCH_CASES = [
    ("qwen3_moe", "ring", "expert", "folded_data2_context4"),
    ("qwen2_moe", "ring", "token", "data2_expert4"),
    ("qwen3_moe", "alltoall", "auto", "expert8"),
]


@pytest.mark.parametrize("arch,dispatcher,routing,layout", DISPATCH_CASES)
def test_dispatchers_agree(arch, dispatcher, routing, layout):
    """Same weights, three dispatchers on three meshes: the logits, losses, router logits and
    load, and every parameter's gradient match the dense reference dispatcher on EP=8 (the
    shared expert is outside the op: one dispatcher suffices for qwen2_moe). The model under
    test is built abstract (`nnx.eval_shape`: its shardings, no initialiser compiled) and takes
    the reference's weights; its grouped matmuls are lax.ragged_dot (what is checked here is
    the model around the op; about 60% of the blocked XLA one's compile time, and every
    dispatcher runs that one, CPU's "auto", on every routing and layout in test_dispatch.py).

    Also covers the former test_other_meshes_match (each mesh once, with a dispatcher that
    the former dispatcher cases ran on EP=8): [folded_data2_context4] is the ring-expert case
    (experts over the folded (data, context) axes, the sequence over context), [data2_expert4]
    the ring-token case (tokens over (data, expert), weight gradients summed over data); the
    former [qwen3_moe-ring-expert] / [qwen3_moe-ring-token] cases on EP=8 (expert routing: the
    folded case, the same relay over a folded axis; token routing: on (data, expert), the same
    relay); and the former [qwen2_moe-ring-expert-expert8] (qwen2_moe's shared expert and
    attention: the data2_expert4 case; the model's plumbing on a plain EP=8 mesh: the all-to-all
    case; the ring's on EP=8: test_dispatch.py)."""
    ref_model, ids, ref_logits, ref_aux, ref_loss, ref_grads = reference_run(arch)
    cfg = ref_model.config
    m = mesh(*MESHES[layout])
    rules = rules_for(m)
    if layout == "folded_data2_context4":
        assert rules.expert_axis == ("data", "context") and rules.axes("seq") == ("context",)
    elif layout == "data2_expert4":
        assert rules.expert_axis == "expert" and rules.token_axes == ("data", "expert")
    kept = ("arch", "shared_expert_intermediate_size", "num_hidden_layers")
    over = {k: cfg.as_dict()[k] for k in kept}
    over.update(dispatcher=dispatcher, routing=routing, gmm_impl="ragged_dot")
    model = transplant(
        ref_model, nnx.eval_shape(lambda: QwenMoe(tiny(**over), mesh=m, rngs=nnx.Rngs(1))), m
    )
    assert model.layers[0].mlp.w_gate.get_value().sharding.spec[0] == rules.expert_axis
    (loss, (logits, aux)), grads = loss_and_grads(model, ids)
    assert logits.shape == (B, S, TINY["vocab_size"])
    assert_close(logits, ref_logits, what="logits")
    assert_close(aux.aux_loss, ref_aux.aux_loss, what="aux_loss")
    assert_close(aux.router_logits, ref_aux.router_logits, what="router_logits")
    np.testing.assert_array_equal(aux.expert_load, ref_aux.expert_load)
    assert_close(loss, ref_loss, what="loss")
    grads = flat(grads)
    assert grads.keys() == ref_grads.keys()
    assert len(grads) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    for k in ref_grads:
        assert np.all(np.isfinite(grads[k])), k
        assert_close(grads[k], ref_grads[k], what=f"grad {k}")


# ---------------------------------------------------------------------------------------------
# router


@pytest.mark.parametrize("norm", [True, False])
def test_router_topk_matches_numpy(norm):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((40, 16)), rng.standard_normal((16, 8))
    logits, probs, ids, wts = router.route(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), top_k=3, norm_topk_prob=norm
    )
    ref_logits = x @ w
    ref_p = np.exp(ref_logits - ref_logits.max(-1, keepdims=True))
    ref_p /= ref_p.sum(-1, keepdims=True)
    ref_ids = np.argsort(-ref_p, axis=-1)[:, :3]
    ref_w = np.take_along_axis(ref_p, ref_ids, -1)
    if norm:
        ref_w /= ref_w.sum(-1, keepdims=True)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs, ref_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(wts, ref_w, rtol=1e-5, atol=1e-6)
    assert ids.dtype == jnp.int32 and logits.dtype == jnp.float32


def test_router_topk_stays_sharded():
    """lax.top_k on tokens sharded over an Explicit mesh makes XLA all-gather the whole
    [T_global, E] scores onto every device; the router selects where the tokens live (a
    shard_map), with the ids of numpy on the whole array and no all-gather in the program."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((8 * 64, 16)), rng.standard_normal((16, 32))
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
    x_th = jax.device_put(jnp.asarray(x, jnp.float32), tokens)
    w_he = jax.device_put(jnp.asarray(w, jnp.float32), tokens.update(spec=()))
    route = jax.jit(lambda x, w: router.route(x, w, top_k=4, norm_topk_prob=True)[2])
    ids = route(x_th, w_he)
    np.testing.assert_array_equal(ids, np.argsort(-(x @ w), axis=-1, kind="stable")[:, :4])
    assert ids.sharding.spec[0] == "expert"
    assert "all-gather" not in route.lower(x_th, w_he).compile().as_text()


def numpy_losses(logits_lte, k):
    """float64 numpy: HF's load_balancing_loss_func (concatenated layers), per layer, z-loss."""
    logits = np.asarray(logits_lte, np.float64)
    num_l, t, e = logits.shape
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1)[..., :k]
    counts = np.stack([np.bincount(ids[n].ravel(), minlength=e) for n in range(num_l)])
    f, pm = counts / t, p.mean(1)
    concat = e * np.sum((counts.sum(0) / (num_l * t)) * p.reshape(-1, e).mean(0))
    per_layer = e * np.sum(f * pm, axis=-1)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return concat, per_layer, np.mean(lse**2, axis=-1), counts


def test_losses_match_float64_numpy():
    rng = np.random.default_rng(2)
    logits_lte = rng.standard_normal((3, 50, 8)) * 2
    stats = []
    for n in range(3):
        lg = jnp.asarray(logits_lte[n], jnp.float32)
        probs = jax.nn.softmax(lg)
        _, ids = jax.lax.top_k(probs, 2)
        stats.append(
            (*router.balance_stats(probs, ids), router.z_loss(lg), router.expert_load(ids, 8))
        )
    f_le, p_le = jnp.stack([s[0] for s in stats]), jnp.stack([s[1] for s in stats])
    concat, per_layer, z, counts = numpy_losses(logits_lte, 2)
    np.testing.assert_allclose(router.load_balancing_loss(f_le, p_le), concat, rtol=1e-6)
    np.testing.assert_allclose(
        router.load_balancing_loss_per_layer(f_le, p_le), per_layer, rtol=1e-6
    )
    np.testing.assert_allclose([s[2] for s in stats], z, rtol=1e-6)
    np.testing.assert_array_equal(np.stack([s[3] for s in stats]), counts)


@functools.cache
def bias_run():
    """The two-layer reference-dispatcher model with an expert bias (zero until updated, so its
    routing is plain top-k) and its loss_and_grads: model, ids, aux, flat grads."""
    model = QwenMoe(
        tiny(expert_bias=True, expert_bias_rate=0.5, dispatcher="reference"),
        mesh=mesh(),
        rngs=nnx.Rngs(0),
    )
    ids = input_ids()
    (_, (_, aux)), grads = loss_and_grads(model, ids)
    return model, ids, aux, flat(grads)


def test_model_aux_matches_numpy_of_its_router_logits():
    """Two MoE layers (concatenated and per-layer balance losses differ), the expert bias zero."""
    _, _, aux, _ = bias_run()
    rl = np.asarray(aux.router_logits).reshape(len(aux.z_loss_per_layer), B * S, -1)
    assert rl.shape[0] == 2
    concat, per_layer, z, counts = numpy_losses(rl, TINY["num_experts_per_tok"])
    np.testing.assert_allclose(aux.aux_loss, concat, rtol=1e-5)
    np.testing.assert_allclose(aux.aux_loss_per_layer, per_layer, rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss_per_layer, z, rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, z.mean(), rtol=1e-5)
    np.testing.assert_array_equal(aux.expert_load, counts)
    np.testing.assert_allclose(aux.router_loss, 1e-2 * concat + 1e-3 * z.mean(), rtol=1e-5)
    assert int(aux.dropped_pairs) == 0


# ---------------------------------------------------------------------------------------------
# aux-loss-free expert bias


def test_expert_bias_update_direction():
    bias = jnp.zeros(4, jnp.float32)
    load = jnp.asarray([10, 0, 5, 5], jnp.int32)  # mean 5: 0 over, 1 under, 2 and 3 even
    np.testing.assert_allclose(router.expert_bias_update(bias, load, 0.1), [-0.1, 0.1, 0, 0])
    layers = router.expert_bias_update(jnp.zeros((2, 4)), jnp.asarray([[1, 2, 2, 7], [3] * 4]), 1.0)
    np.testing.assert_allclose(layers, [[1, 1, 1, -1], [0, 0, 0, 0]])


def test_expert_bias_changes_selection_not_weights():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    _, probs, ids0, _ = router.route(x, w, top_k=2, norm_topk_prob=False)
    bias = jnp.zeros(8).at[5].set(10.0)  # expert 5 wins every token's selection
    _, probs_b, ids, wts = router.route(x, w, top_k=2, norm_topk_prob=False, bias_e=bias)
    assert np.all(np.asarray(ids)[:, 0] == 5) and not np.all(np.asarray(ids0)[:, 0] == 5)
    np.testing.assert_array_equal(probs_b, probs)
    np.testing.assert_array_equal(wts, np.take_along_axis(np.asarray(probs), np.asarray(ids), -1))
    _, _, _, wts_n = router.route(x, w, top_k=2, norm_topk_prob=True, bias_e=bias)
    np.testing.assert_allclose(wts_n, wts / wts.sum(-1, keepdims=True), rtol=1e-6)


def test_model_expert_bias_update():
    """The update from the model's own load, then a large bias on one expert (the same compiled
    loss_and_grads program, new bias values)."""
    model, ids, aux, grads = bias_run()
    load = np.asarray(aux.expert_load)
    assert load.shape == (2, 8) and np.all(load.sum(1) == B * S * 2)
    assert not any("expert_bias" in k for k in grads)  # not a Param: no gradient
    model.update_expert_bias(aux.expert_load)
    for n, i in enumerate(model.moe_layers):
        bias = np.asarray(model.layers[i].mlp.expert_bias[...])
        np.testing.assert_allclose(bias, 0.5 * np.sign(load[n].mean() - load[n]))
    # a large bias on expert 3 routes every token there (slot 0) in every layer
    for i in model.moe_layers:
        var = model.layers[i].mlp.expert_bias
        var.set_value(
            jax.device_put(np.eye(8, dtype=np.float32)[3] * 100, var.get_value().sharding)
        )
    (_, (_, biased)), _ = loss_and_grads(model, ids)
    assert np.all(np.asarray(biased.expert_load)[:, 3] == B * S)


def test_expert_bias_update_inside_jit_equals_eager():
    """A trainer can fold the bias update into its jitted step; the placement is kept."""
    cfg = tiny(expert_bias=True, expert_bias_rate=0.25, dispatcher="reference")
    eager, jitted = (QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0)) for _ in range(2))
    load = jnp.asarray(np.random.default_rng(3).integers(0, 9, (2, 8)), jnp.int32)
    eager.update_expert_bias(load)
    nnx.jit(lambda m, x: m.update_expert_bias(x))(jitted, load)
    for i in eager.moe_layers:
        a, b = eager.layers[i].mlp.expert_bias[...], jitted.layers[i].mlp.expert_bias[...]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)


@pytest.mark.parametrize("shape", [(3, 8), (1, 8), (2, 9), (8,)])
def test_model_expert_bias_update_refuses_a_load_of_the_wrong_shape(shape):
    """One row of counts per MoE layer, [num_moe_layers, E]: more rows were silently ignored and
    fewer an IndexError; now one error, and no layer's bias changes."""
    cfg = tiny(expert_bias=True, expert_bias_rate=0.25, dispatcher="reference")
    model = QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0))
    before = [np.asarray(model.layers[i].mlp.expert_bias[...]) for i in model.moe_layers]
    with pytest.raises(ValueError, match=r"expected \[2, 8\]: one row of expert counts per MoE"):
        model.update_expert_bias(np.ones(shape, np.int32))
    for i, b in zip(model.moe_layers, before):
        np.testing.assert_array_equal(np.asarray(model.layers[i].mlp.expert_bias[...]), b)


# ---------------------------------------------------------------------------------------------
# structure


def test_dense_and_moe_layer_placement():
    """Which layers are MoE, the MLP shapes, and the aux shapes of the 5-layer model's forward
    (traced: nnx.eval_shape; running it would show no more); the all-dense model run."""
    cfg = tiny(
        num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=(3,), dispatcher="reference"
    )
    model = QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0))
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [DenseMLP, MoELayer, DenseMLP, DenseMLP, DenseMLP]
    assert model.moe_layers == (1,)
    assert model.layers[0].mlp.gate_proj.shape == (32, 48)
    assert model.layers[1].mlp.w_gate.shape == (8, 32, 16)
    assert model.layers[1].mlp.w_down.shape == (8, 16, 32)
    _, aux = nnx.eval_shape(lambda mo, ids: mo(ids, return_router_logits=True), model, input_ids())
    assert aux.expert_load.shape == (1, 8) and aux.router_logits.shape == (1, B, S, 8)
    # no MoE layer at all
    dense = QwenMoe(tiny(num_experts=0, dispatcher="reference"), mesh=mesh(), rngs=nnx.Rngs(0))
    assert all(isinstance(layer.mlp, DenseMLP) for layer in dense.layers)
    _, aux = forward(dense, input_ids())
    assert float(aux.aux_loss) == 0.0 and aux.expert_load.shape == (0, 0)


def test_params_created_sharded():
    model = QwenMoe(tiny(dispatcher="reference"), mesh=mesh(), rngs=nnx.Rngs(0))
    mlp = model.layers[0].mlp
    assert mlp.w_gate.get_value().sharding.spec == jax.P("expert", None, None)
    assert mlp.w_down.get_value().sharding.spec == jax.P("expert", None, None)
    assert mlp.w_gate.get_metadata()["logical_axes"] == ("experts", "embed", "expert_ffn")
    assert mlp.w_gate.get_value().addressable_shards[0].data.shape == (1, 32, 16)
    q = model.layers[0].self_attn.q_proj.get_value()
    assert q.sharding.is_fully_replicated
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert specs["layers"][0]["mlp"]["w_up"].get_value() == jax.P("expert", None, None)


def test_checkpoint_names_in_loss_jaxpr():
    for arch, names in [("qwen3_moe", ["q_norm", "k_norm"]), ("qwen2_moe", [])]:
        model = QwenMoe(tiny(arch=arch, dispatcher="reference"), mesh=mesh(), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        loss = lambda st, ids, g=graphdef: lm_loss(nnx.merge(g, st), ids)
        text = str(jax.make_jaxpr(loss)(state, input_ids()))
        for name in [
            "attn_norm",
            "q_proj",
            "k_proj",
            "v_proj",
            "attn_out",
            "o_proj",
            "mlp_norm",
            *names,
        ]:  # once per layer
            assert text.count(f"name[name={name}]") == 2, (arch, name)
        if arch == "qwen2_moe":
            assert "name[name=q_norm]" not in text


# ---------------------------------------------------------------------------------------------
# other meshes


def test_folded_mesh_shards_sequence():
    """A (data=2, context=4) batch of 2 x 8: each device holds 2 positions of one sequence."""
    m = mesh((2, 4), ("data", "context"))
    rules = rules_for(m)
    ids = jax.device_put(input_ids(), NamedSharding(m, rules.spec("batch", "seq")))
    assert ids.addressable_shards[0].data.shape == (1, 2)


@pytest.mark.parametrize("names,batch", [(("data", "context"), 4), (("data", "expert"), 8)])
def test_token_flatten_moves_no_data(names, batch):
    """The MoE's [B*S, H] view of a (batch, seq)-sharded activation needs no collective, and
    from_tokens inverts to_tokens."""
    m = mesh((2, 4), names)
    rules = rules_for(m)
    x = jax.device_put(
        jnp.arange(batch * S * 3, dtype=jnp.float32).reshape(batch, S, 3),
        NamedSharding(m, rules.fit((batch, S), "batch", "seq")),
    )
    f = jax.jit(lambda x: from_tokens(to_tokens(x, rules) * 2, batch, S, rules))
    np.testing.assert_array_equal(f(x), 2 * np.asarray(x))
    hlo = f.lower(x).compile().as_text()
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert op not in hlo, op
    assert jax.jit(lambda x: to_tokens(x, rules))(x).sharding.spec[0] == rules.token_axes


PARAM_COUNT_CASES = {
    "tiny": ("tiny", {}),
    "tiny-qwen2": ("tiny-qwen2", {}),
    "router_bias": ("tiny", dict(router="topk_softmax", router_bias=True)),
    "gpt_oss expert_biases": ("tiny", dict(activation="gpt_oss", expert_biases=True)),
    "sigmoid_group expert_bias": (
        "tiny",
        dict(router="sigmoid_group", n_group=2, topk_group=1, expert_bias=True),
    ),
    "ungated shared expert": ("tiny-qwen2", dict(shared_expert_gated=False)),
    "dense": ("tiny", dict(num_experts=0)),
}


@pytest.mark.parametrize("case", PARAM_COUNT_CASES)
def test_model_parameters_match_the_param_count_formula(case):
    """The NNX model's trainable parameters, counted element by element, equal `param_count`
    (the formula, itself checked against HF checkpoints in test_configs), with the router's and
    the experts' biases of the MoE block's keys too (the aux-loss-free expert_bias is no Param)."""
    from relaymoe_jax.models.config_files import load_config
    from relaymoe_jax.models.param_count import param_count

    name, over = PARAM_COUNT_CASES[case]
    cfg = load_config(name, **over)
    model = nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == param_count(cfg)["total"]
