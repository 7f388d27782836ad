"""The parity assertion `assert_moe_parity` and its tolerances `DEFAULT_RTOL`.

`assert_runs_close` compares two `MoeRun`s array by array with chex; the negative control
(`relaymoe_jax.testing.controls`) reuses it.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.testing.grads import (
    arg_names,
    argnums_of,
    is_inexact,
    moe_value_and_grads,
    random_cotangent,
    same_y_shapes,
)

# max |got - want| allowed per array, relative to the reference array's max |want|.
DEFAULT_RTOL = {"float64": 1e-9, "float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}


def default_rtol(args, dtype):
    """DEFAULT_RTOL of `dtype`, else of the least precise floating-point argument."""
    dtypes = (
        [jnp.dtype(dtype)]
        if dtype is not None
        else [jnp.result_type(a) for a in jax.tree.leaves(args) if is_inexact(a)]
    )
    return max((DEFAULT_RTOL.get(jnp.dtype(d).name, 1e-5) for d in dtypes), default=1e-5)


def require_chex_asserts():
    """Raises RuntimeError when chex assertions are disabled (every check would pass)."""
    try:
        chex.assert_trees_all_close(np.zeros(1), np.ones(1))
    except AssertionError:
        return
    raise RuntimeError(
        "chex assertions are disabled (chex.disable_asserts()), so the parity "
        "check would pass whatever the functions compute; chex.enable_asserts()"
    )


def assert_runs_close(got, want, rtol, atol):
    """Each array of y and of the grads: same shape, finite (both), and
    max |got - want| <= rtol * max |want| + atol."""
    chex.assert_trees_all_equal_structs(got.y, want.y)
    chex.assert_trees_all_equal_structs(got.grads, want.grads)
    named = lambda what, tree: [
        (what + jax.tree_util.keystr(k), a)
        for k, a in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    got_leaves = named("output y", got.y)
    want_leaves = named("output y", want.y)
    for n in want.grads:
        got_leaves += named(f"gradient w.r.t. {n}", got.grads[n])
        want_leaves += named(f"gradient w.r.t. {n}", want.grads[n])
    for (what, a), (_, b) in zip(got_leaves, want_leaves):
        if getattr(b, "dtype", None) == jax.dtypes.float0:  # an integer leaf's "gradient"
            continue
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b), initial=0.0))
        tol = rtol * scale + atol
        try:
            chex.assert_equal_shape([a, b])
            chex.assert_tree_all_finite(b, custom_message="in the reference")
            chex.assert_tree_all_finite(
                a, custom_message=("(with poisoning on, NaN means a padding row was read)")
            )
            chex.assert_trees_all_close(a, b, rtol=0.0, atol=tol)
        except AssertionError as e:
            err = float(np.max(np.abs(a - b), initial=0.0)) if a.shape == b.shape else np.nan
            raise AssertionError(
                f"MoE parity: {what} differs from the reference: max |got - want| = {err:.3g} "
                f"= {err / max(scale, 1e-30):.3g} x max |want| ({scale:.3g}); allowed "
                f"{rtol:.1g} x max |want| + {atol:.1g}.\n{e}"
            ) from None


def assert_moe_parity(
    f,
    g,
    *args,
    argnums=None,
    cotangent=None,
    rtol=None,
    atol=0.0,
    dtype=None,
    has_aux=False,
    poison=True,
    jit=True,
    seed=0,
):
    """Asserts f (under test) and g (the reference) agree on y and on every gradient.

    Both are called as f(*args) (same signature; jitted or not; args may be sharded arrays or
    pytrees of them, e.g. a parameter nnx.State; y may be a pytree too).
    Checked with chex, per array: the shapes match, both are finite, and
    max |got - want| <= rtol * max |want| + atol, for y and for the gradient of
    sum(y * cotangent) w.r.t. each of args[argnums] (default every floating-point argument).
    The cotangent defaults to a random float32 one (from `seed`), so every output entry counts.
    rtol defaults to DEFAULT_RTOL of `dtype` (default: the least precise floating-point argument):
    float32 1e-5 is far below one (token, expert) pair's share of y, so a dropped, duplicated or
    misweighted pair fails (see `assert_parity_detects`). has_aux: f and g return (y, aux); aux
    is returned, not compared (f's y and g's must have the same structure and shapes: a
    ValueError says what each returns). poison: run both under `relaymoe_jax.poison_unwritten()`.
    jit: jit each value-and-grad computation (cached per function object).

    Raises AssertionError naming the output or gradient that differed and its max error.
    Returns (got, want), two `MoeRun`s, for further checks (e.g. on aux).
    """
    require_chex_asserts()
    argnums = argnums_of(args, argnums)
    y = same_y_shapes(f, g, args, has_aux, "assert_moe_parity")
    if cotangent is None and argnums:
        cotangent = random_cotangent(g, args, has_aux, seed, y=y)
    kw = dict(
        argnums=argnums,
        cotangent=cotangent,
        has_aux=has_aux,
        poison=poison,
        jit=jit,
        names=arg_names([f, g], len(args)),
    )
    want = moe_value_and_grads(g, *args, **kw)
    got = moe_value_and_grads(f, *args, **kw)
    rtol = default_rtol(args, dtype) if rtol is None else rtol
    assert_runs_close(got, want, rtol, atol)
    return got, want
