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
from relaymoe_jax.kernels.gmm.fp8 import gmm_fp8

__all__ = [
    "IMPLS",
    "MOE_IMPLS",
    "describe_impl",
    "gmm",
    "gmm_fp8",
    "impl_kwargs",
    "resolve_impl",
    "tgmm",
]
