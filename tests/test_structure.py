"""The ring program's structure: collectives follow the schedule; it never builds [T*k, H]."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import relaymoe_jax
from moe_cases import make_inputs, mesh, place, uniform_ids
from relaymoe_jax.op import moe_ffn

E, K, H = 16, 8, 32
T_LOCAL = 64


def _setup(mesh_name="ep8", token_axes=("expert",), dispatcher="ring", routing="expert", **extra):
    m = mesh(mesh_name)
    shards = int(np.prod([m.shape[a] for a in token_axes]))
    ids = uniform_ids(np.random.default_rng(0), T_LOCAL * shards, E, K)
    inp = place(make_inputs(ids, E, h=H, f=32), m, token_axes)
    kw = dict(mesh=m, dispatcher=dispatcher, token_axes=token_axes, **extra)
    if dispatcher == "ring":
        kw["routing"] = routing

    def fwd(x, wts, wg, wu, wd, ids, r):
        return jnp.sum(moe_ffn(x, ids, wts, wg, wu, wd, **kw) * r)

    args = [inp[n] for n in ("x", "wts", "wg", "wu", "wd", "ids", "r")]
    return m, fwd, jax.grad(fwd, argnums=(0, 1, 2, 3, 4)), args


def _collectives(jaxpr, mult=1, out=None):
    """[(primitive, executions)] over a jaxpr, multiplying by the length of enclosing scans."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        if eqn.primitive.name in ("ppermute", "all_to_all", "ragged_all_to_all"):
            out.append((eqn.primitive.name, mult))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _collectives(sub, inner, out)
    return out


def _count(jaxpr, name):
    return sum(n for p, n in _collectives(jaxpr) if p == name)


MESHES = [("ep8", ("expert",)), ("dp2_ep4", ("data", "expert"))]


@pytest.mark.parametrize("mesh_name,token_axes", MESHES)
def test_ppermute_count_matches_the_expert_routing_schedule(mesh_name, token_axes):
    m, fwd, grad, args = _setup(mesh_name, token_axes)
    n = m.shape["expert"]
    # One ppermute per array: 3 weight arrays per transfer.
    # forward: N-1 weight transfers (the last one is peeled off).
    assert _count(jax.make_jaxpr(fwd)(*args).jaxpr, "ppermute") == 3 * (n - 1)
    # + backward: N-1 weight transfers, N-1 trailing dW transfers, 1 gradient-only return.
    bwd = 3 * (n - 1) + 3 * (n - 1) + 3
    assert _count(jax.make_jaxpr(grad)(*args).jaxpr, "ppermute") == 3 * (n - 1) + bwd


@pytest.mark.parametrize("mesh_name,token_axes", MESHES)
def test_ppermute_count_matches_the_token_routing_schedule(mesh_name, token_axes):
    m, fwd, grad, args = _setup(mesh_name, token_axes, routing="token")
    n = m.shape["expert"]
    # forward: N-1 transfers of the token partition (x, weights, pair order, counts: 4 arrays)
    # and N of its output accumulator (the last one brings it home).
    fwd_count = 4 * (n - 1) + n
    assert _count(jax.make_jaxpr(fwd)(*args).jaxpr, "ppermute") == fwd_count
    # + backward: N-1 transfers of the partition and its dy (5 arrays), N of the dx and
    # d expert_weights accumulators (2 arrays). dW stays local: no weight array moves.
    bwd_count = 5 * (n - 1) + 2 * n
    assert _count(jax.make_jaxpr(grad)(*args).jaxpr, "ppermute") == fwd_count + bwd_count


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_ring_has_no_all_to_all_but_the_baseline_does(routing):
    _, _, grad, args = _setup(routing=routing)
    assert _count(jax.make_jaxpr(grad)(*args).jaxpr, "all_to_all") == 0
    _, _, grad_a2a, _ = _setup(dispatcher="alltoall")
    assert _count(jax.make_jaxpr(grad_a2a)(*args).jaxpr, "all_to_all") >= 3


_SHAPE = re.compile(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8)\[([\d,]+)\]")


def _largest_array(hlo_text):
    return max(int(np.prod([int(d) for d in dims.split(",")])) for dims in _SHAPE.findall(hlo_text))


@functools.cache
def _baseline_largest_array():
    """The all-to-all's compiled gradient program's largest array: the control, one compile
    for both routings' tests (the same program: it has no routing)."""
    _, _, grad_a2a, args = _setup(dispatcher="alltoall")
    return _largest_array(jax.jit(grad_a2a).lower(*args).compile().as_text())


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_no_expanded_buffer_in_the_compiled_ring(routing):
    limit = T_LOCAL * K * H // 2
    _, _, grad, args = _setup(routing=routing)
    hlo = jax.jit(grad).lower(*args).compile().as_text()
    assert _largest_array(hlo) < limit, f"ring holds an array of {_largest_array(hlo)} elements"
    assert _baseline_largest_array() >= limit  # the check can fail: the baseline fails it


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_poisoning_really_puts_nan_in_the_program(routing):
    nan = "0x7FC00000"
    _, fwd, _, args = _setup(routing=routing)  # fresh each time: jit caches traces per function
    plain = jax.jit(fwd).lower(*args).as_text().count(nan)
    _, fwd, _, args = _setup(routing=routing)
    with relaymoe_jax.poison_unwritten():
        poisoned = jax.jit(fwd).lower(*args).as_text().count(nan)
    assert poisoned >= plain + 2  # chunk token rows (forward) and dy rows are NaN-filled


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_pallas_kernel_reads_token_rows_without_a_gathered_chunk(routing):
    """With the Pallas kernel the ring never gathers a [C, H] block of x or dy: the kernel reads
    rows of the [T, H] matrices by index. The blocked XLA path does gather them (the control)."""
    chunk = T_LOCAL * K // 8

    def gathered_chunks(gmm_impl):
        _, _, grad, args = _setup(routing=routing, gmm_impl=gmm_impl)
        return [
            e
            for e in _eqns(jax.make_jaxpr(grad)(*args).jaxpr)
            if e.primitive.name == "gather" and e.outvars[0].aval.shape == (chunk, H)
        ]

    assert gathered_chunks("xla")
    assert not gathered_chunks("pallas-interpret")
