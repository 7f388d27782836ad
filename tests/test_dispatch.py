"""Ring (expert and token routing) and all-to-all against the dense reference: values and all
five gradients.

One test base, subclassed per dispatcher and routing mode. Every run poisons padding rows with NaN,
so a row an implementation should never read shows up as a non-finite output or gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import relaymoe_jax
from moe_cases import assert_matches, make_inputs, mesh, place, rel_err, run, uniform_ids

T = 64  # global tokens: 8 per device on an 8-way token mesh


def _uniform(rng, e, k):
    return uniform_ids(rng, T, e, k)


def _one_expert(rng, e, k):                 # slot 0 of every token is expert 5
    ids = uniform_ids(rng, T, e - 1, k)
    ids[ids >= 5] += 1
    ids[:, 0] = 5
    return ids


def _one_partition(rng, e, k):              # every pair in partition 3 (experts 6, 7 of 16)
    return np.where(rng.random((T, k)) < 0.5, 6, 7) if k == 1 else np.tile([6, 7], (T, 1))


def _all_experts(rng, e, k):                # top_k == num_experts, shuffled per token
    return np.stack([rng.permutation(e) for _ in range(T)])


def _repeated(rng, e, k):                   # repeated ids within a token, and weight ties
    ids = uniform_ids(rng, T, e, k)
    ids[:, 1] = ids[:, 0]
    ids[::3] = 9
    return ids


# name -> (ids maker, E, k, extra moe_ffn kwargs)
PATTERNS = {
    "uniform": (_uniform, 16, 4, {}),
    "all_to_one_expert_k1": (lambda rng, e, k: np.full((T, 1), 5), 16, 1, {}),
    "one_expert_in_every_token": (_one_expert, 16, 4, {}),
    "all_to_one_partition": (_one_partition, 16, 2, {}),
    "top_k_equals_E": (_all_experts, 8, 8, {}),
    "E_equals_EP": (_uniform, 8, 2, {}),
    "pairs_not_multiple_of_chunk": (_uniform, 16, 3, {"chunk_size": 5}),
    "chunk_1": (_uniform, 16, 2, {"chunk_size": 1}),
    "chunk_larger_than_T_k": (_uniform, 16, 4, {"chunk_size": 1000}),
    "repeated_ids_and_ties": (_repeated, 16, 4, {}),
}

RING_ONLY = ("chunk_size",)


class DispatcherParity:
    dispatcher: str
    routing = "auto"

    def kwargs(self, extra):
        if self.dispatcher != "ring":
            return {k: v for k, v in extra.items() if k not in RING_ONLY}
        return dict(extra, routing=self.routing)

    def check(self, ids, e, mesh_name="ep8", token_axes=("expert",), dtype=np.float32,
              tol=1e-5, expert_axis="expert", etp=None, **kw):
        m = mesh(mesh_name)
        inp = place(make_inputs(ids, e, dtype=dtype), m, token_axes, expert_axis, etp)
        ta = dict(token_axes=token_axes) if token_axes != m.axis_names else {}
        ta.update(expert_axis=expert_axis, expert_tensor_axis=etp)
        y, stats, g = run(self.dispatcher, inp, m, **ta, **self.kwargs(kw))
        y_ref, _, g_ref = run("reference", inp, m, poison=False, **ta)
        assert_matches((y, g), (y_ref, g_ref), tol, f"{self.dispatcher}")
        assert int(stats["dropped_pairs"]) == 0
        return y, g, y_ref, g_ref

    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_routing_patterns(self, pattern):
        make, e, k, kw = PATTERNS[pattern]
        self.check(make(np.random.default_rng(1), e, k), e, **kw)

    def test_weight_ties(self):
        ids = uniform_ids(np.random.default_rng(2), T, 16, 4)
        m = mesh("ep8")
        inp = make_inputs(ids, 16)
        inp["wts"] = jnp.full_like(inp["wts"], 0.25)    # every weight equal
        inp = place(inp, m, ("expert",))
        y, _, g = run(self.dispatcher, inp, m)
        y_ref, _, g_ref = run("reference", inp, m, poison=False)
        assert_matches((y, g), (y_ref, g_ref), 1e-5, "ties")

    def test_bfloat16(self):
        ids = uniform_ids(np.random.default_rng(3), T, 16, 4)
        self.check(ids, 16, dtype=jnp.bfloat16, tol=3e-2)

    def test_data_and_expert_mesh(self):
        ids = uniform_ids(np.random.default_rng(4), T, 16, 4)
        self.check(ids, 16, mesh_name="dp2_ep4", token_axes=("data", "expert"))

    def test_expert_and_replicated_tensor_axis(self):
        ids = uniform_ids(np.random.default_rng(5), T, 16, 4)
        self.check(ids, 16, mesh_name="ep4_tp2", token_axes=("expert",))

    @pytest.mark.parametrize("tokens_over_etp", [True, False])
    def test_expert_tensor_axis(self, tokens_over_etp):
        """(expert=4, expert_tensor=2): ffn split over ETP; tokens sharded over it (all-gather in,
        reduce-scatter out) or replicated over it (psum)."""
        ids = uniform_ids(np.random.default_rng(9), T, 16, 4)
        ta = ("expert", "expert_tensor") if tokens_over_etp else ("expert",)
        self.check(ids, 16, mesh_name="ep4_etp2", token_axes=ta, etp="expert_tensor")

    def test_folded_layout_one_mesh(self):
        """Attention's (data=2, context=4) mesh, the MoE's expert axis folded over both."""
        ids = uniform_ids(np.random.default_rng(10), T, 16, 4)
        self.check(ids, 16, mesh_name="dp2_cp4", token_axes=("data", "context"),
                   expert_axis=("data", "context"))

    def test_folded_layout_two_meshes(self):
        """Attention on a (data=2, context=4) mesh, the MoE on (expert=8) over the same devices:
        the token shards coincide, so the hand-over needs no communication."""
        attn = mesh("dp2_cp4")
        moe = jax.sharding.Mesh(attn.devices.reshape(-1), ("expert",),
                                axis_types=(jax.sharding.AxisType.Explicit,))
        inp = make_inputs(uniform_ids(np.random.default_rng(11), T, 16, 4), 16)
        inp = place(inp, attn, ("data", "context"), ("data", "context"))

        def layer(x, ids, wts, wg, wu, wd, dispatcher, kw):
            x = jnp.tanh(x)                                   # "attention" on its own mesh
            wg, wu, wd, x, ids, wts = (jax.sharding.reshard(a, NamedSharding(moe, s)) for a, s in
                                       zip((wg, wu, wd, x, ids, wts), (P("expert"),) * 3 +
                                           (P("expert"),) * 3))
            y = relaymoe_jax.moe_ffn(x, ids, wts, wg, wu, wd, mesh=moe, dispatcher=dispatcher,
                                     **kw)
            return jax.sharding.reshard(y, NamedSharding(attn, P(("data", "context"))))

        def value_and_grads(dispatcher, kw):
            loss = lambda *a: jnp.sum(layer(*a[:6], dispatcher, kw) * a[6])
            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5)))
            args = [inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd", "r")]
            with relaymoe_jax.poison_unwritten():
                (v, g), text = f(*args), f.lower(*args).compile().as_text()
            return v, dict(zip(("x", "wts", "wg", "wu", "wd"), g)), text

        _, g, text = value_and_grads(self.dispatcher, self.kwargs({}))
        _, g_ref, _ = value_and_grads("reference", {})
        y = layer(*(inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")), self.dispatcher,
                  self.kwargs({}))
        y_ref = layer(*(inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")), "reference", {})
        assert_matches((y, g), (y_ref, g_ref), 1e-5, "two meshes")
        if self.dispatcher == "ring":                         # the hand-over moved nothing
            assert "all-gather" not in text and "all-to-all" not in text

    def test_auto_mesh_and_eager_call(self):
        """An Auto-typed mesh, unsharded inputs, no jit: the op places the inputs itself."""
        m = mesh("ep8", explicit=False)
        inp = make_inputs(uniform_ids(np.random.default_rng(8), T, 16, 4), 16)
        args = [inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")]
        with relaymoe_jax.poison_unwritten():
            y = relaymoe_jax.moe_ffn(*args, mesh=m, dispatcher=self.dispatcher)
        y_ref = relaymoe_jax.moe_ffn(*args, mesh=m, dispatcher="reference")
        assert np.all(np.isfinite(np.asarray(y)))
        assert rel_err(y, y_ref) <= 1e-5

    def test_out_of_range_ids_are_ignored(self):
        ids = uniform_ids(np.random.default_rng(6), T, 16, 4)
        ids[0, 0], ids[9, 2], ids[33, 1] = -1, 16, 1000
        m = mesh("ep8")
        inp = place(make_inputs(ids, 16), m, ("expert",))
        y, stats, g = run(self.dispatcher, inp, m)
        y_ref, _, g_ref = run("reference", inp, m, poison=False)
        assert_matches((y, g), (y_ref, g_ref), 1e-5, "out-of-range")
        assert int(stats["ignored_pairs"]) == 3
        gw = np.asarray(g["wts"])
        assert gw[0, 0] == 0 and gw[9, 2] == 0 and gw[33, 1] == 0

    def test_one_misweighted_pair_is_detected(self):
        """The comparison itself: changing a single pair's weight must break the match."""
        ids = uniform_ids(np.random.default_rng(7), T, 16, 4)
        m = mesh("ep8")
        inp = make_inputs(ids, 16)
        y_ref, _, g_ref = run("reference", place(inp, m, ("expert",)), m, poison=False)
        bad = dict(inp, wts=inp["wts"].at[17, 2].multiply(1.5))
        y, _, g = run(self.dispatcher, place(bad, m, ("expert",)), m)
        with pytest.raises(AssertionError):
            assert_matches((y, g), (y_ref, g_ref), 1e-5)


class TestRingExpertRouting(DispatcherParity):
    dispatcher = "ring"
    routing = "expert"


class TestRingTokenRouting(DispatcherParity):
    dispatcher = "ring"
    routing = "token"


class TestAllToAll(DispatcherParity):
    dispatcher = "alltoall"


@pytest.mark.parametrize("pattern", ["uniform", "one_expert_in_every_token",
                                     "pairs_not_multiple_of_chunk", "repeated_ids_and_ties"])
def test_token_routing_equals_expert_routing(pattern):
    """The two ring modes compute the same pairs: equal up to f32 summation order."""
    make, e, k, kw = PATTERNS[pattern]
    m = mesh("ep8")
    inp = place(make_inputs(make(np.random.default_rng(12), e, k), e), m, ("expert",))
    y_e, _, g_e = run("ring", inp, m, routing="expert", **kw)
    y_t, _, g_t = run("ring", inp, m, routing="token", **kw)
    assert_matches((y_t, g_t), (y_e, g_e), 2e-6, "token vs expert")


@pytest.mark.parametrize("t_local,want", [(8, "token"), (256, "expert")])
def test_auto_routing_logs_its_choice_and_matches_the_reference(caplog, t_local, want):
    """E16 H16 F24 k4 f32 over EP=8: expert routing moves 2 experts x 3*16*24*4 B = 9216 B per
    hop, token routing t_local x (16*4 + 4*(4+4)) B = 96 B per token: token below 96 tokens."""
    m = mesh("ep8")
    inp = place(make_inputs(uniform_ids(np.random.default_rng(13), 8 * t_local, 16, 4), 16), m,
                ("expert",))
    args = [inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")]
    plan_ = relaymoe_jax.routing_plan(*args, mesh=m)
    assert (plan_.expert_fwd, plan_.token_fwd, plan_.choice) == (
        2 * 3 * 16 * 24 * 4, t_local * (16 * 4 + 4 * 8), want)
    with caplog.at_level("INFO", logger="relaymoe_jax"):
        y = relaymoe_jax.moe_ffn(*args, mesh=m, routing="auto")
    assert f"routing '{want}'" in caplog.text
    y_ref = relaymoe_jax.moe_ffn(*args, mesh=m, dispatcher="reference")
    assert rel_err(y, y_ref) <= 1e-5


def test_routing_plan_counts_tokens_gathered_over_the_expert_tensor_axis():
    m = mesh("ep4_etp2")
    inp = make_inputs(uniform_ids(np.random.default_rng(14), T, 16, 4), 16)
    args = [inp[n] for n in ("x", "ids", "wts", "wg", "wu", "wd")]
    both = relaymoe_jax.routing_plan(*args, mesh=m, expert_tensor_axis="expert_tensor")
    # tokens sharded over 8 devices, gathered over ETP=2: 16 per ring member; ffn halved.
    assert (both.tokens_per_device, both.expert_bytes) == (T // 8 * 2, 3 * 16 * 24 * 4 // 2)
    rep = relaymoe_jax.routing_plan(*args, mesh=m, expert_tensor_axis="expert_tensor",
                                    token_axes=("expert",))
    assert rep.tokens_per_device == T // 4
