"""Shared meshes, inputs and parity runs for the dispatcher tests (no test functions here); the
inputs, comparisons and routings come from relaymoe_jax.testing."""

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import testing
from relaymoe_jax.op import moe_ffn

MESHES = {
    "ep1": ((1,), ("expert",)),  # the Mosaic GPU interpreter's: one device only
    "ep8": ((8,), ("expert",)),
    "dp2_ep4": ((2, 4), ("data", "expert")),
    "ep4_tp2": ((4, 2), ("expert", "tensor")),
    "ep4_etp2": ((4, 2), ("expert", "expert_tensor")),
    "dp2_cp4": ((2, 4), ("data", "context")),  # attention's layout; MoE folds it into EP=8
}
KEYS = ("x", "ids", "wts", "wg", "wu", "wd", "r")  # make_inputs' keys, moe_ffn's argument order


@functools.cache
def mesh(name, explicit=True):
    shape, names = MESHES[name]
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def uniform_ids(rng, t, e, k):
    """[t, k] ids, k distinct experts per token: testing's "uniform" case (rng: seed or rng)."""
    return testing.routing_case("uniform", t, k, e, 1, seed=rng)


def make_inputs(ids, e, h=16, f=24, dtype="float32", seed=0, equal_weights=False):
    """testing.moe_inputs as a dict: x, ids, wts (not normalised), wg, wu, wd, r (y's cotangent)."""
    return dict(zip(KEYS, testing.moe_inputs(ids, e, h, f, dtype, seed, equal_weights)))


def args(inp):
    """moe_ffn's six positional arguments from a make_inputs dict."""
    return [inp[n] for n in KEYS[:6]]


def moe_fn(dispatcher, mesh_, **kw):
    """moe_ffn(x, ids, wts, wg, wu, wd) -> (y, stats) for one dispatcher, mesh and options; the
    same object for the same arguments, so testing's jit cache is shared across tests."""
    return _moe_fn(dispatcher, mesh_, tuple(sorted(kw.items())))


@functools.cache
def _moe_fn(dispatcher, mesh_, kw):
    return functools.partial(
        moe_ffn, mesh=mesh_, dispatcher=dispatcher, return_stats=True, **dict(kw)
    )


def run(dispatcher, inp, mesh_, poison=True, **kw):
    """(y, stats, grads {x, wts, wg, wu, wd}) of one dispatcher, NaN-poisoned padding by default."""
    out = testing.moe_value_and_grads(
        moe_fn(dispatcher, mesh_, **kw), *args(inp), cotangent=inp["r"], has_aux=True, poison=poison
    )
    return out.y, out.aux, dict(zip(("x", "wts", "wg", "wu", "wd"), out.grads.values()))


def check_parity(dispatcher, inp, mesh_, rtol=1e-5, ref_kw=None, ref=None, **kw):
    """testing.assert_moe_parity of one dispatcher against the reference dispatcher (or `ref`):
    y and the five gradients, the cotangent inp["r"], padding NaN-poisoned. ref_kw: the reference's
    moe_ffn options (the mesh plumbing). Returns (got, want) `MoeRun`s; aux holds the stats."""
    ref = ref or moe_fn("reference", mesh_, **(ref_kw or {}))
    return testing.assert_moe_parity(
        moe_fn(dispatcher, mesh_, **kw),
        ref,
        *args(inp),
        cotangent=inp["r"],
        has_aux=True,
        rtol=rtol,
    )


def place(inp, mesh_, token_axes, expert_axis="expert", etp=None):
    """Put the inputs where moe_ffn wants them: tokens over token_axes, experts over expert_axis,
    ffn over etp."""
    tok = NamedSharding(mesh_, P(token_axes))
    w_in, w_out = (
        NamedSharding(mesh_, P(expert_axis, None, etp)),
        NamedSharding(mesh_, P(expert_axis, etp, None)),
    )
    out = dict(inp)
    for n in ("x", "ids", "wts", "r"):
        out[n] = jax.device_put(inp[n], tok)
    for n, s in (("wg", w_in), ("wu", w_in), ("wd", w_out)):
        out[n] = jax.device_put(inp[n], s)
    return out
