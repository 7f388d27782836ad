"""One device's MoE step: the expert-tensor (ETP) plumbing around the ring or the all-to-all.

`local_moe(spec, ...)` runs inside `shard_map` on one device's tokens [T, H] and its experts'
ffn slice. `LocalSpec` is everything static it needs, built once per call by the op's front door
(`relaymoe_jax.op.resolve`).
"""

import dataclasses
import logging

import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch.activation import SWIGLU, Activation
from relaymoe_jax.dispatch.alltoall import AllToAllConfig, alltoall_moe
from relaymoe_jax.dispatch.experts import Experts
from relaymoe_jax.dispatch.ring import RingConfig, ring_moe
from relaymoe_jax.quant import fp8
from relaymoe_jax.util.typed import varying_like

log = logging.getLogger("relaymoe_jax")


@dataclasses.dataclass(frozen=True)
class LocalSpec:
    """Everything static one device's step needs (hashable)."""

    dispatcher: str  # "ring" or "alltoall"
    expert_axes: tuple
    etp: str | None
    gather_etp: bool  # tokens sharded over the ETP axis: all-gathered, reduce-scattered back
    etp_size: int
    reduce_axes: tuple  # token axes other than the expert and expert-tensor ones
    num_experts: int
    chunk: int
    routing: str  # the ring's mode, resolved: "expert" or "token"
    capacity_factor: float | None
    gmm_impl: str  # resolved: never "auto"
    poison: bool
    return_stats: bool
    check_vma: bool = True  # False: shard_map's transpose sums the weight gradients itself
    hierarchical: bool = False  # the ring: rounds of an inner ring over expert_axes[-1]
    activation: Activation = SWIGLU  # the experts' gated activation
    expert_fp8: bool = False  # the expert matrices in e4m3 (`Experts.fake_quantized`)

    @property
    def stat_axes(self) -> tuple:
        """The axes over which devices hold different tokens (stats are summed over them)."""
        return (
            *self.expert_axes,
            *self.reduce_axes,
            *((self.etp,) if self.gather_etp else ()),
        )


def local_moe(spec: LocalSpec, x_th, ids_tk, wts_tk, experts: Experts):
    """Per device: ETP plumbing around the dispatcher, whose experts hold an ffn slice.

    Each ETP rank computes every pair of its token group with its slice of ffn, so the outputs are
    partial sums. Tokens sharded over the ETP axis are all-gathered first and the partials
    reduce-scattered back: each rank keeps only its [T/ETP, H] share of the result (a psum would
    leave the full [T, H] sum on every rank), and the transposes are the same pair (all-gather of
    dy, reduce-scatter of dx). Tokens replicated over the ETP axis get a psum.
    `experts`: w_gate, w_up [E/EP, H, F/ETP], w_down [E/EP, F/ETP, H] and the biases, all three
    or none (b_gate, b_up [E/EP, F/ETP], b_down [E/EP, H]); b_down is added by ETP rank 0 only,
    so that the partial sums hold it once.
    Returns (y [T, H], dropped pairs summed over the token axes).
    """
    etp, gather = spec.etp, spec.gather_etp
    # this device's blocks: the global ones, as F / ETP is whole blocks (the ring quantises them
    # itself, to e4m3 records that it relays or keeps: `RingConfig.fp8_acts`)
    if spec.expert_fp8 and spec.dispatcher != "ring":
        experts = experts.fake_quantized()
    if experts.has_biases and etp is not None:
        experts = experts._replace(b_down=jnp.where(lax.axis_index(etp) == 0, experts.b_down, 0))
    if etp is not None:
        if gather:
            x_th, ids_tk, wts_tk = (
                lax.all_gather(a, etp, axis=0, tiled=True) for a in (x_th, ids_tk, wts_tk)
            )
        else:  # mark them varying over ETP: the transpose sums the partial dx / d weights
            x_th, wts_tk = (varying_like(a, experts.w_gate) for a in (x_th, wts_tk))
    if spec.expert_fp8 and spec.dispatcher != "ring":  # as the gate and up GEMMs see them
        x_th = fp8.quantize_operand(x_th)  # (1 x 128 tiles; the ring rounds its chunks' rows)
    if spec.dispatcher == "ring":
        y_th = _ring(spec, x_th, ids_tk, wts_tk, experts)
        dropped = jnp.int32(0)
    else:
        y_th, dropped = _alltoall(spec, x_th, ids_tk, wts_tk, experts)
        dropped = dropped // (spec.etp_size if gather else 1)  # each ETP rank counted the same
    # its gradient, rounded per token, reaches the down projection's GEMMs (the ring rounds it
    # itself, to an e4m3 record: `ring_moe`'s backward)
    if spec.expert_fp8 and spec.dispatcher != "ring":
        y_th = fp8.quantize_grad(y_th)
    if etp is not None:
        y_th = (
            lax.psum_scatter(y_th, etp, scatter_dimension=0, tiled=True)
            if gather
            else lax.psum(y_th, etp)
        )
    return y_th, dropped


def _ring(spec: LocalSpec, *args):
    cfg = RingConfig(
        axis=spec.expert_axes,
        num_experts=spec.num_experts,
        chunk=spec.chunk,
        reduce_axes=spec.reduce_axes if spec.check_vma else (),
        routing=spec.routing,
        gmm_impl=spec.gmm_impl,
        poison=spec.poison,
        hierarchical=spec.hierarchical,
        activation=spec.activation,
        fp8_acts=spec.expert_fp8,
    )
    return ring_moe(cfg, *args)


def _alltoall(spec: LocalSpec, *args):
    if spec.capacity_factor is not None and not spec.return_stats:
        log.warning(
            "moe_ffn(dispatcher='alltoall', capacity_factor=%s) may drop pairs; "
            "pass return_stats=True to get stats['dropped_pairs']",
            spec.capacity_factor,
        )
    cfg = AllToAllConfig(
        axis=spec.expert_axes,
        num_experts=spec.num_experts,
        capacity_factor=spec.capacity_factor,
        stat_axes=spec.stat_axes,
        gmm_impl=spec.gmm_impl,
        poison=spec.poison,
        activation=spec.activation,
        fp8_acts=spec.expert_fp8,
    )
    return alltoall_moe(cfg, *args)
