"""The swap-in expert block: `moe_ffn` on global arrays, `moe_ffn_local` inside your shard_map.

`moe_ffn_local` is the per-device op: one device's shards in, its tokens' outputs out, run
inside the caller's `jax.shard_map` (the ring or the all-to-all, with the same custom VJP).
`moe_ffn` is a thin wrapper: it reads where x's tokens live (`layout.py`), puts the weights where
the op wants them, and runs `moe_ffn_local`'s body in a `shard_map` of its own.
"""

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import layout as lay
from relaymoe_jax import topology
from relaymoe_jax import validate as vd
from relaymoe_jax.dispatch import plan
from relaymoe_jax.dispatch.alltoall import AllToAllConfig, alltoall_moe
from relaymoe_jax.dispatch.reference import reference_moe
from relaymoe_jax.dispatch.ring import RingConfig, ring_moe
from relaymoe_jax.kernels.gmm import resolve_impl

log = logging.getLogger("relaymoe_jax")
MANUAL = jax.sharding.AxisType.Manual


def moe_ffn(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    mesh,
    expert_axis="expert",
    expert_tensor_axis=None,
    dispatcher="ring",
    routing="auto",
    ring="auto",
    capacity_factor=None,
    chunk_size=None,
    token_axes=None,
    gmm_impl="auto",
    out_sharding=None,
    return_stats=False,
):
    """Routed SwiGLU experts: y[t] = sum_j expert_weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]).

    Takes global arrays (call it under `jax.jit`, or eagerly); inside a `jax.shard_map` use
    `moe_ffn_local`.

    Args:
      x: [..., hidden] float32 or bfloat16: [tokens, hidden], [batch, seq, hidden], ... Its
        leading dimensions keep their sharding (each device flattens its own block; nothing
        moves); see `relaymoe_jax.layout` for how the op reads it. Any token count works: when the
        shards hold fewer tokens than the expert axes have devices, or do not divide, the op
        splits and pads internally, exactly.
      expert_ids: [..., top_k] int, values in [0, num_experts). Ids outside that range are
        ignored: the pair contributes nothing and gets no gradient (counted in stats).
      expert_weights: [..., top_k] float, the router's (already normalised) weights.
      w_gate, w_up: [num_experts, hidden, ffn]; w_down: [num_experts, ffn, hidden]. The op uses
        them sharded over `expert_axis` on experts and over `expert_tensor_axis` on ffn, replicated
        otherwise; a weight sharded over another axis is all-gathered, with one warning on the
        "relaymoe_jax" logger that says over which axes and how many bytes.
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
      ring: ring only. "flat" (one ring over all expert axes), "hierarchical" (expert_axis a
        tuple (outer..., inner): an inner ring over the last axis, e.g. a host's GPUs, once per
        round, and one transfer per round over the outer axes, overlapped with the round), or
        "auto": hierarchical when the last expert axis stays on one host and the others reach
        other hosts (the devices' process_index; `relaymoe_jax.topology`), else flat.
      capacity_factor: alltoall only. None = dropless; c > 0 = at most ceil(c*T*k/E) pairs per
        expert from each device; the rest are dropped and counted in stats["dropped_pairs"].
      chunk_size: ring only: pairs per chunk (default: the balanced share ceil(T_local*k / EP);
        capped at the T_local*k pairs a hop can hold).
      token_axes: the mesh axes to shard the tokens over, laid over x's leading dimensions in
        order. Default: x's own sharding when it is known (an Explicit mesh, or an array placed
        on the mesh), else every axis of the mesh.
      gmm_impl: grouped matmul, see `relaymoe_jax.kernels.gmm`: "auto" (the Pallas kernel when
        `mesh`'s devices are GPUs, abstract ones included; the blocked XLA one elsewhere),
        "xla", "ragged_dot", "pallas", or "pallas-interpret" (the Pallas kernel in its CPU
        interpreter: slow, for tests).
      out_sharding: where to put y (a NamedSharding, or a PartitionSpec on `mesh`). Default: x's
        own sharding when known, else the layout the op computed in.
      return_stats: also return {"dropped_pairs", "ignored_pairs"} (int32 scalars).

    Returns y with x's shape and dtype, or (y, stats) with return_stats=True.
    Differentiable in x, expert_weights, w_gate, w_up and w_down; works under jax.jit.
    """
    manual = _manual_axes()
    if manual:
        raise ValueError(
            f"moe_ffn takes global arrays, but it is called inside a jax.shard_map "
            f"(manual mesh axes {manual}); there, call "
            "relaymoe_jax.moe_ffn_local with each device's shards"
        )
    vd.check_options(
        dispatcher=dispatcher,
        routing=routing,
        capacity_factor=capacity_factor,
        chunk_size=chunk_size,
        gmm_impl=gmm_impl,
    )
    ea, token_axes, _, _, _ = vd.check_global(
        x,
        expert_ids,
        expert_weights,
        w_gate,
        w_up,
        w_down,
        mesh=mesh,
        expert_axis=expert_axis,
        expert_tensor_axis=expert_tensor_axis,
        token_axes=token_axes,
        dispatcher=dispatcher,
        gmm_impl=gmm_impl,
    )
    topology.check_ring(ring, dispatcher, ea)
    etp = expert_tensor_axis
    out_sharding = _out_sharding(out_sharding, mesh, x)
    _warn_gathered(mesh, ea, etp, w_gate=w_gate, w_up=w_up, w_down=w_down)
    known = lay.known_sharding(x, mesh)
    # One jitted program per static configuration: eager calls reuse their compile, and under
    # an outer jit (or jax.grad outside one) it is an ordinary nested call.
    program = _program(
        mesh=mesh,
        expert_axes=ea,
        etp=etp,
        dispatcher=dispatcher,
        routing=routing,
        ring=ring,
        capacity_factor=capacity_factor,
        chunk_size=chunk_size,
        token_axes=token_axes,
        gmm_impl=gmm_impl,
        out_sharding=out_sharding,
        x_spec=None if known is None else known.spec,
        poison=plan.poisoning(),
        return_stats=bool(return_stats),
    )
    args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
    if jax.sharding.get_abstract_mesh().axis_names or not lay.is_explicit(mesh):
        y, stats = program(*args)
    elif _eager():  # concrete arrays: the program runs on the mesh's devices
        with jax.set_mesh(mesh):
            y, stats = program(*args)
    elif not _under_jit():
        raise ValueError(
            "moe_ffn is transformed eagerly (jax.grad or jax.vmap outside jax.jit) "
            "on an Explicit mesh with no mesh context, where jax cannot place the "
            "cotangents: wrap the computation in jax.jit, or run it under "
            "`with jax.set_mesh(mesh):`"
        )
    else:
        y, stats = program(*args)
    return (y, stats) if return_stats else y


def _eager() -> bool:
    """No transformation is tracing (a plain call on concrete arrays)."""
    return jax._src.core.trace_state_clean()


def _under_jit() -> bool:
    """Some jit (or other staging transformation) is tracing."""
    return jax._src.core.unsafe_am_i_under_a_jit()


@functools.lru_cache(maxsize=256)
def _program(**static):
    return jax.jit(functools.partial(_moe_ffn, **static))


def _moe_ffn(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    mesh,
    expert_axes,
    etp,
    dispatcher,
    routing,
    ring,
    capacity_factor,
    chunk_size,
    token_axes,
    gmm_impl,
    out_sharding,
    x_spec,
    poison,
    return_stats,
):
    """`moe_ffn`'s program, for checked arguments; returns (y, stats)."""
    ea = expert_axes
    _, _, h, k, e, f = vd.check_arrays(x, expert_ids, expert_weights, w_gate, w_up, w_down)
    etp_size = mesh.shape[etp] if etp is not None else 1
    ep = math.prod(mesh.shape[a] for a in ea)
    stats = {"dropped_pairs": jnp.int32(0), "ignored_pairs": _ignored(expert_ids, e)}
    known = None if x_spec is None else NamedSharding(mesh, x_spec)
    layout = lay.resolve(x, mesh, ea, etp, token_axes, known=known)
    tok = layout.spec(None)
    if dispatcher == "reference":  # every device computes everything, then keeps its tokens
        y = _reference(mesh, x, expert_ids, expert_weights, w_gate, w_up, w_down)
        return _place(y, out_sharding or layout.known or NamedSharding(mesh, tok)), stats

    hierarchical = _hierarchical(dispatcher, ring, mesh, ea, "moe_ffn")
    chunk, vol, mode = vd.ring_plan(
        routing=routing,
        chunk_size=chunk_size,
        ring_tokens=layout.ring_tokens,
        num_experts=e,
        top_k=k,
        hidden=h,
        ffn=f,
        ep=ep,
        etp_size=etp_size,
        x_dtype=x.dtype,
        w_dtype=w_gate.dtype,
        wts_dtype=expert_weights.dtype,
        hosts=topology.ring_hosts(mesh, ea),
        hierarchical=hierarchical,
    )
    if dispatcher == "ring" and routing == "auto":
        log.info("moe_ffn(routing='auto'): %s", vol.explain())
    reduce_axes = tuple(a for a in layout.token_axes if a not in (*ea, etp))
    cfg = _Plan(
        dispatcher=dispatcher,
        expert_axes=ea,
        etp=etp,
        gather_etp=layout.gather_etp,
        etp_size=etp_size,
        reduce_axes=reduce_axes,
        num_experts=e,
        chunk=chunk,
        routing=mode,
        capacity_factor=capacity_factor,
        gmm_impl=resolve_impl("auto", mesh=mesh) if gmm_impl == "auto" else gmm_impl,
        poison=poison,
        return_stats=return_stats,
        hierarchical=hierarchical,
        check_vma=gmm_impl != "pallas-interpret",
    )
    w_in, w_out = P(ea, None, etp), P(ea, etp, None)
    specs = (tok, tok, tok, w_in, w_in, w_out)
    args = (x, expert_ids, expert_weights, w_gate, w_up, w_down)
    args = tuple(_place(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))
    body = functools.partial(_split_body, cfg, layout)
    # jax 0.12's Pallas interpreter fails under check_vma (a JAX limitation, see kernels/gmm).
    y, dropped = jax.shard_map(
        body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=cfg.check_vma
    )(*args)
    target = out_sharding or layout.known
    if target is not None and _spec(target.spec, y.ndim) != _spec(tok, y.ndim):
        y = _place(y, target)
    stats["dropped_pairs"] = dropped
    return y, stats


def moe_ffn_local(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    expert_axis,
    expert_tensor_axis=None,
    tokens_sharded_over_etp=None,
    dispatcher="ring",
    routing="auto",
    ring="auto",
    capacity_factor=None,
    chunk_size=None,
    gmm_impl="auto",
    return_stats=False,
):
    """`moe_ffn` for one device, inside the caller's `jax.shard_map`: the drop-in for a
    codebase that already shards its expert step by hand.

    Args (each device's shards):
      x: [..., hidden], this device's tokens. Each device must hold its own tokens along the
        expert axes (x varies over them): tokens replicated over an expert axis would have their
        weight gradients counted once per copy.
      expert_ids, expert_weights: [..., top_k], global expert ids in [0, num_experts).
      w_gate, w_up: [E / EP, hidden, ffn / ETP]; w_down: [E / EP, ffn / ETP, hidden]: this
        device's experts (partition `axis_index(expert_axis)`) and its ffn slice.
      expert_axis: the manual mesh axis (or tuple of axes) holding the experts; the ring runs
        over it. expert_tensor_axis: the manual axis splitting ffn, if any.
      tokens_sharded_over_etp: whether each expert-tensor rank holds other tokens (gathered, then
        reduce-scattered) or the same ones (psum). Default: read from x's varying axes; must be
        given under `shard_map(check_vma=False)`.
      dispatcher, routing, ring, capacity_factor, chunk_size, gmm_impl, return_stats: as
        `moe_ffn` ("reference" is not available per device; ring="auto" reads the devices of
        the `jax.set_mesh` mesh, and is flat without one). The stats are summed over the axes the
        tokens vary over (under check_vma=False: the expert axes, and the ETP axis when gathered).

    The weight gradients are summed over the axes whose devices hold other tokens for the same
    weights (data-parallel axes), with nothing to pass: under check_vma the types say which (x
    varies there and w_gate does not) and the op sums over them; under `check_vma=False`
    shard_map's own transpose sums every input's gradient over the axes its in_spec leaves out.

    Returns y like x (this device's tokens), or (y, stats) with return_stats=True.
    """
    vd.check_options(
        dispatcher=dispatcher,
        routing=routing,
        capacity_factor=capacity_factor,
        chunk_size=chunk_size,
        gmm_impl=gmm_impl,
    )
    if dispatcher == "reference":
        raise ValueError(
            "dispatcher='reference' is not available per device: use moe_ffn, or "
            "relaymoe_jax.dispatch.reference.reference_moe on gathered arrays"
        )
    mesh = jax.sharding.get_abstract_mesh()
    names, manual = tuple(mesh.axis_names), _manual_axes()
    etp = expert_tensor_axis
    wanted = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
    outside = [a for a in (*wanted, *((etp,) if etp else ())) if a not in manual]
    if outside:
        raise ValueError(
            f"moe_ffn_local runs inside jax.shard_map over {outside}, but those axes "
            f"are not manual here (manual: {manual}); with global arrays call "
            "relaymoe_jax.moe_ffn"
        )
    ea = vd.check_axes(
        names, expert_axis, expert_tensor_axis, dispatcher=dispatcher, gmm_impl=gmm_impl
    )
    topology.check_ring(ring, dispatcher, ea)
    _, t, h, k, e_local, f_local = vd.check_arrays(
        x, expert_ids, expert_weights, w_gate, w_up, w_down
    )
    ep = math.prod(mesh.shape[a] for a in ea)
    etp_size = mesh.shape[etp] if etp is not None else 1
    e = e_local * ep
    vd.check_sizes(
        num_experts=e,
        top_k=k,
        ep=ep,
        expert_axis=expert_axis,
        ffn=f_local,
        etp=etp,
        etp_size=etp_size,
        local=True,
    )
    gather, reduce_axes, typed = _infer_axes(x, w_gate, ea, etp, manual, tokens_sharded_over_etp)
    concrete = topology.concrete_mesh()
    if concrete is not None and not set(ea) <= set(concrete.axis_names):
        concrete = None
    hierarchical = (
        _hierarchical(dispatcher, ring, concrete, ea, "moe_ffn_local")
        if concrete is not None
        else ring == "hierarchical"
    )
    chunk, vol, mode = vd.ring_plan(
        routing=routing,
        chunk_size=chunk_size,
        ring_tokens=t * (etp_size if gather else 1),
        num_experts=e,
        top_k=k,
        hidden=h,
        ffn=f_local * etp_size,
        ep=ep,
        etp_size=etp_size,
        x_dtype=x.dtype,
        w_dtype=w_gate.dtype,
        wts_dtype=expert_weights.dtype,
        hosts=topology.ring_hosts(concrete, ea) if concrete is not None else 1,
        hierarchical=hierarchical,
    )
    if dispatcher == "ring" and routing == "auto":
        log.info("moe_ffn_local(routing='auto'): %s", vol.explain())
    cfg = _Plan(
        dispatcher=dispatcher,
        expert_axes=ea,
        etp=etp,
        gather_etp=gather,
        etp_size=etp_size,
        reduce_axes=reduce_axes,
        num_experts=e,
        chunk=chunk,
        routing=mode,
        capacity_factor=capacity_factor,
        gmm_impl=resolve_impl("auto", mesh=mesh) if gmm_impl == "auto" else gmm_impl,
        poison=plan.poisoning(),
        return_stats=return_stats,
        check_vma=typed,
        hierarchical=hierarchical,
    )
    y_th, dropped = _local(
        cfg,
        x.reshape(t, h),
        expert_ids.reshape(t, k),
        expert_weights.reshape(t, k),
        w_gate,
        w_up,
        w_down,
    )
    y = y_th.reshape(x.shape)
    if not return_stats:
        return y
    ignored = lax.psum(_ignored(expert_ids, e), _stat_axes(cfg))
    return y, {"dropped_pairs": dropped, "ignored_pairs": ignored}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static one device's body needs."""

    dispatcher: str
    expert_axes: tuple
    etp: str | None
    gather_etp: bool
    etp_size: int
    reduce_axes: tuple  # token axes other than the expert and expert-tensor ones
    num_experts: int
    chunk: int
    routing: str
    capacity_factor: float | None
    gmm_impl: str
    poison: bool
    return_stats: bool
    check_vma: bool = True  # False: shard_map's transpose sums the weight gradients itself
    hierarchical: bool = False  # the ring: rounds of an inner ring over expert_axes[-1]


def _hierarchical(dispatcher, ring, mesh, ea, who):
    """Whether the ring is hierarchical (`relaymoe_jax.topology`); auto's choice logged."""
    if dispatcher != "ring":
        return False
    hier = topology.choose_ring(ring, mesh, ea)
    if ring == "auto" and hier:
        log.info(
            "%s(ring='auto'): hierarchical ring, inner %r within each host, outer %r across hosts",
            who,
            ea[-1],
            ea[:-1] if len(ea) > 2 else ea[0],
        )
    return hier


def _stat_axes(cfg):
    """The axes over which devices hold different tokens (stats are summed over them)."""
    return (*cfg.expert_axes, *cfg.reduce_axes, *((cfg.etp,) if cfg.gather_etp else ()))


def _local(cfg: _Plan, x_th, ids_tk, wts_tk, w_gate, w_up, w_down):
    """Per device: ETP plumbing around the dispatcher, whose experts hold an ffn slice.

    Each ETP rank computes every pair of its token group with its slice of ffn, so the outputs are
    partial sums. Tokens sharded over the ETP axis are all-gathered first and the partials
    reduce-scattered back: each rank keeps only its [T/ETP, H] share of the result (a psum would
    leave the full [T, H] sum on every rank), and the transposes are the same pair (all-gather of
    dy, reduce-scatter of dx). Tokens replicated over the ETP axis get a psum.
    Returns (y [T, H], dropped pairs summed over the token axes).
    """
    etp, gather = cfg.etp, cfg.gather_etp
    if etp is not None:
        if gather:
            x_th, ids_tk, wts_tk = (
                lax.all_gather(a, etp, axis=0, tiled=True) for a in (x_th, ids_tk, wts_tk)
            )
        else:  # mark them varying over ETP: the transpose sums the partial dx / d weights
            x_th, wts_tk = (plan.vary_like(a, w_gate) for a in (x_th, wts_tk))
    ea = cfg.expert_axes
    if cfg.dispatcher == "ring":
        ring = RingConfig(
            axis=ea,
            num_experts=cfg.num_experts,
            chunk=cfg.chunk,
            reduce_axes=cfg.reduce_axes if cfg.check_vma else (),
            routing=cfg.routing,
            gmm_impl=cfg.gmm_impl,
            poison=cfg.poison,
            hierarchical=cfg.hierarchical,
        )
        y_th, dropped = ring_moe(ring, x_th, ids_tk, wts_tk, w_gate, w_up, w_down), jnp.int32(0)
    else:
        if cfg.capacity_factor is not None and not cfg.return_stats:
            log.warning(
                "moe_ffn(dispatcher='alltoall', capacity_factor=%s) may drop pairs; "
                "pass return_stats=True to get stats['dropped_pairs']",
                cfg.capacity_factor,
            )
        a2a = AllToAllConfig(
            axis=ea,
            num_experts=cfg.num_experts,
            capacity_factor=cfg.capacity_factor,
            stat_axes=_stat_axes(cfg),
            gmm_impl=cfg.gmm_impl,
            poison=cfg.poison,
        )
        y_th, dropped = alltoall_moe(a2a, x_th, ids_tk, wts_tk, w_gate, w_up, w_down)
        dropped = dropped // (cfg.etp_size if gather else 1)  # each ETP rank counted the same
    if etp is not None:
        y_th = (
            lax.psum_scatter(y_th, etp, scatter_dimension=0, tiled=True)
            if gather
            else lax.psum(y_th, etp)
        )
    return y_th, dropped


def _split_body(cfg: _Plan, layout: lay.TokenLayout, x, ids, wts, w_gate, w_up, w_down):
    """`moe_ffn`'s per-device body: flatten the block, split it over the split axes (padded
    with ignored pairs), run `_local`, gather the shares back, unflatten."""
    t, h, k = layout.local_tokens, x.shape[-1], ids.shape[-1]
    x_th, ids_tk, wts_tk = x.reshape(t, h), ids.reshape(t, k), wts.reshape(t, k)
    split = layout.split
    if split:
        share = layout.share
        pad = share * layout.split_size - t
        fill = float("nan") if cfg.poison else 0.0
        x_th = jnp.concatenate([x_th, jnp.full((pad, h), fill, x_th.dtype)]) if pad else x_th
        ids_tk = jnp.concatenate([ids_tk, jnp.full((pad, k), -1, ids_tk.dtype)]) if pad else ids_tk
        wts_tk = jnp.concatenate([wts_tk, jnp.zeros((pad, k), wts_tk.dtype)]) if pad else wts_tk
        start = lax.axis_index(split) * share
        x_th, ids_tk, wts_tk = (
            lax.dynamic_slice_in_dim(a, start, share, 0) for a in (x_th, ids_tk, wts_tk)
        )
    y_th, dropped = _local(cfg, x_th, ids_tk, wts_tk, w_gate, w_up, w_down)
    if split:
        y_th = lax.all_gather(y_th, split, axis=0, tiled=True, to="invarying")[:t]
    return y_th.reshape(x.shape), dropped


def _infer_axes(x, w_gate, ea, etp, manual, tokens_sharded_over_etp):
    """(gather over ETP, the other token axes, whether check_vma types them) for
    `moe_ffn_local`, from x's and w_gate's varying axes when the shard_map checks them."""
    vx = set(jax.typeof(x).manual_axis_type.varying)
    vw = set(jax.typeof(w_gate).manual_axis_type.varying)
    typed = bool(vx or vw)  # under check_vma the experts vary over the expert axes; without it
    # nothing varies
    missing = [a for a in ea if a not in vx]
    if typed and missing:
        raise ValueError(
            f"moe_ffn_local: x does not vary over the expert axes {missing}: each "
            "device must hold its own tokens there (tokens replicated over an expert "
            "axis would have their weight gradients counted once per copy)"
        )
    if tokens_sharded_over_etp is not None:
        gather = bool(tokens_sharded_over_etp) and etp is not None
    elif etp is None:
        gather = False
    elif typed:
        gather = etp in vx
    else:
        raise ValueError(
            f"moe_ffn_local(expert_tensor_axis={etp!r}) under "
            "shard_map(check_vma=False): pass tokens_sharded_over_etp=True or False "
            "(whether each expert-tensor rank holds other tokens)"
        )
    others = [a for a in manual if a not in (*ea, etp)]
    if typed:
        return gather, tuple(a for a in others if a in vx and a not in vw), True
    return gather, (), False


def _spec(spec, ndim):
    """A PartitionSpec as a tuple of axis tuples, one per dimension (for comparisons)."""
    return tuple(lay._axes(e) for e in (*tuple(spec), *(None,) * (ndim - len(spec))))


def _manual_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == MANUAL)


def _ignored(ids, num_experts):
    return jnp.sum((ids < 0) | (ids >= num_experts)).astype(jnp.int32)


def _reference(mesh, x, ids, wts, w_gate, w_up, w_down):
    """The dense reference on every device (replicated in and out, in a shard_map, so that a
    jit over inputs not yet on the mesh has the mesh's devices)."""
    args = tuple(_place(a, NamedSharding(mesh, P())) for a in (x, ids, wts, w_gate, w_up, w_down))
    t, h, k = math.prod(x.shape[:-1]), x.shape[-1], ids.shape[-1]

    def body(x, ids, wts, w_gate, w_up, w_down):
        y = reference_moe(
            x.reshape(t, h), ids.reshape(t, k), wts.reshape(t, k), w_gate, w_up, w_down
        )
        return y.reshape(x.shape)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 6, out_specs=P())(*args)


def _out_sharding(out_sharding, mesh, x):
    if out_sharding is None or isinstance(out_sharding, NamedSharding):
        return out_sharding
    if isinstance(out_sharding, P):
        return NamedSharding(mesh, out_sharding)
    raise ValueError(
        f"out_sharding: expected a NamedSharding or a PartitionSpec, got "
        f"{type(out_sharding).__name__} (x has shape {x.shape})"
    )


_warned: set = set()


def _warn_gathered(mesh, ea, etp, **weights):
    """One warning per layout of the weights that the op must all-gather (a weight sharded over
    an axis it does not use for that dimension), with the bytes each device then holds."""
    want = {"w_gate": (ea, (), (etp,)), "w_up": (ea, (), (etp,)), "w_down": (ea, (etp,), ())}
    found, nbytes = [], 0
    for name, w in weights.items():
        s = lay.known_sharding(w, mesh)
        if s is None:
            continue
        spec = tuple(s.spec) + (None,) * 3
        extra = tuple(
            sorted(
                {
                    a
                    for entry, ok in zip(spec[:3], want[name])
                    for a in lay._axes(entry)
                    if a not in ok
                }
            )
        )
        if extra:
            found.append((name, tuple(w.shape), tuple(s.spec), extra))
            kept = (
                math.prod(w.shape)
                // math.prod(mesh.shape[a] for a in ea)
                // (mesh.shape[etp] if etp else 1)
            )
            nbytes += kept * jnp.dtype(w.dtype).itemsize
    key = (tuple(found), ea, etp)
    if not found or key in _warned:
        return
    _warned.add(key)
    what = ", ".join(f"{n} {shape} over {list(axes)}" for n, shape, _, axes in found)
    log.warning(
        "moe_ffn: weights sharded over axes the op does not use there (%s; "
        "expert_axis=%r, expert_tensor_axis=%r) are all-gathered: %s bytes per device at "
        "each call. If an ffn split is meant, pass its axis as expert_tensor_axis.",
        what,
        ea if len(ea) > 1 else ea[0],
        etp,
        f"{nbytes:,}",
    )


def _place(a, sharding):
    if lay.is_explicit(sharding.mesh):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def routing_plan(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    mesh,
    expert_axis="expert",
    expert_tensor_axis=None,
    token_axes=None,
    ring="auto",
):
    """The per-hop volumes of both routing modes for this exact `moe_ffn` call, and the mode
    `routing="auto"` picks (a `RoutingVolumes`; see `relaymoe_jax.routing_volumes`).

    Tokens per device are those one ring member works on: its share of x's tokens (see
    `relaymoe_jax.layout`), times the expert-tensor axis size when tokens are sharded over it
    (they are gathered there). Only shapes, dtypes and known shardings are read: arrays,
    `jax.ShapeDtypeStruct`s or tracers all work. With `mesh`'s devices on several hosts it also
    gives the bytes per link class (`RoutingVolumes.link_bytes`) of the ring `ring` resolves to.
    """
    ea, token_axes, ep, etp_size, (h, k, e, f) = vd.check_global(
        x,
        expert_ids,
        expert_weights,
        w_gate,
        w_up,
        w_down,
        mesh=mesh,
        expert_axis=expert_axis,
        expert_tensor_axis=expert_tensor_axis,
        token_axes=token_axes,
        dispatcher="ring",
        gmm_impl="auto",
    )
    etp = expert_tensor_axis
    topology.check_ring(ring, "ring", ea)
    layout = lay.resolve(x, mesh, ea, etp, token_axes)
    return vd.ring_plan(
        routing="auto",
        chunk_size=None,
        ring_tokens=layout.ring_tokens,
        num_experts=e,
        top_k=k,
        hidden=h,
        ffn=f,
        ep=ep,
        etp_size=etp_size,
        x_dtype=x.dtype,
        w_dtype=w_gate.dtype,
        wts_dtype=expert_weights.dtype,
        hosts=topology.ring_hosts(mesh, ea),
        hierarchical=topology.choose_ring(ring, mesh, ea),
    )[1]
