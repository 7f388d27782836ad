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
    "ETP, tokens replicated": dict(
        m="ep4_etp2", tokens=P("expert"), kw={"expert_tensor_axis": ETP}
    ),
}
# (layout, dispatcher, routing, gmm_impl). Every dispatcher on (data, expert), where each sums
# its weight and bias gradients over data its own way (the ring's recomputing backward, the
# all-to-all's autodiff). Expert tensor parallelism, whose gather/psum and b_down-once mask sit
# above the dispatcher (`dispatch.local`), once through moe_ffn (tokens replicated, ring token
# routing) and twice through moe_ffn_local (test_moe_ffn_local_with_biases: tokens gathered, ring
# expert routing, whose biases travel with the weights; tokens replicated, the all-to-all).
# The biases are added outside the grouped matmul, the same for every implementation but the
# Pallas kernel's fused row gather (test_other_grouped_matmuls_...): the blocked XLA one (CPU's
# "auto") rides on one case, and every other case and test here takes lax.ragged_dot (GMM),
# whose programs compile in about 60% of its time.
DISPATCH_CASES = [
    ("data x expert", "ring", "expert", "xla"),
    ("data x expert", "ring", "token", "ragged_dot"),
    ("data x expert", "alltoall", "auto", "ragged_dot"),
    ("ETP, tokens replicated", "ring", "token", "ragged_dot"),
]
GMM = "ragged_dot"


@functools.cache
def reference(mesh_name, activation="gpt_oss_clamped", names=NAMES):
    """The reference with biases on `mesh_name`: one object per mesh, so its program is compiled
    once for every dispatcher compared with it."""
    a = CASES.get(activation, activation)
    return with_biases(
        functools.partial(moe_ffn, mesh=mesh(mesh_name), dispatcher="reference", activation=a),
        names,
    )


@pytest.mark.parametrize("layout,dispatcher,routing,gmm_impl", DISPATCH_CASES)
def test_dispatchers_with_biases_match_the_reference(layout, dispatcher, routing, gmm_impl):
    """GPT-OSS's clamped activation with all three biases, on each adversarial routing:
    b_down is added once with expert tensor parallelism (not once per rank).

    Also covers what the removed layout x dispatcher cases did (see DISPATCH_CASES):
    [ETP, tokens gathered-ring-expert] and [ETP, tokens replicated-ring-expert]
    (test_moe_ffn_local_with_biases[ETP, tokens gathered], expert routing: the token layout is
    handled above the ring), [ETP, tokens gathered-ring-token] ([ETP, tokens replicated-ring-
    token] here, the same ring code under ETP), [ETP, tokens gathered-alltoall-auto] and
    [ETP, tokens replicated-alltoall-auto] (test_moe_ffn_local_with_biases[ETP, tokens
    replicated, all-to-all]); and test_other_grouped_matmuls_with_biases[*-ragged_dot]
    (ragged_dot here on (data, expert) for ring token routing, whose hop code is expert
    routing's too, and for the all-to-all)."""
    where = LAYOUTS[layout]
    m = mesh(where["m"])
    a = CASES["gpt_oss_clamped"]
    ours = with_biases(
        functools.partial(
            moe_ffn,
            mesh=m,
            dispatcher=dispatcher,
            routing=routing,
            gmm_impl=gmm_impl,
            activation=a,
            **where["kw"],
        )
    )
    tok = NamedSharding(m, where["tokens"])
    bb = biases(E, H, F)
    for case, ids in testing.routing_cases(T, K, E, 4, seed=3).items():
        inp = testing.moe_inputs(ids, E, seed=3)
        args = [jax.device_put(v, tok) for v in inp.args[:3]] + list(inp.args[3:])
        try:
            testing.assert_moe_parity(ours, reference(where["m"]), *args, *bb)
        except AssertionError as err:
            raise AssertionError(f"routing case {case!r}: {err}") from None


def test_some_biases_only():
    """b_up only: the others are zero, and only the given one is differentiated. The given bias
    changes y: the same compiled program with it zeroed gives another y. The missing biases are
    filled in by the op's front door (`Experts.complete`) before any dispatcher, by one
    expression for each (zeros shaped and varying like its weight): here b_gate (an input
    projection's) and b_down (the output projection's) through the ring, whose expert routing
    sends them round with the weights. This covers the former cases [names0-alltoall] (b_down
    only: b_gate and b_up filled) and [names1-ring] (b_gate and b_up: b_down filled); the
    all-to-all with every bias is test_dispatchers_with_biases_match_the_reference."""
    names, dispatcher = ("b_up",), "ring"
    m = mesh("dp2_ep4")
    ids = testing.routing_case("uniform", T, K, E, 4, seed=5)
    inp = testing.moe_inputs(ids, E, seed=5)
    given = [b for n, b in zip(NAMES, biases(E, H, F, seed=5)) if n in names]
    ours = with_biases(
        functools.partial(moe_ffn, mesh=m, dispatcher=dispatcher, gmm_impl=GMM), names
    )
    got, _ = testing.assert_moe_parity(
        ours, reference("dp2_ep4", "swiglu", names), *inp.args, *given
    )
    plain = testing.moe_value_and_grads(ours, *inp.args, *(jnp.zeros_like(b) for b in given))
    assert np.max(np.abs(np.asarray(got.y) - np.asarray(plain.y))) > 1e-3


def test_other_grouped_matmuls_with_biases():
    """The ring with the Pallas kernel (in its interpreter), clamped GPT-OSS with all three
    biases: the kernel reads the chunk's rows by index (a fused gather), and the biases' rows,
    b_down's gradient and its router-weight term are gathered beside it (`dispatch.hop`).

    Also covers test_activations.py::test_other_grouped_matmuls_with_gpt_oss (the same
    activation, without biases, was its case) and what the removed [alltoall-auto-pallas-
    interpret] did: the all-to-all adds the biases outside the grouped matmul, the same code for
    every implementation (test_dispatchers_with_biases_match_the_reference, ragged_dot and xla);
    its Pallas calls run in test_dispatch_pallas.py. The ragged_dot cases moved to
    test_dispatchers_with_biases_match_the_reference.

    Run with jax_enable_x64=True and int64 ids: also what test_op_edges.py::test_x64[ring-expert-
    pallas-interpret-int64] did (the ring's expert routing and the kernel's group sizes under x64
    with int64 ids; the biases are float32 operands beside them), one Pallas-interpreter program
    for both."""
    m = mesh("ep8")
    with jax.enable_x64(True):
        ids = testing.routing_case("ragged", T, K, E, 8, seed=6)
        args = list(testing.moe_inputs(ids, E, seed=6).args)
        args[1] = args[1].astype(jnp.int64)
        assert args[1].dtype == jnp.int64
        a = CASES["gpt_oss_clamped"]
        ours = with_biases(
            functools.partial(
                moe_ffn,
                mesh=m,
                dispatcher="ring",
                routing="expert",
                gmm_impl="pallas-interpret",
                activation=a,
            )
        )
        testing.assert_moe_parity(ours, reference("ep8"), *args, *biases(E, H, F, seed=6))


def _local_layer(m, tokens, ea, etp=None, **kw):
    """The caller's shard_map: experts over `ea`, ffn (and b_gate, b_up) over `etp`, b_down
    replicated over `etp`."""
    w_in, w_out = P(ea, None, etp), P(ea, etp, None)
    b_in, b_out = P(ea, etp), P(ea, None)
    specs = (tokens,) * 3 + (w_in, w_in, w_out, b_in, b_in, b_out)
    body = functools.partial(
        with_biases(moe_ffn_local), expert_axis=ea, expert_tensor_axis=etp, gmm_impl=GMM, **kw
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
    """moe_ffn_local in the caller's shard_map with all three biases: the hierarchical ring (with
    GeGLU: this also covers what test_activations.py::test_hierarchical_ring_and_moe_ffn_local_
    take_the_activation did), and expert tensor parallelism with tokens gathered (ring, expert
    routing: also covers test_dispatchers_with_biases_match_the_reference[ETP, tokens gathered-
    ring-expert] and [ETP, tokens replicated-ring-expert]) or replicated (the all-to-all: also
    covers its [ETP, tokens replicated-alltoall-auto] and [ETP, tokens gathered-alltoall-auto]).
    The hierarchical ring also covers the former test_hierarchical.py::test_local_entry_point_
    inside_a_shard_map (moe_ffn_local(ring="hierarchical") over (node, local) on its "ragged"
    routing; the same entry point and ring, here with biases)."""
    ids = testing.routing_case("ragged", T, K, E, 8, seed=7)
    inp = testing.moe_inputs(ids, E, seed=7)
    bb = biases(E, H, F, seed=7)
    if case == "hierarchical ring":
        m, ea = jax.make_mesh((2, 4), ("node", "local")), ("node", "local")
        ours = _local_layer(m, P(ea), ea, ring="hierarchical", activation="geglu")
        ref_kw = dict(expert_axis=ea, activation="geglu")
    else:
        m, ea = mesh("ep4_etp2"), "expert"
        tokens = P(("expert", "expert_tensor")) if "gathered" in case else P("expert")
        mode = dict(dispatcher="alltoall") if "all-to-all" in case else dict(routing="expert")
        ours = _local_layer(m, tokens, ea, "expert_tensor", **mode)
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
        # lowered: the refusals are the trace's; the right layout's values and gradients are
        # test_moe_ffn_local_with_biases[ETP, *]
        jax.jit(jax.shard_map(body, mesh=m, in_specs=specs, out_specs=P("expert"))).lower(*args)

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
    run(good, (b_gate, b_up, b_down))  # the right layout traces


def test_fp8_alltoall_with_biases_matches_the_ring():
    """expert_fp8 with all three biases: the all-to-all, whose router weight sits inside the
    down projection with b_down (`dispatch.weighted_down`: a custom VJP; the biases' and the
    weights' gradients around it by autodiff), against the ring, whose hop writes every
    gradient by hand (`dispatch.hop`): two implementations of the one recipe
    (docs/precision.md). The recipe without biases is checked against float64 in
    tests/test_fp8_op.py; a bias added outside the weight, or its gradient unweighted, moves y
    or d b_down by a whole router weight's share."""
    m = mesh("ep8")
    a = CASES["gpt_oss_clamped"]
    run = lambda d, **kw: with_biases(
        functools.partial(
            moe_ffn, mesh=m, dispatcher=d, activation=a, expert_fp8=True, gmm_impl=GMM, **kw
        )
    )
    ids = testing.routing_case("ragged", T, K, E, 8, seed=7)
    inp = testing.moe_inputs(ids, E, seed=7)
    testing.assert_moe_parity(
        run("alltoall"), run("ring", routing="expert"), *inp.args, *biases(E, H, F), rtol=1e-4
    )
