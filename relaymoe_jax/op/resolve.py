"""The op's one front door: (sizes, options, where the call runs) -> the static `LocalSpec`.

`moe_ffn`, `moe_ffn_local` and `routing_plan` each read where the tokens and the experts are (a
`Placement`: from x's layout on the mesh, or from the manual axes of the caller's shard_map), then
call `resolve`, which picks the ring's chunk and routing mode (`ring_choice`) and the grouped
matmul, and builds the record one device's step runs on.
"""

import logging
from typing import NamedTuple

from relaymoe_jax.dispatch.activation import SWIGLU, Activation
from relaymoe_jax.dispatch.chunking import default_chunk
from relaymoe_jax.dispatch.local import LocalSpec
from relaymoe_jax.dispatch.mode import RoutingVolumes, routing_volumes
from relaymoe_jax.kernels.attention import interpret
from relaymoe_jax.kernels.gmm import resolve_impl
from relaymoe_jax.op import topology
from relaymoe_jax.op.checks import Dtypes, Sizes, check_gmm_platform, check_interpret_devices
from relaymoe_jax.op.options import MoEOptions
from relaymoe_jax.util.platform import platform

log = logging.getLogger("relaymoe_jax")


class Placement(NamedTuple):
    """Where one call's experts and tokens live, as one ring member sees them."""

    expert_axes: tuple[str, ...]
    etp: str | None  # the expert-tensor axis
    ep: int  # devices over the expert axes
    etp_size: int
    ring_tokens: int  # tokens one ring member works on (gathered over ETP when sharded there)
    gather_etp: bool  # tokens sharded over the ETP axis
    reduce_axes: tuple[str, ...]  # token axes other than the expert and ETP ones
    hosts: int  # hosts one ring spans
    hierarchical: bool  # the ring runs in rounds (`op.topology`)


class RingChoice(NamedTuple):
    chunk: int  # pairs per chunk
    volumes: RoutingVolumes  # both modes' bytes per hop
    routing: str  # the mode: the given one, or auto's choice


def ring_choice(options: MoEOptions, sizes: Sizes, dtypes: Dtypes, where: Placement) -> RingChoice:
    """Chunk, volumes and routing mode for `where.ring_tokens` tokens per ring member (`sizes`
    global: all experts, the whole ffn).

    The default chunk is `dispatch.chunking.default_chunk` (at most the balanced share
    ceil(T * k / EP)); a given one is capped at the pairs a hop can hold (T * k), so no buffer is
    sized past what can exist."""
    t, k = where.ring_tokens, sizes.top_k
    chunk = (
        default_chunk(t, k, where.ep, sizes.experts)
        if options.chunk_size is None
        else min(int(options.chunk_size), t * k)
    )
    vol = routing_volumes(
        experts=sizes.experts,
        top_k=k,
        hidden=sizes.hidden,
        ffn=sizes.ffn,
        ep=where.ep,
        etp=where.etp_size,
        tokens_per_device=t,
        act_dtype=dtypes.x,
        weight_dtype=dtypes.weights,
        router_dtype=dtypes.router,
        hosts=where.hosts,
        hierarchical=where.hierarchical,
    )
    return RingChoice(chunk, vol, vol.choice if options.routing == "auto" else options.routing)


def choose_hierarchical(options: MoEOptions, mesh, expert_axes, who: str | None = None) -> bool:
    """Whether the ring is hierarchical (`op.topology`); auto's choice logged for `who`."""
    if options.dispatcher != "ring":
        return False
    hier = topology.choose_ring(options.ring, mesh, expert_axes)
    if who and options.ring == "auto" and hier:
        ea = expert_axes
        log.info(
            "%s(ring='auto'): hierarchical ring, inner %r within each host, outer %r across hosts",
            who,
            ea[-1],
            ea[:-1] if len(ea) > 2 else ea[0],
        )
    return hier


def resolve(
    options: MoEOptions,
    sizes: Sizes,
    dtypes: Dtypes,
    where: Placement,
    *,
    mesh,
    poison: bool,
    return_stats: bool,
    check_vma: bool,
    who: str,
    activation: Activation = SWIGLU,
) -> tuple[LocalSpec, RoutingVolumes]:
    """The `LocalSpec` of one call (`sizes` global), and both routing modes' volumes."""
    choice = ring_choice(options, sizes, dtypes, where)
    if options.dispatcher == "ring" and options.routing == "auto":
        log.info("%s(routing='auto'): %s", who, choice.volumes.explain())
    impl = options.gmm_impl
    check_gmm_platform(impl, platform(mesh))
    check_interpret_devices(impl, mesh.size)
    if impl == "mosaic-interpret":
        interpret.check_threads("gmm_impl='mosaic-interpret'", "'xla'")
    spec = LocalSpec(
        dispatcher=options.dispatcher,
        expert_axes=where.expert_axes,
        etp=where.etp,
        gather_etp=where.gather_etp,
        etp_size=where.etp_size,
        reduce_axes=where.reduce_axes,
        num_experts=sizes.experts,
        chunk=choice.chunk,
        routing=choice.routing,
        capacity_factor=options.capacity_factor,
        gmm_impl=(
            resolve_impl("auto", mesh=mesh, dtypes=(dtypes.x, dtypes.weights))
            if impl == "auto"
            else impl
        ),
        poison=poison,
        return_stats=return_stats,
        check_vma=check_vma,
        hierarchical=where.hierarchical,
        activation=activation,
        expert_fp8=options.expert_fp8,
    )
    return spec, choice.volumes
