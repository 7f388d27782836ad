"""Shared inputs and comparison helpers for the dispatcher tests (no test functions here)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import relaymoe_jax
from relaymoe_jax.op import moe_ffn

MESHES = {
    "ep8": ((8,), ("expert",)),
    "dp2_ep4": ((2, 4), ("data", "expert")),
    "ep4_tp2": ((4, 2), ("expert", "tensor")),
    "ep4_etp2": ((4, 2), ("expert", "expert_tensor")),
    "dp2_cp4": ((2, 4), ("data", "context")),      # attention's layout; MoE folds it into EP=8
}


@functools.cache
def mesh(name, explicit=True):
    shape, names = MESHES[name]
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def uniform_ids(rng, t, e, k):
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)])


def make_inputs(ids, e, h=16, f=24, dtype=np.float32, seed=0):
    """x, ids, weights (random, not normalised: misweighting shows), w_gate, w_up, w_down, r."""
    rng = np.random.default_rng(seed)
    t, k = ids.shape
    x = rng.standard_normal((t, h))
    wts = rng.uniform(0.1, 1.0, (t, k))
    wg, wu = (rng.standard_normal((e, h, f)) / np.sqrt(h) for _ in range(2))
    wd = rng.standard_normal((e, f, h)) / np.sqrt(f)
    r = rng.standard_normal((t, h))          # the loss is sum(y * r): every dy entry differs
    cast = lambda a: jnp.asarray(a, dtype)
    return dict(x=cast(x), ids=jnp.asarray(ids, jnp.int32), wts=cast(wts), wg=cast(wg),
                wu=cast(wu), wd=cast(wd), r=jnp.asarray(r, jnp.float32))


@functools.cache
def _value_and_grads(dispatcher, mesh_, kw, poison):
    """A jitted function per (dispatcher, mesh, kwargs, poison): poisoning is read at trace time."""
    kw = dict(kw)

    def loss(x, wts, wg, wu, wd, ids, r):
        y, stats = moe_ffn(x, ids, wts, wg, wu, wd, mesh=mesh_, dispatcher=dispatcher,
                           return_stats=True, **kw)
        return jnp.sum(y.astype(jnp.float32) * r), (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def run(dispatcher, inp, mesh_, poison=True, **kw):
    """(y, stats, grads {x, wts, wg, wu, wd}) of one dispatcher, NaN-poisoned padding by default."""
    fn = _value_and_grads(dispatcher, mesh_, tuple(sorted(kw.items())), poison)
    args = [inp[n] for n in ("x", "wts", "wg", "wu", "wd", "ids", "r")]
    if poison:
        with relaymoe_jax.poison_unwritten():
            (_, (y, stats)), g = fn(*args)
    else:
        (_, (y, stats)), g = fn(*args)
    return y, stats, dict(zip(("x", "wts", "wg", "wu", "wd"), g))


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_matches(got, want, tol, what=""):
    """got (y, grads) vs want (y, grads): all finite, max error <= tol * max |want| per array."""
    (y, g), (y_ref, g_ref) = got, want
    for name, a, b in [("y", y, y_ref), *((n, g[n], g_ref[n]) for n in g_ref)]:
        a = np.asarray(a, np.float64)
        assert np.all(np.isfinite(a)), f"{what} {name}: non-finite values (a padding row leaked?)"
        err = rel_err(a, b)
        assert err <= tol, f"{what} {name}: max error {err:.2e} > {tol:.0e} (relative to max |ref|)"


def place(inp, mesh_, token_axes, expert_axis="expert", etp=None):
    """Put the inputs where moe_ffn wants them: tokens over token_axes, experts over expert_axis,
    ffn over etp."""
    tok = NamedSharding(mesh_, P(token_axes))
    w_in, w_out = NamedSharding(mesh_, P(expert_axis, None, etp)), NamedSharding(
        mesh_, P(expert_axis, etp, None))
    out = dict(inp)
    for n in ("x", "ids", "wts", "r"):
        out[n] = jax.device_put(inp[n], tok)
    for n, s in (("wg", w_in), ("wu", w_in), ("wd", w_out)):
        out[n] = jax.device_put(inp[n], s)
    return out
