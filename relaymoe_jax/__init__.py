"""RelayMoE in JAX: ring-based expert-parallel MoE dispatch (arXiv 2610.07333)."""

from relaymoe_jax.dispatch.mode import RoutingVolumes, routing_volumes
from relaymoe_jax.dispatch.plan import poison_unwritten
from relaymoe_jax.op import moe_ffn, moe_ffn_local, routing_plan
from relaymoe_jax.validate import DISPATCHERS

__all__ = ["DISPATCHERS", "RoutingVolumes", "moe_ffn", "moe_ffn_local", "poison_unwritten",
           "routing_plan", "routing_volumes"]
