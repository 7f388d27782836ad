"""The hierarchical ring (`ring="hierarchical"`) against the dense reference on emulated
(node, local) meshes: values and all five gradients, every adversarial routing case, both routing
modes, NaN-poisoned padding; and the transfers its program makes (from the compiled HLO's
collective-permute source-target pairs): along the inner axis within a node, along the outer axis
between nodes, never diagonally.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_cases import args, check_parity, make_inputs, moe_fn
from relaymoe_jax import moe_ffn, moe_ffn_local, testing
from relaymoe_jax.analysis import hlo
from relaymoe_jax.op import topology

T, E = 64, 16
NODES_LOCAL = [(2, 4), (4, 2)]
AXES = ("node", "local")


@functools.cache
def hier_mesh(nodes, local):
    return jax.make_mesh((nodes, local), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def placed(ids, m, e=E, dtype=np.float32):
    inp = make_inputs(ids, e, dtype=dtype)
    tok, w_in = NamedSharding(m, P(AXES)), NamedSharding(m, P(AXES))
    return {
        n: jax.device_put(v, tok if n in ("x", "ids", "wts", "r") else w_in) for n, v in inp.items()
    }


# every adversarial case that applies at k=4 (2 experts per partition), all pairs in one
# partition at k=2, and every token on one expert at k=1
CASES = [
    *((c, 4) for c in testing.routing_cases(T, 4, E, 8)),
    ("one_partition", 2),
    ("one_expert", 1),
]


# each case in both routing modes, on the two meshes in turn (each mesh meets each mode on
# several cases; the full product doubled this file's time for no path it did not already take)
VALUE_CASES = [
    (case, k, *NODES_LOCAL[(i + j) % 2], routing)
    for i, (case, k) in enumerate(CASES)
    for j, routing in enumerate(("expert", "token"))
]


@pytest.mark.parametrize(
    "case,k,nodes,local,routing",
    VALUE_CASES,
    ids=[f"{c}-k{k}-{n}-{lo}-{r}" for c, k, n, lo, r in VALUE_CASES],
)
def test_values_and_gradients(case, k, nodes, local, routing):
    m = hier_mesh(nodes, local)
    inp = placed(testing.routing_case(case, T, k, E, nodes * local, seed=k), m)
    kw = dict(expert_axis=AXES, token_axes=AXES)
    got, _ = check_parity(
        "ring", inp, m, 1e-5, ref_kw=kw, routing=routing, ring="hierarchical", **kw
    )
    assert int(got.aux["dropped_pairs"]) == 0


@pytest.mark.parametrize("routing", ["expert", "token"])
@pytest.mark.parametrize("case,k", [("uniform", 4), ("one_partition", 2)])
def test_two_device_flat_ring(case, k, routing):
    """A ring of two (as the outer ring at 2 nodes, the inner at 2 GPUs per node): its parts do
    not trail their payload, the owner keeps its own and the other comes home after the last hop
    (`dispatch/ring.relay`)."""
    m = jax.make_mesh(
        (2,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2]
    )
    inp = make_inputs(testing.routing_case(case, T, k, E, 2, seed=k), E)
    inp = {n: jax.device_put(v, NamedSharding(m, P("expert"))) for n, v in inp.items()}
    got, _ = check_parity("ring", inp, m, 1e-5, routing=routing)
    assert int(got.aux["dropped_pairs"]) == 0


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_one_node(routing):
    """ring="hierarchical" on one node: the round runs inline (no outer transfer to keep in
    flight), the flat ring over the local axis."""
    m = hier_mesh(1, 8)
    inp = placed(testing.routing_case("uniform", T, 4, E, 8, seed=1), m)
    kw = dict(expert_axis=AXES, token_axes=AXES)
    got, _ = check_parity(
        "ring", inp, m, 1e-5, ref_kw=kw, routing=routing, ring="hierarchical", **kw
    )
    assert int(got.aux["dropped_pairs"]) == 0


def test_parity_detects_a_dropped_pair():
    """The comparison above would fail if one (token, expert) pair were dropped, duplicated or
    misweighted: testing.assert_parity_detects perturbs each and expects a failure."""
    m = hier_mesh(2, 4)
    inp = placed(testing.routing_case("uniform", T, 2, E, 8), m)
    kw = dict(expert_axis=AXES, token_axes=AXES)
    f = moe_fn("ring", m, ring="hierarchical", **kw)
    ref = moe_fn("reference", m, **kw)
    testing.assert_parity_detects(
        f, ref, *args(inp), num_experts=E, cotangent=inp["r"], has_aux=True
    )


def _pairs(fn, *a):
    text = jax.jit(fn).lower(*a).compile().as_text()
    return [p for p in hlo.collective_permutes(text)]


@pytest.mark.parametrize(
    "nodes,local,routing", [(*NODES_LOCAL[0], "expert"), (*NODES_LOCAL[1], "token")]
)
def test_transfers_stay_on_their_axes(nodes, local, routing):
    """Every permute of the hierarchical program moves data along exactly one of the two axes:
    the inner one (same node, next local index) or the outer one (same local index, next node);
    the flat ring's has pairs that change both (local L-1 -> next node's 0)."""
    m = hier_mesh(nodes, local)
    inp = placed(testing.routing_case("uniform", T, 2, E, nodes * local), m)

    def grads(ring):
        def loss(x, wts, wg, wu, wd, ids):
            y = moe_ffn(
                x, ids, wts, wg, wu, wd, mesh=m, expert_axis=AXES, routing=routing, ring=ring
            )
            return (y * y).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))

    a = [inp[n] for n in ("x", "wts", "wg", "wu", "wd", "ids")]
    pos = lambda i: divmod(i, local)  # partition id -> (node, local): host-major CPU mesh
    kinds = {"hierarchical": set(), "flat": set()}
    for ring in kinds:
        for p in _pairs(grads(ring), *a):
            for s, t in p.pairs:
                (ns, ls), (nt, lt) = pos(s), pos(t)
                kinds[ring].add("inner" if ns == nt else "outer" if ls == lt else "both")
    assert kinds["hierarchical"] == {"inner", "outer"}, kinds
    assert "both" in kinds["flat"], kinds


def test_local_entry_point_inside_a_shard_map():
    """moe_ffn_local(ring="hierarchical") in the caller's shard_map over (node, local) equals the
    reference (values and gradients)."""
    m = hier_mesh(2, 4)
    inp = placed(testing.routing_case("ragged", T, 4, E, 8), m)
    spec = P(AXES)

    def local_fn(x, ids, wts, wg, wu, wd):
        body = functools.partial(moe_ffn_local, expert_axis=AXES, ring="hierarchical")
        return jax.shard_map(body, mesh=m, in_specs=(spec,) * 6, out_specs=spec)(
            x, ids, wts, wg, wu, wd
        )

    ref = moe_fn("reference", m, expert_axis=AXES, token_axes=AXES)
    testing.assert_moe_parity(local_fn, lambda *a: ref(*a)[0], *args(inp), cotangent=inp["r"])


def test_ring_option_errors():
    m = hier_mesh(2, 4)
    inp = placed(testing.routing_case("uniform", T, 2, E, 8), m)
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
