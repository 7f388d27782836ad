"""Compute kernels used by the MoE dispatchers."""

from relaymoe_jax.kernels.gmm import gmm, tgmm

__all__ = ["gmm", "tgmm"]
