"""RelayMoE in JAX: ring-based expert-parallel MoE dispatch (arXiv 2610.07333)."""

from relaymoe_jax.dispatch.mode import RoutingVolumes, routing_volumes
from relaymoe_jax.dispatch.plan import poison_unwritten
from relaymoe_jax.op import moe_ffn, moe_ffn_local, routing_plan
from relaymoe_jax.validate import DISPATCHERS
from relaymoe_jax.xla_options import XLA_FLAGS, XLA_OPTIONS

__all__ = [
    "DISPATCHERS",
    "XLA_FLAGS",
    "XLA_OPTIONS",
    "RoutingVolumes",
    "moe_ffn",
    "moe_ffn_local",
    "poison_unwritten",
    "routing_plan",
    "routing_volumes",
]
