"""Grouped matmul (gmm) and its transposed form (tgmm) for sorted MoE rows."""

from relaymoe_jax.kernels.gmm.api import (
    IMPLS,
    MOE_IMPLS,
    describe_impl,
    gmm,
    impl_kwargs,
    resolve_impl,
    tgmm,
)

__all__ = ["IMPLS", "MOE_IMPLS", "describe_impl", "gmm", "impl_kwargs", "resolve_impl", "tgmm"]
