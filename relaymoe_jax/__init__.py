"""RelayMoE in JAX: ring-based expert-parallel MoE dispatch (arXiv 2610.07333)."""

import sys

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.dispatch.activation import ACTIVATIONS, Activation
from relaymoe_jax.dispatch.mode import RoutingVolumes, routing_volumes
from relaymoe_jax.dispatch.pairs import poison_unwritten
from relaymoe_jax.op import moe_ffn, moe_ffn_local, routing_plan
from relaymoe_jax.op.options import DISPATCHERS, MoEOptions
from relaymoe_jax.xla_options import XLA_FLAGS, XLA_OPTIONS

# public as relaymoe_jax.gpu_mesh (it lives in analysis/): `import relaymoe_jax.gpu_mesh` works too
sys.modules["relaymoe_jax.gpu_mesh"] = gpu_mesh

__all__ = [
    "ACTIVATIONS",
    "DISPATCHERS",
    "XLA_FLAGS",
    "XLA_OPTIONS",
    "Activation",
    "MoEOptions",
    "RoutingVolumes",
    "gpu_mesh",
    "moe_ffn",
    "moe_ffn_local",
    "poison_unwritten",
    "routing_plan",
    "routing_volumes",
]
