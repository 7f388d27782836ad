"""Ring (expert and token routing) and all-to-all against the dense reference: values and all
five gradients.

One test base, subclassed per dispatcher and routing mode; the mesh layouts that are the op's
plumbing around the dispatcher run on two modes (LAYOUT_MODES). The routings, inputs and
comparisons are relaymoe_jax.testing's. Every run poisons padding rows with NaN, so a row an
implementation should never read shows up as a non-finite output or gradient.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import relaymoe_jax
from moe_cases import args, check_parity, make_inputs, mesh, moe_fn, place
from relaymoe_jax import poison_unwritten, testing
from relaymoe_jax.testing import grads as testing_grads

T = 64  # global tokens: 8 per device on an 8-way token mesh

# name -> (testing.routing_case on T tokens and 8 partitions, E, k, extra moe_ffn kwargs). One
# compiled program per (E, k, kwargs): the first four share one (the routing is data); each edge
# of the chunk loop rides on an edge shape, so the ring compiles four programs here, not eight.
PATTERNS = {
    "uniform": ("uniform", 16, 4, {}),
    "one_expert_in_every_token": ("one_expert", 16, 4, {}),
    "ragged_with_empty_experts": ("ragged", 16, 4, {}),
    "repeated_ids_and_ties": ("ties", 16, 4, {}),
    # was all_to_one_expert_k1 and pairs_not_multiple_of_chunk (k=3, chunk 5): the 8 pairs of a
    # device all go to one expert, in chunks of 5 (the last one partial)
    "all_to_one_expert_k1_chunk_5": ("one_expert", 16, 1, {"chunk_size": 5}),
    # was all_to_one_partition and chunk_1: one partition gets every pair, one pair per chunk,
    # and the other hops have none (zero trips)
    "all_to_one_partition_chunk_1": ("one_partition", 16, 2, {"chunk_size": 1}),
    # was top_k_equals_E, E_equals_EP (uniform E=8, k=2) and chunk_larger_than_T_k: k == E == EP
    # (one expert per device, every token at every expert), chunk_size capped at T_local * k
    "top_k_equals_E_equals_EP_chunk_1000": ("all_experts", 8, 8, {"chunk_size": 1000}),
}

RING_ONLY = ("chunk_size",)


def ids_of(case, e, k, seed):
    return testing.routing_case(case, T, k, e, 8, seed=seed)


class Mode:
    """One dispatcher (and ring routing mode) and its parity check against the reference."""

    dispatcher: str
    routing = "auto"

    def kwargs(self, extra):
        if self.dispatcher != "ring":
            return {k: v for k, v in extra.items() if k not in RING_ONLY}
        return dict(extra, routing=self.routing)

    def check(
        self,
        ids,
        e,
        mesh_name="ep8",
        token_axes=("expert",),
        dtype=np.float32,
        tol=1e-5,
        expert_axis="expert",
        etp=None,
        equal_weights=False,
        **kw,
    ):
        """testing.assert_moe_parity against the reference dispatcher: y and all five gradients,
        padding NaN-poisoned, nothing dropped. Returns (got, want) MoeRuns."""
        m = mesh(mesh_name)
        inp = place(
            make_inputs(ids, e, dtype=dtype, equal_weights=equal_weights),
            m,
            token_axes,
            expert_axis,
            etp,
        )
        ta = self.axes_kw(m, token_axes, expert_axis, etp)
        got, want = check_parity(self.dispatcher, inp, m, tol, ref_kw=ta, **ta, **self.kwargs(kw))
        assert int(got.aux["dropped_pairs"]) == 0
        return got, want

    @staticmethod
    def axes_kw(m, token_axes=("expert",), expert_axis="expert", etp=None):
        ta = dict(token_axes=token_axes) if token_axes != m.axis_names else {}
        ta.update(expert_axis=expert_axis, expert_tensor_axis=etp)
        return ta


MODES = {
    "ring-expert": ("ring", "expert"),
    "ring-token": ("ring", "token"),
    "alltoall": ("alltoall", "auto"),
}


def mode(name):
    """The Mode called `name` (a key of MODES)."""
    dispatcher, routing = MODES[name]
    return type("ModeOf", (Mode,), dict(dispatcher=dispatcher, routing=routing))()


class DispatcherParity(Mode):
    """The tests every dispatcher and routing mode runs (one subclass each)."""

    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_routing_patterns(self, pattern):
        """Each adversarial routing of PATTERNS. The merged names cover the removed cases
        [all_to_one_expert_k1] and [pairs_not_multiple_of_chunk] (all_to_one_expert_k1_chunk_5),
        [all_to_one_partition] and [chunk_1] (all_to_one_partition_chunk_1), [top_k_equals_E],
        [E_equals_EP] and [chunk_larger_than_T_k] (top_k_equals_E_equals_EP_chunk_1000)."""
        case, e, k, kw = PATTERNS[pattern]
        self.check(ids_of(case, e, k, seed=1), e, **kw)

    def test_weight_ties(self):
        self.check(ids_of("uniform", 16, 4, seed=2), 16, equal_weights=True)  # every weight 1/4

    def test_bfloat16(self):
        self.check(ids_of("uniform", 16, 4, seed=3), 16, dtype=jnp.bfloat16, tol=3e-2)

    def test_out_of_range_ids_are_ignored(self):
        """ids -1, E and 2**31 - 1 (testing's "out_of_range" case): no contribution, counted,
        and a zero weight gradient."""
        ids = ids_of("out_of_range", 16, 4, seed=6)
        bad = (ids < 0) | (ids >= 16)
        assert bad.sum() == 3
        got, _ = self.check(ids, 16)
        assert int(got.aux["ignored_pairs"]) == 3
        assert np.all(np.asarray(got.grads["expert_weights"])[bad] == 0)

    def test_misweighted_dropped_and_duplicated_pairs_are_detected(self):
        """On (data=2, expert=4), tokens over both: the dispatcher matches the reference (the
        control's unperturbed run, y and all five gradients: this covers what
        test_data_and_expert_mesh did), and the comparison itself (testing.assert_parity_detects)
        catches one pair weighted x1.5, dropped or duplicated. One compiled program for both."""
        m = mesh("dp2_ep4")
        inp = make_inputs(ids_of("uniform", 16, 4, seed=4), 16)
        inp = place(inp, m, ("data", "expert"))
        caught = testing.assert_parity_detects(
            moe_fn(self.dispatcher, m, **self.kwargs({})),
            moe_fn("reference", m),
            *args(inp),
            cotangent=inp["r"],
            has_aux=True,
            rtol=1e-5,
        )
        assert sorted(caught) == ["drop", "duplicate", "misweight"]


class TestRingExpertRouting(DispatcherParity):
    dispatcher = "ring"
    routing = "expert"


class TestRingTokenRouting(DispatcherParity):
    dispatcher = "ring"
    routing = "token"


class TestAllToAll(DispatcherParity):
    dispatcher = "alltoall"


# The layouts below are the op's plumbing around the dispatcher: which axes the tokens and weights
# vary over, what the ring's backward sums over (`RingConfig.reduce_axes`, read by the op the same
# way for both ring routings), the axes the ring shifts over (`relay`, the same for both) and the
# expert-tensor gather/reduce-scatter or psum (`dispatch.local`, around any dispatcher). They run
# on the ring with expert routing and on the all-to-all. Token routing's own layouts are the data
# axis (its test_misweighted_..._are_detected) and the rest of its class above; with expert
# tensor parallelism it runs inside the caller's shard_map (test_drop_in.py::
# test_moe_ffn_local_with_an_expert_tensor_axis, and without check_vma [True/False]) and, with
# biases, through moe_ffn (test_expert_biases.py, ETP with tokens replicated).
LAYOUT_MODES = ["ring-expert", "alltoall"]


@pytest.mark.parametrize(
    "name,tokens_over_etp", [("ring-expert", False), ("alltoall", True), ("alltoall", False)]
)
def test_expert_tensor_axis(name, tokens_over_etp):
    """(expert=4, expert_tensor=2): ffn split over ETP; tokens sharded over it (all-gather in,
    reduce-scatter out) or replicated over it (psum). Was a test of each class: its
    TestRingTokenRouting cases are covered as LAYOUT_MODES says. The former [ring-expert-True]
    (tokens over ETP, the ring with expert routing) is covered by [alltoall-True] (moe_ffn reading
    the tokens' ETP sharding, and the gather / reduce-scatter in `dispatch.local`, above any
    dispatcher) and test_expert_biases.py::test_moe_ffn_local_with_biases[ETP, tokens gathered]
    (the ring with expert routing on the gathered tokens and ETP-split weights)."""
    ta = ("expert", "expert_tensor") if tokens_over_etp else ("expert",)
    mode(name).check(
        ids_of("uniform", 16, 4, seed=9),
        16,
        mesh_name="ep4_etp2",
        token_axes=ta,
        etp="expert_tensor",
    )


@pytest.mark.parametrize("name", LAYOUT_MODES)
def test_expert_and_replicated_tensor_axis(name):
    """(expert=4, tensor=2), tokens and weights replicated over tensor. Was a test of each class:
    [ring-token] is covered as LAYOUT_MODES says (the ring sums nothing over tensor for either
    routing: the same reduce axes)."""
    mode(name).check(
        ids_of("uniform", 16, 4, seed=5), 16, mesh_name="ep4_tp2", token_axes=("expert",)
    )


@pytest.mark.parametrize("name", [*LAYOUT_MODES, "ring-token"])
def test_folded_layout_one_mesh(name):
    """Attention's (data=2, context=4) mesh, the MoE's expert axis folded over both, for each
    dispatcher and ring routing (the one layout test that keeps ring-token: its tokens, not the
    weights, go round the folded axes)."""
    mode(name).check(
        ids_of("uniform", 16, 4, seed=10),
        16,
        mesh_name="dp2_cp4",
        token_axes=("data", "context"),
        expert_axis=("data", "context"),
    )


def test_folded_layout_two_meshes():
    """Attention on a (data=2, context=4) mesh, the MoE on (expert=8) over the same devices:
    the token shards coincide, so the hand-over needs no communication. The ring with expert
    routing, values and gradients, and its compiled program has no all-gather or all-to-all.

    Also covers what [ring-token] and [alltoall] did: the hand-over (reshards between the two
    meshes) is the caller's, outside the op, which sees an ordinary (expert=8) mesh, where each
    dispatcher runs its whole class above."""
    attn = mesh("dp2_cp4")
    moe = jax.sharding.Mesh(
        attn.devices.reshape(-1), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    inp = make_inputs(ids_of("uniform", 16, 4, seed=11), 16)
    inp = place(inp, attn, ("data", "context"), ("data", "context"))

    def layer(x, ids, wts, wg, wu, wd, dispatcher, kw):
        x = jnp.tanh(x)  # "attention" on its own mesh
        wg, wu, wd, x, ids, wts = (
            jax.sharding.reshard(a, NamedSharding(moe, P("expert")))
            for a in (wg, wu, wd, x, ids, wts)
        )
        y = relaymoe_jax.moe_ffn(x, ids, wts, wg, wu, wd, mesh=moe, dispatcher=dispatcher, **kw)
        return jax.sharding.reshard(y, NamedSharding(attn, P(("data", "context"))))

    ours = functools.partial(layer, dispatcher="ring", kw={"routing": "expert"})
    ref = functools.partial(layer, dispatcher="reference", kw={})
    testing.assert_moe_parity(ours, ref, *args(inp), cotangent=inp["r"], rtol=1e-5)
    # the parity run's own program (values and gradients), from testing's cache: no new compile
    run = testing_grads.value_and_grads_fn(ours, (0, 2, 3, 4, 5), False, True, True)
    with poison_unwritten():
        text = run.lower(inp["r"], *args(inp)).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text


TOKEN_VS_EXPERT = [
    "uniform",
    "one_expert_in_every_token",
    "all_to_one_expert_k1_chunk_5",
    "repeated_ids_and_ties",
]


@pytest.mark.parametrize("pattern", TOKEN_VS_EXPERT)
def test_token_routing_equals_expert_routing(pattern):
    """The two ring modes compute the same pairs: equal up to f32 summation order. (The programs
    are the two ring classes' for these patterns: the same functions and shapes.)
    [pairs_not_multiple_of_chunk] became [all_to_one_expert_k1_chunk_5] (see PATTERNS)."""
    case, e, k, kw = PATTERNS[pattern]
    m = mesh("ep8")
    inp = place(make_inputs(ids_of(case, e, k, seed=12), e), m, ("expert",))
    ta = Mode.axes_kw(m)
    expert = moe_fn("ring", m, routing="expert", **ta, **kw)
    check_parity("ring", inp, m, 2e-6, ref=expert, routing="token", **ta, **kw)


def test_auto_routing_logs_its_choice_and_matches_the_reference(caplog):
    """E16 H16 F24 k4 f32 over EP=8: expert routing moves 2 experts x 3*16*24*4 B = 9216 B per
    hop, token routing t_local x (16*4 + 4*(4+4)) B = 96 B per token: token below 96 tokens.
    At 8 tokens per device the op picks token routing, says so and matches the reference; at
    256 it picks expert routing and says so, read from a trace (`jax.eval_shape`: the choice and
    its line are the trace's). Also covers the former [256-expert] parity run: what auto runs
    then is the ring with expert routing, TestRingExpertRouting's.

    On an Auto-typed mesh, unsharded inputs, no jit: the op places the inputs itself. This also
    covers the former test_auto_mesh_and_eager_call (the ring, routing left to auto, on the
    same mesh and shapes; the placement is the op's front door, before any dispatcher, and the
    all-to-all's own code runs on every layout in its class)."""
    m = mesh("ep8", explicit=False)
    auto = functools.partial(relaymoe_jax.moe_ffn, mesh=m, dispatcher="ring", routing="auto")
    for t_local, want in ((8, "token"), (256, "expert")):
        ids = testing.routing_case("uniform", 8 * t_local, 4, 16, 8, seed=13)
        a = args(make_inputs(ids, 16))
        plan_ = relaymoe_jax.routing_plan(*a, mesh=m)
        assert (plan_.expert_fwd, plan_.token_fwd, plan_.choice) == (
            2 * 3 * 16 * 24 * 4,
            t_local * (16 * 4 + 4 * 8),
            want,
        )
        caplog.clear()
        with caplog.at_level("INFO", logger="relaymoe_jax"):  # eager: logged when called
            if want == "expert":
                jax.eval_shape(auto, *a)
            else:
                testing.assert_moe_parity(
                    auto,
                    functools.partial(relaymoe_jax.moe_ffn, mesh=m, dispatcher="reference"),
                    *a,
                    argnums=(),
                    jit=False,
                    rtol=1e-5,
                )
        assert f"routing '{want}'" in caplog.text, t_local


def test_routing_plan_counts_tokens_gathered_over_the_expert_tensor_axis():
    m = mesh("ep4_etp2")
    a = args(make_inputs(ids_of("uniform", 16, 4, seed=14), 16))
    both = relaymoe_jax.routing_plan(*a, mesh=m, expert_tensor_axis="expert_tensor")
    # tokens sharded over 8 devices, gathered over ETP=2: 16 per ring member; ffn halved.
    assert (both.tokens_per_device, both.expert_bytes) == (T // 8 * 2, 3 * 16 * 24 * 4 // 2)
    rep = relaymoe_jax.routing_plan(
        *a, mesh=m, expert_tensor_axis="expert_tensor", token_axes=("expert",)
    )
    assert rep.tokens_per_device == T // 4
