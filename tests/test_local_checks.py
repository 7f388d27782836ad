"""`moe_ffn_local` against the caller's shard_map: contradictions between the sharding and the
arguments refused before tracing (check_vma types), the run-time `debug_checks` for what the types
cannot show, partial-manual shard_maps for every dispatcher and grouped matmul (values and every
gradient against the dense reference), and stats that do not depend on check_vma."""

import functools
import logging
import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_drop_in import E, inputs, reference
from test_expert_biases import biases

from moe_cases import mesh
from relaymoe_jax import moe_ffn, moe_ffn_local, testing
from relaymoe_jax.dispatch.alltoall import expert_capacity
from relaymoe_jax.dispatch.experts import BIAS_NAMES

TOKENS = P(("data", "expert"))
EXPERTS = P("expert")
IN_ETP, OUT_ETP = P("expert", None, "expert_tensor"), P("expert", "expert_tensor", None)


def local_call(m, tokens, w_specs, check_vma=True, axis_names=None, **kw):
    """jit(shard_map(moe_ffn_local)) with x, ids, weights on `tokens` and the three expert
    weights on `w_specs` (one spec, or (w_gate/w_up, w_down)); the weights are put there."""
    w_in, w_out = (w_specs, w_specs) if isinstance(w_specs, P) else w_specs
    specs = (tokens,) * 3 + (w_in, w_in, w_out)
    extra = {} if axis_names is None else {"axis_names": axis_names}
    run = jax.shard_map(
        lambda *a: moe_ffn_local(*a, **kw),
        mesh=m,
        in_specs=specs,
        out_specs=tokens,
        check_vma=check_vma,
        **extra,
    )

    def layer(*args):
        placed = [jax.device_put(a, NamedSharding(m, s)) for a, s in zip(args, specs)]
        return run(*placed)

    return jax.jit(layer)


# ------------------------------------------------ refused before tracing (check_vma types)

DP_EP = dict(m="dp2_ep4", tokens=TOKENS)
EP_ETP = dict(m="ep4_etp2", tokens=P("expert"))
REFUSED = {
    "expert_axis names an axis the experts do not vary over": (
        DP_EP,
        EXPERTS,
        dict(expert_axis="data"),
        r"w_gate does not vary over the expert axes \['data'\] \(expert_axis='data'; w_gate "
        r"varies over \('expert',\)\).*pass expert_axis='expert'",
    ),
    "replicated experts": (
        DP_EP,
        P(),
        dict(expert_axis="expert"),
        r"w_gate does not vary over the expert axes \['expert'\].*every device holds all "
        "experts: shard them over the expert axes, or call relaymoe_jax.moe_ffn",
    ),
    "an expert-axis tuple wider than the weights' sharding": (
        DP_EP,
        EXPERTS,
        dict(expert_axis=("data", "expert")),
        r"w_gate does not vary over the expert axes \['data'\].*pass expert_axis='expert'",
    ),
    "experts sharded over an axis the tokens are replicated over": (
        dict(m="dp2_ep4", tokens=EXPERTS),
        TOKENS,
        dict(expert_axis="expert"),
        r"w_gate varies over \('data',\), which is neither an expert axis \(expert_axis="
        r"'expert'\) nor expert_tensor_axis=None: the experts look sharded over \('data', "
        r"'expert'\).*pass expert_axis as the tuple of those axes in the order",
    ),
    # x varies over data too (the weights' type alone says it): y's relative error was 0.7
    "experts sharded over (data, expert) with expert_axis='expert'": (
        DP_EP,
        TOKENS,
        dict(expert_axis="expert"),
        r"w_gate varies over \('data',\), which is neither an expert axis \(expert_axis="
        r"'expert'\) nor expert_tensor_axis=None: the experts look sharded over \('data', "
        r"'expert'\)",
    ),
    "an ffn not split over expert_tensor_axis": (
        EP_ETP,
        EXPERTS,
        dict(expert_axis="expert", expert_tensor_axis="expert_tensor"),
        r"w_gate does not vary over expert_tensor_axis='expert_tensor'.*pass "
        "expert_tensor_axis=None if the ffn is not split",
    ),
    "tokens_sharded_over_etp=False while x varies over the ETP axis": (
        dict(m="ep4_etp2", tokens=P(("expert", "expert_tensor"))),
        (IN_ETP, OUT_ETP),
        dict(
            expert_axis="expert", expert_tensor_axis="expert_tensor", tokens_sharded_over_etp=False
        ),
        r"tokens_sharded_over_etp=False, but x varies over expert_tensor_axis='expert_tensor' "
        r"\(each expert-tensor rank holds other tokens\): pass True",
    ),
    "tokens_sharded_over_etp=True while x does not vary over the ETP axis": (
        EP_ETP,
        (IN_ETP, OUT_ETP),
        dict(
            expert_axis="expert", expert_tensor_axis="expert_tensor", tokens_sharded_over_etp=True
        ),
        r"tokens_sharded_over_etp=True, but x does not vary over expert_tensor_axis=",
    ),
    "tokens_sharded_over_etp=True without an expert-tensor axis": (
        DP_EP,
        EXPERTS,
        dict(expert_axis="expert", tokens_sharded_over_etp=True),
        "tokens_sharded_over_etp=True needs expert_tensor_axis",
    ),
    "expert_axis naming no mesh axis": (
        DP_EP,
        EXPERTS,
        dict(expert_axis="experts"),
        r"expert_axis='experts': expected an axis of the mesh.*\('data', 'expert'\)",
    ),
    "gmm_impl='pallas' where the call compiles for the CPU": (
        DP_EP,
        EXPERTS,
        dict(expert_axis="expert", gmm_impl="pallas"),
        "gmm_impl='pallas' compiles a GPU kernel, but this call compiles for "
        "'cpu': use gmm_impl='pallas-interpret'",
    ),
    "the Pallas interpreter under check_vma=True": (
        DP_EP,
        EXPERTS,
        dict(expert_axis="expert", gmm_impl="pallas-interpret"),
        r"gmm_impl='pallas-interpret'\) under shard_map\(check_vma=True\): jax 0.12's Pallas "
        "interpreter needs check_vma=False",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_contradictions_are_refused(case, monkeypatch):
    """Each is one ValueError naming the argument and what was expected, raised before the ring
    is traced (the per-device step is never entered). Without the check each computed wrong
    numbers silently, or failed inside JAX."""
    where, w_specs, kw, match = REFUSED[case]
    m = mesh(where["m"])
    args = inputs((64,), m, where["tokens"])
    entered = []
    monkeypatch.setattr(
        "relaymoe_jax.op.local_call.local_moe", lambda *a, **k: entered.append(1) or 1 / 0
    )
    with pytest.raises(ValueError, match=match):
        local_call(m, where["tokens"], w_specs, **kw)(*args)
    assert not entered


def test_weights_sharded_unlike_each_other_are_refused():
    """w_down gathered over data in the caller's body (FSDP), w_gate and w_up not: the types
    differ, which no shape shows."""
    m = mesh("dp2_ep4")
    args = inputs((64,), m, TOKENS)
    fsdp = P("expert", "data", None)

    def body(x, ids, wts, wg, wu, wd):
        wd = jax.lax.all_gather(wd, "data", axis=1, tiled=True)
        return moe_ffn_local(x, ids, wts, wg, wu, wd, expert_axis="expert")

    run = jax.shard_map(
        body, mesh=m, in_specs=(TOKENS,) * 3 + (EXPERTS, EXPERTS, fsdp), out_specs=TOKENS
    )
    ws = [
        jax.sharding.reshard(w, NamedSharding(m, s))
        for w, s in zip(args[3:], (EXPERTS, EXPERTS, fsdp))
    ]
    with pytest.raises(
        ValueError,
        match=r"w_down varies over \('data', 'expert'\), but w_gate over \('expert',\): "
        "the three expert weights must be sharded alike",
    ):
        jax.jit(run)(*args[:3], *ws)


def test_an_axis_that_is_not_manual_is_named():
    """expert_axis on an axis the (partial-manual) shard_map leaves automatic."""
    m = mesh("dp2_ep4", explicit=False)
    args = inputs((64,), m, EXPERTS)
    f = local_call(m, EXPERTS, EXPERTS, axis_names={"expert"}, expert_axis=("data", "expert"))
    with (
        jax.set_mesh(m),
        pytest.raises(
            ValueError,
            match=r"the axes \['data'\] are not manual in this jax.shard_map \(manual: "
            r"\('expert',\)\): add them to its axis_names",
        ),
    ):
        f(*args)


@pytest.mark.parametrize("impl", ["mosaic", "pallas"])
def test_moe_ffn_refuses_the_compiled_kernels_on_the_cpu(impl):
    m = mesh("ep8")
    args = inputs((64,), m, P("expert"))
    with pytest.raises(ValueError, match=f"gmm_impl='{impl}' compiles a GPU kernel"):
        jax.jit(functools.partial(moe_ffn, mesh=m, gmm_impl=impl))(*args)


def test_moe_ffn_refuses_the_mosaic_interpreter_on_several_devices():
    """jax 0.12's Mosaic GPU interpreter runs one device only (several wait forever)."""
    m = mesh("ep8")
    args = inputs((64,), m, P("expert"))
    with pytest.raises(ValueError, match="'mosaic-interpret' on a mesh of 8 devices"):
        jax.jit(functools.partial(moe_ffn, mesh=m, gmm_impl="mosaic-interpret"))(*args)


def test_moe_ffn_refuses_the_mosaic_interpreter_without_its_threads(monkeypatch):
    """Fewer XLA:CPU threads than the caller and a kernel's three warpgroups: one line naming
    NPROC, before anything waits (the pool's size is read from NPROC)."""
    monkeypatch.setenv("NPROC", "2")
    m = mesh("ep1")
    args = inputs((64,), m, P("expert"))
    with pytest.raises(ValueError, match=r"mosaic-interpret' needs 4 XLA:CPU threads.*'xla'"):
        jax.jit(functools.partial(moe_ffn, mesh=m, gmm_impl="mosaic-interpret"))(*args)


# ------------------------------------------------ what only a run can show: debug_checks

DEBUG = {
    # name: (where, weight specs, check_vma, keywords, the warning, or None for none)
    # (under check_vma=True refused before tracing: test_contradictions_are_refused)
    "experts over (data, expert), expert_axis='expert', check_vma=False": (
        DP_EP,
        TOKENS,
        False,
        dict(expert_axis="expert"),
        r"(\d+) \(token, expert\) pairs have ids >= 8 \(up to 15\), the experts this call sees "
        r"\(2 per device in w_gate x 4 over expert_axis='expert'\)",
    ),
    "replicated experts, check_vma=False": (
        DP_EP,
        P(),
        False,
        dict(expert_axis="expert"),
        "w_gate is the same on every device along expert_axis='expert'",
    ),
    "expert_axis naming the data axis, check_vma=False": (
        DP_EP,
        EXPERTS,
        False,
        dict(expert_axis="data"),
        "w_gate is the same on every device along expert_axis='data'",
    ),
    "tokens over ETP said False, check_vma=False": (
        dict(m="ep4_etp2", tokens=P(("expert", "expert_tensor"))),
        (IN_ETP, OUT_ETP),
        False,
        dict(
            expert_axis="expert", expert_tensor_axis="expert_tensor", tokens_sharded_over_etp=False
        ),
        "tokens_sharded_over_etp=False, but x holds other tokens on some expert-tensor rank",
    ),
    "tokens replicated over ETP said True, check_vma=False": (
        EP_ETP,
        (IN_ETP, OUT_ETP),
        False,
        dict(
            expert_axis="expert", expert_tensor_axis="expert_tensor", tokens_sharded_over_etp=True
        ),
        "tokens_sharded_over_etp=True, but x holds the same tokens on every expert-tensor rank",
    ),
    "a right call": (DP_EP, EXPERTS, True, dict(expert_axis="expert"), None),
    "a right call, check_vma=False": (DP_EP, EXPERTS, False, dict(expert_axis="expert"), None),
    "a right ETP call, check_vma=False": (
        EP_ETP,
        (IN_ETP, OUT_ETP),
        False,
        dict(
            expert_axis="expert", expert_tensor_axis="expert_tensor", tokens_sharded_over_etp=False
        ),
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(DEBUG))
def test_debug_checks_report_what_the_types_cannot_show(case, caplog):
    """One warning per finding per call, from one device; a right call gets none and the
    reference's y. The ids count is the pairs with ids the call cannot hold, counted in numpy."""
    where, w_specs, check_vma, kw, match = DEBUG[case]
    m = mesh(where["m"])
    args = inputs((64,), m, where["tokens"])
    f = local_call(m, where["tokens"], w_specs, check_vma=check_vma, debug_checks=True, **kw)
    with caplog.at_level(logging.WARNING, logger="relaymoe_jax"):
        y = f(*args)
        jax.block_until_ready(y)
        jax.effects_barrier()
    found = [r.getMessage() for r in caplog.records if "debug_checks=True" in r.getMessage()]
    if match is None:
        assert found == []
        want = jax.jit(reference(m))(*args)
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=0, atol=1e-5)
        return
    hits = [h for h in (re.search(match, f) for f in found) if h]
    assert len(hits) == 1 and len(found) == len(set(found)), found  # once, from one device
    hit = hits[0]
    if hit.groups():
        assert int(hit.group(1)) == int(np.sum(np.asarray(args[1]) >= 8))


BIAS_DEBUG = {
    # name: (the biases' spec, their scale, the warning or None)
    "biases replicated over the expert axis": (
        P(),
        0.5,
        "b_gate, b_up, b_down are the same on every device along expert_axis='expert': the "
        "biases are replicated there",
    ),
    "biases sharded like the weights": (EXPERTS, 0.5, None),
    "zero biases replicated (no different from sharded zeros)": (P(), 0.0, None),
}


@functools.cache
def _bias_debug_call(m, b_spec):
    """(in_specs, jit(shard_map(moe_ffn_local with biases, debug_checks=True))) for biases on
    b_spec: one program for both replicated cases (they differ in values only)."""
    specs = (TOKENS,) * 3 + (EXPERTS,) * 3 + (b_spec,) * 3
    run = jax.shard_map(
        lambda *a: moe_ffn_local(
            *a[:6], **dict(zip(BIAS_NAMES, a[6:])), expert_axis="expert", debug_checks=True
        ),
        mesh=m,
        in_specs=specs,
        out_specs=TOKENS,
        check_vma=False,
    )
    return specs, jax.jit(run)


@pytest.mark.parametrize("case", sorted(BIAS_DEBUG))
def test_debug_checks_cover_the_biases(case, caplog):
    """check_vma=False: biases of one device's shape [E / EP, ...] given replicated over the
    expert axis (each device adds the same rows to other experts: y's relative error 0.28) are
    reported like replicated weights, once; sharded ones are not."""
    b_spec, scale, match = BIAS_DEBUG[case]
    m = mesh("dp2_ep4")
    args = inputs((64,), m, TOKENS)
    ep = 4
    bb = [np.asarray(b) for b in biases(E, 16, 24, seed=5, scale=scale)]
    if b_spec == P():
        bb = [b[: E // ep] for b in bb]  # one device's rows, on every device
    specs, run = _bias_debug_call(m, b_spec)
    placed = [jax.device_put(a, NamedSharding(m, s)) for a, s in zip((*args, *bb), specs)]
    with caplog.at_level(logging.WARNING, logger="relaymoe_jax"):
        jax.block_until_ready(run(*placed))
        jax.effects_barrier()
    found = [r.getMessage() for r in caplog.records if "debug_checks=True" in r.getMessage()]
    if match is None:
        assert found == []
    else:
        assert len(found) == 1 and match in found[0], found


def test_fsdp_weights_gathered_invarying_match_the_reference():
    """What the refusal of weights varying over a non-expert axis says to do: FSDP storage
    sharded over data, gathered in the body with all_gather(to='invarying'); values and every
    gradient against the reference (the weight gradients summed over data by the op)."""
    m = mesh("dp2_ep4")
    args = inputs((64,), m, TOKENS)
    w_in, w_out = P("expert", "data", None), P("expert", None, "data")
    gather = functools.partial(jax.lax.all_gather, axis_name="data", tiled=True, to="invarying")

    def body(x, ids, wts, wg, wu, wd):
        wg, wu, wd = gather(wg, axis=1), gather(wu, axis=1), gather(wd, axis=2)
        return moe_ffn_local(x, ids, wts, wg, wu, wd, expert_axis="expert")

    specs = (TOKENS,) * 3 + (w_in, w_in, w_out)
    run = jax.shard_map(body, mesh=m, in_specs=specs, out_specs=TOKENS)

    def ours(*a):
        return run(*(jax.sharding.reshard(v, NamedSharding(m, s)) for v, s in zip(a, specs)))

    testing.assert_moe_parity(ours, reference(m), *args)


# ------------------------------------------------ partial-manual shard_map

# Each dispatcher (ring expert, ring token, all-to-all), each grouped matmul (xla, ragged_dot,
# the Pallas interpreter) and each check_vma at least once: the grouped matmul is the same code
# under either dispatcher (what partial-manual changes is the manual/auto axis types of the ops
# both run). The Pallas interpreter is slow: the all-to-all covers its calls.
PARTIAL_MANUAL = [
    ("ring", "expert", "xla", False),
    ("ring", "token", "ragged_dot", True),
    ("alltoall", "auto", "xla", True),
    ("alltoall", "auto", "pallas-interpret", False),
]


@pytest.mark.parametrize("dispatcher,routing,gmm_impl,check_vma", PARTIAL_MANUAL)
def test_partial_manual_shard_map(dispatcher, routing, gmm_impl, check_vma):
    """MaxText's way: shard_map(axis_names={'expert'}) on an Auto (data, expert) mesh, data left
    to the compiler. Values and every gradient against the reference (NaN-poisoned padding).
    jax 0.12's searchsorted failed there with an AssertionError on the manual axis type.

    Also covers the former cases [ring-expert-xla-True] and [ring-expert-pallas-interpret-False]
    (the ring, expert routing, under check_vma=False: ring-expert-xla-False; the ring under
    check_vma=True: ring-token-ragged_dot-True, whose hops are expert routing's code; the Pallas
    interpreter's calls, the same kernel wrapper under either dispatcher:
    alltoall-auto-pallas-interpret-False), [ring-token-xla-True] (the xla grouped matmul:
    ring-expert-xla; the token relay: ring-token-ragged_dot), [ring-expert-ragged_dot-True] and
    [alltoall-auto-ragged_dot-True] (ragged_dot: ring-token-ragged_dot; both dispatchers: their
    xla and Pallas cases)."""
    m = mesh("dp2_ep4", explicit=False)
    args = inputs((64,), m, EXPERTS)
    ours = local_call(
        m,
        EXPERTS,
        EXPERTS,
        check_vma=check_vma,
        axis_names={"expert"},
        expert_axis="expert",
        dispatcher=dispatcher,
        routing=routing,
        gmm_impl=gmm_impl,
    )
    with jax.set_mesh(m):
        testing.assert_moe_parity(ours, reference(m), *args)


# ------------------------------------------------ stats

CF = 1.0


def _expected_stats(ids_tk, devices: int, e: int):
    """Dropped and ignored pairs of the capacity-CF all-to-all, counted in numpy: each device's
    tokens keep, per expert, the first expert_capacity pairs (token order)."""
    k = ids_tk.shape[1]
    per_dev = ids_tk.reshape(devices, -1, k)
    cap = expert_capacity(per_dev.shape[1], k, e, CF)
    dropped = 0
    for dev in per_dev:
        ok = dev[(dev >= 0) & (dev < e)]
        counts = np.bincount(ok, minlength=e)
        dropped += int(np.maximum(counts - cap, 0).sum())
    ignored = int(np.sum((ids_tk < 0) | (ids_tk >= e)))
    return dropped, ignored


@functools.cache
def _global_alltoall(m):
    return jax.jit(
        functools.partial(
            moe_ffn, mesh=m, dispatcher="alltoall", capacity_factor=CF, return_stats=True
        )
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_stats_are_the_same_under_both_check_vma_settings(check_vma):
    """Tokens over (data, expert): the stats are summed over every device holding tokens under
    either setting (check_vma=False used to leave out data), and match moe_ffn's."""
    m = mesh("dp2_ep4")
    t, k = 64, 4
    ids = testing.routing_case("out_of_range", t, k, E, 4, seed=3)
    ids[: t // 2, 0] = 1  # a hot expert: pairs dropped at capacity 1.0
    inp = testing.moe_inputs(ids, E, seed=3)
    tok = NamedSharding(m, TOKENS)
    args = [jax.device_put(a, tok) for a in inp[:3]] + list(inp[3:6])
    dropped, ignored = _expected_stats(np.asarray(ids), math.prod(m.shape.values()), E)
    assert dropped > 0 and ignored > 0
    run = jax.shard_map(
        lambda *a: moe_ffn_local(
            *a,
            expert_axis="expert",
            dispatcher="alltoall",
            capacity_factor=CF,
            return_stats=True,
        )[1],
        mesh=m,
        in_specs=(TOKENS,) * 3 + (EXPERTS,) * 3,
        out_specs=P(),
        check_vma=check_vma,
    )
    ws = [jax.sharding.reshard(w, NamedSharding(m, EXPERTS)) for w in args[3:]]
    stats = jax.jit(run)(*args[:3], *ws)
    assert int(stats["dropped_pairs"]) == dropped
    assert int(stats["ignored_pairs"]) == ignored
    _, global_stats = _global_alltoall(m)(*args)  # compiled once for both settings
    assert int(global_stats["dropped_pairs"]) == dropped
    assert int(global_stats["ignored_pairs"]) == ignored
