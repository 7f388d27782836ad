"""Ring (expert and token routing) and all-to-all against the dense reference: values and all
five gradients.

One test base, subclassed per dispatcher and routing mode; the routings, inputs and comparisons are
relaymoe_jax.testing's. Every run poisons padding rows with NaN, so a row an implementation should
never read shows up as a non-finite output or gradient.
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
from relaymoe_jax import testing

T = 64  # global tokens: 8 per device on an 8-way token mesh

# name -> (testing.routing_case on T tokens and 8 partitions, E, k, extra moe_ffn kwargs)
PATTERNS = {
    "uniform": ("uniform", 16, 4, {}),
    "all_to_one_expert_k1": ("one_expert", 16, 1, {}),
    "one_expert_in_every_token": ("one_expert", 16, 4, {}),
    "all_to_one_partition": ("one_partition", 16, 2, {}),
    "top_k_equals_E": ("all_experts", 8, 8, {}),
    "E_equals_EP": ("uniform", 8, 2, {}),
    "ragged_with_empty_experts": ("ragged", 16, 4, {}),
    "pairs_not_multiple_of_chunk": ("uniform", 16, 3, {"chunk_size": 5}),
    "chunk_1": ("uniform", 16, 2, {"chunk_size": 1}),
    "chunk_larger_than_T_k": ("uniform", 16, 4, {"chunk_size": 1000}),
    "repeated_ids_and_ties": ("ties", 16, 4, {}),
}

RING_ONLY = ("chunk_size",)


def ids_of(case, e, k, seed):
    return testing.routing_case(case, T, k, e, 8, seed=seed)


class DispatcherParity:
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
        ta = dict(token_axes=token_axes) if token_axes != m.axis_names else {}
        ta.update(expert_axis=expert_axis, expert_tensor_axis=etp)
        got, want = check_parity(self.dispatcher, inp, m, tol, ref_kw=ta, **ta, **self.kwargs(kw))
        assert int(got.aux["dropped_pairs"]) == 0
        return got, want

    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_routing_patterns(self, pattern):
        case, e, k, kw = PATTERNS[pattern]
        self.check(ids_of(case, e, k, seed=1), e, **kw)

    def test_weight_ties(self):
        self.check(ids_of("uniform", 16, 4, seed=2), 16, equal_weights=True)  # every weight 1/4

    def test_bfloat16(self):
        self.check(ids_of("uniform", 16, 4, seed=3), 16, dtype=jnp.bfloat16, tol=3e-2)

    def test_data_and_expert_mesh(self):
        self.check(
            ids_of("uniform", 16, 4, seed=4), 16, mesh_name="dp2_ep4", token_axes=("data", "expert")
        )

    def test_expert_and_replicated_tensor_axis(self):
        self.check(
            ids_of("uniform", 16, 4, seed=5), 16, mesh_name="ep4_tp2", token_axes=("expert",)
        )

    @pytest.mark.parametrize("tokens_over_etp", [True, False])
    def test_expert_tensor_axis(self, tokens_over_etp):
        """(expert=4, expert_tensor=2): ffn split over ETP; tokens sharded over it (all-gather in,
        reduce-scatter out) or replicated over it (psum)."""
        ta = ("expert", "expert_tensor") if tokens_over_etp else ("expert",)
        self.check(
            ids_of("uniform", 16, 4, seed=9),
            16,
            mesh_name="ep4_etp2",
            token_axes=ta,
            etp="expert_tensor",
        )

    def test_folded_layout_one_mesh(self):
        """Attention's (data=2, context=4) mesh, the MoE's expert axis folded over both."""
        self.check(
            ids_of("uniform", 16, 4, seed=10),
            16,
            mesh_name="dp2_cp4",
            token_axes=("data", "context"),
            expert_axis=("data", "context"),
        )

    def test_folded_layout_two_meshes(self):
        """Attention on a (data=2, context=4) mesh, the MoE on (expert=8) over the same devices:
        the token shards coincide, so the hand-over needs no communication."""
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

        ours = functools.partial(layer, dispatcher=self.dispatcher, kw=self.kwargs({}))
        ref = functools.partial(layer, dispatcher="reference", kw={})
        testing.assert_moe_parity(ours, ref, *args(inp), cotangent=inp["r"], rtol=1e-5)
        if self.dispatcher == "ring":  # the hand-over moved nothing
            loss = lambda *a: jnp.sum(ours(*a) * inp["r"])
            text = (
                jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
                .lower(*args(inp))
                .compile()
                .as_text()
            )
            assert "all-gather" not in text and "all-to-all" not in text

    def test_auto_mesh_and_eager_call(self):
        """An Auto-typed mesh, unsharded inputs, no jit: the op places the inputs itself."""
        m = mesh("ep8", explicit=False)
        inp = make_inputs(ids_of("uniform", 16, 4, seed=8), 16)
        testing.assert_moe_parity(
            functools.partial(relaymoe_jax.moe_ffn, mesh=m, dispatcher=self.dispatcher),
            functools.partial(relaymoe_jax.moe_ffn, mesh=m, dispatcher="reference"),
            *args(inp),
            argnums=(),
            jit=False,
            rtol=1e-5,
        )

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
        """The comparison itself (testing.assert_parity_detects): one pair weighted x1.5, dropped
        or duplicated must break the match, while the unchanged dispatcher passes."""
        m = mesh("ep8")
        inp = place(make_inputs(ids_of("uniform", 16, 4, seed=7), 16), m, ("expert",))
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


@pytest.mark.parametrize(
    "pattern",
    [
        "uniform",
        "one_expert_in_every_token",
        "pairs_not_multiple_of_chunk",
        "repeated_ids_and_ties",
    ],
)
def test_token_routing_equals_expert_routing(pattern):
    """The two ring modes compute the same pairs: equal up to f32 summation order."""
    case, e, k, kw = PATTERNS[pattern]
    m = mesh("ep8")
    inp = place(make_inputs(ids_of(case, e, k, seed=12), e), m, ("expert",))
    check_parity(
        "ring", inp, m, 2e-6, ref=moe_fn("ring", m, routing="expert", **kw), routing="token", **kw
    )


@pytest.mark.parametrize("t_local,want", [(8, "token"), (256, "expert")])
def test_auto_routing_logs_its_choice_and_matches_the_reference(caplog, t_local, want):
    """E16 H16 F24 k4 f32 over EP=8: expert routing moves 2 experts x 3*16*24*4 B = 9216 B per
    hop, token routing t_local x (16*4 + 4*(4+4)) B = 96 B per token: token below 96 tokens."""
    m = mesh("ep8")
    ids = testing.routing_case("uniform", 8 * t_local, 4, 16, 8, seed=13)
    a = args(place(make_inputs(ids, 16), m, ("expert",)))
    plan_ = relaymoe_jax.routing_plan(*a, mesh=m)
    assert (plan_.expert_fwd, plan_.token_fwd, plan_.choice) == (
        2 * 3 * 16 * 24 * 4,
        t_local * (16 * 4 + 4 * 8),
        want,
    )
    with caplog.at_level("INFO", logger="relaymoe_jax"):  # eager: logged when called
        testing.assert_moe_parity(
            functools.partial(relaymoe_jax.moe_ffn, mesh=m, routing="auto"),
            functools.partial(relaymoe_jax.moe_ffn, mesh=m, dispatcher="reference"),
            *a,
            argnums=(),
            jit=False,
            rtol=1e-5,
        )
    assert f"routing '{want}'" in caplog.text


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
