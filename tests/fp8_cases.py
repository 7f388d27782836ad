"""A float64 numpy reference of blockwise e4m3 quantisation (no test functions here), written
from the definition (`relaymoe_jax.quant.fp8`'s module doc): ml_dtypes' e4m3 rounding and a
power-of-two scale found by search, not by the library's exponent arithmetic."""

import math

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


def ref_scale_exp(amax: float) -> int:
    """The smallest e >= -126 (float32's smallest normal) with amax / 2^e <= 448, by search in
    float64."""
    if amax == 0:
        return -126
    e = math.floor(math.log2(amax / 448.0)) - 2
    while amax / 2.0**e > 448.0:
        e += 1
    return max(e, -126)


def ref_quantize(x: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(q as e4m3, scales) of x [..., R, C], block by block, in float64."""
    x = np.asarray(x, np.float64)
    br, bc = block
    *lead, r, c = x.shape
    nr, nc = -(-r // br), -(-c // bc)
    q = np.zeros(x.shape, E4M3)
    scale = np.zeros((*lead, nr, nc), np.float64)
    for idx in np.ndindex(*lead, nr, nc):
        *b, i, j = idx
        sl = (*b, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
        amax = np.max(np.abs(x[sl]))
        if not np.isfinite(amax):
            scale[idx] = np.nan
            q[sl] = np.nan  # any: the block dequantises to NaN
            continue
        e = ref_scale_exp(float(amax))
        scale[idx] = 2.0**e
        q[sl] = (x[sl] / 2.0**e).astype(E4M3)
    return q, scale


def ref_dequantize(q, scale, block):
    full = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return q.astype(np.float64) * full[..., : q.shape[-2], : q.shape[-1]]
