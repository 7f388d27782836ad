"""docs/maxtext.md's `RelayRoutedMoE` against MaxText's own `RoutedMoE` (maxtext==0.2.5).

The page's python blocks are exec'd as written (the subclass, `use_relaymoe`), so the page and
this test cannot drift apart. Each case builds both layers from one MaxText config with the same
parameters, placed by MaxText's sharding rules, and compares them with
`relaymoe_jax.testing.assert_moe_parity`: the output and the load-balance loss, and the gradient
of both (random cotangent) with respect to the input and every parameter, float32, within 1e-5 of
the largest entry; and the routed-bias update, exactly.

MaxText is not a dependency of this project: the test is skipped where it is not installed (the
project's venv, CI). docs/maxtext.md makes the venv it runs in.

On XLA:CPU, MaxText's default sparse path cannot run with expert parallelism (its ragged
all-to-all has no CPU implementation), so the sparse reference on an expert mesh is MaxText's
ring-of-experts variant of it (`use_ring_of_experts`, which needs `megablox`, interpreted here).
"""

import contextlib
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "maxtext.layers.moe",
    reason="MaxText is not installed (maxtext==0.2.5 in its own venv: docs/maxtext.md)",
)

import jax
import jax.numpy as jnp
import maxtext
import maxtext.models.qwen3
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh
from maxtext.configs import pyconfig
from maxtext.layers import moe
from maxtext.layers.initializers import nd_dense_init
from maxtext.models import models
from maxtext.utils import maxtext_utils

from relaymoe_jax import testing

PAGE = Path(__file__).resolve().parents[1] / "docs" / "maxtext.md"
BASE_YML = Path(maxtext.__file__).parent / "configs" / "base.yml"


def page_namespace():
    """The page's python blocks, exec'd in order in one namespace."""
    namespace = {"__name__": "docs_maxtext"}
    for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)):
        exec(compile(code, f"{PAGE}:python block {i + 1}", "exec"), namespace)
    return namespace


PAGE_CODE = page_namespace()
RelayRoutedMoE = PAGE_CODE["RelayRoutedMoE"]

# Tiny members of two MaxText model families (their model configs, smaller sizes): Qwen3-MoE
# (softmax router, top-k normalised, the load-balance loss) and DeepSeek-V3 (sigmoid router
# with group-limited top-k, routed scaling, the routed bias and its aux-loss-free update).
FAMILIES = {
    "qwen3-30b-a3b": dict(model_name="qwen3-30b-a3b", num_experts=16, num_experts_per_tok=4),
    "deepseek3-tiny": dict(
        model_name="deepseek3-tiny",
        num_experts=16,
        num_experts_per_tok=4,
        n_routing_groups=4,
        topk_routing_group=2,
        routed_bias_update_rate=0.01,
    ),
}
MESHES = {  # MaxText's ici_* settings on 8 devices
    "fsdp": dict(ici_fsdp_parallelism=8),
    "expert": dict(ici_fsdp_parallelism=1, ici_expert_parallelism=8),
    "data x expert": dict(ici_fsdp_parallelism=1, ici_data_parallelism=2, ici_expert_parallelism=4),
}
HIDDEN, FFN, SEQ = 32, 16, 16


def config(family, mesh_name, path, **overrides):
    """A MaxText config; `path` "sparse" (MaxText's default) or "dense" (sparse_matmul=False)."""
    settings = dict(
        run_name="test_maxtext",
        enable_checkpointing=False,
        override_model_config=True,
        base_emb_dim=HIDDEN,
        base_moe_mlp_dim=FFN,
        dtype="float32",
        weight_dtype="float32",
        matmul_precision="highest",
        per_device_batch_size=1,
        max_target_length=SEQ,
        load_balance_loss_weight=0.01,
        sparse_matmul=path == "sparse",
        megablox=False,
        **FAMILIES[family],
        **MESHES[mesh_name],
    )
    if path == "sparse" and mesh_name != "fsdp":  # the sparse path XLA:CPU can run with EP
        settings.update(use_ring_of_experts=True, megablox=True)
    return pyconfig.initialize([None, str(BASE_YML)], **{**settings, **overrides})


@contextlib.contextmanager
def on_mesh(cfg):
    """The mesh MaxText makes from `cfg`, with its logical axis rules, as its trainer runs."""
    mesh = Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
    with nn_partitioning.axis_rules(cfg.logical_axis_rules), jax.set_mesh(mesh):
        yield mesh


def layer(cls, cfg, mesh):
    """(graphdef, parameters placed by MaxText's sharding rules, the rest) of a RoutedMoE."""
    module = cls(
        config=cfg,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        mesh=mesh,
        kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", None),  # as MaxText's Qwen3 decoder layer builds it
        intermediate_dim=cfg.moe_mlp_dim,
        dtype=cfg.dtype,
        weight_dtype=cfg.weight_dtype,
        rngs=nnx.Rngs(params=0),
    )
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return graphdef, jax.device_put(params, nnx.get_named_sharding(params, mesh)), rest


def whole_batch_loss(module, x, sparse):
    """MaxText's load-balance loss on the whole batch, from MaxText's own methods."""
    gate_logits, pre_bias_logits = module.gate(x)
    _, ids = module.get_topk(gate_logits, pre_bias_logits)
    logits = pre_bias_logits if sparse and pre_bias_logits is not None else gate_logits
    return module.load_balance_loss(ids, jax.nn.softmax(logits.astype(jnp.float32), axis=-1))


def layer_fn(graphdef, rest, whole_batch_value=False):
    """f(x, params) -> ((y, load-balance loss), routed-bias update). whole_batch_value: report
    the (sparse path's) loss value on the whole batch, keeping the layer's gradient."""

    def f(x, params):
        module = nnx.merge(graphdef, params, rest)
        y, lb_loss, bias_updates = module(x)
        if whole_batch_value:
            whole = whole_batch_loss(module, x, sparse=True)
            lb_loss = lb_loss + jax.lax.stop_gradient(whole - lb_loss)
        return (y, lb_loss), bias_updates

    return f


def worst_error(got, want):
    """max over y and the gradients of max |got - want| / max |want|."""
    pairs = zip(jax.tree.leaves((got.y, got.grads)), jax.tree.leaves((want.y, want.grads)))
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-30))
        for a, b in pairs
    )


def x_for(cfg, batch, seq=SEQ):
    return jax.random.normal(jax.random.key(1), (batch, seq, cfg.emb_dim), jnp.float32)


@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_relay_routed_moe_matches_maxtext(family, mesh_name, path):
    cfg = config(family, mesh_name, path)
    with on_mesh(cfg) as mesh:
        ref_graphdef, params, rest = layer(moe.RoutedMoE, cfg, mesh)
        our_graphdef, our_params, _ = layer(RelayRoutedMoE, cfg, mesh)
        assert jax.tree.all(jax.tree.map(jnp.array_equal, params, our_params))
        x = x_for(cfg, batch=8)
        ours = layer_fn(our_graphdef, rest)
        # MaxText's sparse path reports one batch shard's loss value (the next test); its
        # gradient is the whole batch's. There the reference keeps MaxText's gradient, with the
        # whole batch's value; the dense path's own value is the whole batch's.
        theirs = layer_fn(ref_graphdef, rest, whole_batch_value=path == "sparse")
        got, want = testing.assert_moe_parity(ours, theirs, x, params, has_aux=True)

        assert want.y[1] is not None and float(want.y[1]) > 0
        routed_bias = family.startswith("deepseek")
        assert (want.aux is not None) == routed_bias
        if routed_bias:
            np.testing.assert_array_equal(np.asarray(got.aux), np.asarray(want.aux))
            assert np.any(np.asarray(want.aux) != 0)
        ring = "fsdp" if mesh_name == "fsdp" else "expert"
        assert nnx.merge(our_graphdef, params, rest)._ring_axes() == ring
        assert "ppermute" in str(jax.make_jaxpr(ours)(x, params))  # the ring ran
    print(f"{family} | {mesh_name} | {path} | worst relative error {worst_error(got, want):.2e}")


@pytest.mark.parametrize("mesh_name", ["fsdp", "expert", "data x expert"])
def test_maxtexts_sparse_loss_value_is_its_first_batch_shards(mesh_name):
    """MaxText's sparse path computes the loss inside its shard_map (per batch shard; with ring
    of experts, after gathering over the expert axis) and returns it unreduced (out_specs P(),
    check_vma=False): the value is the first shard's. The subclass reports the whole batch's."""
    cfg = config("qwen3-30b-a3b", mesh_name, "sparse")
    with on_mesh(cfg) as mesh:
        graphdef, params, rest = layer(moe.RoutedMoE, cfg, mesh)
        our_graphdef, _, _ = layer(RelayRoutedMoE, cfg, mesh)
        x = x_for(cfg, batch=8)
        (_, theirs), _ = jax.jit(layer_fn(graphdef, rest))(x, params)
        (_, ours), _ = jax.jit(layer_fn(our_graphdef, rest))(x, params)
        module = nnx.merge(graphdef, params, rest)
        rows = 8 // (mesh.shape["data"] * mesh.shape["fsdp"])  # the shard_map's first shard
        first = whole_batch_loss(module, x[:rows], sparse=True)
        whole = whole_batch_loss(module, x, sparse=True)
    np.testing.assert_allclose(float(theirs), float(first), rtol=1e-6)
    np.testing.assert_allclose(float(ours), float(whole), rtol=1e-6)
    assert (rows == 8) == (abs(float(first) - float(whole)) < 1e-9)
    print(
        f"{mesh_name}: MaxText sparse {float(theirs):.6f}, first shard ({rows} of 8 rows) "
        f"{float(first):.6f}, whole batch {float(whole):.6f}, subclass {float(ours):.6f}"
    )


@pytest.mark.parametrize("batch, seq", [(4, SEQ), (2, 1)])
@pytest.mark.parametrize("mesh_name", ["expert", "data x expert"])
def test_batches_maxtexts_sparse_path_refuses(mesh_name, batch, seq):
    """A batch that data x fsdp x expert does not divide (4 sequences, or a decode step of 2
    tokens, on 8 devices): MaxText's sparse path with expert parallelism refuses it; the
    subclass (sparse config) runs it and matches MaxText's dense path."""
    family = "qwen3-30b-a3b"
    default_sparse = config(family, mesh_name, "sparse", use_ring_of_experts=False, megablox=True)
    with on_mesh(default_sparse) as mesh:
        graphdef, params, rest = layer(moe.RoutedMoE, default_sparse, mesh)
        x = x_for(default_sparse, batch, seq)
        with pytest.raises(ValueError, match="not evenly divisible"):
            jax.eval_shape(layer_fn(graphdef, rest), x, params)
        our_graphdef, _, _ = layer(RelayRoutedMoE, default_sparse, mesh)
        ours = layer_fn(our_graphdef, rest)
    dense = config(family, mesh_name, "dense")
    with on_mesh(dense) as mesh:
        dense_graphdef, dense_params, dense_rest = layer(moe.RoutedMoE, dense, mesh)
        assert jax.tree.all(jax.tree.map(jnp.array_equal, params, dense_params))
        theirs = layer_fn(dense_graphdef, dense_rest)
        got, want = testing.assert_moe_parity(ours, theirs, x, params, has_aux=True)
    print(
        f"{mesh_name} | batch {batch} x {seq} | worst relative error {worst_error(got, want):.2e}"
    )


def test_use_relaymoe_swaps_it_into_a_whole_maxtext_model(monkeypatch):
    """The page's use_relaymoe() in a tiny Qwen3-30B-A3B-shaped MaxText Transformer (2 scanned
    MoE layers, attention, embeddings): logits and every parameter's gradient match the model
    MaxText builds without it, on the data x expert mesh, MaxText's sparse path."""
    monkeypatch.setattr(moe, "RoutedMoE", moe.RoutedMoE)  # restored after the test
    monkeypatch.setattr(maxtext.models.qwen3, "RoutedMoE", maxtext.models.qwen3.RoutedMoE)
    tiny = dict(
        base_num_decoder_layers=2,
        base_num_query_heads=4,
        base_num_kv_heads=2,
        head_dim=8,
        base_mlp_dim=FFN,
        vocab_size=128,
        attention="dot_product",
    )
    cfg = config("qwen3-30b-a3b", "data x expert", "sparse", **tiny)
    with on_mesh(cfg) as mesh:

        def transformer():
            return models.Transformer(cfg, mesh, quant=None, rngs=nnx.Rngs(params=0, dropout=0))

        ref_graphdef, params, rest = nnx.split(transformer(), nnx.Param, ...)
        PAGE_CODE["use_relaymoe"]()
        ours_model = transformer()
        kinds = {type(m) for _, m in nnx.iter_modules(ours_model) if isinstance(m, moe.RoutedMoE)}
        assert kinds == {RelayRoutedMoE}
        our_graphdef, our_params, our_rest = nnx.split(ours_model, nnx.Param, ...)
        assert jax.tree.all(jax.tree.map(jnp.array_equal, params, our_params))
        params = jax.device_put(params, nnx.get_named_sharding(params, mesh))
        tokens = jax.random.randint(jax.random.key(2), (8, SEQ), 0, cfg.vocab_size)
        positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)

        def model_fn(graphdef, rest):
            def f(params):
                return nnx.merge(graphdef, params, rest)(tokens, positions, enable_dropout=False)

            return f

        got, want = testing.assert_moe_parity(
            model_fn(our_graphdef, our_rest), model_fn(ref_graphdef, rest), params
        )
    print(f"whole model | data x expert | worst relative error {worst_error(got, want):.2e}")


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(mlp_activations=["gelu", "linear"]), "mlp_activations"),
        (dict(sparse_matmul=False, capacity_factor=1.0), "capacity_factor"),
    ],
)
def test_what_the_subclass_does_not_cover_is_refused(overrides, named):
    cfg = config("qwen3-30b-a3b", "expert", "dense", **overrides)
    with on_mesh(cfg) as mesh:
        graphdef, params, rest = layer(RelayRoutedMoE, cfg, mesh)
        with pytest.raises(NotImplementedError, match=named):
            jax.eval_shape(layer_fn(graphdef, rest), x_for(cfg, batch=8), params)
