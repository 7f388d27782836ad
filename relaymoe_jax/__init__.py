"""RelayMoE in JAX: ring-based expert-parallel MoE dispatch (arXiv 2610.07333)."""

from relaymoe_jax.dispatch.plan import poison_unwritten
from relaymoe_jax.op import DISPATCHERS, moe_ffn

__all__ = ["DISPATCHERS", "moe_ffn", "poison_unwritten"]
