"""The routers of `MoEConfig.router` against float64 numpy written from the families' published
formulas (Qwen's softmax then top-k, GPT-OSS's top-k then softmax, DeepSeek-V3's grouped sigmoid
with its selection bias), DeepSeek-V3's sequence-wise balance loss, and `MoELayer` built with each
router, activation and the expert biases against a float64 numpy forward; config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_activations import act_f64

from moe_cases import mesh
from relaymoe_jax import Activation
from relaymoe_jax.models import MoEConfig, MoELayer, routers
from relaymoe_jax.models import router_losses as router
from relaymoe_jax.op.options import MoEOptions

T, E, K = 24, 8, 2
a_swiglu = Activation("swiglu")


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _top(scores, k):
    """Indices of the k largest, largest first, ties to the lower index (as lax.top_k)."""
    return np.array([sorted(range(len(r)), key=lambda e: (-r[e], e))[:k] for r in scores])


def route_f64(kind, logits, k, *, norm=True, bias=None, n_group=1, topk_group=1, scale=1.0):
    """(ids, weights, probs) in float64 numpy, token by token."""
    bias = np.zeros(logits.shape[-1]) if bias is None else bias
    if kind == "softmax_topk":
        p = _softmax(logits)
        ids = _top(p + bias, k)
        w = np.take_along_axis(p, ids, -1)
        return ids, (w / w.sum(-1, keepdims=True) if norm else w), p
    if kind == "topk_softmax":
        ids = _top(logits + bias, k)
        return ids, _softmax(np.take_along_axis(logits, ids, -1)), _softmax(logits)
    s = _sigmoid(logits)
    ids, ws = [], []
    for row_s in s:
        c = row_s + bias
        size = len(c) // n_group
        groups = [sorted(c[g * size : (g + 1) * size])[-2:] for g in range(n_group)]
        kept = _top(np.array([[sum(g) for g in groups]]), topk_group)[0]
        masked = np.array([c[e] if e // size in kept else -np.inf for e in range(len(c))])
        top = _top(masked[None], k)[0]
        w = row_s[top]
        if norm:
            w = w / (w.sum() + 1e-20)
        ids.append(top)
        ws.append(w * scale)
    return np.array(ids), np.array(ws), s / s.sum(-1, keepdims=True)


def _logits(seed=0, t=T, e=E):
    """Random logits whose selections have a clear margin (no near-ties to break)."""
    return np.random.default_rng(seed).standard_normal((t, e)) * 2.0


CASES = {
    "softmax_topk": dict(norm=True),
    "softmax_topk_unnormalised": dict(norm=False),
    "topk_softmax": {},
    "sigmoid_group": dict(n_group=4, topk_group=2, scale=2.5),
    "sigmoid_group_4_per_group": dict(n_group=2, topk_group=1, scale=1.0),  # top-2 of 4 matters
    "sigmoid_no_groups": dict(n_group=1, topk_group=1, scale=1.0, norm=False),
}


def _run(kind, logits, bias, kw):
    x = jnp.asarray(logits, jnp.float32)
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    if kind == "softmax_topk":
        return routers.softmax_topk(x, K, norm_topk_prob=kw["norm"], bias_e=b)
    if kind == "topk_softmax":
        return routers.topk_softmax(x, K, bias_e=b)
    return routers.sigmoid_group(
        x,
        K,
        n_group=kw["n_group"],
        topk_group=kw["topk_group"],
        routed_scaling_factor=kw["scale"],
        norm_topk_prob=kw.get("norm", True),
        bias_e=b,
    )


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_routers_match_float64_numpy(case, with_bias):
    kind = case.removesuffix("_unnormalised").removesuffix("_4_per_group")
    kind = kind.replace("sigmoid_no_groups", "sigmoid_group")
    kw = CASES[case]
    logits = _logits(seed=len(case))
    bias = np.random.default_rng(7).uniform(-0.3, 0.3, E) if with_bias else None
    ids, w, p = route_f64(kind, logits, K, bias=bias, **kw)
    got = _run(kind, logits, bias, kw)
    np.testing.assert_array_equal(np.asarray(got.ids_tk), ids)
    np.testing.assert_allclose(np.asarray(got.weights_tk), w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got.probs_te), p, rtol=1e-6, atol=1e-7)


def test_group_limit_changes_the_choice():
    """A control: with the group limit, some token picks other experts than without it (so the
    test above would see a router that ignored n_group)."""
    logits = _logits(seed=3)
    grouped = route_f64("sigmoid_group", logits, K, n_group=4, topk_group=1)[0]
    flat = route_f64("sigmoid_group", logits, K)[0]
    assert (grouped != flat).any()
    got = _run("sigmoid_group", logits, None, dict(n_group=4, topk_group=1, scale=1.0))
    np.testing.assert_array_equal(np.asarray(got.ids_tk), grouped)


def test_sharded_tokens_route_like_unsharded():
    """On an Explicit mesh with the tokens sharded (top-k where the tokens live)."""
    m = mesh("dp2_ep4")
    logits = _logits(seed=4, t=32)
    x = jax.device_put(jnp.asarray(logits, jnp.float32), NamedSharding(m, P(("data", "expert"))))
    fn = jax.jit(
        lambda z: routers.sigmoid_group(
            z, K, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True
        )
    )
    got = fn(x)
    want = route_f64("sigmoid_group", logits, K, n_group=4, topk_group=2, scale=2.5)
    np.testing.assert_array_equal(np.asarray(got.ids_tk), want[0])


def test_sequence_balance_loss_matches_numpy():
    """DeepSeek-V3 eq. 17-20 per sequence, averaged: f_e = E/(k S) * count, P_e = mean_s s'."""
    b, s = 3, 8
    logits = _logits(seed=5, t=b * s)
    ids, _, p = route_f64("sigmoid_group", logits, K, n_group=4, topk_group=2)
    want = 0.0
    for i in range(b):
        rows = slice(i * s, (i + 1) * s)
        counts = np.bincount(ids[rows].ravel(), minlength=E)
        want += np.sum(counts * E / (K * s) * p[rows].mean(0)) / b
    got = router.sequence_balance_loss(
        jnp.asarray(p.reshape(b, s, E), jnp.float32), jnp.asarray(ids.reshape(b, s, K))
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


# ------------------------------------------------------------------ MoELayer

LAYERS = {
    "gpt_oss": dict(
        router="topk_softmax",
        router_bias=True,
        activation="gpt_oss",
        swiglu_limit=1.0,
        expert_biases=True,
    ),
    "deepseek_v3": dict(
        router="sigmoid_group",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        expert_bias=True,
        shared_expert_intermediate_size=12,
        shared_expert_gated=False,
    ),
    "qwen2_gated_shared": dict(shared_expert_intermediate_size=8),
    "grok_geglu": dict(router="softmax_topk", norm_topk_prob=False, activation="geglu"),
}


def _perturbed_layer(name, m, dispatcher, h=16, f=12):
    """The layer with every parameter drawn at random (biases included), and its values."""
    sizes = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=f)
    cfg = MoEConfig(**sizes, options=MoEOptions(dispatcher=dispatcher), **LAYERS[name])
    layer = MoELayer(cfg, hidden_size=h, mesh=m, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(11)
    for _, var in nnx.to_flat_state(nnx.state(layer)):
        v = var.get_value()
        scale = 1.0 / math.sqrt(v.shape[-2]) if v.ndim >= 2 else 0.3
        new = jnp.asarray(scale * rng.standard_normal(v.shape), v.dtype)
        var.set_value(jax.device_put(new, v.sharding))
    params = {
        ".".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(layer))
    }
    return cfg, layer, params


def layer_f64(cfg, params, x):
    """The MoE block in float64 numpy: router logits (+ bias), the routing, then each pair's
    expert with its biases and activation."""
    g = lambda n: np.asarray(params[n], np.float64) if n in params else None
    logits = x @ g("gate") + (g("gate_bias") if cfg.router_bias else 0.0)
    kw = dict(norm=cfg.norm_topk_prob, bias=g("expert_bias"), n_group=cfg.n_group)
    kw.update(topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor)
    ids, w, _ = route_f64(cfg.router, logits, cfg.num_experts_per_tok, **kw)
    a = cfg.expert_activation()
    zf = np.zeros((E, cfg.moe_intermediate_size))
    bg, bu = (g(n) if cfg.expert_biases else zf for n in ("b_gate", "b_up"))
    bd = g("b_down") if cfg.expert_biases else np.zeros((E, x.shape[-1]))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            hid = act_f64(a, x[t] @ g("w_gate")[e] + bg[e], x[t] @ g("w_up")[e] + bu[e])
            y[t] += w[t, j] * (hid @ g("w_down")[e] + bd[e])
    if cfg.shared_expert_intermediate_size:
        gp, up, dp = (g(f"shared_expert.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
        shared = act_f64(a_swiglu, x @ gp, x @ up) @ dp
        if cfg.shared_expert_gated:
            shared = shared / (1 + np.exp(-(x @ g("shared_expert_gate"))))
        y = y + shared
    return y, ids


# Each family through one dispatcher, each dispatcher with two families. The family (router,
# router and expert biases, activation, shared expert) is the layer's code around moe_ffn, the
# same for every dispatcher; moe_ffn's dispatchers run every activation, the biases and every
# routing against the reference in test_dispatch.py, test_activations.py and
# test_expert_biases.py. This covers the former cross product ([deepseek_v3-alltoall],
# [gpt_oss-alltoall], [grok_geglu-ring] and [qwen2_gated_shared-ring] too).
FAMILY_DISPATCHERS = [
    ("deepseek_v3", "ring"),
    ("gpt_oss", "ring"),
    ("grok_geglu", "alltoall"),
    ("qwen2_gated_shared", "alltoall"),
]


@pytest.mark.parametrize("name,dispatcher", FAMILY_DISPATCHERS)
def test_moe_layer_families_match_float64_numpy(name, dispatcher):
    """The layer of each family (FAMILY_DISPATCHERS) against float64 numpy: y and the expert
    load."""
    assert sorted(n for n, _ in FAMILY_DISPATCHERS) == sorted(LAYERS)
    m = mesh("dp2_ep4")
    cfg, layer, params = _perturbed_layer(name, m, dispatcher)
    x = np.random.default_rng(12).standard_normal((2, 12, layer.hidden_size))
    xs = jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(m, P("data", "expert")))
    y, aux = nnx.jit(lambda lyr, v: lyr(v))(layer, xs)
    want, ids = layer_f64(cfg, params, x.reshape(-1, layer.hidden_size))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, layer.hidden_size), want, atol=2e-5)
    load = np.bincount(ids.ravel(), minlength=E)
    np.testing.assert_array_equal(np.asarray(aux.expert_load), load)
    assert (aux.seq_aux_loss is not None) == (cfg.router == "sigmoid_group")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(router="topk"), r"^router='topk': expected one of \('softmax_topk', "),
        (dict(n_group=2), "^n_group=2 applies to router='sigmoid_group' only"),
        (
            dict(routed_scaling_factor=2.5, router="topk_softmax"),
            "routed_scaling_factor=2.5 applies to router='sigmoid_group' only",
        ),
        (
            dict(router="sigmoid_group", n_group=3, topk_group=1),
            "n_group=3, topk_group=1 with num_experts=8 and num_experts_per_tok=2: expected",
        ),
        (
            dict(router="sigmoid_group", n_group=4, topk_group=5),
            "expected n_group dividing num_experts, topk_group <= n_group",
        ),
        (
            dict(router="sigmoid_group", n_group=8, topk_group=1),
            r"num_experts_per_tok <= topk_group \* num_experts / n_group",
        ),
        (
            dict(router="sigmoid_group", routed_scaling_factor=0.0),
            "routed_scaling_factor=0.0: expected a finite number > 0",
        ),
        (dict(activation="relu"), "^activation='relu': expected one of"),
        (dict(swiglu_limit=3.0), "swiglu_limit=3.0 applies to activation='gpt_oss' only"),
        (
            dict(activation="gpt_oss", swiglu_limit=-1.0),
            "^swiglu_limit=-1.0: expected a finite number > 0",
        ),
        (dict(router_bias=1), "^router_bias=1: expected true or false"),
        (dict(expert_biases="yes"), "^expert_biases='yes': expected true or false"),
        (
            dict(shared_expert_gated=False),
            "shared_expert_gated=False applies to a shared expert only",
        ),
    ],
)
def test_bad_router_and_expert_settings_are_refused(kw, match):
    base = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=12)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**base, **kw)


@pytest.mark.parametrize("nan_at", [0, 3, E - 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_nan_score_makes_its_tokens_weights_nan_under_every_router(case, nan_at):
    """Every router propagates a NaN logit to its token's weights and probs, other tokens
    untouched (sigmoid_group used to route around the NaN expert and return finite weights: its
    sigmoid's NaN sorts below every number in top_k)."""
    kind = case.removesuffix("_unnormalised").removesuffix("_4_per_group")
    kind = kind.replace("sigmoid_no_groups", "sigmoid_group")
    logits = _logits(seed=5)
    logits[0, nan_at] = np.nan
    got = _run(kind, logits, None, CASES[case])
    w, p = np.asarray(got.weights_tk), np.asarray(got.probs_te)
    assert np.isnan(w[0]).all() and np.isnan(p[0]).all(), (w[0], p[0])
    assert np.isfinite(w[1:]).all() and np.isfinite(p[1:]).all()
