"""The op's edges: eager calls, eager autodiff, the reference's placement and NaNs, grad-of-grad,
x64, and the chunk-size cap. Each against the dense reference or XLA's buffer assignment."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_cases import mesh
from relaymoe_jax import moe_ffn, poison_unwritten, testing
from relaymoe_jax.op import global_call
from relaymoe_jax.testing import grads as testing_grads

E = 16


def args_on(m, seed=0, t=64, k=4):
    inp = testing.moe_inputs(testing.routing_case("uniform", t, k, E, 8, seed=seed), E)
    tok = NamedSharding(m, P("expert"))
    return [jax.device_put(a, tok) for a in inp.args[:3]] + list(inp.args[3:])


@functools.cache
def reference(m):
    """One object per mesh: its programs (per shape, and per x64 setting) compile once."""
    return functools.partial(moe_ffn, mesh=m, dispatcher="reference")


def test_an_eager_call_reuses_its_compiled_program():
    m = mesh("ep8")
    args = args_on(m)
    global_call.program.cache_clear()
    y1 = moe_ffn(*args, mesh=m)
    y2 = moe_ffn(*args, mesh=m)
    assert (
        global_call.program.cache_info().currsize == 1
        and global_call.program.cache_info().hits == 1
    )
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    want = jax.jit(reference(m))(*args)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(want), rtol=0, atol=1e-5)


def test_eager_autodiff_says_what_to_do_and_works_under_set_mesh():
    m = mesh("ep8")
    args = args_on(m)
    loss = lambda x, wg: jnp.sum(moe_ffn(x, args[1], args[2], wg, *args[4:], mesh=m))
    with pytest.raises(
        ValueError,
        match=r"moe_ffn is transformed eagerly \(jax.grad or jax.vmap "
        r"outside jax.jit\) .* wrap the computation in jax.jit, "
        r"or run it under `with jax.set_mesh\(mesh\):`",
    ):
        jax.grad(loss)(args[0], args[3])
    ref_loss = lambda x, wg: jnp.sum(
        moe_ffn(x, args[1], args[2], wg, *args[4:], mesh=m, dispatcher="reference")
    )
    with jax.set_mesh(m):
        got = jax.grad(loss, argnums=(0, 1))(args[0], args[3])
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(args[0], args[3])
    for a, b in zip(got, want):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(np.abs(b).max())
        )


@pytest.mark.parametrize("dispatcher", ["reference", "ring"])
def test_inputs_not_on_the_mesh_are_placed_by_the_op(dispatcher):
    """Plain (single-device) arrays under jit on an Explicit mesh."""
    m = mesh("ep8")
    inp = testing.moe_inputs(testing.routing_case("ragged", 64, 4, E, 8), E)
    y = jax.jit(lambda *a: moe_ffn(*a, mesh=m, dispatcher=dispatcher))(*inp.args)
    placed = [jax.device_put(a, NamedSharding(m, P("expert"))) for a in inp.args[:3]]
    want = jax.jit(reference(m))(*placed, *inp.args[3:])
    assert y.shape == inp.x.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dispatcher", ["reference", "ring", "alltoall"])
def test_a_nan_expert_stays_in_its_tokens(dispatcher):
    """NaN in one expert's weights: y and dx are NaN exactly in the tokens routed to it (y and
    its vjp in one program)."""
    m = mesh("ep8")
    args = args_on(m, seed=3)
    args[3] = args[3].at[5].set(jnp.nan)
    routed = np.any(np.asarray(args[1]) == 5, axis=1)
    assert 0 < routed.sum() < len(routed)
    f = lambda x: moe_ffn(x, *args[1:], mesh=m, dispatcher=dispatcher)

    def y_and_dx(x):
        y, vjp = jax.vjp(f, x)
        return y, vjp(jnp.ones_like(y))[0]

    y, dx = jax.jit(y_and_dx)(args[0])
    np.testing.assert_array_equal(np.isnan(np.asarray(y)).any(1), routed)
    np.testing.assert_array_equal(np.isnan(np.asarray(dx)).any(1), routed)


@pytest.mark.parametrize("dispatcher,routing", [("ring", "expert"), ("alltoall", "auto")])
def test_grad_of_grad_raises_not_implemented(dispatcher, routing):
    """The former case [ring-token] is [ring-expert]: both routings' backward is one custom_vjp
    rule (`dispatch/ring._ring_op`'s bwd), which passes its inputs through `first_order` before
    the routing's own backward runs."""
    m = mesh("ep8")
    args = args_on(m)
    inner = jax.grad(
        lambda x: jnp.sum(
            moe_ffn(x, *args[1:], mesh=m, dispatcher=dispatcher, routing=routing) ** 2
        )
    )
    with pytest.raises(NotImplementedError, match=r"differentiable once, in reverse mode"):
        jax.jit(jax.grad(lambda x: jnp.sum(inner(x))))(args[0])


# [ring-expert-pallas-interpret-int64] is test_expert_biases.py::test_other_grouped_matmuls_with_
# biases, run under x64 with int64 ids (one Pallas-interpreter program for both).
X64 = [
    ("ring", "token", "xla", jnp.int32),
    ("ring", "token", "ragged_dot", jnp.int64),
    ("alltoall", "auto", "xla", jnp.int64),
    ("alltoall", "auto", "pallas-interpret", jnp.int32),
    ("reference", "auto", "auto", jnp.int64),
]


@pytest.mark.parametrize("dispatcher,routing,gmm_impl,ids_dtype", X64)
def test_x64(dispatcher, routing, gmm_impl, ids_dtype):
    """jax_enable_x64=True, int32 and int64 ids: values and gradients against the reference.
    Also covers the former case [ring-expert-xla-int64]: the ring's expert routing under x64 with
    int64 ids is test_expert_biases.py::test_other_grouped_matmuls_with_biases (the Pallas kernel,
    the former [ring-expert-pallas-interpret-int64]; the grouped matmul is called with the same
    ids), the xla grouped matmul with int64 ids alltoall-auto-xla-int64."""
    m = mesh("ep8")
    with jax.enable_x64(True):
        args = args_on(m)
        args[1] = args[1].astype(ids_dtype)
        assert args[1].dtype == ids_dtype
        ours = functools.partial(
            moe_ffn, mesh=m, dispatcher=dispatcher, routing=routing, gmm_impl=gmm_impl
        )
        testing.assert_moe_parity(ours, reference(m), *args)


def test_chunk_size_is_capped_at_the_pairs_there_are():
    """chunk_size=2**31-1 for 8 tokens x 4 slots per device lowers to the very program of 32
    (the value-and-gradients program, forward and backward; so XLA:CPU assigns it the same
    buffers), whose buffers stay small, and computes the same as the reference (values and every
    gradient). Also covers the former chunk_size=10**9 (capped the same way; 2**31-1 is also the
    largest int32); the former compared the two compiled programs' temp bytes, this the programs
    themselves (one compile, not three)."""
    m = mesh("ep8")
    args = args_on(m)
    huge = moe_fn(2**31 - 1)
    testing.assert_moe_parity(huge, reference(m), *args)

    def lowered(fn):  # testing's cached jit of the parity run (the program run just now)
        run = testing_grads.value_and_grads_fn(fn, (0, 2, 3, 4, 5), False, True, True)
        r = testing_grads.random_cotangent(fn, args, False, 0)
        with poison_unwritten():
            return run.lower(r, *args)

    capped = lowered(huge)
    assert capped.as_text() == lowered(moe_fn(32)).as_text()
    assert capped.compile().memory_analysis().temp_size_in_bytes < 2 * 1024 * 1024


@functools.cache
def moe_fn(chunk):
    return functools.partial(moe_ffn, mesh=mesh("ep8"), routing="expert", chunk_size=chunk)


@pytest.mark.parametrize(
    "options",
    [
        dict(dispatcher="ring", routing="token", chunk_size=8),
        dict(dispatcher="alltoall", capacity_factor=None),
    ],
)
def test_an_options_record_runs_the_op_it_describes(options):
    """moe_ffn(options=MoEOptions(...)) lowers to the program the same keywords lower to (so it
    computes what they compute), and matches the dense reference in values and every gradient
    (a misrouted pair would show)."""
    from relaymoe_jax import MoEOptions

    m = mesh("ep8")
    args = args_on(m, seed=3)
    record = functools.partial(moe_ffn, mesh=m, options=MoEOptions(**options))
    testing.assert_moe_parity(record, reference(m), *args)
    # the same program as the keywords' (lowered, not compiled again)
    keywords = functools.partial(moe_ffn, mesh=m, **options)
    assert jax.jit(record).lower(*args).as_text() == jax.jit(keywords).lower(*args).as_text()
