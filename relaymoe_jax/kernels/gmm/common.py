"""What every grouped-matmul implementation shares: the dtype its products are taken in.

A 16-bit operand meeting a float32 one is the common accident: a matmul with
`preferred_element_type=float32` hands its float32 cotangent to the next grouped matmul under
autodiff. Promoting (float32 math, IEEE precision) would run the GPU kernel in f32 FMA without the
tensor cores: ~10x to 100x slower (our all-to-all's backward ran ~160x slower on an H200 that
way). So the wider operand is cast to the narrower one: bf16 x f32 multiplies in bf16 on the
tensor cores (accumulating in float32 as always), and the output dtype is unchanged. Two different
16-bit types (bf16 x f16) are refused: neither is "the" narrower one. Equal types, and float32 x
float64, multiply as before (promoted; float32 at `Precision.HIGHEST`, no TF32).
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

NARROW_BYTES = 2  # itemsize of bf16/f16 (and smaller: fp8)


def operand_dtype(a, b) -> np.dtype:
    """Holds the dtype both operands are cast to before the product (module doc)."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    floats = jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)
    narrow = [d for d in (a, b) if d.itemsize <= NARROW_BYTES]
    if not floats or not narrow:
        return np.dtype(jnp.promote_types(a, b))
    if len(narrow) == 2:
        raise ValueError(
            f"grouped matmul operands of two different narrow types, {a} and {b}: "
            f"cast one to the other's dtype first"
        )
    return narrow[0]


def precision(compute) -> lax.Precision:
    """HIGHEST (IEEE, no TF32) for float32 math; the native MMA path for narrower types."""
    return lax.Precision.HIGHEST if np.dtype(compute) == np.float32 else lax.Precision.DEFAULT


def check_acc(acc, shape, dtype):
    """Holds tgmm's `acc` checked to be a [G, K, N] array of the output dtype."""
    acc = jnp.asarray(acc)
    if tuple(acc.shape) != tuple(shape) or np.dtype(acc.dtype) != np.dtype(dtype):
        raise ValueError(
            f"acc must be the output's [G, K, N] = {tuple(shape)} {np.dtype(dtype)} "
            f"(preferred_element_type), got {acc.dtype}{tuple(acc.shape)}"
        )
    return acc
