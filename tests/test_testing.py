"""relaymoe_jax.testing: the routing cases have their documented properties (checked with numpy),
the parity assertion passes for moe_ffn against the dense reference on 8 devices and fails for a
dropped, misweighted or duplicated pair, the negative control cannot pass vacuously, and
use_cpu_devices refuses a late change of the device count."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import relaymoe_jax
from moe_cases import mesh
from relaymoe_jax import testing
from relaymoe_jax.cli import devices
from relaymoe_jax.dispatch.reference import reference_moe

# ---------------------------------------------------------------------------------------------
# routing cases

SHAPES = [(64, 4, 16, 8), (64, 2, 16, 8), (64, 8, 8, 8), (48, 1, 16, 4), (30, 3, 12, 1)]


def _counts(ids_tk, e):
    return np.bincount(ids_tk[(ids_tk >= 0) & (ids_tk < e)], minlength=e)


def _rows_distinct(ids_tk):
    return all(len(set(row)) == len(row) for row in ids_tk.tolist())


@pytest.mark.parametrize("t,k,e,n", SHAPES)
def test_routing_cases_have_their_properties(t, k, e, n):
    cases = testing.routing_cases(t, k, e, n, seed=3)
    e_local = e // n
    applies = {"uniform", "one_expert", "out_of_range"}
    applies |= {"one_partition"} if k <= e_local else set()
    applies |= {"all_experts"} if k == e else set()
    applies |= {"ragged"} if k <= e - 1 - (e_local if n > 1 else 0) else set()
    applies |= {"ties"} if k >= 2 else set()
    assert set(cases) == applies
    for name, ids in cases.items():
        assert ids.shape == (t, k) and ids.dtype == np.int32, name
        if name != "out_of_range":
            assert np.all((ids >= 0) & (ids < e)), name
    assert _rows_distinct(cases["uniform"])
    assert np.all(cases["one_expert"][:, 0] == e // 3) and _rows_distinct(cases["one_expert"])
    if "one_partition" in cases:
        part = cases["one_partition"] // e_local
        assert np.all(part == (n - 1) // 2) and _rows_distinct(cases["one_partition"])
    if "all_experts" in cases:
        ids = cases["all_experts"]
        assert np.all(np.sort(ids, axis=1) == np.arange(e)) and len(np.unique(ids, axis=0)) > 1
    if "ragged" in cases:
        counts = _counts(cases["ragged"], e)
        assert counts[0] == 0 and _rows_distinct(cases["ragged"])
        if n > 1:
            assert np.all(counts[e - e_local :] == 0)  # a whole partition is empty
        assert counts.max() >= 2 * t * k / e  # the busiest: twice the mean
    if "ties" in cases:
        ids = cases["ties"]
        assert np.all(ids[:, 0] == ids[:, 1]) and np.all(ids[::3] == min(e // 2 + 1, e - 1))
    ids = cases["out_of_range"]
    bad = (ids < 0) | (ids >= e)
    assert sorted(ids[bad].tolist()) == [-1, e, 2**31 - 1]
    assert _rows_distinct(np.where(bad, -1 - np.arange(k), ids))  # the rest: uniform


def test_routing_case_refuses_shapes_it_does_not_apply_to():
    for name, shape, msg in [
        ("all_experts", (8, 4, 16, 8), "top_k=4 != num_experts=16"),
        ("one_partition", (8, 4, 16, 8), "experts per partition 2"),
        ("ties", (8, 1, 16, 8), "top_k=1"),
        ("nope", (8, 1, 16, 8), "unknown case"),
        ("uniform", (8, 2, 15, 8), "num_experts % num_partitions"),
    ]:
        with pytest.raises(ValueError, match=msg):
            testing.routing_case(name, *shape)


def test_moe_inputs():
    ids = testing.routing_case("uniform", 8, 2, 4, 2)
    inp = testing.moe_inputs(ids, 4, hidden=6, ffn=5, dtype=jnp.bfloat16, seed=1)
    assert [a.shape for a in inp] == [
        (8, 6),
        (8, 2),
        (8, 2),
        (4, 6, 5),
        (4, 6, 5),
        (4, 5, 6),
        (8, 6),
    ]
    assert inp.x.dtype == jnp.bfloat16 and inp.r.dtype == jnp.float32 and len(inp.args) == 6
    assert np.all(np.asarray(inp.expert_ids) == ids)
    assert not np.allclose(np.asarray(inp.expert_weights, np.float32).sum(1), 1)  # not normalised
    ties = testing.moe_inputs(ids, 4, equal_weights=True)
    assert np.all(np.asarray(ties.expert_weights) == 0.5)
    again = testing.moe_inputs(ids, 4, hidden=6, ffn=5, dtype=jnp.bfloat16, seed=1)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(inp, again))


# ---------------------------------------------------------------------------------------------
# the parity assertion on an 8-device mesh

T, K, E = 32, 2, 16  # 4 tokens per device
M = mesh("ep8")
REP = NamedSharding(M, P())
OURS = jax.jit(functools.partial(relaymoe_jax.moe_ffn, mesh=M))


def dense(x, expert_ids, expert_weights, w_gate, w_up, w_down):
    """The reference on replicated copies of the (sharded) arguments."""
    args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
    return reference_moe(*(jax.sharding.reshard(a, REP) for a in args))


@functools.cache
def sharded_args(case="uniform"):
    ids = testing.routing_case(case, T, K, E, 8, seed=0)
    inp = testing.moe_inputs(ids, E, hidden=8, ffn=8)
    tok = NamedSharding(M, P("expert"))
    return tuple(jax.device_put(a, tok) for a in inp.args)


def test_parity_passes_for_moe_ffn_against_the_dense_reference():
    got, want = testing.assert_moe_parity(OURS, dense, *sharded_args("ragged"))
    assert list(got.grads) == ["x", "expert_weights", "w_gate", "w_up", "w_down"]
    assert got.y.shape == (T, 8) and got.grads["w_down"].shape == (E, 8, 8)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in want.grads.values())  # nothing vacuous


def _one_pair(args):
    """The first token's slot 0: (token, slot, expert), and slot 1's expert."""
    ids = np.asarray(args[1])
    return 0, 0, int(ids[0, 0]), int(ids[0, 1])


def _mask():
    mask = np.zeros((T, K), bool)
    mask[0, 0] = True
    return mask


BROKEN = {  # dense with one pair changed, written without relaymoe_jax.testing's perturbations
    "drop": lambda x, ids, wts, *w: dense(x, jnp.where(_mask(), -1, ids), wts, *w),
    "misweight": lambda x, ids, wts, *w: dense(x, ids, wts * np.where(_mask(), 1.5, 1.0), *w),
    "duplicate": lambda x, ids, wts, *w: dense(  # slot 1 of token 0 also takes slot 0's expert
        x, jnp.where(np.roll(_mask(), 1, axis=1), _one_pair(sharded_args())[2], ids), wts, *w
    ),
}


@pytest.mark.parametrize("kind", BROKEN)
def test_parity_fails_for_one_broken_pair(kind):
    args = sharded_args()
    assert _one_pair(args)[2] != _one_pair(args)[3]
    with pytest.raises(AssertionError, match=r"output y differs .* max \|got - want\| = "):
        testing.assert_moe_parity(BROKEN[kind], dense, *args)


def test_parity_names_the_gradient_that_differs_and_flags_nan():
    args = sharded_args()
    no_grad = lambda x, ids, wts, *w: dense(x, ids, jax.lax.stop_gradient(wts), *w)
    with pytest.raises(AssertionError, match=r"gradient w\.r\.t\. expert_weights differs"):
        testing.assert_moe_parity(no_grad, dense, *args)
    nan_row = lambda *a: dense(*a) + jnp.where(np.arange(T)[:, None] == 5, jnp.nan, 0.0)
    with pytest.raises(AssertionError, match=r"output y differs(.|\n)*non-finite"):
        testing.assert_moe_parity(nan_row, dense, *args, argnums=())


def test_parity_takes_pytrees_and_names_the_leaf_that_differs():
    """A parameter dict with an integer leaf (float0 gradient, not compared), as nnx.State has."""
    x, ids, wts, wg, wu, wd = sharded_args()
    params = {"w_gate": wg, "w_up": wu, "w_down": wd, "step": jnp.int32(7)}
    layer = lambda x, ids, wts, p: dense(x, ids, wts, p["w_gate"], p["w_up"], p["w_down"])
    got, _ = testing.assert_moe_parity(layer, layer, x, ids, wts, params)
    assert list(got.grads) == ["x", "wts", "p"] and got.grads["p"]["w_up"].shape == wu.shape
    frozen = lambda x, ids, wts, p: layer(
        x, ids, wts, dict(p, w_up=jax.lax.stop_gradient(p["w_up"]))
    )
    with pytest.raises(AssertionError, match=r"gradient w\.r\.t\. p\['w_up'\] differs"):
        testing.assert_moe_parity(frozen, layer, x, ids, wts, params)


def test_negative_control_passes_for_a_correct_pair():
    caught = testing.assert_parity_detects(OURS, dense, *sharded_args())
    assert sorted(caught) == ["drop", "duplicate", "misweight"]
    assert all("output y differs" in str(e) for e in caught.values())


def test_negative_control_fails_for_a_function_that_ignores_routing():
    args = sharded_args()
    blind = lambda x, ids, wts, *w: dense(x, jnp.zeros_like(ids), jnp.ones_like(wts), *w)
    with pytest.raises(AssertionError, match="do not match even unperturbed"):
        testing.assert_parity_detects(blind, dense, *args)
    with pytest.raises(AssertionError, match="did not detect a misweight"):
        testing.assert_parity_detects(blind, blind, *args)


def test_disabled_chex_assertions_are_refused():
    chex.disable_asserts()
    try:
        with pytest.raises(RuntimeError, match="chex assertions are disabled"):
            testing.assert_moe_parity(dense, dense, *sharded_args())
    finally:
        chex.enable_asserts()


# ---------------------------------------------------------------------------------------------
# emulated devices


def test_use_cpu_devices_refuses_another_count_once_jax_started():
    if devices.user_set_cpu_devices():
        pytest.skip("the CPU device count was chosen by XLA_FLAGS / JAX_NUM_CPU_DEVICES")
    assert testing.use_cpu_devices is devices.use_cpu_devices
    assert jax.device_count("cpu") == 8
    testing.use_cpu_devices(8)  # the same count: nothing to do
    with pytest.raises(RuntimeError, match="already initialised with 8 CPU devices"):
        testing.use_cpu_devices(4)
    assert jax.device_count("cpu") == 8


# ---------------------------------------------------------------------------------------------
# the documented calls, and misuse said in one sentence

REFERENCE = functools.partial(relaymoe_jax.moe_ffn, mesh=M, dispatcher="reference")


def test_the_documented_calls_work_with_unplaced_arguments():
    """The module docstring's calls with testing.moe_inputs as they come (not on the mesh): the
    negative control's perturbations were committed to one device ("incompatible devices").
    The control runs assert_moe_parity's check unperturbed first, so it covers both calls."""
    ids = testing.routing_case("ragged", T, K, E, 8, seed=0)
    inp = testing.moe_inputs(ids, E, hidden=8, ffn=8)
    caught = testing.assert_parity_detects(OURS, REFERENCE, *inp.args)
    assert sorted(caught) == ["drop", "duplicate", "misweight"]


def _unplaced():
    ids = testing.routing_case("uniform", T, K, E, 8, seed=0)
    return testing.moe_inputs(ids, E, hidden=8, ffn=8)


def _nnx_style():
    from flax import nnx

    graphdef, params = nnx.split(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    layer = lambda x, params: nnx.merge(graphdef, params)(x)
    return layer, layer, _unplaced().x, params


WITH_STATS = functools.partial(relaymoe_jax.moe_ffn, mesh=M, return_stats=True)
MISUSE = {  # helper, its arguments, keywords, the error
    "the control on an NNX-style f(x, params)": (
        testing.assert_parity_detects,
        _nnx_style,
        {},
        r"assert_parity_detects perturbs the routing it is given, so f and g must take "
        r"moe_ffn's positional arguments .*got 2 arguments \(float32\[32,8\], a State of 2 "
        r"leaves\).*run the control on its expert step",
    ),
    "the control without w_gate nor num_experts": (
        testing.assert_parity_detects,
        lambda: (dense, dense, *_unplaced().args[:3]),
        {},
        r"num_experts= is needed when args\[3\] is not w_gate",
    ),
    "f returns (y, stats), g returns y": (
        testing.assert_moe_parity,
        lambda: (WITH_STATS, REFERENCE, *_unplaced().args),
        {},
        r"assert_moe_parity: f returns \(float32\[32,8\], \{'dropped_pairs': int32\[\], "
        r"'ignored_pairs': int32\[\]\}\) but g returns float32\[32,8\].*pass has_aux=True",
    ),
    "the same in the control": (
        testing.assert_parity_detects,
        lambda: (WITH_STATS, REFERENCE, *_unplaced().args),
        {},
        r"assert_parity_detects: f returns \(float32\[32,8\], .* but g returns float32\[32,8\]",
    ),
    "y of another shape": (
        testing.assert_moe_parity,
        lambda: (lambda *a: REFERENCE(*a)[None], REFERENCE, *_unplaced().args),
        {},
        r"f returns float32\[1,32,8\] but g returns float32\[32,8\]; both must return y with "
        r"the same structure and shapes$",
    ),
    "has_aux=True with y alone": (
        testing.assert_moe_parity,
        lambda: (REFERENCE, REFERENCE, *_unplaced().args),
        {"has_aux": True},
        r"has_aux=True, so f must return \(y, aux\), but it returns float32\[32,8\]",
    ),
    "a cotangent shaped unlike y": (
        testing.moe_value_and_grads,
        lambda: (REFERENCE, *_unplaced().args),
        {"cotangent": (np.zeros((T, 8)),) * 2},
        r"the function returns float32\[32,8\], but the cotangent is \(float32\[32,8\], "
        r"float32\[32,8\]\)",
    ),
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_is_one_clear_error_before_anything_runs(case):
    helper, make_args, kw, match = MISUSE[case]
    with pytest.raises(ValueError, match=match):
        helper(*make_args(), **kw)
