"""Grouped matmul (gmm) and its transposed form (tgmm) for sorted MoE rows."""
from relaymoe_jax.kernels.gmm.api import IMPLS, gmm, resolve_impl, tgmm

__all__ = ["IMPLS", "gmm", "resolve_impl", "tgmm"]
