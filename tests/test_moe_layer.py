"""`MoELayer` on a foreign mesh: parameters where the logical rules put them, values and every
gradient against a dense layer written here, the aux outputs against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
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
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        shared_expert_intermediate_size=FS if shared else 0,
        options=MoEOptions(dispatcher=dispatcher),
    )
    layer = MoELayer(cfg, hidden_size=H, rules=rules, rngs=nnx.Rngs(0))
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
    np.testing.assert_array_equal(np.asarray(aux.expert_load), load)
    np.testing.assert_allclose(
        np.asarray(aux.router_logits).reshape(-1, E), logits, rtol=0, atol=1e-5
    )
    np.testing.assert_allclose(float(aux.aux_loss), E * np.sum(frac * mean_p), rtol=1e-5)
    np.testing.assert_allclose(float(aux.z_loss), np.mean(lse**2), rtol=1e-5)
    assert int(aux.dropped_pairs) == 0


def test_expert_bias_update():
    _, rules = foreign_mesh()
    cfg = MoEConfig(
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        expert_bias=True,
        expert_bias_rate=0.25,
    )
    layer = MoELayer(cfg, hidden_size=H, rules=rules, rngs=nnx.Rngs(0))
    load = np.array([9, 1, 4, 4, 0, 2, 6, 6])
    layer.update_expert_bias(load)
    np.testing.assert_array_equal(
        np.asarray(layer.expert_bias[...]), 0.25 * np.sign(load.mean() - load)
    )
    plain = MoELayer(
        cfg.__class__(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F),
        hidden_size=H,
        rules=rules,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match="the layer has expert_bias=False"):
        plain.update_expert_bias(load)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_experts=-1), r"^num_experts=-1: expected an int >= 0"),
        (
            dict(num_experts_per_tok=9),
            r"^num_experts_per_tok=9: expected an int in \[1, num_experts=8\]",
        ),
        (dict(dispatcher="a2a"), r"^dispatcher='a2a': expected one of"),
        (dict(routing="experts"), r"^routing='experts': expected one of"),
        (dict(norm_topk_prob="false"), r"^norm_topk_prob='false': expected true or false"),
        (dict(expert_bias=1), r"^expert_bias=1: expected true or false"),
        (dict(expert_bias_rate=-0.5), r"^expert_bias_rate=-0.5: expected a finite"),
        (dict(expert_bias_rate=float("inf")), r"^expert_bias_rate=inf: expected a"),
        (
            dict(shared_expert_intermediate_size=-1),
            r"^shared_expert_intermediate_size=-1: expected an int >= 0",
        ),
        (
            dict(ring="nested"),
            r"^ring='nested': expected one of \('auto', 'flat', "
            r"'hierarchical'\)",
        ),
    ],
)
def test_bad_config(kw, match):
    base = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F)
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_dict({**base, **kw})


def test_experts_must_divide_over_their_axes():
    _, rules = foreign_mesh()
    with pytest.raises(
        ValueError, match=r"num_experts=6 is not divisible by the size 4 of the experts' mesh axes"
    ):
        MoELayer(
            MoEConfig(num_experts=6, num_experts_per_tok=K, moe_intermediate_size=F),
            hidden_size=H,
            rules=rules,
            rngs=nnx.Rngs(0),
        )


# ---------------------------------------------------------------------------------------------
# in a user's model: y typed like x, an unplaced batch trains

DP_EP = jax.make_mesh((2, 4), ("data", "expert"))  # the default axis types: Explicit


def small_cfg(dispatcher="ring", **kw):
    return MoEConfig(
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        options=MoEOptions(dispatcher=dispatcher),
        **kw,
    )


class UserNet(nnx.Module):
    """A user's model: their linear layers around our MoE layer, on the default mesh."""

    def __init__(self, dispatcher, mesh, rngs):
        self.inp = nnx.Linear(H, H, rngs=rngs)
        self.moe = MoELayer(small_cfg(dispatcher), hidden_size=H, mesh=mesh, rngs=rngs)
        self.out = nnx.Linear(H, 3, rngs=rngs)

    def __call__(self, x):
        y, aux = self.moe(self.inp(x))
        return self.out(y), aux


def train_one_step(dispatcher, x, target):
    """One SGD step of UserNet (nnx.jit, value_and_grad, nnx.Optimizer), the user's way."""
    net = UserNet(dispatcher, jax.make_mesh((8,), ("expert",)), nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(net, opt, x, target):
        def loss_fn(net):
            out, aux = net(x)  # the next layer's backward contracts y over the tokens
            return jnp.mean((out - target) ** 2) + 0.01 * aux.aux_loss

        loss, grads = nnx.value_and_grad(loss_fn)(net)
        opt.update(net, grads)
        return loss, grads

    loss, grads = step(net, opt, x, target)
    return float(loss), nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.state(net, nnx.Param))


def test_a_user_model_trains_one_step_with_an_unplaced_batch():
    """Issue 25: on the default (Explicit) mesh with a batch straight from numpy, y came back
    sharded over the tokens and the user's next layer's backward failed (ShardingTypeError)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, H)).astype(np.float32)
    target = rng.standard_normal((4, 8, 3)).astype(np.float32)
    loss, grads, params = train_one_step("ring", x, target)
    want_loss, want_grads, want_params = train_one_step("reference", x, target)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in ((grads, want_grads), (params, want_params)):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max()),
            got,
            want,
        )
    assert (
        np.abs(want_grads["moe"]["w_up"]).max() > 0
        and np.abs(want_grads["inp"]["kernel"]).max() > 0
    )


PLACEMENTS = {  # x [batch 8, seq 4, H] on the (data 2, expert 4) mesh: unknown to the op,
    # known and split over the expert axis, known over every axis, hidden sharded
    "unplaced": None,
    "unplaced, under jax.set_mesh": "context",
    "batch over data": P("data"),
    "batch over data, seq over expert": P("data", "expert"),
    "hidden over data": P(None, None, "data"),
}


@pytest.mark.parametrize("where", PLACEMENTS)
def test_y_is_typed_like_x(where):
    """y's sharding type is x's (replicated for an unplaced x), forward and backward, with the
    shared expert too: traced only (jax.eval_shape), nothing compiled."""
    layer = MoELayer(
        small_cfg(shared_expert_intermediate_size=FS), hidden_size=H, mesh=DP_EP, rngs=nnx.Rngs(0)
    )
    graphdef, params = nnx.split(layer)
    spec = PLACEMENTS[where]
    x = jax.ShapeDtypeStruct(
        (8, 4, H),
        jnp.float32,
        sharding=None if spec in (None, "context") else NamedSharding(DP_EP, spec),
    )
    seen = []

    def loss(x, params):
        y, _ = nnx.merge(graphdef, params)(x)
        seen.append((jax.typeof(x).sharding.spec, jax.typeof(y).sharding.spec))
        return jnp.sum(y * y)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    if spec == "context":
        with jax.set_mesh(DP_EP):
            gx, _ = jax.eval_shape(grad, x, params)
    else:
        gx, _ = jax.eval_shape(grad, x, params)
    ((x_spec, y_spec),) = seen
    assert y_spec == x_spec, (where, x_spec, y_spec)
    assert gx.shape == x.shape


# ---------------------------------------------------------------------------------------------
# contradictory arguments: refused before tracing, naming what was expected


def fsdp_tp():
    return jax.make_mesh((4, 2), ("fsdp", "tp"))


def make_layer(cfg=None, **kw):
    return MoELayer(cfg or small_cfg(), hidden_size=H, rngs=nnx.Rngs(0), **kw)


LAYER_ERRORS = {
    "an (fsdp, tp) mesh without rules": (
        lambda: make_layer(mesh=fsdp_tp()),
        r"the experts would be sharded over \('fsdp', 'tp'\) but the tokens only over "
        r"\('fsdp',\).*rules=rules_for\(mesh, experts='fsdp', expert_ffn='tp'\)",
    ),
    "experts and expert_ffn on one axis": (
        lambda: make_layer(rules=rules_for(fsdp_tp(), experts="tp", expert_ffn="tp")),
        r"experts=\('tp',\) and expert_ffn=\('tp',\) share the mesh axis 'tp'.*"
        r"map expert_ffn to another axis or to None",
    ),
    "experts and embed on one axis": (
        lambda: make_layer(rules=rules_for(fsdp_tp(), experts="fsdp", embed="fsdp")),
        r"experts=\('fsdp',\) and embed=\('fsdp',\) share the mesh axis 'fsdp'",
    ),
    "embed and router on one axis (the gate [H, E])": (
        lambda: make_layer(rules=rules_for(fsdp_tp(), experts="fsdp", embed="tp", router="tp")),
        r"mesh axis 'tp' is mapped to both 'embed' and 'router', two dimensions of one array",
    ),
    "two expert_ffn axes": (
        lambda: make_layer(
            rules=rules_for(jax.make_mesh((2, 2, 2), ("expert", "a", "b")), expert_ffn=("a", "b"))
        ),
        r"expert_ffn=\('a', 'b'\): expected one mesh axis at most",
    ),
    "experts on no axis": (
        lambda: make_layer(rules=rules_for(fsdp_tp(), experts=None)),
        r"the rules map 'experts' to no mesh axis",
    ),
    "a mesh other than the rules' mesh": (
        lambda: make_layer(mesh=jax.make_mesh((8,), ("expert",)), rules=foreign_mesh()[1]),
        r"mesh= \{'expert': 8\} is not the rules' mesh \{'fsdp': 4, 'tp': 2\}",
    ),
    "rules that are not an AxisRules": (
        lambda: make_layer(rules={"experts": "fsdp"}),
        r"rules=dict: expected an AxisRules",
    ),
    "an ffn that does not split over expert_ffn": (
        lambda: make_layer(
            MoEConfig(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=5),
            rules=foreign_mesh()[1],
        ),
        r"w_gate \[num_experts, hidden_size, moe_intermediate_size\]: dimension 'expert_ffn' "
        r"of size 5 does not divide over the 2 devices of its mesh axes \('tp',\)",
    ),
    "an integer dtype": (
        lambda: make_layer(rules=foreign_mesh()[1], dtype=jnp.int32),
        r"dtype=int32: expected a floating dtype",
    ),
    "x of another hidden size": (
        lambda: make_layer(rules=foreign_mesh()[1])(np.zeros((2, 4, H + 1), np.float32)),
        r"x has shape \(2, 4, 17\), expected \[\.\.\., hidden_size\] with the layer's "
        r"hidden_size=16",
    ),
    "x on another mesh": (
        lambda: make_layer(mesh=jax.make_mesh((8,), ("expert",)))(
            jax.device_put(np.zeros((8, 4, H), np.float32), NamedSharding(DP_EP, P("data")))
        ),
        r"x is on the mesh \{'data': 2, 'expert': 4\}, but the layer's parameters are on "
        r"\{'expert': 8\}",
    ),
    "a dense config (no experts)": (
        lambda: make_layer(MoEConfig(num_experts=0), rules=foreign_mesh()[1]),
        r"MoELayer: num_experts=0: expected an int >= 1",
    ),
    "options moe_ffn refuses (a capacity factor with the ring)": (
        lambda: make_layer(small_cfg().replace(capacity_factor=1.0), rules=foreign_mesh()[1]),
        r"capacity_factor=1.0 applies to dispatcher='alltoall' only",
    ),
    "an infinite initializer_range": (
        lambda: make_layer(rules=foreign_mesh()[1], initializer_range=float("inf")),
        r"MoELayer: initializer_range=inf: expected a finite number >= 0",
    ),
    "rngs that are not an nnx.Rngs": (
        lambda: MoELayer(small_cfg(), hidden_size=H, mesh=DP_EP, rngs=0),
        r"rngs=int: expected an nnx.Rngs",
    ),
    "x without a token dimension": (
        lambda: make_layer(rules=foreign_mesh()[1])(np.zeros((H,), np.float32)),
        r"x has shape \(16,\), expected \[\.\.\., hidden_size\].*at least one token dimension",
    ),
}


@pytest.mark.parametrize("case", LAYER_ERRORS)
def test_contradictory_layer_arguments_are_refused(case):
    build, match = LAYER_ERRORS[case]
    with pytest.raises(ValueError, match=match):
        build()


def expert_bias_layer():
    return make_layer(small_cfg(expert_bias=True), rules=foreign_mesh()[1])


BIAS_ERRORS = {  # (load, rate, the error)
    "one expert too many": (
        np.ones(E + 1),
        None,
        r"expert_load is float32\[9\], expected int "
        r"or float counts shaped like the bias, \[8\]",
    ),
    "a leading 1": (np.ones((1, E)), None, r"expert_load is float32\[1, 8\], expected .*\[8\]"),
    "[L, E] for one layer": (np.ones((2, E)), None, r"\[2, 8\], .*\[L, E\] for stacked layers"),
    "a scalar": (np.int32(3), None, r"expert_load is int32\[\], expected"),
    "booleans": (np.ones(E, bool), None, r"expert_load is bool\[8\], expected int or float"),
    "a negative rate": (np.ones(E), -0.1, r"rate=-0.1: expected a finite number >= 0"),
    "a NaN rate": (np.ones(E), float("nan"), r"rate=nan: expected a finite number >= 0"),
    "a string rate": (np.ones(E), "0.1", r"rate='0.1': expected a finite number >= 0"),
}


@pytest.mark.parametrize("case", BIAS_ERRORS)
def test_update_expert_bias_refuses_a_load_or_rate_it_cannot_use(case):
    load, rate, match = BIAS_ERRORS[case]
    layer = expert_bias_layer()
    before = np.asarray(layer.expert_bias[...])
    with pytest.raises(ValueError, match=match):
        layer.update_expert_bias(load, rate)
    np.testing.assert_array_equal(np.asarray(layer.expert_bias[...]), before)  # untouched
    assert layer.expert_bias[...].shape == (E,)
