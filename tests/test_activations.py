"""The experts' gated activations (`relaymoe_jax.Activation`): the dense reference against float64
numpy (values, and every gradient by central differences), then every dispatcher and grouped
matmul against the reference on the adversarial routings, values and every gradient, padding
NaN-poisoned; bad input."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_cases import mesh
from relaymoe_jax import ACTIVATIONS, Activation, moe_ffn, testing
from relaymoe_jax.dispatch.reference import reference_moe

# gpt_oss at a small limit, so that both clamps (min on g, clip on u at both ends) are hit
CASES = {
    "swiglu": Activation("swiglu"),
    "geglu": Activation("geglu"),
    "geglu_exact": Activation("geglu_exact"),
    "gpt_oss": Activation("gpt_oss"),
    "gpt_oss_clamped": Activation("gpt_oss", alpha=1.702, limit=0.5),
}


def _gelu_tanh(g):
    return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


def _gelu_erf(g):
    erf = np.vectorize(math.erf)
    return 0.5 * g * (1 + erf(g / math.sqrt(2)))


def act_f64(a: Activation, g, u):
    """The activations written again in float64 numpy, from their published formulas."""
    if a.name == "swiglu":
        return g / (1 + np.exp(-g)) * u
    if a.name == "geglu":
        return _gelu_tanh(g) * u
    if a.name == "geglu_exact":
        return _gelu_erf(g) * u
    g = np.minimum(g, a.limit)
    u = np.clip(u, -a.limit, a.limit)
    return (u + 1) * g / (1 + np.exp(-a.alpha * g))


def moe_f64(a, x, ids, wts, wg, wu, wd, bg=None, bu=None, bd=None):
    """y = sum_j wts[t, j] * (act(x W_g[e] + b_g[e], x W_u[e] + b_u[e]) W_d[e] + b_d[e]), pair
    by pair in float64 (missing biases: 0)."""
    e_, f, h_ = wg.shape[0], wg.shape[2], x.shape[1]
    bg = np.zeros((e_, f)) if bg is None else bg
    bu = np.zeros((e_, f)) if bu is None else bu
    bd = np.zeros((e_, h_)) if bd is None else bd
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            h = act_f64(a, x[t] @ wg[e] + bg[e], x[t] @ wu[e] + bu[e])
            y[t] += wts[t, j] * (h @ wd[e] + bd[e])
    return y


def test_activation_cases_cover_every_name():
    assert {a.name for a in CASES.values()} == set(ACTIVATIONS)


def assert_reference_matches_f64(a: Activation, inp, biases=()):
    """The dense reference's y, and its gradient of sum(y * r) w.r.t. x, the router weights, the
    three weights and the given biases, against float64 numpy (central differences, every
    entry)."""
    ids64, r = np.asarray(inp.expert_ids), np.asarray(inp.r, np.float64)
    jax_args = [inp.args[i] for i in (0, 2, 3, 4, 5)] + list(biases)
    diff = [np.asarray(v, np.float64) for v in jax_args]

    def loss64(vals):
        return float(np.sum(moe_f64(a, vals[0], ids64, *vals[1:]) * r))

    def ref(x, wts, wg, wu, wd, *bb):
        return reference_moe(x, inp.expert_ids, wts, wg, wu, wd, *bb, activation=a)

    y = jax.jit(ref)(*jax_args)
    want_y = moe_f64(a, diff[0], ids64, *diff[1:])
    np.testing.assert_allclose(np.asarray(y, np.float64), want_y, rtol=0, atol=2e-6)
    argnums = tuple(range(len(jax_args)))
    grads = jax.jit(jax.grad(lambda *v: (ref(*v) * inp.r).sum(), argnums=argnums))(*jax_args)
    eps = 1e-6
    for n, (g_got, base) in enumerate(zip(grads, diff)):
        want = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            plus, minus = [v.copy() for v in diff], [v.copy() for v in diff]
            plus[n][idx] += eps
            minus[n][idx] -= eps
            want[idx] = (loss64(plus) - loss64(minus)) / (2 * eps)
        scale = np.max(np.abs(want))
        assert scale > 0, n
        np.testing.assert_allclose(np.asarray(g_got), want, rtol=0, atol=1e-4 * scale)


def small_inputs(seed=1, e=4, k=2, t=6, h=4, f=5):
    ids = testing.routing_case("uniform", t, k, e, 1, seed=seed)
    return testing.moe_inputs(ids, e, hidden=h, ffn=f, seed=seed)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_float64_numpy(name):
    a = CASES[name]
    inp = small_inputs()
    if name == "gpt_oss_clamped":  # the clamps are hit on both sides
        x, wg, wu = (np.asarray(inp.args[i], np.float64) for i in (0, 3, 4))
        first = np.asarray(inp.expert_ids)[:, 0]
        gates = np.einsum("th,thf->tf", x, wg[first])
        ups = np.einsum("th,thf->tf", x, wu[first])
        assert (gates > a.limit).any() and (ups > a.limit).any() and (ups < -a.limit).any()
    assert_reference_matches_f64(a, inp)


# (activation, dispatcher, routing): each activation through a dispatcher, the clamped GPT-OSS
# one (the backward that differs most from SwiGLU's) through the ring and the all-to-all, each
# ring routing with at least one. A dispatcher applies the activation in one place for both ring
# routings (`dispatch.hop`: the forward's expert_mlp, the backward's jax.vjp of it) and in one for
# the all-to-all (expert_mlp, autodiff), so this covers every activation's code in each; SwiGLU,
# the default, runs through every dispatcher, routing and mesh in test_dispatch.py. The clamped
# GPT-OSS activation runs through the ring (both routings) and the all-to-all, on this mesh and
# these routing cases, in test_expert_biases.py::test_dispatchers_with_biases_match_the_reference
# (with biases; the bias-free path is every other test's): its former cases here,
# [gpt_oss_clamped-ring-expert] and [gpt_oss_clamped-alltoall-auto], are its [data x expert-ring-
# expert-xla] and [data x expert-alltoall-auto-ragged_dot].
DISPATCH_CASES = [
    ("geglu", "ring", "expert"),
    ("geglu_exact", "ring", "token"),
    ("gpt_oss", "alltoall", "auto"),
]


@functools.cache
def reference(name):
    """The reference on (data=2, expert=4) with activation `name`: one object per activation, so
    its program is compiled once for every dispatcher compared with it."""
    return functools.partial(
        moe_ffn, mesh=mesh("dp2_ep4"), dispatcher="reference", activation=CASES[name]
    )


@pytest.mark.parametrize("name,dispatcher,routing", DISPATCH_CASES)
def test_dispatchers_match_the_reference_on_every_routing(name, dispatcher, routing):
    """(data=2, expert=4), tokens over both: values and every gradient on each adversarial
    routing of relaymoe_jax.testing (one program per function: the routings are data).

    Also covers what the removed cross product did ([swiglu-*], [geglu-ring-token],
    [geglu-alltoall-auto], [geglu_exact-ring-expert], [geglu_exact-alltoall-auto],
    [gpt_oss-ring-expert], [gpt_oss-ring-token], [gpt_oss_clamped-ring-token]): see
    DISPATCH_CASES (token routing runs the clamped activation with biases in
    test_expert_biases.py too). The clamped GPT-OSS cases ([gpt_oss_clamped-ring-expert] and
    [gpt_oss_clamped-alltoall-auto], removed, see DISPATCH_CASES) run in
    test_expert_biases.py::test_dispatchers_with_biases_match_the_reference (the default blocked
    XLA grouped matmul: what test_other_grouped_matmuls_with_gpt_oss did; ragged_dot) and
    test_other_grouped_matmuls_with_biases (the Pallas kernel), clamped GPT-OSS with biases."""
    a = CASES[name]
    m = mesh("dp2_ep4")
    e, k, t = 16, 4, 64
    ours = functools.partial(moe_ffn, mesh=m, dispatcher=dispatcher, routing=routing, activation=a)
    tok = NamedSharding(m, P(("data", "expert")))
    for case, ids in testing.routing_cases(t, k, e, 4, seed=2).items():
        inp = testing.moe_inputs(ids, e, seed=2)
        args = [jax.device_put(v, tok) for v in inp.args[:3]] + list(inp.args[3:])
        try:
            testing.assert_moe_parity(ours, reference(name), *args)
        except AssertionError as err:
            raise AssertionError(f"routing case {case!r}: {err}") from None


def test_the_activation_changes_the_result():
    """A control: with each activation the dense reference gives a different y from the others
    on the same inputs, so a dispatcher that ignored `activation` (or applied another one) would
    fail the parity tests, which compare it with the reference of its activation. (The
    hierarchical ring and moe_ffn_local with an activation, test_hierarchical_ring_and_moe_ffn_
    local_take_the_activation here before, run in test_expert_biases.py::
    test_moe_ffn_local_with_biases[hierarchical ring], GeGLU against its reference.)"""
    ids = testing.routing_case("uniform", 64, 4, 16, 8, seed=6)
    inp = testing.moe_inputs(ids, 16, seed=6)
    every = jax.jit(lambda *a: {n: reference_moe(*a, activation=act) for n, act in CASES.items()})
    ys = {n: np.asarray(y) for n, y in every(*inp.args).items()}
    names = sorted(ys)
    for i, n1 in enumerate(names):
        for n2 in names[i + 1 :]:
            assert np.max(np.abs(ys[n1] - ys[n2])) > 1e-4, (n1, n2)


# GPT-OSS's clamps at L = 1 (exact in float32): g at the bound, u at both bounds, and beyond
AT_BOUND = Activation("gpt_oss", limit=1.0)
G_AT = np.array([1.0, 1.0, 1.0, 0.25, 2.0, -3.0])
U_AT = np.array([1.0, -1.0, 0.25, 1.0, -1.0, 3.0])


def clamped_grads_f64(a: Activation, g, u, c):
    """d/dg and d/du of sum(c * act(g, u)) for gpt_oss, derived by hand in float64 with
    torch.clamp's gradient: 1 where g <= L and where -L <= u <= L, the bounds included."""
    lim = a.limit
    gc, uc = np.minimum(g, lim), np.clip(u, -lim, lim)
    s = 1 / (1 + np.exp(-a.alpha * gc))
    dg = c * (uc + 1) * (s + a.alpha * gc * s * (1 - s)) * (g <= lim)
    du = c * gc * s * ((u >= -lim) & (u <= lim))
    return dg, du


def test_gpt_oss_clamp_passes_the_whole_gradient_at_the_bound():
    """At g == L and u == +-L the gradient is torch.clamp's (jnp.minimum/jnp.clip gave half)."""
    c = np.array([0.7, -1.3, 0.4, 1.1, 0.9, -0.6])
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    loss = lambda g, u: jnp.sum(f32(c) * AT_BOUND(g, u))
    got = jax.grad(loss, argnums=(0, 1))(f32(G_AT), f32(U_AT))
    for name, g, w in zip(("d/dg", "d/du"), got, clamped_grads_f64(AT_BOUND, G_AT, U_AT, c)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(
        np.asarray(AT_BOUND(f32(G_AT), f32(U_AT))), act_f64(AT_BOUND, G_AT, U_AT), rtol=1e-6
    )


@pytest.mark.parametrize("dispatcher", ["reference", "ring"])
def test_the_op_passes_the_whole_gradient_at_the_clamp_bound(dispatcher):
    """Through moe_ffn: one-hot tokens make each gate/up projection a row of w_gate/w_up exactly,
    set at the bounds; dx, dw_gate and dw_up against the hand-derived float64 gradient."""
    e, h, f = 8, 4, G_AT.size
    rng = np.random.default_rng(3)
    ids = np.arange(e, dtype=np.int32)[:, None]  # token t to expert t, k = 1
    x = np.zeros((e, h))
    x[:, 0] = 1.0
    wts = rng.uniform(0.5, 1.0, (e, 1))
    wg, wu = rng.standard_normal((2, e, h, f))
    wg[:, 0], wu[:, 0] = G_AT, U_AT
    wd, r = rng.standard_normal((e, f, h)), rng.standard_normal((e, h))
    dh = wts * np.einsum("efh,eh->ef", wd, r)  # d loss / d act, per token (= expert)
    dg, du = clamped_grads_f64(AT_BOUND, G_AT[None], U_AT[None], dh)
    want = {
        "x": np.einsum("ehf,ef->eh", wg, dg) + np.einsum("ehf,ef->eh", wu, du),
        "w_gate": np.einsum("eh,ef->ehf", x, dg),
        "w_up": np.einsum("eh,ef->ehf", x, du),
    }
    f32 = [jnp.asarray(v, jnp.float32) for v in (x, wts, wg, wu, wd, r)]
    op = functools.partial(moe_ffn, mesh=mesh("ep8"), dispatcher=dispatcher, activation=AT_BOUND)

    def loss(x, wg, wu):
        return jnp.sum(op(x, jnp.asarray(ids), f32[1], wg, wu, f32[4]) * f32[5])

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(f32[0], f32[2], f32[3])
    for (name, w), g in zip(want.items(), got):
        scale = np.abs(w).max()
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize(
    "value,match",
    [
        ("relu", r"activation='relu': expected one of \('swiglu', 'geglu', 'geglu_exact', "),
        (Activation, r"activation=<class .*>: expected one of"),
        (3, "activation=3: expected one of"),
    ],
)
def test_bad_activation_names_are_refused(value, match):
    m = mesh("ep8")
    ids = testing.routing_case("uniform", 16, 2, 16, 8)
    inp = testing.moe_inputs(ids, 16)
    with pytest.raises(ValueError, match=match):
        moe_ffn(*inp.args, mesh=m, activation=value)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(name="swiglu", limit=3.0), "activation 'swiglu' takes no alpha or limit"),
        (dict(name="gpt_oss", limit=0.0), r"activation limit=0.0: expected a finite number > 0"),
        (dict(name="gpt_oss", alpha=float("inf")), "activation alpha=inf: expected a finite"),
        (dict(name="gpt_oss", limit="7"), "activation limit='7': expected a finite number"),
        (dict(name="gpt_oss", alpha=True), "activation alpha=True: expected a finite number"),
    ],
)
def test_bad_activation_records_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Activation(**kw)
