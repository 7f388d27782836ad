"""The op as a drop-in: caller-shaped inputs and outputs for `moe_ffn`, and `moe_ffn_local`
inside the caller's own shard_map. Values and every gradient against the dense reference
(`relaymoe_jax.testing.assert_moe_parity`, NaN-poisoned padding).

What is checked here sits above the dispatcher's grouped matmuls (the front door, the caller's
shard_map, the expert-tensor gather and sums), so they are lax.ragged_dot (GMM): its programs
compile in about 60% of the time of the blocked XLA one, CPU's "auto", which every dispatcher
runs on every routing and layout in test_dispatch.py."""

import functools
import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_cases import mesh
from relaymoe_jax import moe_ffn, moe_ffn_local, poison_unwritten, testing
from relaymoe_jax.testing import grads as testing_grads

E, K = 16, 4
GMM = "ragged_dot"  # the dispatchers' grouped matmul (module doc)


def inputs(lead, m, spec, seed=0, e=E, k=K):
    """moe_ffn's arguments with x [*lead, H] and ids/weights [*lead, k] on `spec` (tokens)."""
    t = int(np.prod(lead))
    ids = testing.routing_case("uniform", t, k, e, 1, seed=seed)
    inp = testing.moe_inputs(ids, e, seed=seed)
    tok = NamedSharding(m, spec)
    x, ids, wts = (
        jax.device_put(a.reshape(*lead, a.shape[-1]), tok)
        for a in (inp.x, inp.expert_ids, inp.expert_weights)
    )
    return x, ids, wts, inp.w_gate, inp.w_up, inp.w_down


@functools.cache
def reference(m):
    """The reference on mesh m: one object per mesh, so its program (per input shape and
    sharding) is compiled once for every function compared with it."""
    return functools.partial(moe_ffn, mesh=m, dispatcher="reference")


# (mesh, x's leading dimensions, their sharding, dispatcher, routing). Flattening the leading
# dimensions and splitting them (padded) over the expert axes they are not sharded over is the op's
# front door, the same for every dispatcher; each dispatcher gets a split, padded case (its own
# way of never reading the NaN-poisoned padding: ids -1, weight 0).
CALLER_CASES = [
    ("dp2_ep4", (4, 16), P("data", "expert"), "ring", "expert"),  # [B, S, H], the sequence sharded
    ("ep8", (4,), P(), "alltoall", "auto"),  # a decode step: 4 tokens, 8 devices
    ("dp2_ep4", (2, 3), P("data"), "ring", "expert"),  # 3 tokens per device over 4 expert devices
    ("ep8", (60, 1), P(), "ring", "token"),  # [B, 1, H]; 60 tokens do not divide 8 shards
]


@pytest.mark.parametrize("mesh_name,lead,spec,dispatcher,routing", CALLER_CASES)
def test_caller_shaped_inputs_and_outputs(mesh_name, lead, spec, dispatcher, routing):
    """y has x's shape and sharding; token counts that do not divide the shards are padded
    inside the op, exactly (padding NaN-poisoned). y is read from the parity run (one program).

    Also covers the removed shape x dispatcher cases (each shape ran with all three): the shape
    handling runs before the dispatcher, and each dispatcher keeps a split, padded case here
    (ring expert routing (2, 3), token routing (60, 1), the all-to-all (4,)); the dispatchers'
    other layouts run in test_dispatch.py. (60, 1) merges the removed [B, 1, H] case (4, 1) and
    60 tokens over 8 shards (60,).

    [B, S, H] over (data, expert) (the first case) also checks what the former
    test_a_sharded_sequence_is_flattened_without_moving_data did, on the parity run's own
    program (values and gradients, read from testing's cache: no second compile): no all-gather
    and no all-to-all, only the ring's collective-permutes (and the weight gradients' all-reduce
    over data)."""
    m = mesh(mesh_name)
    args = inputs(lead, m, spec)
    ours = functools.partial(moe_ffn, mesh=m, dispatcher=dispatcher, routing=routing, gmm_impl=GMM)
    got, _ = testing.assert_moe_parity(ours, reference(m), *args)
    assert got.y.shape == args[0].shape
    assert got.y.sharding.is_equivalent_to(args[0].sharding, got.y.ndim)
    if spec == P("data", "expert"):  # a sharded sequence is flattened without moving data
        run = testing_grads.value_and_grads_fn(ours, (0, 2, 3, 4, 5), False, True, True)
        r = testing_grads.random_cotangent(ours, args, False, 0)
        with poison_unwritten():
            text = run.lower(r, *args).compile().as_text()
        assert "collective-permute" in text
        assert "all-gather" not in text and "all-to-all" not in text


def test_residual_add_on_an_explicit_mesh_of_three_axes():
    """jax-llm-examples' layout: Explicit axes x, y, z, the batch over x only, experts over all
    three. The output comes back like x, so the residual add type-checks (y read from the
    parity run: one program)."""
    m = jax.make_mesh((2, 2, 2), ("x", "y", "z"))
    args = inputs((4, 8), m, P("x", None))
    ea = ("x", "y", "z")
    ws = [jax.device_put(w, NamedSharding(m, P(ea))) for w in args[3:]]

    def block(x, ids, wts, wg, wu, wd):
        return x + moe_ffn(x, ids, wts, wg, wu, wd, mesh=m, expert_axis=ea, gmm_impl=GMM)

    def block_ref(x, ids, wts, wg, wu, wd):
        return x + moe_ffn(x, ids, wts, wg, wu, wd, mesh=m, expert_axis=ea, dispatcher="reference")

    got, _ = testing.assert_moe_parity(block, block_ref, *args[:3], *ws)
    assert got.y.sharding.is_equivalent_to(args[0].sharding, got.y.ndim)


def test_a_weight_sharded_over_an_unused_axis_warns_once_with_the_bytes(caplog):
    """ffn split over "tensor", which is not passed as expert_tensor_axis: the op gathers the
    weights (right numbers, hidden memory) and says so once, with the bytes per device.

    Asked for a replicated y (`out_sharding=P()`), it gets one: this also covers the former
    test_out_sharding_puts_y_where_asked (the same on ep8; the output's placement is the op's
    last step, after any dispatcher and whatever the weights' layout), on this test's program."""
    m = mesh("ep4_tp2")
    args = inputs((64,), m, P("expert"))
    ws = [
        jax.device_put(w, NamedSharding(m, s))
        for w, s in zip(
            args[3:], (P("expert", None, "tensor"),) * 2 + (P("expert", "tensor", None),)
        )
    ]
    f = jax.jit(lambda *a: moe_ffn(*a, mesh=m, out_sharding=P(), gmm_impl=GMM))
    with caplog.at_level(logging.WARNING, logger="relaymoe_jax"):
        y = f(*args[:3], *ws)
        f(*args[:3], *ws)  # cached: no second trace
        # traced again (lowered: the warning is the trace's; no compile): no repeat
        jax.jit(lambda *a: 2 * moe_ffn(*a, mesh=m, gmm_impl=GMM)).lower(*args[:3], *ws)
    assert y.sharding.is_fully_replicated
    gathered = [r.getMessage() for r in caplog.records if "all-gathered" in r.getMessage()]
    per_device = 3 * 16 // 4 * 16 * 24 * 4  # 3 weights x E/EP x H x F float32, gathered
    assert len(gathered) == 1, gathered  # one warning for the three weights
    assert f"{per_device:,} bytes per device" in gathered[0]
    assert all(f"{n} " in gathered[0] for n in ("w_gate", "w_up", "w_down"))
    assert "over ['tensor']" in gathered[0]
    want = jax.jit(reference(m))(*args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=0, atol=1e-5)


def test_moe_ffn_inside_a_shard_map_points_to_moe_ffn_local():
    m = mesh("ep8")
    args = inputs((64,), m, P("expert"))
    args = (*args[:3], *(jax.device_put(w, NamedSharding(m, P("expert"))) for w in args[3:]))
    body = lambda x, ids, wts, wg, wu, wd: moe_ffn(x, ids, wts, wg, wu, wd, mesh=m)
    f = jax.shard_map(body, mesh=m, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    with pytest.raises(
        ValueError,
        match=r"moe_ffn takes global arrays, but it is called inside "
        r"a jax.shard_map \(manual mesh axes \('expert',\)\); "
        "there, call relaymoe_jax.moe_ffn_local",
    ):
        jax.jit(f)(*args)


# ------------------------------------------------------------------ moe_ffn_local


def local_layer(m, tokens, etp=None, check_vma=True, **kw):
    """A caller's shard_map around moe_ffn_local: tokens on `tokens`, experts over "expert" and
    ffn over `etp` (the weights are put there first, as the caller's model keeps them)."""
    w_in, w_out = P("expert", None, etp), P("expert", etp, None)
    body = lambda *a: moe_ffn_local(
        *a, expert_axis="expert", expert_tensor_axis=etp, gmm_impl=GMM, **kw
    )
    run = jax.shard_map(
        body,
        mesh=m,
        in_specs=(tokens,) * 3 + (w_in, w_in, w_out),
        out_specs=tokens,
        check_vma=check_vma,
    )

    def layer(x, ids, wts, wg, wu, wd):
        wg, wu, wd = (
            jax.sharding.reshard(w, NamedSharding(m, s))
            for w, s in zip((wg, wu, wd), (w_in, w_in, w_out))
        )
        return run(x, ids, wts, wg, wu, wd)

    return layer


@pytest.mark.parametrize("dispatcher,routing", [("ring", "expert"), ("alltoall", "auto")])
def test_moe_ffn_local_in_the_callers_shard_map(dispatcher, routing):
    """(data=2, expert=4), tokens [B, S, H] over both: the weight gradients are summed over data
    (read from the varying axes). The ring sums them once for both routings (`_ring_op`'s
    backward, over the reduce axes the op reads): [ring-token], removed, is covered by
    test_moe_ffn_local_without_check_vma (token routing, same mesh and tokens) and
    test_dispatch.py's data x expert case of token routing."""
    m = mesh("dp2_ep4")
    tokens = P("data", "expert")
    args = inputs((4, 8), m, tokens)
    ours = local_layer(m, tokens, dispatcher=dispatcher, routing=routing)
    testing.assert_moe_parity(ours, reference(m), *args)


def test_moe_ffn_local_with_an_expert_tensor_axis():
    """Ring token routing (explicitly: `auto` picks it here too) with expert tensor parallelism,
    tokens replicated over it: this is where token routing runs under ETP without biases
    (test_dispatch.py's ETP layouts run expert routing and the all-to-all).

    The former case [True] (tokens gathered over ETP) is covered by
    test_moe_ffn_local_with_an_expert_tensor_axis_without_check_vma[True] (ring token routing,
    tokens gathered, values and every gradient) and, under check_vma=True,
    test_expert_biases.py::test_moe_ffn_local_with_biases[ETP, tokens gathered] and
    test_dispatch.py::test_expert_tensor_axis[*-True]: the all-gather in and reduce-scatter out
    sit above the dispatcher (`dispatch.local`), the same for both ring routings."""
    m = mesh("ep4_etp2")
    tokens = P("expert")
    args = inputs((64,), m, tokens)
    ours = local_layer(m, tokens, etp="expert_tensor", routing="token")
    testing.assert_moe_parity(ours, reference(m), *args)


def test_moe_ffn_local_without_check_vma():
    """Under check_vma=False shard_map's transpose sums the weight gradients over data itself
    (the op must not sum them again: that would double them). Ring token routing, on the
    inputs of test_moe_ffn_local_in_the_callers_shard_map (its reference program is shared)."""
    m = mesh("dp2_ep4")
    tokens = P("data", "expert")
    args = inputs((4, 8), m, tokens)
    ours = local_layer(m, tokens, check_vma=False, routing="token")
    testing.assert_moe_parity(ours, reference(m), *args)


@pytest.mark.parametrize("tokens_over_etp", [True, False])
def test_moe_ffn_local_with_an_expert_tensor_axis_without_check_vma(tokens_over_etp):
    m = mesh("ep4_etp2")
    tokens = P(("expert", "expert_tensor")) if tokens_over_etp else P("expert")
    args = inputs((64,), m, tokens)
    with pytest.raises(
        ValueError,
        match=r"under shard_map\(check_vma=False\): pass "
        "tokens_sharded_over_etp=True or False",
    ):
        jax.jit(local_layer(m, tokens, etp="expert_tensor", check_vma=False))(*args)
    ours = local_layer(
        m,
        tokens,
        etp="expert_tensor",
        check_vma=False,
        tokens_sharded_over_etp=tokens_over_etp,
        routing="token",
    )
    testing.assert_moe_parity(ours, reference(m), *args)


def test_moe_ffn_local_refuses_what_it_cannot_do():
    m = mesh("ep8")
    args = inputs((64,), m, P("expert"))
    args = (*args[:3], *(jax.device_put(w, NamedSharding(m, P("expert"))) for w in args[3:]))
    with pytest.raises(
        ValueError,
        match=r"moe_ffn_local runs inside jax.shard_map over "
        r"\['expert'\], but no axis is manual here; with global arrays call "
        "relaymoe_jax.moe_ffn",
    ):
        jax.jit(lambda *a: moe_ffn_local(*a, expert_axis="expert"))(*args)
    replicated = jax.shard_map(
        lambda *a: moe_ffn_local(*a, expert_axis="expert"),
        mesh=m,
        in_specs=(P(),) * 3 + (P("expert"),) * 3,
        out_specs=P(),
    )
    rep = [jax.sharding.reshard(a, NamedSharding(m, P())) for a in args[:3]]
    with pytest.raises(ValueError, match=r"x does not vary over the expert axes \['expert'\]"):
        jax.jit(replicated)(*rep, *args[3:])
    with pytest.raises(ValueError, match=r"dispatcher='reference' is not available per device"):
        moe_ffn_local(*args, expert_axis="expert", dispatcher="reference")
