"""`moe_ffn_local`'s path: one device's shards, inside the caller's `jax.shard_map`.

The axes the op needs are read from the manual mesh and from the varying-manual-axes types of x
and the weights (under `check_vma`); then the same front door as `moe_ffn` (`op.resolve`) and the
same per-device step (`dispatch.local`).
"""

import math

import jax
from jax import lax

from relaymoe_jax.dispatch import pairs
from relaymoe_jax.dispatch.activation import SWIGLU
from relaymoe_jax.dispatch.experts import Experts
from relaymoe_jax.dispatch.local import local_moe
from relaymoe_jax.op import checks, local_axes, topology
from relaymoe_jax.op import debug_checks as debug
from relaymoe_jax.op.global_call import ignored_pairs
from relaymoe_jax.op.options import MoEOptions
from relaymoe_jax.op.resolve import Placement, choose_hierarchical, resolve
from relaymoe_jax.util import tracing

MANUAL = jax.sharding.AxisType.Manual


def manual_axes() -> tuple[str, ...]:
    """The manual axes of the mesh traced in now (inside a shard_map), else ()."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == MANUAL)


def _check_manual(expert_axis, etp, mesh, *, dispatcher, gmm_impl) -> tuple[tuple, tuple]:
    """(the expert axes, the manual axes): each expert axis checked to be a manual axis of the
    shard_map traced in now."""
    manual = manual_axes()
    wanted = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
    wanted = (*wanted, *((etp,) if etp else ()))
    if not manual:
        raise ValueError(
            f"moe_ffn_local runs inside jax.shard_map over {list(wanted)}, but no axis is "
            "manual here; with global arrays call relaymoe_jax.moe_ffn"
        )
    ea = checks.check_axes(
        tuple(mesh.axis_names), expert_axis, etp, dispatcher=dispatcher, gmm_impl=gmm_impl
    )
    outside = [a for a in wanted if a not in manual]
    if outside:
        raise ValueError(
            f"moe_ffn_local: the axes {outside} are not manual in this jax.shard_map "
            f"(manual: {manual}): add them to its axis_names"
        )
    return ea, manual


def _ring_mesh(ea):
    """The `jax.set_mesh` mesh when it has the expert axes (its devices say which hosts a ring
    spans), else None."""
    concrete = tracing.concrete_mesh()
    if concrete is not None and not set(ea) <= set(concrete.axis_names):
        return None
    return concrete


def _placement(options, ea, etp, mesh, sizes, gather, reduce_axes):
    ep = math.prod(mesh.shape[a] for a in ea)
    etp_size = mesh.shape[etp] if etp is not None else 1
    concrete = _ring_mesh(ea)
    if concrete is not None:
        hierarchical = choose_hierarchical(options, concrete, ea, "moe_ffn_local")
    else:
        hierarchical = options.ring == "hierarchical"
    return Placement(
        expert_axes=ea,
        etp=etp,
        ep=ep,
        etp_size=etp_size,
        ring_tokens=sizes.tokens * (etp_size if gather else 1),
        gather_etp=gather,
        reduce_axes=reduce_axes,
        hosts=topology.ring_hosts(concrete, ea) if concrete is not None else 1,
        hierarchical=hierarchical,
    )


def run(
    tokens,
    experts: Experts,
    options: MoEOptions,
    *,
    expert_axis,
    expert_tensor_axis,
    tokens_sharded_over_etp,
    return_stats,
    debug_checks=False,
    activation=SWIGLU,
):
    """`moe_ffn_local` on checked options, (x, expert_ids, expert_weights) and the experts (the
    biases None where not given); returns y, or (y, stats)."""
    if options.dispatcher == "reference":
        raise ValueError(
            "dispatcher='reference' is not available per device: use moe_ffn, or "
            "relaymoe_jax.dispatch.reference.reference_moe on gathered arrays"
        )
    mesh = jax.sharding.get_abstract_mesh()
    etp = expert_tensor_axis
    ea, manual = _check_manual(
        expert_axis, etp, mesh, dispatcher=options.dispatcher, gmm_impl=options.gmm_impl
    )
    topology.check_ring_axes(options.ring, ea)
    x, ids, wts = tokens
    local = checks.check_arrays(x, ids, wts, experts)
    checks.check_biases(local, experts)
    given, experts = experts, experts.complete()
    ep = math.prod(mesh.shape[a] for a in ea)
    etp_size = mesh.shape[etp] if etp is not None else 1
    checks.check_sizes(
        local, ep=ep, expert_axis=expert_axis, etp=etp, etp_size=etp_size, local=True
    )
    checks.check_fp8_blocks(
        local, expert_fp8=options.expert_fp8, etp=etp, etp_size=etp_size, local=True
    )
    axes = local_axes.read_axes(x, given, expert_axis, ea, etp, manual, tokens_sharded_over_etp)
    checks.check_interpret_vma(options.gmm_impl, axes.typed, who="moe_ffn_local")
    where = _placement(options, ea, etp, mesh, local, axes.gather_etp, axes.reduce_axes)
    spec, _ = resolve(
        options,
        local._replace(experts=local.experts * ep, ffn=local.ffn * etp_size),
        checks.dtypes(x, wts, experts.w_gate),
        where,
        mesh=mesh,
        poison=pairs.poisoning(),
        return_stats=return_stats,
        check_vma=axes.typed,
        who="moe_ffn_local",
        activation=activation,
    )
    t, h, k = local.tokens, local.hidden, local.top_k
    y_th, dropped = local_moe(spec, x.reshape(t, h), ids.reshape(t, k), wts.reshape(t, k), experts)
    y = y_th.reshape(x.shape)
    if debug_checks:
        debug.run(
            spec,
            ep=ep,
            manual=manual,
            typed=axes.typed,
            expert_axis=expert_axis,
            x=x,
            ids=ids,
            experts=given,
        )
    if not return_stats:
        return y
    ignored = lax.psum(ignored_pairs(ids, spec.num_experts), spec.stat_axes)
    return y, {"dropped_pairs": dropped, "ignored_pairs": ignored}
