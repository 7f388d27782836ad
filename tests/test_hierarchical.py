"""The hierarchical ring (`ring="hierarchical"`) against the dense reference on emulated
(node, local) meshes: values and all five gradients, every adversarial routing case, both routing
modes, NaN-poisoned padding; and the transfers its program makes (from the compiled HLO's
collective-permute source-target pairs): along the inner axis within a node, along the outer axis
between nodes, never diagonally.

Compile time is this file's time, so every routing case runs at one shape (top_k = 4, E = 32: 4
experts per partition, so "one_partition" applies at k = 4 too) and shares one compiled program
per (mesh, routing mode); the transfers are read from those same compiled programs.

moe_ffn_local(ring="hierarchical") in the caller's shard_map over (node, local) is
test_expert_biases.py::test_moe_ffn_local_with_biases[hierarchical ring] (values and every
gradient against the reference; it was also test_local_entry_point_inside_a_shard_map here, the
same entry point and ring without biases: the biases are an addition on the same path).
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_cases import args, check_parity, make_inputs, moe_fn
from relaymoe_jax import moe_ffn, poison_unwritten, testing
from relaymoe_jax.analysis import hlo
from relaymoe_jax.op import topology
from relaymoe_jax.testing import grads as testing_grads

T, E, K = 64, 32, 4
NODES_LOCAL = [(2, 4), (4, 2)]
AXES = ("node", "local")
KW = dict(expert_axis=AXES, token_axes=AXES)


@functools.cache
def hier_mesh(nodes, local):
    return jax.make_mesh((nodes, local), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def placed(ids, m, e=E, dtype=np.float32):
    inp = make_inputs(ids, e, dtype=dtype)
    tok, w_in = NamedSharding(m, P(AXES)), NamedSharding(m, P(AXES))
    return {
        n: jax.device_put(v, tok if n in ("x", "ids", "wts", "r") else w_in) for n, v in inp.items()
    }


def case_inputs(case, nodes, local, seed=K):
    m = hier_mesh(nodes, local)
    return m, placed(testing.routing_case(case, T, K, E, nodes * local, seed=seed), m)


# every adversarial case that applies at k=4 with 4 experts per partition: uniform, one_expert
# (every token's slot 0 on one expert), one_partition (every pair in one partition), ragged,
# ties, out_of_range
CASES = list(testing.routing_cases(T, K, E, 8))

# (2, 4, "expert") is checked by test_parity_detects_a_dropped_pair (its unperturbed run is the
# same parity check), every case too. (4, 2, "token") was a case too: each routing mode runs on a
# 2-node mesh (an outer ring of two) and the inner ring of two runs at (4, 2) with expert routing;
# both modes are one schedule (`dispatch/ring.relay`: the payload and accumulator differ, the
# two-level relay and its ring-of-two case are the same code), so the cross term adds no path.
VALUE_MESHES = [(2, 4, "token"), (4, 2, "expert")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "nodes,local,routing", VALUE_MESHES, ids=[f"{n}-{lo}-{r}" for n, lo, r in VALUE_MESHES]
)
def test_values_and_gradients(nodes, local, routing, case):
    """Values and the five gradients against the reference, every routing case on each mesh in
    each routing mode (one compiled program per mesh and mode). Also covers what the former
    test_values_and_gradients[one_partition-k2-*] and [one_expert-k1-*] did: all pairs in one
    partition and every token on one expert now run at k=4 (E=32), in the same program (no
    dispatcher path depends on k). At 2 nodes the outer ring is a ring of two, at 4 x 2 the inner
    one: both relays' special case of two. The former [4-2-token-*] cases are covered as
    VALUE_MESHES says ([4-2-expert-*] and [2-4-token-*]: the same relay code)."""
    m, inp = case_inputs(case, nodes, local)
    got, _ = check_parity(
        "ring", inp, m, 1e-5, ref_kw=KW, routing=routing, ring="hierarchical", **KW
    )
    assert int(got.aux["dropped_pairs"]) == 0


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_two_device_flat_ring(routing):
    """A ring of two (as the outer ring at 2 nodes, the inner at 2 GPUs per node): its parts do
    not trail their payload, the owner keeps its own and the other comes home after the last hop
    (`dispatch/ring.relay`). Also covers the former [one_partition-2-*] cases: "uniform" and
    "one_partition" (every pair in one of the two partitions) share one program at k=4."""
    m = jax.make_mesh(
        (2,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2]
    )
    for case in ("uniform", "one_partition"):
        inp = make_inputs(testing.routing_case(case, T, K, E, 2, seed=K), E)
        inp = {n: jax.device_put(v, NamedSharding(m, P("expert"))) for n, v in inp.items()}
        got, _ = check_parity("ring", inp, m, 1e-5, routing=routing)
        assert int(got.aux["dropped_pairs"]) == 0


def test_one_node():
    """ring="hierarchical" on one node: the round runs inline (no outer transfer to keep in
    flight), the flat ring over the local axis. Also covers the former test_one_node[token]: the
    inline round (`relay`'s n == 1 level) is the same for both routing modes, and expert routing
    takes the inner relay both without an accumulator (forward) and with one (backward); the
    token mode's relays run in test_values_and_gradients."""
    m = hier_mesh(1, 8)
    inp = placed(testing.routing_case("uniform", T, K, E, 8, seed=1), m)
    got, _ = check_parity(
        "ring", inp, m, 1e-5, ref_kw=KW, routing="expert", ring="hierarchical", **KW
    )
    assert int(got.aux["dropped_pairs"]) == 0


@pytest.mark.parametrize("case", CASES)
def test_parity_detects_a_dropped_pair(case):
    """On (node=2, local=4), expert routing, every routing case: the unperturbed run equals the
    reference (values and the five gradients: what test_values_and_gradients[*-2-4-expert] did),
    and the comparison fails if one (token, expert) pair is dropped, duplicated or misweighted
    (testing.assert_parity_detects perturbs each; one compiled program for all)."""
    m, inp = case_inputs(case, 2, 4)
    f = moe_fn("ring", m, ring="hierarchical", routing="expert", **KW)
    ref = moe_fn("reference", m, **KW)
    caught = testing.assert_parity_detects(
        f, ref, *args(inp), num_experts=E, cotangent=inp["r"], has_aux=True
    )
    assert {"misweight", "drop", "duplicate"} <= caught.keys()


def _kinds(text, local):
    """{"inner", "outer", "both"}: how each permute pair of `text` moves between (node, local)
    positions (partition id -> (node, local): host-major CPU mesh)."""
    pos = lambda i: divmod(i, local)
    kinds = set()
    for p in hlo.collective_permutes(text):
        for s, t in p.pairs:
            (ns, ls), (nt, lt) = pos(s), pos(t)
            kinds.add("inner" if ns == nt else "outer" if ls == lt else "both")
    return kinds


@pytest.mark.parametrize("nodes,local,routing", [(2, 4, "token"), (4, 2, "expert")])
def test_transfers_stay_on_their_axes(nodes, local, routing):
    """Every permute of the hierarchical program (values and gradients: the very program
    test_values_and_gradients compiled and ran, taken from testing's cache) moves data along
    exactly one of the two axes: the inner one (same node, next local index) or the outer one
    (same local index, next node); the flat ring's has pairs that change both (local L-1 -> next
    node's 0). Both meshes and both routing modes, as before (then [2-4-expert] and
    [4-2-token]); the flat ring's control on its forward program, on one mesh."""
    m, inp = case_inputs("uniform", nodes, local)
    f = moe_fn("ring", m, routing=routing, ring="hierarchical", **KW)
    run = testing_grads.value_and_grads_fn(f, (0, 2, 3, 4, 5), True, True, True)
    with poison_unwritten():
        text = run.lower(inp["r"], *args(inp)).compile().as_text()
    assert _kinds(text, local) == {"inner", "outer"}
    if nodes == 2:
        flat = jax.jit(moe_fn("ring", m, routing=routing, ring="flat", **KW))
        assert "both" in _kinds(flat.lower(*args(inp)).compile().as_text(), local)


def test_ring_option_errors():
    m, inp = case_inputs("uniform", 2, 4)
    with pytest.raises(ValueError, match=r"ring='hierarchical' needs expert_axis as a tuple"):
        moe_ffn(*args(inp), mesh=jax.make_mesh((8,), ("expert",)), ring="hierarchical")
    with pytest.raises(ValueError, match=r"ring='ring': expected one of"):
        moe_ffn(*args(inp), mesh=m, expert_axis=AXES, ring="ring")
    with pytest.raises(ValueError, match=r"ring='flat' applies to dispatcher='ring' only"):
        moe_ffn(*args(inp), mesh=m, expert_axis=AXES, dispatcher="alltoall", ring="flat")


def test_auto_is_flat_on_one_host():
    """All emulated CPU devices are process 0: auto keeps the flat ring there."""
    m = hier_mesh(2, 4)
    assert topology.spans(m, AXES) == (True, False)
    assert not topology.choose_ring("auto", m, AXES)
    assert topology.choose_ring("hierarchical", m, AXES)
