"""The negative control `assert_parity_detects`: the parity assertion fails for a perturbed
routing (one (token, expert) pair misweighted, dropped or duplicated), so it cannot pass
vacuously."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from relaymoe_jax.testing.grads import (
    arg_names,
    argnums_of,
    describe,
    moe_value_and_grads,
    random_cotangent,
    same_y_shapes,
)
from relaymoe_jax.testing.parity import assert_runs_close, default_rtol, require_chex_asserts


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
    """numpy `a` on `ref`'s sharding when ref is placed on a mesh, so sharded calls stay sharded
    (an unplaced ref leaves `a` unplaced too: committing it to ref's one device would clash with
    a program on the mesh's devices)."""
    sharding = getattr(ref, "sharding", None)
    return jax.device_put(a, sharding) if isinstance(sharding, NamedSharding) else a


def _routing_args(args, num_experts):
    """(expert_ids, expert_weights, num_experts) of moe_ffn-style args, or a ValueError saying
    what the control needs."""
    ids, wts = (args[1], args[2]) if len(args) >= 3 else (None, None)
    ok = all(hasattr(a, "shape") and hasattr(a, "dtype") for a in (ids, wts))
    ok = ok and jnp.issubdtype(ids.dtype, jnp.integer) and tuple(ids.shape) == tuple(wts.shape)
    if not ok:
        got = ", ".join(map(describe, args))
        raise ValueError(
            "assert_parity_detects perturbs the routing it is given, so f and g must take "
            "moe_ffn's positional arguments (x, expert_ids, expert_weights, w_gate, w_up, "
            f"w_down, ...): args[1] the integer expert_ids [..., top_k] and args[2] the "
            f"expert_weights of the same shape; got {len(args)} arguments ({got}). A layer that "
            "routes inside (f(x, params), the NNX style) cannot be perturbed from outside: run "
            "the control on its expert step (a function of x, ids, weights and the expert "
            "weights), and assert_moe_parity on the whole layer"
        )
    if num_experts is None:
        w_gate = args[3] if len(args) >= 4 else None
        if getattr(w_gate, "ndim", 0) != 3:
            raise ValueError(
                "assert_parity_detects: num_experts= is needed when args[3] is not w_gate "
                f"[E, H, F] (got {describe(w_gate)})"
            )
        num_experts = w_gate.shape[0]
    return ids, wts, num_experts


def assert_parity_detects(f, g, *args, num_experts=None, **parity_kw):
    """Negative control for `assert_moe_parity`: asserts it passes for (f, g) and fails for f with
    one (token, expert) pair misweighted (x1.5), dropped (id -1) or duplicated (another slot of
    the token takes the same expert; skipped when top_k == 1).

    f and g take moe_ffn's positional arguments (x, expert_ids, expert_weights, w_gate, w_up,
    w_down, ...), since the routing they are given is what is perturbed (a ValueError says so for
    other arguments, e.g. an NNX layer's f(x, params)); num_experts defaults to w_gate.shape[0].
    parity_kw go to `assert_moe_parity` (argnums, cotangent, rtol, atol, dtype, has_aux, poison,
    jit, seed). Usage:

        assert_parity_detects(theirs, ours, *inp.args)

    It cannot pass vacuously: if f ignores routing it fails, either because f does not match g
    or, when neither uses the routing, because no perturbation is detected. One compile serves
    all perturbations (they are arguments of one wrapper around f).
    Raises AssertionError; returns {perturbation: the AssertionError assert_moe_parity raised}.
    """
    require_chex_asserts()
    ids, wts, num_experts = _routing_args(args, num_experts)
    pkw = dict(parity_kw)
    argnums = argnums_of(args, pkw.pop("argnums", None))
    rtol = pkw.pop("rtol", None)
    rtol = default_rtol(args, pkw.pop("dtype", None)) if rtol is None else rtol
    atol = pkw.pop("atol", 0.0)
    has_aux, seed = pkw.get("has_aux", False), pkw.pop("seed", 0)
    y = same_y_shapes(f, g, args, has_aux, "assert_parity_detects")
    if pkw.get("cotangent") is None and argnums:
        pkw["cotangent"] = random_cotangent(g, args, has_aux, seed, y=y)
    names = arg_names([f, g], len(args))
    want = moe_value_and_grads(g, *args, argnums=argnums, names=names, **pkw)
    caught = {}
    for kind, (what, scale, mask, new_ids) in _perturbations(ids, wts, num_experts).items():
        extra = (
            _like(scale.astype(jnp.result_type(wts)), wts),
            _like(mask, ids),
            _like(new_ids.astype(jnp.result_type(ids)), ids),
        )
        got = moe_value_and_grads(_perturbed(f), *args, *extra, argnums=argnums, names=names, **pkw)
        try:
            assert_runs_close(got, want, rtol, atol)
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
