"""`moe_ffn`: the swap-in expert block. Validation, mesh plumbing and the dispatcher choice."""

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.dispatch import plan
from relaymoe_jax.dispatch.alltoall import AllToAllConfig, alltoall_moe
from relaymoe_jax.dispatch.mode import routing_volumes
from relaymoe_jax.dispatch.reference import reference_moe
from relaymoe_jax.dispatch.ring import RingConfig, ring_moe

log = logging.getLogger("relaymoe_jax")

DISPATCHERS = ("ring", "alltoall", "reference")
ROUTINGS = ("expert", "token", "auto")


def moe_ffn(x, expert_ids, expert_weights, w_gate, w_up, w_down, *, mesh, expert_axis="expert",
            expert_tensor_axis=None, dispatcher="ring", routing="auto", capacity_factor=None,
            chunk_size=None, token_axes=None, gmm_impl="auto", return_stats=False):
    """Routed SwiGLU experts: y[t] = sum_j expert_weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]).

    Args:
      x: [tokens, hidden] float32 or bfloat16, sharded over `token_axes` on tokens.
      expert_ids: [tokens, top_k] int, values in [0, num_experts). Ids outside that range are
        ignored: the pair contributes nothing and gets no gradient (counted in stats).
      expert_weights: [tokens, top_k] float, the router's (already normalised) weights.
      w_gate, w_up: [num_experts, hidden, ffn]; w_down: [num_experts, ffn, hidden], sharded over
        `expert_axis` on experts and over `expert_tensor_axis` on ffn (replicated over the other
        mesh axes inside the op).
      mesh: a `jax.sharding.Mesh` that has `expert_axis`.
      expert_axis: the mesh axis the ring runs over, or a tuple of axes used together (parallel
        folding: e.g. ("data", "context") lets the MoE see an attention mesh as one expert axis).
      expert_tensor_axis: optional mesh axis splitting each expert's ffn dimension (ETP). Tokens
        sharded over it are all-gathered before the experts and the down projection's partial
        sums are reduce-scattered back; tokens replicated over it get a psum instead.
      dispatcher: "ring" (RelayMoE), "alltoall" (Megatron-style baseline) or "reference" (dense).
      routing: ring only. "expert" (weights travel), "token" (tokens travel) or "auto": the mode
        with the lower per-hop volume of paper Table 2 (see `routing_volumes`), logged at INFO.
      capacity_factor: alltoall only. None = dropless; c > 0 = at most ceil(c*T*k/E) pairs per
        expert from each device; the rest are dropped and counted in stats["dropped_pairs"].
      chunk_size: ring only: pairs per chunk (default: the balanced share ceil(T_local*k / EP)).
      token_axes: mesh axes the token dimension is sharded over; must include the expert axes.
        Default: every axis of the mesh.
      gmm_impl: grouped-matmul implementation, see `relaymoe_jax.kernels.gmm`.
      return_stats: also return {"dropped_pairs", "ignored_pairs"} (int32 scalars).

    Returns y [tokens, hidden] in x.dtype, or (y, stats) with return_stats=True.
    Differentiable in x, expert_weights, w_gate, w_up and w_down; works under jax.jit.
    """
    spec = _validate(x, expert_ids, expert_weights, w_gate, w_up, w_down, mesh=mesh,
                     expert_axis=expert_axis, expert_tensor_axis=expert_tensor_axis,
                     dispatcher=dispatcher, routing=routing, capacity_factor=capacity_factor,
                     chunk_size=chunk_size, token_axes=token_axes)
    num_experts = w_gate.shape[0]
    stats = {
        "dropped_pairs": jnp.int32(0),
        "ignored_pairs": jnp.sum((expert_ids < 0) | (expert_ids >= num_experts)).astype(jnp.int32),
    }
    if dispatcher == "ring" and routing == "auto":
        log.info("moe_ffn(routing='auto'): %s", spec["volumes"].explain())
    tok_axes, ea, etp = spec["token_axes"], spec["expert_axes"], expert_tensor_axis
    tok = P(tok_axes)
    if dispatcher == "reference":   # every device computes everything, then keeps its tokens
        args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
        y = _place(reference_moe(*(_place(a, mesh, P()) for a in args)), mesh, tok)
        return (y, stats) if return_stats else y

    w_in, w_out = P(ea, None, etp), P(ea, etp, None)
    specs = (tok, tok, tok, w_in, w_in, w_out)
    args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
    args = tuple(_place(a, mesh, s) for a, s in zip(args, specs))
    gather = etp is not None and etp in tok_axes
    poison = plan.poisoning()
    if dispatcher == "ring":
        routing = spec["routing"]
        cfg = RingConfig(axis=ea, num_experts=num_experts, chunk=spec["chunk"],
                         reduce_axes=tuple(a for a in tok_axes if a not in (*ea, etp)),
                         routing=routing, gmm_impl=gmm_impl, poison=poison)
        run = lambda *a: (ring_moe(cfg, *a), jnp.int32(0))
    else:
        if capacity_factor is not None and not return_stats:
            log.warning("moe_ffn(dispatcher='alltoall', capacity_factor=%s) may drop pairs; "
                        "pass return_stats=True to get stats['dropped_pairs']", capacity_factor)
        cfg = AllToAllConfig(axis=ea, num_experts=num_experts,
                             capacity_factor=capacity_factor, stat_axes=tok_axes,
                             gmm_impl=gmm_impl, poison=poison)
        etp_size = mesh.shape[etp] if gather else 1   # gathered: each ETP rank counted the same
        run = lambda *a: (lambda y, d: (y, d // etp_size))(*alltoall_moe(cfg, *a))
    body = functools.partial(_etp_body, run, etp, gather)
    y, dropped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()))(*args)
    if dispatcher == "alltoall":
        stats["dropped_pairs"] = dropped
    return (y, stats) if return_stats else y


def _etp_body(run, etp, gather, x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
    """Per device: ETP plumbing around a dispatcher whose experts hold an ffn slice.

    Each ETP rank computes every pair of its token group with its slice of ffn, so the outputs are
    partial sums. Tokens sharded over the ETP axis are all-gathered first and the partials
    reduce-scattered back: each rank keeps only its [T/ETP, H] share of the result (a psum would
    leave the full [T, H] sum on every rank), and the transposes are the same pair (all-gather of
    dy, reduce-scatter of dx). Tokens replicated over the ETP axis get a psum.
    """
    if etp is not None:
        if gather:
            x_th, ids_tk, wts_tk = (lax.all_gather(a, etp, axis=0, tiled=True)
                                    for a in (x_th, ids_tk, wts_tk))
        else:   # mark them varying over ETP: the transpose sums the partial dx / d weights
            x_th, wts_tk = (plan.vary_like(a, w_gate) for a in (x_th, wts_tk))
    y_th, dropped = run(x_th, ids_tk, wts_tk, w_gate, w_up, w_down)
    if etp is not None:
        y_th = (lax.psum_scatter(y_th, etp, scatter_dimension=0, tiled=True) if gather
                else lax.psum(y_th, etp))
    return y_th, dropped


def _place(a, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    if all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def _validate(x, ids, wts, w_gate, w_up, w_down, *, mesh, expert_axis, expert_tensor_axis,
              dispatcher, routing, capacity_factor, chunk_size, token_axes):
    """Check everything static before tracing; resolve axes, chunk size and routing mode."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}: expected one of {DISPATCHERS}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    if routing != "auto" and dispatcher != "ring":
        raise ValueError(f"routing={routing!r} applies to dispatcher='ring' only (got "
                         f"{dispatcher!r}); leave it at 'auto'")
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    ea = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
    if not ea or len(set(ea)) != len(ea) or any(a not in names for a in ea):
        raise ValueError(f"expert_axis={expert_axis!r}: expected an axis of the mesh, or a tuple "
                         f"of distinct axes (mesh axes: {names})")
    etp = expert_tensor_axis
    if etp is not None and (etp not in names or etp in ea):
        raise ValueError(f"expert_tensor_axis={etp!r}: expected None or a mesh axis other than "
                         f"the expert axes {ea} (mesh axes: {names})")
    token_axes = names if token_axes is None else tuple(token_axes)
    for a in token_axes:
        if a not in names:
            raise ValueError(f"token_axes: {a!r} is not an axis of the mesh {names}")
    if any(a not in token_axes for a in ea):
        raise ValueError(f"token_axes={token_axes} must include every expert axis {ea}: the "
                         "ring (and the all-to-all) reach the experts through them")

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
    n = math.prod(mesh.shape[a] for a in ea)
    if e % n:
        raise ValueError(f"num_experts={e} is not divisible by the size {n} of expert_axis "
                         f"{expert_axis!r}")
    etp_size = 1 if etp is None else mesh.shape[etp]
    if f % etp_size:
        raise ValueError(f"w_gate: ffn size {f} is not divisible by the size {etp_size} of "
                         f"expert_tensor_axis {etp!r}")
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
    # Tokens one ring member works on: its shard, gathered over the ETP axis if sharded there.
    t_ring = t // shards * (etp_size if etp in token_axes else 1)
    chunk = int(chunk_size) if chunk_size is not None else max(1, -(-t_ring * k // n))
    vol = routing_volumes(experts=e, top_k=k, hidden=h, ffn=f, ep=n, etp=etp_size,
                          tokens_per_device=t_ring, act_dtype=x.dtype, weight_dtype=w_gate.dtype,
                          router_dtype=wts.dtype)
    return {"token_axes": token_axes, "expert_axes": ea, "chunk": chunk, "volumes": vol,
            "routing": vol.choice if routing == "auto" else routing}


def routing_plan(x, expert_ids, expert_weights, w_gate, w_up, w_down, *, mesh,
                 expert_axis="expert", expert_tensor_axis=None, token_axes=None):
    """The per-hop volumes of both routing modes for this exact `moe_ffn` call, and the mode
    `routing="auto"` picks (a `RoutingVolumes`; see `relaymoe_jax.routing_volumes`).

    Tokens per device are those one ring member works on: x's token count over the token shards,
    times the expert-tensor axis size when tokens are sharded over it (they are gathered there).
    Only shapes and dtypes are read: arrays, `jax.ShapeDtypeStruct`s or tracers all work.
    """
    return _validate(x, expert_ids, expert_weights, w_gate, w_up, w_down, mesh=mesh,
                     expert_axis=expert_axis, expert_tensor_axis=expert_tensor_axis,
                     dispatcher="ring", routing="auto", capacity_factor=None, chunk_size=None,
                     token_axes=token_axes)["volumes"]
