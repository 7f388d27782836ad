"""The ring's transfers can hide behind its compute: read from the jaxpr, no GPU compiler needed.

In every ring loop body (a scan / while body holding a `ppermute` and a hop's inner chunk
`while`), nothing the body sends may depend on that body's chunk loops. Otherwise XLA:GPU has to
run the chunk loop before starting the transfer (and its collective-permute combiner then merges
the independent transfers of the body into the dependent one): no overlap at all. Peeled code
outside loop bodies is exempt (the last hop necessarily sends what it computed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_cases import make_inputs, mesh, place, uniform_ids
from relaymoe_jax import moe_ffn

T_LOCAL, H, F, E, K = 64, 16, 24, 16, 4


def _sub_jaxprs(eqn):
    """The jaxprs in an equation's parameters (open `Jaxpr`s, closed ones unwrapped)."""

    def walk(v):
        if hasattr(v, "eqns"):
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            yield v.jaxpr
        elif isinstance(v, (tuple, list)):
            for x in v:
                yield from walk(x)

    for v in eqn.params.values():
        yield from walk(v)


def _loop_bodies(eqn):
    if eqn.primitive.name == "while":
        return [eqn.params["body_jaxpr"].jaxpr]
    if eqn.primitive.name == "scan":
        return [eqn.params["jaxpr"].jaxpr]
    return []


def _is_loop(eqn):
    return eqn.primitive.name in ("while", "scan")


def _contains(eqn, pred):
    """pred(eqn), or pred of an equation nested anywhere in its sub-jaxprs."""
    return pred(eqn) or any(_contains(e, pred) for j in _sub_jaxprs(eqn) for e in j.eqns)


def _sends(eqn):
    """A ppermute, or a call (pjit, custom_jvp, ...) that is not a loop and holds one: its
    operands are what leaves this level (conservative for a call)."""
    if eqn.primitive.name == "ppermute":
        return True
    return not _is_loop(eqn) and any(_contains(e, _sends) for j in _sub_jaxprs(eqn) for e in j.eqns)


def _computes(eqn):
    """An inner while (the hop's chunk loop), or an equation holding one."""
    return _contains(eqn, lambda e: e.primitive.name == "while")


def _vars(atoms):
    return [a for a in atoms if not hasattr(a, "val")]  # drop literals


def ring_bodies_with_dependent_sends(jaxpr):
    """All ring loop bodies under `jaxpr` (recursively: through custom_vjp, shard_map, pjit and
    loops), as (body, bad) with bad the ppermute equations of the body whose operands depend,
    through the body's equations, on an output of one of the body's inner while loops."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            for body in _loop_bodies(eqn):
                if any(_sends(e) for e in body.eqns) and any(
                    _is_loop(e) and _computes(e) for e in body.eqns
                ):
                    found.append((body, _dependent_sends(body)))
            for sub in _sub_jaxprs(eqn):
                visit(sub)

    visit(jaxpr)
    return found


def _dependent_sends(body):
    tainted = set()  # vars that depend on an inner while's outputs
    bad = []
    for eqn in body.eqns:
        if _sends(eqn) and any(v in tainted for v in _vars(eqn.invars)):
            bad.append(eqn)
        if (_is_loop(eqn) and _computes(eqn)) or any(v in tainted for v in _vars(eqn.invars)):
            tainted.update(eqn.outvars)
    return bad


def _fwd_bwd_jaxpr(routing):
    m = mesh("ep8")
    rng = np.random.default_rng(0)
    ids = uniform_ids(rng, 8 * T_LOCAL, E, K)
    inp = place(make_inputs(ids, E, h=H, f=F), m, ("expert",))

    def loss(x, wts, wg, wu, wd):
        y = moe_ffn(x, inp["ids"], wts, wg, wu, wd, mesh=m, dispatcher="ring", routing=routing)
        return jnp.sum(y.astype(jnp.float32) * inp["r"])

    args = [inp[n] for n in ("x", "wts", "wg", "wu", "wd")]
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args).jaxpr


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_ring_loop_bodies_send_nothing_computed_in_the_same_body(routing):
    bodies = ring_bodies_with_dependent_sends(_fwd_bwd_jaxpr(routing))
    # One forward and one backward ring loop (hops 0..N-2, or 1..N-2 with hop 0 peeled).
    assert len(bodies) == 2, f"expected 2 ring loop bodies, found {len(bodies)}"
    for _body, bad in bodies:
        assert not bad, (
            f"{routing} routing: a ring loop body sends what its own chunk loop "
            f"computed (the transfer cannot overlap): {bad}"
        )
