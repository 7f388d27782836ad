"""Parity testing for MoE layers on emulated multi-device CPU, built on chex.

For users who swap `relaymoe_jax.moe_ffn` into their own JAX MoE model and want to prove that
their expert block and ours compute the same thing, values and gradients:

    from relaymoe_jax import testing
    testing.use_cpu_devices(8)                # first, before jax's first operation
    ids_tk = testing.routing_cases(64, 4, 16, num_partitions=8)["ragged"]
    inp = testing.moe_inputs(ids_tk, num_experts=16)
    testing.assert_moe_parity(theirs, ours, *inp.args)      # values and all 5 gradients
    testing.assert_parity_detects(theirs, ours, *inp.args)  # ...and the check can fail

`theirs` and `ours` take `moe_ffn`'s positional arguments (x, expert_ids, expert_weights,
w_gate, w_up, w_down) and return y [tokens, hidden]; bind the rest with functools.partial, e.g.
`ours = functools.partial(relaymoe_jax.moe_ffn, mesh=mesh)`. Place the arguments on the mesh
first (`jax.device_put`) to test sharded inputs.
"""

import contextlib
import functools
import inspect
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.devices import use_cpu_devices
from relaymoe_jax.dispatch.plan import poison_unwritten

__all__ = [
    "CASES",
    "DEFAULT_RTOL",
    "MoeInputs",
    "MoeRun",
    "assert_moe_parity",
    "assert_parity_detects",
    "moe_inputs",
    "moe_value_and_grads",
    "routing_case",
    "routing_cases",
    "use_cpu_devices",
]

# ---------------------------------------------------------------------------------------------
# routing cases

# Every case is an int32 [num_tokens, top_k] array. Partition p (ring position p) holds experts
# [p * E_l, (p + 1) * E_l), E_l = num_experts / num_partitions.
CASES = {
    "uniform": "k distinct ids per token, uniformly at random",
    "one_expert": "slot 0 of every token is expert E // 3; the other slots distinct, random",
    "one_partition": "every pair in partition (P - 1) // 2, k distinct ids per token "
    "(only when k <= E_l)",
    "all_experts": "k == E: every token a random permutation of all experts (only when k == E)",
    "ragged": "expert 0 and, when P > 1, the whole last partition get no pair; the others are "
    "drawn with probabilities halving from one to the next (shuffled order), k distinct "
    "per token (only when k <= the experts left)",
    "ties": "repeated ids within a token (ties in the pairs' sort key): slot 1 repeats slot 0, "
    "and every third token sends all k slots to expert min(E // 2 + 1, E - 1) "
    "(only when k >= 2)",
    "out_of_range": "uniform, then up to three pairs (tokens ~T/6, T/2, 5T/6) get the ids -1, E "
    "and 2**31 - 1, which every dispatcher ignores",
}


def _not_applicable(name, num_tokens, top_k, num_experts, num_partitions):
    """Why case `name` cannot be built for this shape, or None."""
    e_local = num_experts // num_partitions
    left = num_experts - 1 - (e_local if num_partitions > 1 else 0)
    return {
        "one_partition": top_k > e_local and f"top_k={top_k} > experts per partition {e_local}",
        "all_experts": top_k != num_experts and f"top_k={top_k} != num_experts={num_experts}",
        "ragged": top_k > left and f"top_k={top_k} > the {left} experts that get pairs",
        "ties": top_k < 2 and "top_k=1 has no second slot to repeat",
    }.get(name) or None


def _distinct(rng, num_tokens, top_k, experts):
    """[T, k]: k distinct entries of `experts` per token, uniformly at random."""
    experts = np.asarray(experts)
    order = np.argsort(rng.random((num_tokens, len(experts))), axis=1)
    return experts[order[:, :top_k]]


def routing_case(name, num_tokens, top_k, num_experts, num_partitions, seed=0):
    """One adversarial routing, int32 expert_ids [num_tokens, top_k]; see `CASES` for each.

    num_partitions is the ring size (expert-parallel degree); seed an int or a numpy Generator.
    Raises ValueError when the case does not apply to the shape (e.g. "all_experts" needs
    top_k == num_experts) or the shape is invalid.
    """
    t, k, e, n = num_tokens, top_k, num_experts, num_partitions
    if name not in CASES:
        raise ValueError(f"routing_case({name!r}): unknown case; one of {list(CASES)}")
    if not (t >= 1 and 1 <= k <= e and n >= 1 and e % n == 0):
        raise ValueError(
            f"routing_case: need tokens >= 1, 1 <= top_k <= num_experts and "
            f"num_experts % num_partitions == 0; got T={t} k={k} E={e} P={n}"
        )
    why = _not_applicable(name, t, k, e, n)
    if why:
        raise ValueError(f"routing_case({name!r}) does not apply: {why}")
    rng = np.random.default_rng(seed)
    e_local = e // n
    if name in ("uniform", "all_experts", "out_of_range"):
        ids = _distinct(rng, t, k, np.arange(e))
        if name == "out_of_range":
            for i, bad in enumerate([-1, e, 2**31 - 1][:t]):
                ids[(2 * i + 1) * t // 6, i % k] = bad
    elif name == "one_expert":
        hot = e // 3
        ids = np.concatenate(
            [np.full((t, 1), hot), _distinct(rng, t, k - 1, np.delete(np.arange(e), hot))], axis=1
        )
    elif name == "one_partition":
        p = (n - 1) // 2
        ids = _distinct(rng, t, k, np.arange(p * e_local, (p + 1) * e_local))
    elif name == "ragged":
        empty = {0, *(range(e - e_local, e) if n > 1 else ())}
        busy = rng.permutation([i for i in range(e) if i not in empty])
        prob = 0.5 ** np.arange(len(busy))
        ids = np.stack([rng.choice(busy, k, replace=False, p=prob / prob.sum()) for _ in range(t)])
    else:  # ties
        ids = _distinct(rng, t, k, np.arange(e))
        ids[:, 1] = ids[:, 0]
        ids[::3] = min(e // 2 + 1, e - 1)
    return ids.astype(np.int32)


def routing_cases(num_tokens, top_k, num_experts, num_partitions, seed=0):
    """{case name: int32 expert_ids [num_tokens, top_k]} for every case in `CASES` that applies
    to this shape (the others are left out; `routing_case` says why)."""
    return {
        name: routing_case(name, num_tokens, top_k, num_experts, num_partitions, seed)
        for name in CASES
        if not _not_applicable(name, num_tokens, top_k, num_experts, num_partitions)
    }


class MoeInputs(NamedTuple):
    """moe_ffn's six positional arguments and a cotangent r for y (float32 [T, H])."""

    x: jax.Array
    expert_ids: jax.Array
    expert_weights: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    r: jax.Array

    @property
    def args(self):
        return tuple(self[:6])


def moe_inputs(
    ids_tk, num_experts, hidden=16, ffn=24, dtype=np.float32, seed=0, equal_weights=False
):
    """Random inputs for `ids_tk`: x ~ N(0, 1); router weights U(0.1, 1), not normalised, so a
    misweighted pair shows (equal_weights: all 1/k, weight ties); SwiGLU weights scaled by
    1/sqrt(fan-in); r ~ N(0, 1), the cotangent of y, so every output entry matters."""
    rng = np.random.default_rng(seed)
    t, k = np.shape(ids_tk)
    x_th = rng.standard_normal((t, hidden))
    wts_tk = np.full((t, k), 1 / k) if equal_weights else rng.uniform(0.1, 1.0, (t, k))
    w_gate_ehf, w_up_ehf = (
        rng.standard_normal((num_experts, hidden, ffn)) / np.sqrt(hidden) for _ in range(2)
    )
    w_down_efh = rng.standard_normal((num_experts, ffn, hidden)) / np.sqrt(ffn)
    r_th = rng.standard_normal((t, hidden))
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return MoeInputs(
        cast(x_th),
        jnp.asarray(ids_tk, jnp.int32),
        cast(wts_tk),
        cast(w_gate_ehf),
        cast(w_up_ehf),
        cast(w_down_efh),
        jnp.asarray(r_th, jnp.float32),
    )


# ---------------------------------------------------------------------------------------------
# values and gradients


class MoeRun(NamedTuple):
    """One function's output y, {argument name: gradient of sum(y * r)}, and its aux output."""

    y: jax.Array
    grads: dict
    aux: Any


def _inexact(a):
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _argnums(args, argnums):
    """argnums as a tuple; default: every argument (array or pytree) with a floating leaf."""
    if argnums is None:
        return tuple(i for i, a in enumerate(args) if any(map(_inexact, jax.tree.leaves(a))))
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _arg_names(fns, nargs):
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


def _random_cotangent(fn, args, has_aux, seed):
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
    argnums = _argnums(args, argnums)
    if cotangent is None and argnums:
        cotangent = _random_cotangent(f, args, has_aux, seed)
    names = names or _arg_names([f], len(args))
    try:
        run = _value_and_grads_fn(f, argnums, has_aux, jit, poison)
    except TypeError:  # an unhashable f: no cache
        run = _value_and_grads_fn.__wrapped__(f, argnums, has_aux, jit, poison)
    with poison_unwritten() if poison else contextlib.nullcontext():
        y, aux, grads = run(cotangent, *args)
    return MoeRun(y, {names[i]: g for i, g in zip(argnums, grads)}, aux)


# ---------------------------------------------------------------------------------------------
# the parity assertion

# max |got - want| allowed per array, relative to the reference array's max |want|.
DEFAULT_RTOL = {"float64": 1e-9, "float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}


def _default_rtol(args, dtype):
    """DEFAULT_RTOL of `dtype`, else of the least precise floating-point argument."""
    dtypes = (
        [jnp.dtype(dtype)]
        if dtype is not None
        else [jnp.result_type(a) for a in jax.tree.leaves(args) if _inexact(a)]
    )
    return max((DEFAULT_RTOL.get(jnp.dtype(d).name, 1e-5) for d in dtypes), default=1e-5)


def _require_chex_asserts():
    try:
        chex.assert_trees_all_close(np.zeros(1), np.ones(1))
    except AssertionError:
        return
    raise RuntimeError(
        "chex assertions are disabled (chex.disable_asserts()), so the parity "
        "check would pass whatever the functions compute; chex.enable_asserts()"
    )


def _assert_runs_close(got, want, rtol, atol):
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
    is returned, not compared. poison: run both under `relaymoe_jax.poison_unwritten()`.
    jit: jit each value-and-grad computation (cached per function object).

    Raises AssertionError naming the output or gradient that differed and its max error.
    Returns (got, want), two `MoeRun`s, for further checks (e.g. on aux).
    """
    _require_chex_asserts()
    argnums = _argnums(args, argnums)
    if cotangent is None and argnums:
        cotangent = _random_cotangent(g, args, has_aux, seed)
    kw = dict(
        argnums=argnums,
        cotangent=cotangent,
        has_aux=has_aux,
        poison=poison,
        jit=jit,
        names=_arg_names([f, g], len(args)),
    )
    want = moe_value_and_grads(g, *args, **kw)
    got = moe_value_and_grads(f, *args, **kw)
    rtol = _default_rtol(args, dtype) if rtol is None else rtol
    _assert_runs_close(got, want, rtol, atol)
    return got, want


# ---------------------------------------------------------------------------------------------
# the negative control


@functools.lru_cache(maxsize=64)
def _perturbed(f):
    """f with three extra trailing arguments that change its routing:
    f(x, where(id_mask, new_ids, ids), weights * weight_scale, *rest)."""

    def bad(x, ids, wts, *rest_and_perturbation):
        *rest, scale_tk, mask_tk, new_ids_tk = rest_and_perturbation
        return f(x, jnp.where(mask_tk, new_ids_tk, ids), wts * scale_tk, *rest)

    return bad


def _perturbations(ids_tk, wts_tk, num_experts):
    """{name: (description, weight scale [T, k], id mask [T, k], new ids [T, k])}: the identity
    ("none") and one misweighted, dropped and duplicated pair, on the valid pair with the largest
    |weight| (so the change is as visible as any)."""
    ids_tk, wts_tk = np.asarray(ids_tk), np.asarray(wts_tk, np.float64)
    t, k = ids_tk.shape
    valid = (ids_tk >= 0) & (ids_tk < num_experts)
    if not valid.any():
        raise ValueError("assert_parity_detects: no valid (token, expert) pair to perturb")
    ones, no = np.ones((t, k), np.float32), np.zeros((t, k), bool)
    order = np.argsort(np.where(valid, -np.abs(wts_tk), np.inf), axis=None, kind="stable")
    tok, slot = np.unravel_index(order[0], (t, k))
    e = int(ids_tk[tok, slot])
    scale = ones.copy()
    scale[tok, slot] = 1.5
    drop = no.copy()
    drop[tok, slot] = True
    out = {
        "none": ("nothing", ones, no, ids_tk),
        "misweight": (
            f"pair (token {tok}, slot {slot}, expert {e}) weighted x1.5",
            scale,
            no,
            ids_tk,
        ),
        "drop": (
            f"pair (token {tok}, slot {slot}, expert {e}) dropped (id -1)",
            ones,
            drop,
            np.full_like(ids_tk, -1),
        ),
    }
    # duplicate: another slot of the same token takes the pair's expert (an ignored slot first,
    # so the pair is simply added twice; else the slot's own pair is replaced).
    for i in order[: int(valid.sum())]:
        tok, slot = np.unravel_index(i, (t, k))
        others = [j for j in range(k) if ids_tk[tok, j] != ids_tk[tok, slot]]
        if others:
            j = min(others, key=lambda j: (bool(valid[tok, j]), j))
            dup = no.copy()
            dup[tok, j] = True
            e = int(ids_tk[tok, slot])
            out["duplicate"] = (
                f"pair (token {tok}, expert {e}) duplicated into slot {j} "
                f"(was id {ids_tk[tok, j]})",
                ones,
                dup,
                np.full_like(ids_tk, e),
            )
            break
    return out


def _like(a, ref):
    """numpy `a` on `ref`'s sharding when ref is a jax array, so sharded calls stay sharded."""
    sharding = getattr(ref, "sharding", None)
    return jax.device_put(a, sharding) if isinstance(ref, jax.Array) else a


def assert_parity_detects(f, g, *args, num_experts=None, **parity_kw):
    """Negative control for `assert_moe_parity`: asserts it passes for (f, g) and fails for f with
    one (token, expert) pair misweighted (x1.5), dropped (id -1) or duplicated (another slot of
    the token takes the same expert; skipped when top_k == 1).

    f and g take moe_ffn's positional arguments (x, expert_ids, expert_weights, w_gate, w_up,
    w_down); num_experts defaults to w_gate.shape[0]. parity_kw go to `assert_moe_parity`
    (argnums, cotangent, rtol, atol, dtype, has_aux, poison, jit, seed). Usage:

        assert_parity_detects(theirs, ours, *inp.args)

    It cannot pass vacuously: if f ignores routing it fails, either because f does not match g
    or, when neither uses the routing, because no perturbation is detected. One compile serves
    all perturbations (they are arguments of one wrapper around f).
    Raises AssertionError; returns {perturbation: the AssertionError assert_moe_parity raised}.
    """
    _require_chex_asserts()
    num_experts = args[3].shape[0] if num_experts is None else num_experts
    pkw = dict(parity_kw)
    argnums = _argnums(args, pkw.pop("argnums", None))
    rtol = pkw.pop("rtol", None)
    rtol = _default_rtol(args, pkw.pop("dtype", None)) if rtol is None else rtol
    atol = pkw.pop("atol", 0.0)
    has_aux, seed = pkw.get("has_aux", False), pkw.pop("seed", 0)
    if pkw.get("cotangent") is None and argnums:
        pkw["cotangent"] = _random_cotangent(g, args, has_aux, seed)
    names = _arg_names([f, g], len(args))
    want = moe_value_and_grads(g, *args, argnums=argnums, names=names, **pkw)
    caught = {}
    for kind, (what, scale, mask, new_ids) in _perturbations(args[1], args[2], num_experts).items():
        extra = (
            _like(scale.astype(jnp.result_type(args[2])), args[2]),
            _like(mask, args[1]),
            _like(new_ids.astype(jnp.result_type(args[1])), args[1]),
        )
        got = moe_value_and_grads(_perturbed(f), *args, *extra, argnums=argnums, names=names, **pkw)
        try:
            _assert_runs_close(got, want, rtol, atol)
        except AssertionError as err:
            if kind == "none":
                raise AssertionError(
                    "assert_parity_detects: f and g do not match even "
                    f"unperturbed, so the control proves nothing: {err}"
                ) from err
            caught[kind] = err
            continue
        if kind != "none":
            raise AssertionError(f"assert_moe_parity did not detect a {kind}: {what}")
    return caught
