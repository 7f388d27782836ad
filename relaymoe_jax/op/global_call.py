"""`moe_ffn`'s path: global arrays in, placed on the mesh, one `shard_map`, y back like x.

`check` runs every static check on the global arrays and returns a `GlobalCall`; `run` builds
(and caches) one jitted program per static configuration, whose body resolves x's token layout
(`op.layout`), builds the `LocalSpec` (`op.resolve`) and runs each device's step in a shard_map.
"""

import functools
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.dispatch import pairs
from relaymoe_jax.dispatch.activation import SWIGLU
from relaymoe_jax.dispatch.experts import Experts
from relaymoe_jax.dispatch.local import local_moe
from relaymoe_jax.dispatch.reference import reference_moe
from relaymoe_jax.op import checks, topology
from relaymoe_jax.op import layout as lay
from relaymoe_jax.op.options import MoEOptions
from relaymoe_jax.op.resolve import Placement, choose_hierarchical, resolve
from relaymoe_jax.util import tracing

log = logging.getLogger("relaymoe_jax")


class GlobalCall(NamedTuple):
    """A checked `moe_ffn` call: everything static but the arrays."""

    mesh: object
    expert_axes: tuple[str, ...]
    etp: str | None
    token_axes: tuple[str, ...] | None
    sizes: checks.Sizes


def check(
    tokens,
    experts: Experts,
    options: MoEOptions,
    *,
    mesh,
    expert_axis,
    expert_tensor_axis,
    token_axes,
):
    """Every static check of a call on global arrays (the options already valid): `tokens` is
    (x, expert_ids, expert_weights)."""
    checks.check_mesh(mesh)
    names = tuple(mesh.axis_names)
    ea = checks.check_axes(
        names,
        expert_axis,
        expert_tensor_axis,
        dispatcher=options.dispatcher,
        gmm_impl=options.gmm_impl,
    )
    token_axes = checks.check_token_axes(names, token_axes)
    sizes = checks.check_arrays(*tokens, experts)
    etp = expert_tensor_axis
    checks.check_sizes(
        sizes,
        ep=math.prod(mesh.shape[a] for a in ea),
        expert_axis=expert_axis,
        etp=etp,
        etp_size=mesh.shape[etp] if etp is not None else 1,
    )
    checks.check_fp8_blocks(
        sizes,
        expert_fp8=options.expert_fp8,
        etp=etp,
        etp_size=mesh.shape[etp] if etp is not None else 1,
    )
    topology.check_ring_axes(options.ring, ea)
    checks.check_biases(sizes, experts)
    return GlobalCall(mesh, ea, etp, token_axes, sizes)


def placement(call: GlobalCall, layout: lay.TokenLayout, options: MoEOptions, who=None):
    """Where the call's ring members are, from x's token layout on the mesh."""
    mesh, ea, etp = call.mesh, call.expert_axes, call.etp
    return Placement(
        expert_axes=ea,
        etp=etp,
        ep=math.prod(mesh.shape[a] for a in ea),
        etp_size=mesh.shape[etp] if etp is not None else 1,
        ring_tokens=layout.ring_tokens,
        gather_etp=layout.gather_etp,
        reduce_axes=tuple(a for a in layout.token_axes if a not in (*ea, etp)),
        hosts=topology.ring_hosts(mesh, ea),
        hierarchical=choose_hierarchical(options, mesh, ea, who),
    )


def run(
    call: GlobalCall,
    tokens,
    experts: Experts,
    options: MoEOptions,
    *,
    out_sharding,
    return_stats,
    activation=SWIGLU,
):
    """Run a checked call on (x, expert_ids, expert_weights) and the experts; returns
    (y, stats)."""
    mesh = call.mesh
    x = tokens[0]
    out_sharding = out_sharding_of(out_sharding, mesh, x)
    warn_gathered(mesh, call.expert_axes, call.etp, experts)
    known = lay.known_sharding(x, mesh)
    args = (*tokens, experts)
    # One jitted program per static configuration: eager calls reuse their compile, and under
    # an outer jit (or jax.grad outside one) it is an ordinary nested call.
    jitted = program(
        call._replace(sizes=None),
        options,
        out_sharding=out_sharding,
        x_spec=None if known is None else known.spec,
        poison=pairs.poisoning(),
        return_stats=bool(return_stats),
        activation=activation,
    )
    if jax.sharding.get_abstract_mesh().axis_names or not lay.is_explicit(mesh):
        return jitted(*args)
    if tracing.eager():  # concrete arrays: the program runs on the mesh's devices
        with jax.set_mesh(mesh):
            return jitted(*args)
    if not tracing.under_jit():
        raise ValueError(
            "moe_ffn is transformed eagerly (jax.grad or jax.vmap outside jax.jit) "
            "on an Explicit mesh with no mesh context, where jax cannot place the "
            "cotangents: wrap the computation in jax.jit, or run it under "
            "`with jax.set_mesh(mesh):`"
        )
    return jitted(*args)


@functools.lru_cache(maxsize=256)
def program(call, options, **static):
    """The jitted program of one static configuration (cached: tests read `cache_info`)."""
    return jax.jit(functools.partial(_moe_ffn, call, options, **static))


def _moe_ffn(
    call, options, x, ids, wts, experts, *, out_sharding, x_spec, poison, return_stats, activation
):
    """`moe_ffn`'s program, for checked arguments; returns (y, stats)."""
    mesh, ea, etp = call.mesh, call.expert_axes, call.etp
    sizes = checks.check_arrays(x, ids, wts, experts)
    experts = experts.complete()
    stats = {"dropped_pairs": jnp.int32(0), "ignored_pairs": ignored_pairs(ids, sizes.experts)}
    known = None if x_spec is None else NamedSharding(mesh, x_spec)
    layout = lay.resolve(x, mesh, ea, etp, call.token_axes, known=known)
    tok = layout.spec(None)
    if options.dispatcher == "reference":  # every device computes everything, keeps its tokens
        y = _reference(mesh, activation, x, ids, wts, experts, options.expert_fp8)
        return place(y, out_sharding or layout.known or NamedSharding(mesh, tok)), stats

    spec, _ = resolve(
        options,
        sizes,
        checks.dtypes(x, wts, experts.w_gate),
        placement(call, layout, options, "moe_ffn"),
        mesh=mesh,
        poison=poison,
        return_stats=return_stats,
        check_vma=options.gmm_impl != "pallas-interpret",
        who="moe_ffn",
        activation=activation,
    )
    w_in, w_out = P(ea, None, etp), P(ea, etp, None)
    w_specs = Experts(w_in, w_in, w_out)
    if experts.has_biases:  # b_down is added once: replicated over the ETP axis
        w_specs = w_specs._replace(b_gate=P(ea, etp), b_up=P(ea, etp), b_down=P(ea, None))
    specs = (tok, tok, tok, w_specs)
    args = jax.tree.map(
        lambda a, s: place(a, NamedSharding(mesh, s)), (x, ids, wts, experts), specs
    )
    body = functools.partial(_split_body, spec, layout)
    # jax 0.12's Pallas interpreter fails under check_vma (a JAX limitation, see kernels/gmm).
    y, dropped = jax.shard_map(
        body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=spec.check_vma
    )(*args)
    target = out_sharding or layout.known
    if target is not None and _spec_axes(target.spec, y.ndim) != _spec_axes(tok, y.ndim):
        y = place(y, target)
    stats["dropped_pairs"] = dropped
    return y, stats


def _split_body(spec, layout: lay.TokenLayout, x, ids, wts, experts):
    """`moe_ffn`'s per-device body: flatten the block, split it over the split axes (padded
    with ignored pairs), run `local_moe`, gather the shares back, unflatten."""
    t, h, k = layout.local_tokens, x.shape[-1], ids.shape[-1]
    x_th, ids_tk, wts_tk = x.reshape(t, h), ids.reshape(t, k), wts.reshape(t, k)
    split = layout.split
    if split:
        share = layout.share
        pad = share * layout.split_size - t
        if pad:
            fill = float("nan") if spec.poison else 0.0
            x_th = jnp.concatenate([x_th, jnp.full((pad, h), fill, x_th.dtype)])
            ids_tk = jnp.concatenate([ids_tk, jnp.full((pad, k), -1, ids_tk.dtype)])
            wts_tk = jnp.concatenate([wts_tk, jnp.zeros((pad, k), wts_tk.dtype)])
        start = jax.lax.axis_index(split) * share
        x_th, ids_tk, wts_tk = (
            jax.lax.dynamic_slice_in_dim(a, start, share, 0) for a in (x_th, ids_tk, wts_tk)
        )
    y_th, dropped = local_moe(spec, x_th, ids_tk, wts_tk, experts)
    if split:
        y_th = jax.lax.all_gather(y_th, split, axis=0, tiled=True, to="invarying")[:t]
    return y_th.reshape(x.shape), dropped


def ignored_pairs(ids, num_experts):
    """Pairs whose id lies outside [0, num_experts) (int32)."""
    return jnp.sum((ids < 0) | (ids >= num_experts)).astype(jnp.int32)


def _reference(mesh, activation, x, ids, wts, experts, fp8):
    """The dense reference on every device (replicated in and out, in a shard_map, so that a
    jit over inputs not yet on the mesh has the mesh's devices)."""
    args = jax.tree.map(lambda a: place(a, NamedSharding(mesh, P())), (x, ids, wts, experts))
    t, h, k = math.prod(x.shape[:-1]), x.shape[-1], ids.shape[-1]

    def body(x, ids, wts, experts):
        y = reference_moe(
            x.reshape(t, h),
            ids.reshape(t, k),
            wts.reshape(t, k),
            *experts,
            activation=activation,
            fp8=fp8,
        )
        return y.reshape(x.shape)

    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(*args)


def _spec_axes(spec, ndim):
    """A PartitionSpec as a tuple of axis tuples, one per dimension (for comparisons)."""
    return tuple(lay.spec_axes(e) for e in (*tuple(spec), *(None,) * (ndim - len(spec))))


def out_sharding_of(out_sharding, mesh, x):
    """`out_sharding` as a NamedSharding (or None)."""
    if out_sharding is None or isinstance(out_sharding, NamedSharding):
        return out_sharding
    if isinstance(out_sharding, P):
        return NamedSharding(mesh, out_sharding)
    raise ValueError(
        f"out_sharding: expected a NamedSharding or a PartitionSpec, got "
        f"{type(out_sharding).__name__} (x has shape {x.shape})"
    )


_warned: set = set()


def _extra_axes(spec, wanted) -> tuple:
    """The mesh axes of `spec`'s first three dimensions that `wanted` does not list there."""
    spec = tuple(spec) + (None,) * 3
    return tuple(
        sorted(
            {a for entry, ok in zip(spec[:3], wanted) for a in lay.spec_axes(entry) if a not in ok}
        )
    )


def warn_gathered(mesh, ea, etp, experts: Experts):
    """One warning per layout of the weights that the op must all-gather (a weight sharded over
    an axis it does not use for that dimension), with the bytes each device then holds."""
    w_in, w_out = (ea, (), (etp,)), (ea, (etp,), ())
    found, nbytes = [], 0
    for (name, w), want in zip(experts._asdict().items(), (w_in, w_in, w_out)):
        s = lay.known_sharding(w, mesh)
        extra = () if s is None else _extra_axes(s.spec, want)
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


def place(a, sharding):
    """`a` on `sharding` (a reshard on an Explicit mesh, a sharding constraint otherwise)."""
    if lay.is_explicit(sharding.mesh):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)
