"""`moe_ffn`: the swap-in expert block. Validation, mesh plumbing and the dispatcher choice."""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.dispatch import plan
from relaymoe_jax.dispatch.alltoall import AllToAllConfig, alltoall_moe
from relaymoe_jax.dispatch.reference import reference_moe
from relaymoe_jax.dispatch.ring import RingConfig, ring_expert_routing

log = logging.getLogger("relaymoe_jax")

DISPATCHERS = ("ring", "alltoall", "reference")
ROUTINGS = ("expert", "token", "auto")
_NEXT_ISSUE = ("token" , "auto")


def moe_ffn(x, expert_ids, expert_weights, w_gate, w_up, w_down, *, mesh, expert_axis="expert",
            dispatcher="ring", routing="expert", capacity_factor=None, chunk_size=None,
            token_axes=None, gmm_impl="auto", return_stats=False):
    """Routed SwiGLU experts: y[t] = sum_j expert_weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]).

    Args:
      x: [tokens, hidden] float32 or bfloat16, sharded over `token_axes` on tokens.
      expert_ids: [tokens, top_k] int, values in [0, num_experts). Ids outside that range are
        ignored: the pair contributes nothing and gets no gradient (counted in stats).
      expert_weights: [tokens, top_k] float, the router's (already normalised) weights.
      w_gate, w_up: [num_experts, hidden, ffn]; w_down: [num_experts, ffn, hidden], sharded over
        `expert_axis` on experts (replicated over the other mesh axes inside the op).
      mesh: a `jax.sharding.Mesh` that has `expert_axis`.
      dispatcher: "ring" (RelayMoE), "alltoall" (Megatron-style baseline) or "reference" (dense).
      routing: "expert" (weights travel the ring). "token"/"auto" are not implemented yet.
      capacity_factor: alltoall only. None = dropless; c > 0 = at most ceil(c*T*k/E) pairs per
        expert from each device; the rest are dropped and counted in stats["dropped_pairs"].
      chunk_size: ring only: pairs per chunk (default: the balanced share ceil(T_local*k / EP)).
      token_axes: mesh axes the token dimension is sharded over; must include `expert_axis`.
        Default: every axis of the mesh.
      gmm_impl: grouped-matmul implementation, see `relaymoe_jax.kernels.gmm`.
      return_stats: also return {"dropped_pairs", "ignored_pairs"} (int32 scalars).

    Returns y [tokens, hidden] in x.dtype, or (y, stats) with return_stats=True.
    Differentiable in x, expert_weights, w_gate, w_up and w_down; works under jax.jit.
    """
    spec = _validate(x, expert_ids, expert_weights, w_gate, w_up, w_down, mesh=mesh,
                     expert_axis=expert_axis, dispatcher=dispatcher, routing=routing,
                     capacity_factor=capacity_factor, chunk_size=chunk_size,
                     token_axes=token_axes)
    num_experts = w_gate.shape[0]
    stats = {
        "dropped_pairs": jnp.int32(0),
        "ignored_pairs": jnp.sum((expert_ids < 0) | (expert_ids >= num_experts)).astype(jnp.int32),
    }
    tok_axes = spec["token_axes"]
    tok, wsp = P(tok_axes), P(expert_axis)
    if dispatcher == "reference":   # every device computes everything, then keeps its tokens
        args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
        y = _place(reference_moe(*(_place(a, mesh, P()) for a in args)), mesh, tok)
        return (y, stats) if return_stats else y

    args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
    args = tuple(_place(a, mesh, s) for a, s in zip(args, (tok, tok, tok, wsp, wsp, wsp)))
    others = tuple(a for a in tok_axes if a != expert_axis)
    poison = plan.poisoning()
    if dispatcher == "ring":
        cfg = RingConfig(axis=expert_axis, num_experts=num_experts, chunk=spec["chunk"],
                         reduce_axes=others, gmm_impl=gmm_impl, poison=poison)
        body = lambda *a: ring_expert_routing(cfg, *a)
        y = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wsp, wsp, wsp),
                          out_specs=tok)(*args)
    else:
        if capacity_factor is not None and not return_stats:
            log.warning("moe_ffn(dispatcher='alltoall', capacity_factor=%s) may drop pairs; "
                        "pass return_stats=True to get stats['dropped_pairs']", capacity_factor)
        cfg = AllToAllConfig(axis=expert_axis, num_experts=num_experts,
                             capacity_factor=capacity_factor, stat_axes=tok_axes,
                             gmm_impl=gmm_impl, poison=poison)
        body = lambda *a: alltoall_moe(cfg, *a)
        y, stats["dropped_pairs"] = jax.shard_map(
            body, mesh=mesh, in_specs=(tok, tok, tok, wsp, wsp, wsp), out_specs=(tok, P()))(*args)
    return (y, stats) if return_stats else y


def _place(a, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    if all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def _validate(x, ids, wts, w_gate, w_up, w_down, *, mesh, expert_axis, dispatcher, routing,
              capacity_factor, chunk_size, token_axes):
    """Check everything static before tracing; return the resolved token axes and chunk size."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}: expected one of {DISPATCHERS}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    if routing in _NEXT_ISSUE:
        raise NotImplementedError(f"routing={routing!r} is not implemented yet; use 'expert'")
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the mesh "
                         f"(mesh axes: {mesh.axis_names})")
    token_axes = tuple(mesh.axis_names) if token_axes is None else tuple(token_axes)
    for a in token_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"token_axes: {a!r} is not an axis of the mesh {mesh.axis_names}")
    if expert_axis not in token_axes:
        raise ValueError(f"token_axes={token_axes} must include expert_axis={expert_axis!r}")

    def shape(a, name, rank):
        s = getattr(a, "shape", None)
        if s is None or len(s) != rank:
            raise ValueError(f"{name}: expected a rank-{rank} array, got shape {s}")
        return s

    def floating(a, name):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {a.dtype}")

    t, h = shape(x, "x", 2)
    ti, k = shape(ids, "expert_ids", 2)
    tw, kw = shape(wts, "expert_weights", 2)
    e, hg, f = shape(w_gate, "w_gate", 3)
    floating(x, "x")
    floating(wts, "expert_weights")
    for a, name in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")):
        floating(a, name)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids: expected an integer dtype, got {ids.dtype}")
    if ti != t:
        raise ValueError(f"expert_ids: {ti} tokens, but x has {t} (x {x.shape}, ids {ids.shape})")
    if (tw, kw) != (t, k):
        raise ValueError(f"expert_weights: shape {wts.shape}, expected {(t, k)} like expert_ids")
    if hg != h:
        raise ValueError(f"w_gate: hidden size {hg} does not match x's {h} (w_gate {w_gate.shape})")
    if tuple(w_up.shape) != (e, h, f):
        raise ValueError(f"w_up: shape {w_up.shape}, expected {(e, h, f)} like w_gate")
    if tuple(w_down.shape) != (e, f, h):
        raise ValueError(f"w_down: shape {w_down.shape}, expected {(e, f, h)}")
    if k > e:
        raise ValueError(f"top_k={k} (expert_ids.shape[1]) exceeds num_experts={e}")
    n = mesh.shape[expert_axis]
    if e % n:
        raise ValueError(f"num_experts={e} is not divisible by the size {n} of expert_axis "
                         f"{expert_axis!r}")
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if t % shards:
        raise ValueError(f"x: {t} tokens are not divisible by the {shards} token shards over "
                         f"{token_axes}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, (int, np.integer)) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected an int >= 1 (or None)")
    if capacity_factor is not None:
        if dispatcher != "alltoall":
            raise ValueError(f"capacity_factor={capacity_factor!r} applies to "
                             f"dispatcher='alltoall' only (got {dispatcher!r}): the ring is "
                             "dropless by construction")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor!r}: expected > 0 or None")
    t_local = t // shards
    chunk = int(chunk_size) if chunk_size is not None else max(1, -(-t_local * k // n))
    return {"token_axes": token_axes, "chunk": chunk}
