"""`ModelConfig.scan_layers`: the decoder layers stacked on a leading axis and run by one
`jax.lax.scan`, on 8 emulated CPU devices. Against the unscanned model (same seed, hence the same
weights): logits, losses, router stats and every gradient on several meshes, dispatchers and
remat options; the expert bias; a train step with FSDP storage; Hugging Face import/export; the
refusals; and the compiled program not growing with depth."""

import contextlib
import dataclasses
import functools
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open

import relaymoe_jax
from relaymoe_jax.models import (
    ModelConfig,
    QwenMoe,
    from_pretrained,
    rules_for,
    save_pretrained,
)
from relaymoe_jax.models import router_losses as router
from relaymoe_jax.models.config_files import load_config
from relaymoe_jax.models.decoder import DecoderLayer
from train.data import Batch
from train.settings import TrainConfig
from train.step import train_step

B, S = 2, 8
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
HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


@functools.cache
def mesh(shape=(8,), names=("expert",)):
    return jax.make_mesh(shape, names)


def tiny(**kw):
    return ModelConfig.from_dict({**TINY, **kw})


def input_ids(seed=0):
    return jnp.asarray(
        np.random.default_rng(seed).integers(0, TINY["vocab_size"], (B, S)), jnp.int32
    )


def lm_loss(model, ids):
    logits, aux = model(ids, return_router_logits=True)
    targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1]), axis=-1)
    mask = (jnp.arange(S) < S - 1).astype(jnp.float32)
    return jnp.sum(nll * mask) / (B * (S - 1)) + aux.router_loss, (logits, aux)


# XLA:CPU backend options that halve these tests' compile times; the program (HLO) is the same
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_fast(f, *args, poison=False, **jit_kw):
    """`jax.jit(f, **jit_kw)(*args)`, compiled with FAST; padding rows NaN-poisoned if `poison`
    (read at trace time)."""
    with relaymoe_jax.poison_unwritten() if poison else contextlib.nullcontext():
        compiled = jax.jit(f, **jit_kw).trace(*args).lower().compile(compiler_options=FAST)
    return compiled(*args)


def loss_and_grads(model, ids, poison=False):
    """((loss, (logits, aux)), grads) of `lm_loss`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    f = jax.value_and_grad(
        lambda p, rest, ids: lm_loss(nnx.merge(graphdef, p, rest), ids), has_aux=True
    )
    return run_fast(f, params, rest, ids, poison=poison)


def forward(model, ids):
    graphdef, state = nnx.split(model)
    return run_fast(
        lambda st, ids: nnx.merge(graphdef, st)(ids, return_router_logits=True), state, ids
    )


def per_layer(state, num_layers=None):
    """{path: array} of a state, with a scanned model's stacked layer variables split into the
    unscanned model's paths (`layers/i/...`), so the two compare key by key."""
    out = {}
    for path, v in jax.tree_util.tree_leaves_with_path(state):
        keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)
        a = np.asarray(v)
        if num_layers is not None and keys[0] == "layers":
            assert a.shape[0] == num_layers, (keys, a.shape)
            for i in range(num_layers):
                out[("layers", i, *keys[1:])] = a[i]
        else:
            out[keys] = a
    return out


def read_all(path):
    """Every tensor of a checkpoint directory, {name: array}."""
    out = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(f, framework="numpy") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_close(a, b, rel=1e-5, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert np.all(np.isfinite(a)), what
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
    assert err <= rel, f"{what}: max|a-b|/max|b| = {err:.2e} > {rel}"


# ---------------------------------------------------------------------------------------------
# config and layout


@pytest.mark.parametrize(
    "make, msg",
    [
        (
            lambda: load_config("tiny-qwen2", scan_layers=True),
            r"scan_layers=True: .*layers \[1\] are dense and \[0, 2\] MoE",
        ),
        (
            lambda: tiny(num_hidden_layers=3, decoder_sparse_step=2, scan_layers=True),
            r"layers \[0, 2\] are dense and \[1\] MoE .*decoder_sparse_step=2",
        ),
        (
            lambda: tiny(attention_remat=("full", "save_qkv"), scan_layers=True),
            r"attention_remat=\('full', 'save_qkv'\): "
            r".*one option for every layer with scan_layers",
        ),
        (lambda: tiny(scan_layers=1), r"scan_layers=1: expected true or false"),
        (lambda: load_config("tiny", scan_layers="yes"), r"override scan_layers='yes'"),
        (lambda: rules_for(mesh(), layers="expert"), r"layers=\('expert',\).*never sharded"),
        (
            lambda: from_pretrained(
                os.path.join(HF, "qwen3_moe_dense_layers_sharded"), mesh=mesh(), scan_layers=True
            ),
            r"layers \[1\] are dense",
        ),
        (  # the hook is applied inside the layer scan: without one it would be ignored
            lambda: QwenMoe(tiny(), mesh=mesh(), rngs=nnx.Rngs(0)).hidden(
                jnp.zeros((8, 8), jnp.int32), layer_weights=lambda v: v
            ),
            r"hidden\(layer_weights=...\) applies inside the layer scan: it needs scan_layers=True",
        ),
    ],
)
def test_refusals(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_accepted_configs():
    tiny(attention_remat=("full", "full"), scan_layers=True)
    tiny(num_experts=0, scan_layers=True)  # all dense: one kind
    tiny(num_hidden_layers=1, scan_layers=True)


def test_stacked_layout_and_same_weights():
    """One DecoderLayer of [L, ...] variables with a leading "layers" axis that is never sharded;
    row i equals layer i of the unscanned model of the same seed; the random init is identical."""
    cfg = tiny(num_hidden_layers=3)
    plain = QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0))
    scanned = QwenMoe(dataclasses.replace(cfg, scan_layers=True), mesh=mesh(), rngs=nnx.Rngs(0))
    assert isinstance(scanned.layers, DecoderLayer)
    w = scanned.layers.mlp.w_gate
    assert w.get_value().shape == (3, 8, 32, 16)
    assert w.get_value().sharding.spec == jax.P(None, "expert", None, None)
    assert w.get_metadata()["logical_axes"] == ("layers", "experts", "embed", "expert_ffn")
    assert w.get_metadata()["out_sharding"] == jax.P(None, "expert", None, None)
    assert w.get_value().addressable_shards[0].data.shape == (3, 1, 32, 16)
    q = scanned.layers.self_attn.q_norm.weight
    assert q.get_value().shape == (3, 8) and q.get_metadata()["logical_axes"] == (
        "layers",
        "head_dim",
    )
    a, b = per_layer(nnx.state(plain)), per_layer(nnx.state(scanned), 3)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=str(k))


# ---------------------------------------------------------------------------------------------
# same math


@functools.cache
def reference():
    """The unscanned model on EP=8 (the dense reference dispatcher, whose program compiles in
    about half the ring's time; no remat): ids, loss, logits, aux, grads. The scanned models
    below run the ring and the all-to-all."""
    model = QwenMoe(tiny(dispatcher="reference"), mesh=mesh(), rngs=nnx.Rngs(0))
    ids = input_ids()
    (loss, (logits, aux)), grads = loss_and_grads(model, ids)
    return ids, loss, logits, aux, per_layer(grads)


@pytest.mark.parametrize(
    "layout, over",
    [
        (
            "data2_expert4",
            dict(dispatcher="alltoall", attention_remat=("full", "full"), moe_remat=True),
        ),
        ("data2_context4", dict(attention_remat="save_qkv")),
    ],
)
def test_scanned_matches_unscanned(layout, over):
    """Same weights: the scanned model's logits, losses, router logits and load, and every
    parameter's gradient equal the unscanned model's (EP=8, reference dispatcher, no remat), with
    padding rows NaN-poisoned, on two more meshes (the folded one with context parallelism), both
    dispatchers and remat options. (Unscanned models on these meshes match EP=8:
    test_models.test_dispatchers_agree; the fsdp mesh: the train step test below.)"""
    ids, ref_loss, ref_logits, ref_aux, ref_grads = reference()
    m = {
        "data2_expert4": mesh((2, 4), ("data", "expert")),
        "data2_context4": mesh((2, 4), ("data", "context")),
    }[layout]
    model = QwenMoe(tiny(scan_layers=True, **over), mesh=m, rngs=nnx.Rngs(0))
    (loss, (logits, aux)), grads = loss_and_grads(model, ids, poison=True)
    assert_close(logits, ref_logits, what="logits")
    assert_close(loss, ref_loss, what="loss")
    for k in (
        "aux_loss",
        "aux_loss_per_layer",
        "z_loss",
        "z_loss_per_layer",
        "router_loss",
        "router_logits",
    ):
        assert_close(getattr(aux, k), getattr(ref_aux, k), what=k)
    np.testing.assert_array_equal(aux.expert_load, ref_aux.expert_load)
    assert int(aux.dropped_pairs) == int(ref_aux.dropped_pairs) == 0
    grads = per_layer(grads, 2)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert_close(grads[k], ref_grads[k], what=f"grad {k}")


@pytest.mark.parametrize(
    "over, remats",
    [
        (dict(), 0),
        (dict(attention_remat="full"), 1),
        (dict(attention_remat="save_qkv", moe_remat=True), 2),
        (dict(attention_remat="full", moe_remat=True), 1),
    ],
)
def test_checkpoint_names_and_remat_inside_the_scan(over, remats):
    """The scan body holds each checkpoint name once (for every layer) and the jax.checkpoint of
    the attention block (and of the MoE block with moe_remat; one of the whole layer when both
    recompute everything); nothing is unrolled per layer."""
    model = QwenMoe(
        tiny(scan_layers=True, num_hidden_layers=3, **over), mesh=mesh(), rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(model)
    text = str(jax.make_jaxpr(lambda st: lm_loss(nnx.merge(graphdef, st), input_ids())[0])(state))
    for name in [
        "attn_norm",
        "q_proj",
        "k_proj",
        "v_proj",
        "q_norm",
        "k_norm",
        "attn_out",
        "o_proj",
        "mlp_norm",
    ]:
        assert text.count(f"name[name={name}]") == 1, name
    assert text.count("remat2[") == remats
    assert "length=3" in text  # the layer scan


# ---------------------------------------------------------------------------------------------
# the expert bias


def test_expert_bias_stacked():
    """The [L, E] bias: eager and jitted updates equal the unscanned model's per-layer ones, keep
    the placement, and a large bias on one expert routes every token there in every layer."""
    cfg = tiny(expert_bias=True, expert_bias_rate=0.25, dispatcher="reference")
    plain = QwenMoe(cfg, mesh=mesh(), rngs=nnx.Rngs(0))
    eager, jitted = (
        QwenMoe(dataclasses.replace(cfg, scan_layers=True), mesh=mesh(), rngs=nnx.Rngs(0))
        for _ in range(2)
    )
    load = jnp.asarray(np.random.default_rng(3).integers(0, 9, (2, 8)), jnp.int32)
    plain.update_expert_bias(load)
    eager.update_expert_bias(load)
    nnx.jit(lambda m, x: m.update_expert_bias(x))(jitted, load)
    var = eager.layers.mlp.expert_bias
    assert var.get_value().shape == (2, 8)
    for i in range(2):
        want = np.asarray(plain.layers[i].mlp.expert_bias[...])
        assert np.any(want != 0)
        np.testing.assert_array_equal(np.asarray(var[...])[i], want)
    np.testing.assert_array_equal(
        np.asarray(jitted.layers.mlp.expert_bias[...]), np.asarray(var[...])
    )
    assert jitted.layers.mlp.expert_bias[...].sharding.is_equivalent_to(var[...].sharding, 2)
    var.set_value(
        jax.device_put(
            np.tile(np.eye(8, dtype=np.float32)[3] * 100, (2, 1)), var.get_value().sharding
        )
    )
    _, aux = forward(eager, input_ids())
    assert np.all(np.asarray(aux.expert_load)[:, 3] == B * S)


# ---------------------------------------------------------------------------------------------
# the train step


def test_train_step_fsdp_matches_unscanned():
    """The trainer's step on `fsdp=2,expert=4` with the scanned model (seed 0: the reference's
    weights): loss, router losses, load and grad norm equal the unscanned model's (EP=8), the
    AdamW update is the one of the unscanned gradients, the stacked parameters are stored with
    `fsdp` on their largest free dimension (not the layer axis here), and the stacked expert bias
    updates per layer."""
    ids, ref_loss, _, ref_aux, ref_grads = reference()
    tc = TrainConfig(batch_size=B, seq_len=S, mesh="fsdp=2,expert=4", warmup_steps=0)
    m = mesh((2, 4), ("fsdp", "expert"))
    # the dense reference dispatcher (1e-5 from the ring) compiles faster; a zero bias is a no-op
    cfg = tiny(scan_layers=True, expert_bias=True, dispatcher="reference")
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, m)
    w = state.params["layers"]["mlp"]["w_gate"]
    assert w.sharding.spec == jax.P(None, "expert", "fsdp", None)  # [L, E, H=32, F=16]
    assert state.params["layers"]["input_layernorm"]["weight"].sharding.spec == jax.P(None, "fsdp")
    assert state.opt_state[1][0].mu["layers"]["mlp"]["w_gate"].sharding == w.sharding
    params0 = {"/".join(map(str, k)): v for k, v in per_layer(state.params, 2).items()}
    ids_sharding = jax.NamedSharding(m, rules.fit(ids.shape, "batch", "seq"))
    shardings = jax.tree.map(lambda x: x.sharding, state)  # as train_step.compile_step, FAST
    state, metrics = run_fast(
        train_step.make_step(graphdef, tx),
        state,
        Batch(jax.device_put(ids, ids_sharding)),
        in_shardings=(shardings, ids_sharding),
        out_shardings=(shardings, jax.NamedSharding(m, jax.P())),
        donate_argnums=0,
    )
    assert_close(metrics.loss, ref_loss, what="loss")
    assert_close(metrics.lm_loss, ref_loss - ref_aux.router_loss, what="lm_loss")
    for k in ("aux_loss", "z_loss", "router_loss"):
        assert_close(getattr(metrics, k), getattr(ref_aux, k), what=k)
    np.testing.assert_array_equal(metrics.expert_load, ref_aux.expert_load)
    grads = {"/".join(map(str, k)): v for k, v in ref_grads.items()}
    assert_close(
        metrics.grad_norm,
        np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads.values())),
        what="grad_norm",
    )
    want = jax.jit(lambda p, g: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(
        params0, grads
    )
    got = {"/".join(map(str, k)): v for k, v in per_layer(state.params, 2).items()}
    assert got.keys() == want.keys()
    for k in want:  # Adam's first step lr * g / (|g| + eps) amplifies tiny gradient differences
        assert_close(got[k], want[k], rel=1e-4, what=f"updated {k}")
        assert np.any(got[k] != params0[k]), k
    state = train_step.update_expert_bias(graphdef, state, metrics.expert_load)
    bias = state.rest["layers"]["mlp"]["expert_bias"]
    np.testing.assert_array_equal(
        bias,
        router.expert_bias_update(
            np.zeros((2, 8), np.float32), np.asarray(metrics.expert_load), cfg.moe.expert_bias_rate
        ),
    )


# ---------------------------------------------------------------------------------------------
# Hugging Face


@functools.cache
def hf_reference(name):
    ref = np.load(os.path.join(HF, name, "reference.npz"))
    return {k: ref[k] for k in ref.files}


@pytest.mark.parametrize("name", ["qwen2_moe_shared", "qwen3_moe_topk_raw_tied"])
def test_hf_import_and_export(name, tmp_path):
    """A Hugging Face checkpoint loads into the scanned model (each layer's tensors stacked)
    with the transformers logits, and exports the very same tensors (the reference dispatcher
    compiles faster; the ring and the all-to-all in the scan: test_scanned_matches_unscanned)."""
    src = os.path.join(HF, name)
    model = from_pretrained(src, mesh=mesh(), dispatcher="reference", scan_layers=True)
    assert model.layers.mlp.w_gate.get_value().shape[0] == model.config.num_hidden_layers
    ref = hf_reference(name)
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    logits, aux = forward(model, ids)
    assert float(np.max(np.abs(np.asarray(logits) - ref["logits"]))) <= 1e-4
    np.testing.assert_allclose(aux.aux_loss, ref["aux_loss"], rtol=1e-5)
    for n, i in enumerate(int(i) for i in ref["moe_layers"]):
        np.testing.assert_allclose(
            np.asarray(aux.router_logits[n]).reshape(-1, 8),
            ref[f"router_logits_{i}"],
            atol=1e-4,
            rtol=0,
        )
    save_pretrained(model, str(tmp_path))
    theirs, ours = read_all(src), read_all(str(tmp_path))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


# ---------------------------------------------------------------------------------------------
# one layer body whatever the depth


def _lowered_grad(num_layers, scan):
    model = nnx.eval_shape(
        lambda: QwenMoe(
            tiny(num_hidden_layers=num_layers, scan_layers=scan), mesh=mesh(), rngs=nnx.Rngs(0)
        )
    )
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
    f = jax.jit(jax.grad(lambda st, ids: lm_loss(nnx.merge(graphdef, st), ids)[0]))
    return f.trace(state, ids).lower().as_text()


def test_program_does_not_grow_with_depth():
    """The lowered train-step program (forward and backward) of the scanned model is the same
    size at 2 and 8 layers (the unscanned one is ~4x), with the same number of while loops."""
    small, big = _lowered_grad(2, True), _lowered_grad(8, True)
    assert big.count("stablehlo.while") == small.count("stablehlo.while")
    assert len(big) < 1.05 * len(small), (len(small), len(big))
    assert "tensor<8x8x32x16xf32>" in big  # the stacked w_gate [L, E, H, F]
