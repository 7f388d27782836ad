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


class _Shape:
    """An output's shape and dtype, printed as jax prints a type (float32[64,16])."""

    def __init__(self, s):
        self.s = s

    def __repr__(self):
        return f"{self.s.dtype}[{','.join(map(str, self.s.shape))}]"


def describe(tree) -> str:
    """Arrays (or their `jax.eval_shape`) in one line: float32[64,16],
    (float32[64,16], {'dropped_pairs': int32[]}), ...; other leaves by their type."""
    shaped = lambda a: hasattr(a, "shape") and hasattr(a, "dtype")
    text = repr(jax.tree.map(lambda a: _Shape(a) if shaped(a) else _Type(a), tree))
    if len(text) > 200 or "\n" in text:  # a parameter State, say
        n = len(jax.tree.leaves(tree))
        return f"a {type(tree).__name__} of {n} leaves"
    return text


class _Type(_Shape):
    def __repr__(self):
        return type(self.s).__name__


def y_shapes(fn, args, has_aux, name="f", who="moe_value_and_grads"):
    """The shapes of fn's y (`jax.eval_shape`); with has_aux, fn must return (y, aux)."""
    out = jax.eval_shape(fn, *args)
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(
            f"{who}: has_aux=True, so {name} must return (y, aux), but it returns {describe(out)}"
        )
    return out[0] if has_aux else out


def _returns_pair(out) -> bool:
    return isinstance(out, (tuple, list)) and len(out) == 2 and hasattr(out[0], "shape")


def same_y_shapes(f, g, args, has_aux, who):
    """g's y shapes, after checking that f's y has the same structure and shapes (dtypes may
    differ: a bfloat16 f against a float32 g)."""
    yf = y_shapes(f, args, has_aux, "f", who)
    yg = y_shapes(g, args, has_aux, "g", who)
    shapes = lambda t: jax.tree.map(lambda s: tuple(s.shape), t)
    same = jax.tree.structure(yf) == jax.tree.structure(yg) and shapes(yf) == shapes(yg)
    if same:
        return yg
    hint = "; both must return y with the same structure and shapes"
    if not has_aux and (_returns_pair(yf) or _returns_pair(yg)):
        hint += (
            ". If one returns (y, aux) (e.g. moe_ffn with return_stats=True), make both return "
            "(y, aux) and pass has_aux=True (aux is returned, not compared), e.g. "
            "lambda *a: (g(*a), None); or drop the aux"
        )
    raise ValueError(f"{who}: f returns {describe(yf)} but g returns {describe(yg)}{hint}")


def random_cotangent(fn, args, has_aux, seed, y=None):
    """float32 N(0, 1) shaped like fn's y (a pytree of them for a pytree y; `y`: its shapes when
    known); replicated on the mesh of the first sharded argument (a jit over explicitly sharded
    arrays needs every argument on that mesh)."""
    out = y_shapes(fn, args, has_aux) if y is None else y
    rng = np.random.default_rng(seed)
    r = jax.tree.map(lambda y: rng.standard_normal(y.shape).astype(np.float32), out)
    for a in jax.tree.leaves(args):
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return jax.device_put(r, NamedSharding(sharding.mesh, P()))
    return jax.tree.map(jnp.asarray, r)


@functools.lru_cache(maxsize=64)
def value_and_grads_fn(fn, argnums, has_aux, jit, poison):
    """(r, *args) -> (y, aux, grads of sum(y * r) w.r.t. args[argnums]): the function
    `moe_value_and_grads` runs, cached so that calls with the same fn reuse one jit (poison is
    read at trace time, so it is part of the key); public so that a test can read the program a
    parity check already compiled (`run.lower(...).compile()` then costs nothing)."""
    del poison

    def loss(diff, r, args):
        full = list(args)
        for i, a in zip(argnums, diff):
            full[i] = a
        out = fn(*full)
        y, aux = out if has_aux else (out, None)
        if jax.tree.structure(y) != jax.tree.structure(r):
            raise ValueError(
                f"moe_value_and_grads: the function returns {describe(y)}, but the cotangent "
                f"is {describe(r)}: give a cotangent shaped like y (has_aux=True when the "
                "function returns (y, aux))"
            )
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
        run = value_and_grads_fn(f, argnums, has_aux, jit, poison)
    except TypeError:  # an unhashable f: no cache
        run = value_and_grads_fn.__wrapped__(f, argnums, has_aux, jit, poison)
    with poison_unwritten() if poison else contextlib.nullcontext():
        y, aux, grads = run(cotangent, *args)
    return MoeRun(y, {names[i]: g for i, g in zip(argnums, grads)}, aux)
