"""Expert biases (`b_gate`, `b_up`, `b_down`, as GPT-OSS has them): the dense reference against
float64 numpy, then every dispatcher, mesh layout (data, expert-tensor with tokens gathered or
replicated), grouped matmul, `moe_ffn_local` and the hierarchical ring against the reference,
values and every gradient (the biases' included), padding NaN-poisoned; bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_activations import CASES, assert_reference_matches_f64, small_inputs

from moe_cases import mesh
from relaymoe_jax import moe_ffn, moe_ffn_local, testing

NAMES = ("b_gate", "b_up", "b_down")
E, K, T, H, F = 16, 4, 64, 16, 24
ETP = "expert_tensor"


def biases(e, h, f, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    shapes = ((e, f), (e, f), (e, h))
    return tuple(jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for s in shapes)


@pytest.mark.parametrize("name", ["swiglu", "gpt_oss_clamped"])
def test_reference_with_biases_matches_float64_numpy(name):
    inp = small_inputs()
    assert_reference_matches_f64(CASES[name], inp, biases(4, 4, 5, seed=1))


def with_biases(fn, names=NAMES):
    """fn(x, ids, wts, wg, wu, wd, *biases), the biases passed by keyword (all positional for
    assert_moe_parity, which differentiates every floating-point argument)."""

    def call(x, ids, wts, wg, wu, wd, *bb, **kw):
        return fn(x, ids, wts, wg, wu, wd, **dict(zip(names, bb)), **kw)

    return call


LAYOUTS = {
    "data x expert": dict(m="dp2_ep4", tokens=P(("data", "expert")), kw={}),
    "ETP, tokens gathered": dict(
        m="ep4_etp2", tokens=P(("expert", "expert_tensor")), kw={"expert_tensor_axis": ETP}
    ),
    "ETP, tokens replicated": dict(
        m="ep4_etp2", tokens=P("expert"), kw={"expert_tensor_axis": ETP}
    ),
}
MODES = [("ring", "expert"), ("ring", "token"), ("alltoall", "auto")]


@pytest.mark.parametrize("dispatcher,routing", MODES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dispatchers_with_biases_match_the_reference(layout, dispatcher, routing):
    """GPT-OSS's clamped activation with all three biases, on each adversarial routing:
    b_down is added once with expert tensor parallelism (not once per rank)."""
    where = LAYOUTS[layout]
    m = mesh(where["m"])
    a = CASES["gpt_oss_clamped"]
    ours = with_biases(
        functools.partial(
            moe_ffn,
            mesh=m,
            dispatcher=dispatcher,
            routing=routing,
            activation=a,
            **where["kw"],
        )
    )
    ref = with_biases(functools.partial(moe_ffn, mesh=m, dispatcher="reference", activation=a))
    tok = NamedSharding(m, where["tokens"])
    bb = biases(E, H, F)
    for case, ids in testing.routing_cases(T, K, E, 4, seed=3).items():
        inp = testing.moe_inputs(ids, E, seed=3)
        args = [jax.device_put(v, tok) for v in inp.args[:3]] + list(inp.args[3:])
        try:
            testing.assert_moe_parity(ours, ref, *args, *bb)
        except AssertionError as err:
            raise AssertionError(f"routing case {case!r}: {err}") from None


@pytest.mark.parametrize("names", [("b_down",), ("b_gate", "b_up")])
def test_some_biases_only(names):
    """The others are zero, and only the given ones are differentiated."""
    m = mesh("dp2_ep4")
    ids = testing.routing_case("uniform", T, K, E, 4, seed=5)
    inp = testing.moe_inputs(ids, E, seed=5)
    given = [b for n, b in zip(NAMES, biases(E, H, F, seed=5)) if n in names]
    ours = with_biases(functools.partial(moe_ffn, mesh=m), names)
    ref = with_biases(functools.partial(moe_ffn, mesh=m, dispatcher="reference"), names)
    testing.assert_moe_parity(ours, ref, *inp.args, *given)
    plain = jax.jit(functools.partial(moe_ffn, mesh=m))(*inp.args)
    assert np.max(np.abs(np.asarray(jax.jit(ours)(*inp.args, *given)) - plain)) > 1e-3


@pytest.mark.parametrize("gmm_impl", ["ragged_dot", "pallas-interpret"])
@pytest.mark.parametrize("dispatcher,routing", [("ring", "expert"), ("alltoall", "auto")])
def test_other_grouped_matmuls_with_biases(gmm_impl, dispatcher, routing):
    m = mesh("ep8")
    ids = testing.routing_case("ragged", T, K, E, 8, seed=6)
    inp = testing.moe_inputs(ids, E, seed=6)
    a = CASES["gpt_oss"]
    ours = with_biases(
        functools.partial(
            moe_ffn, mesh=m, dispatcher=dispatcher, routing=routing, gmm_impl=gmm_impl, activation=a
        )
    )
    ref = with_biases(functools.partial(moe_ffn, mesh=m, dispatcher="reference", activation=a))
    testing.assert_moe_parity(ours, ref, *inp.args, *biases(E, H, F, seed=6))


def _local_layer(m, tokens, ea, etp=None, **kw):
    """The caller's shard_map: experts over `ea`, ffn (and b_gate, b_up) over `etp`, b_down
    replicated over `etp`."""
    w_in, w_out = P(ea, None, etp), P(ea, etp, None)
    b_in, b_out = P(ea, etp), P(ea, None)
    specs = (tokens,) * 3 + (w_in, w_in, w_out, b_in, b_in, b_out)
    body = functools.partial(
        with_biases(moe_ffn_local), expert_axis=ea, expert_tensor_axis=etp, **kw
    )
    run = jax.shard_map(body, mesh=m, in_specs=specs, out_specs=tokens)

    def layer(*args):
        return run(*(jax.sharding.reshard(a, NamedSharding(m, s)) for a, s in zip(args, specs)))

    return layer


@pytest.mark.parametrize(
    "case",
    ["hierarchical ring", "ETP, tokens gathered", "ETP, tokens replicated, all-to-all"],
)
def test_moe_ffn_local_with_biases(case):
    ids = testing.routing_case("uniform", T, K, E, 8, seed=7)
    inp = testing.moe_inputs(ids, E, seed=7)
    bb = biases(E, H, F, seed=7)
    if case == "hierarchical ring":
        m, ea = jax.make_mesh((2, 4), ("node", "local")), ("node", "local")
        ours = _local_layer(m, P(ea), ea, ring="hierarchical", activation="geglu")
        ref_kw = dict(expert_axis=ea, activation="geglu")
    else:
        m, ea = mesh("ep4_etp2"), "expert"
        tokens = P(("expert", "expert_tensor")) if "gathered" in case else P("expert")
        dispatcher = "alltoall" if "all-to-all" in case else "ring"
        ours = _local_layer(m, tokens, ea, "expert_tensor", dispatcher=dispatcher)
        ref_kw = dict(expert_axis=ea)
    ref = with_biases(functools.partial(moe_ffn, mesh=m, dispatcher="reference", **ref_kw))
    testing.assert_moe_parity(ours, ref, *inp.args, *bb)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"b_gate": jnp.zeros((E, H))}, r"b_gate: shape \(16, 16\), expected \(16, 24\)"),
        ({"b_down": jnp.zeros((E, F))}, r"b_down: shape \(16, 24\), expected \(16, 16\)"),
        ({"b_up": jnp.zeros((F,))}, r"b_up: shape \(24,\), expected \(16, 24\)"),
        ({"b_up": np.zeros((E, F), np.int32)}, "b_up: expected a floating dtype, got int32"),
        ({"b_down": [[0.0]]}, r"b_down: shape None, expected \(16, 16\)"),
    ],
)
def test_bad_biases_are_refused(bad, match):
    m = mesh("ep8")
    inp = testing.moe_inputs(testing.routing_case("uniform", T, K, E, 8), E)
    with pytest.raises(ValueError, match=match):
        moe_ffn(*inp.args, mesh=m, **bad)


def test_moe_ffn_local_refuses_biases_sharded_unlike_their_weights():
    """b_down different on each expert-tensor rank would be added once per rank; a b_gate of the
    local shape replicated over the expert axis would give every device's experts the same
    biases."""
    m = mesh("ep4_etp2")
    etp = "expert_tensor"
    inp = testing.moe_inputs(testing.routing_case("uniform", T, K, E, 4), E)
    w_in, w_out = P("expert", None, etp), P("expert", etp, None)
    b_gate, b_up, b_down = biases(E, H, F)

    def run(b_specs, b_arrays, body_change=lambda bb: bb):
        def body(*a):
            return with_biases(moe_ffn_local)(
                *a[:6], *body_change(a[6:]), expert_axis="expert", expert_tensor_axis=etp
            )

        specs = (P("expert"),) * 3 + (w_in, w_in, w_out, *b_specs)
        arrays = (*inp.args, *b_arrays)
        args = [jax.device_put(a, NamedSharding(m, s)) for a, s in zip(arrays, specs)]
        jax.jit(jax.shard_map(body, mesh=m, in_specs=specs, out_specs=P("expert")))(*args)

    good = (P("expert", etp), P("expert", etp), P("expert"))
    per_rank = lambda bb: (*bb[:2], jax.lax.pcast(bb[2], etp, to="varying"))
    with pytest.raises(
        ValueError,
        match=r"b_down varies over \('expert', 'expert_tensor'\), expected \('expert',\) like "
        r"its weights \(b_down is added once: the same on every rank of expert_tensor_axis",
    ):
        run(good, (b_gate, b_up, b_down), per_rank)
    replicated = (P(None, etp), P("expert", etp), P("expert"))
    with pytest.raises(
        ValueError,
        match=r"b_gate varies over \('expert_tensor',\), expected \('expert', 'expert_tensor'\)",
    ):
        run(replicated, (b_gate[: E // 4], b_up, b_down))
    run(good, (b_gate, b_up, b_down))  # the right layout runs
