"""Values and gradients of a function under test: `moe_value_and_grads` and its `MoeRun`.

Also the argument handling the parity assertions share: which arguments are differentiated
(`argnums_of`), what the gradients are called (`arg_names`), the default cotangent
(`random_cotangent`).
"""

import contextlib
import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import poison_unwritten


class MoeRun(NamedTuple):
    """One function's output y, {argument name: gradient of sum(y * r)}, and its aux output."""

    y: jax.Array
    grads: dict
    aux: Any


def is_inexact(a):
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def argnums_of(args, argnums):
    """argnums as a tuple; default: every argument (array or pytree) with a floating leaf."""
    if argnums is None:
        return tuple(i for i, a in enumerate(args) if any(map(is_inexact, jax.tree.leaves(a))))
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def arg_names(fns, nargs):
    """Positional parameter names of the first of `fns` that names all nargs, else arg0..."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for fn in fns:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        names = [p.name for p in params if p.kind in kinds]
        if len(names) >= nargs:
            return tuple(names[:nargs])
    return tuple(f"arg{i}" for i in range(nargs))


def random_cotangent(fn, args, has_aux, seed):
    """float32 N(0, 1) shaped like fn's y (a pytree of them for a pytree y); replicated on the
    mesh of the first sharded argument (a jit over explicitly sharded arrays needs every argument
    on that mesh)."""
    out = jax.eval_shape(fn, *args)
    rng = np.random.default_rng(seed)
    r = jax.tree.map(
        lambda y: rng.standard_normal(y.shape).astype(np.float32), out[0] if has_aux else out
    )
    for a in jax.tree.leaves(args):
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return jax.device_put(r, NamedSharding(sharding.mesh, P()))
    return jax.tree.map(jnp.asarray, r)


@functools.lru_cache(maxsize=64)
def _value_and_grads_fn(fn, argnums, has_aux, jit, poison):
    """(r, *args) -> (y, aux, grads of sum(y * r) w.r.t. args[argnums]); cached so that calls
    with the same fn reuse one jit (poison is read at trace time, so it is part of the key)."""
    del poison

    def loss(diff, r, args):
        full = list(args)
        for i, a in zip(argnums, diff):
            full[i] = a
        out = fn(*full)
        y, aux = out if has_aux else (out, None)
        dots = jax.tree.map(
            lambda a, b: jnp.sum(a.astype(jnp.promote_types(a.dtype, b.dtype)) * b), y, r
        )
        return sum(jax.tree.leaves(dots)), (y, aux)

    def run(r, *args):
        if not argnums:
            out = fn(*args)
            return (*(out if has_aux else (out, None)), ())
        diff = tuple(args[i] for i in argnums)
        (_, (y, aux)), grads = jax.value_and_grad(loss, has_aux=True, allow_int=True)(diff, r, args)
        return y, aux, grads

    return jax.jit(run) if jit else run


def moe_value_and_grads(
    f, *args, argnums=None, cotangent=None, has_aux=False, poison=True, jit=True, seed=0, names=None
):
    """f(*args) and the gradients of sum(f(*args) * cotangent) w.r.t. args[argnums], a `MoeRun`.

    args may be arrays or pytrees (e.g. an nnx.State of parameters), y an array or a pytree.
    argnums: default every argument with a floating-point leaf (for moe_ffn's arguments: x,
    expert_weights, w_gate, w_up, w_down); () evaluates y only. Integer leaves of a
    differentiated pytree get float0 gradients, which are not compared. cotangent: default
    float32 N(0, 1) from `seed`. has_aux: f returns (y, aux). poison: run under
    `relaymoe_jax.poison_unwritten()` (padding rows are NaN, so reading one shows). jit: jit the
    whole computation (else op by op; f itself may be jitted or not either way). names: the
    grads' keys (default: f's parameter names).
    """
    argnums = argnums_of(args, argnums)
    if cotangent is None and argnums:
        cotangent = random_cotangent(f, args, has_aux, seed)
    names = names or arg_names([f], len(args))
    try:
        run = _value_and_grads_fn(f, argnums, has_aux, jit, poison)
    except TypeError:  # an unhashable f: no cache
        run = _value_and_grads_fn.__wrapped__(f, argnums, has_aux, jit, poison)
    with poison_unwritten() if poison else contextlib.nullcontext():
        y, aux, grads = run(cotangent, *args)
    return MoeRun(y, {names[i]: g for i, g in zip(argnums, grads)}, aux)
