"""`moe_ffn`: the swap-in expert block. Mesh plumbing, expert tensor parallelism, the dispatcher."""

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.dispatch import plan
from relaymoe_jax.dispatch.alltoall import AllToAllConfig, alltoall_moe
from relaymoe_jax.dispatch.reference import reference_moe
from relaymoe_jax.dispatch.ring import RingConfig, ring_moe
from relaymoe_jax.kernels.gmm import resolve_impl
from relaymoe_jax.validate import validate

log = logging.getLogger("relaymoe_jax")



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
        that sends fewer bytes per hop (paper Table 2 plus the accumulators that travel; see
        `routing_plan`), logged at INFO on the "relaymoe_jax" logger.
      capacity_factor: alltoall only. None = dropless; c > 0 = at most ceil(c*T*k/E) pairs per
        expert from each device; the rest are dropped and counted in stats["dropped_pairs"].
      chunk_size: ring only: pairs per chunk (default: the balanced share ceil(T_local*k / EP)).
      token_axes: mesh axes the token dimension is sharded over; must include the expert axes.
        Default: every axis of the mesh.
      gmm_impl: grouped matmul, see `relaymoe_jax.kernels.gmm`: "auto" (the Pallas kernel when
        `mesh`'s devices are GPUs, abstract ones included; the blocked XLA one elsewhere),
        "xla", "ragged_dot", "pallas", or "pallas-interpret" (the Pallas kernel in its CPU
        interpreter: slow, for tests).
      return_stats: also return {"dropped_pairs", "ignored_pairs"} (int32 scalars).

    Returns y [tokens, hidden] in x.dtype, or (y, stats) with return_stats=True.
    Differentiable in x, expert_weights, w_gate, w_up and w_down; works under jax.jit.
    """
    spec = validate(x, expert_ids, expert_weights, w_gate, w_up, w_down, mesh=mesh,
                     expert_axis=expert_axis, expert_tensor_axis=expert_tensor_axis,
                     dispatcher=dispatcher, routing=routing, capacity_factor=capacity_factor,
                     chunk_size=chunk_size, token_axes=token_axes, gmm_impl=gmm_impl)
    num_experts = w_gate.shape[0]
    if gmm_impl == "auto":   # from the mesh's devices: an abstract GPU mesh gets the kernel
        gmm_impl = resolve_impl("auto", mesh=mesh)
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
    # jax 0.12's Pallas interpreter fails under check_vma (a JAX limitation, see kernels/gmm).
    y, dropped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()),
                               check_vma=gmm_impl != "pallas-interpret")(*args)
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


def routing_plan(x, expert_ids, expert_weights, w_gate, w_up, w_down, *, mesh,
                 expert_axis="expert", expert_tensor_axis=None, token_axes=None):
    """The per-hop volumes of both routing modes for this exact `moe_ffn` call, and the mode
    `routing="auto"` picks (a `RoutingVolumes`; see `relaymoe_jax.routing_volumes`).

    Tokens per device are those one ring member works on: x's token count over the token shards,
    times the expert-tensor axis size when tokens are sharded over it (they are gathered there).
    Only shapes and dtypes are read: arrays, `jax.ShapeDtypeStruct`s or tracers all work.
    """
    return validate(x, expert_ids, expert_weights, w_gate, w_up, w_down, mesh=mesh,
                     expert_axis=expert_axis, expert_tensor_axis=expert_tensor_axis,
                     dispatcher="ring", routing="auto", capacity_factor=None, chunk_size=None,
                     token_axes=token_axes)["volumes"]
