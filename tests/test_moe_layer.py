"""`MoELayer` on a foreign mesh: parameters where the logical rules put them, values and every
gradient against a dense layer written here, the aux outputs against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import MoEOptions, testing
from relaymoe_jax.models import MoEConfig, MoELayer, rules_for

H, E, K, F, FS = 16, 8, 2, 12, 20


def foreign_mesh():
    """tunix's axis names: experts over fsdp, their ffn over tp."""
    m = jax.make_mesh((4, 2), ("fsdp", "tp"))
    return m, rules_for(m, experts="fsdp", expert_ffn="tp")


def dense_layer(x, p, shared):
    """Router, top-k, renormalised weights and every token through every expert (no ring)."""
    probs = jax.nn.softmax(jnp.einsum("bsh,he->bse", x, p["gate"]), axis=-1)
    wts, ids = jax.lax.top_k(probs, K)
    wts = wts / wts.sum(-1, keepdims=True)
    combine = jnp.einsum("bsk,bske->bse", wts, jax.nn.one_hot(ids, E))
    act = jax.nn.silu(jnp.einsum("bsh,ehf->bsef", x, p["w_gate"])) * jnp.einsum(
        "bsh,ehf->bsef", x, p["w_up"]
    )
    y = jnp.einsum("bsef,efh,bse->bsh", act, p["w_down"], combine)
    if shared:
        s = p["shared_expert"]
        inner = jax.nn.silu(x @ s["gate_proj"]) * (x @ s["up_proj"])
        y = y + jax.nn.sigmoid(x @ p["shared_expert_gate"]) * (inner @ s["down_proj"])
    return y


@pytest.mark.parametrize("dispatcher,shared", [("ring", False), ("alltoall", True)])
def test_moe_layer_matches_a_dense_layer(dispatcher, shared):
    m, rules = foreign_mesh()
    cfg = MoEConfig(
        hidden_size=H,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        shared_expert_intermediate_size=FS if shared else 0,
        options=MoEOptions(dispatcher=dispatcher),
    )
    layer = MoELayer(cfg, rules=rules, rngs=nnx.Rngs(0))
    assert layer.w_gate.get_value().sharding.spec == P("fsdp", None, "tp")
    assert layer.w_down.get_metadata()["logical_axes"] == ("experts", "expert_ffn", "embed")
    graphdef, params = nnx.split(layer)
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), (4, 8, H)), NamedSharding(m, P("fsdp", "tp"))
    )
    ours = lambda x, params: nnx.merge(graphdef, params)(x)
    plain = nnx.to_pure_dict(params)
    rep = lambda a: jax.sharding.reshard(a, NamedSharding(m, P()))  # the dense math, unsharded
    dense = lambda x, params: (
        dense_layer(rep(x), jax.tree.map(rep, nnx.to_pure_dict(params)), shared),
        None,
    )
    got, _ = testing.assert_moe_parity(ours, dense, x, params, has_aux=True)
    assert got.y.sharding.is_equivalent_to(x.sharding, 3)

    # aux against float64 numpy
    aux = got.aux
    x64 = np.asarray(x, np.float64).reshape(-1, H)
    logits = x64 @ np.asarray(plain["gate"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    load = np.bincount(ids.reshape(-1), minlength=E)
    frac, mean_p = load / len(x64), probs.mean(0)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), load)
    np.testing.assert_allclose(
        np.asarray(aux["router_logits"]).reshape(-1, E), logits, rtol=0, atol=1e-5
    )
    np.testing.assert_allclose(float(aux["aux_loss"]), E * np.sum(frac * mean_p), rtol=1e-5)
    np.testing.assert_allclose(float(aux["z_loss"]), np.mean(lse**2), rtol=1e-5)
    assert int(aux["dropped_pairs"]) == 0


def test_expert_bias_update():
    _, rules = foreign_mesh()
    cfg = MoEConfig(
        hidden_size=H,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        expert_bias=True,
        expert_bias_rate=0.25,
    )
    layer = MoELayer(cfg, rules=rules, rngs=nnx.Rngs(0))
    load = np.array([9, 1, 4, 4, 0, 2, 6, 6])
    layer.update_expert_bias(load)
    np.testing.assert_array_equal(
        np.asarray(layer.expert_bias[...]), 0.25 * np.sign(load.mean() - load)
    )
    plain = MoELayer(
        cfg.__class__(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F),
        rules=rules,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match="the layer has expert_bias=False"):
        plain.update_expert_bias(load)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_experts=0), r"MoEConfig.num_experts=0: expected an int >= 1"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds num_experts=8"),
        (dict(dispatcher="a2a"), r"MoEConfig.dispatcher='a2a': expected one of"),
        (dict(routing="experts"), r"MoEConfig.routing='experts': expected one of"),
        (
            dict(ring="nested"),
            r"MoEConfig.ring='nested': expected one of \('auto', 'flat', "
            r"'hierarchical'\)",
        ),
    ],
)
def test_bad_config(kw, match):
    base = dict(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F)
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_dict({**base, **kw})


def test_experts_must_divide_over_their_axes():
    _, rules = foreign_mesh()
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the 4 devices"):
        MoELayer(
            MoEConfig(hidden_size=H, num_experts=6, num_experts_per_tok=K, moe_intermediate_size=F),
            rules=rules,
            rngs=nnx.Rngs(0),
        )
