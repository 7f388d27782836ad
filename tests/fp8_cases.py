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


def ref_fake(x, block) -> np.ndarray:
    """x's values as e4m3 with `block` scales, in float64."""
    return ref_dequantize(*ref_quantize(x, block), block)


TILE, BLOCK = (1, 128), (128, 128)


def ref_fp8_moe(x, ids, wts, wg, wu, wd, dy, quantize=True):
    """The FP8 recipe's MoE FFN with SwiGLU (docs/precision.md), pair by pair in float64, and its
    gradients written out by hand: (y, {x, wts, wg, wu, wd}) for y's cotangent dy.

    Forward: x rounded per 1 x 128 tile, the matrices per 128 x 128 block; gate = xq @ wg_e,
    up = xq @ wu_e, h = silu(gate) * up rounded per tile, y = sum_j wts_j * h @ wd_e.
    Backward: dy rounded per tile (every use of it), the gate's and up's gradients rounded per
    tile before their dgrad and wgrad products; the roundings' gradients are the identity (x's and
    the matrices' gradients are those at the rounded values). quantize=False: the same formulas
    with no rounding (the unquantised reference)."""
    f64 = lambda a: np.asarray(a, np.float64)
    x, wts, wg, wu, wd, dy = map(f64, (x, wts, wg, wu, wd, dy))
    ids = np.asarray(ids)
    qt = (lambda a: ref_fake(a, TILE)) if quantize else (lambda a: a)
    qb = (lambda a: ref_fake(a, BLOCK)) if quantize else (lambda a: a)
    xq, wgq, wuq, wdq, dyq = qt(x), qb(wg), qb(wu), qb(wd), qt(dy)
    y = np.zeros_like(x)
    grads = {n: np.zeros_like(a) for n, a in (("x", x), ("wts", wts), ("wg", wg), ("wu", wu))}
    grads["wd"] = np.zeros_like(wd)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        g = np.einsum("th,thf->tf", xq, wgq[e])
        u = np.einsum("th,thf->tf", xq, wuq[e])
        sig = 1.0 / (1.0 + np.exp(-g))
        hq = qt(g * sig * u)
        y_p = np.einsum("tf,tfh->th", hq, wdq[e])
        y += wts[:, j, None] * y_p
        dy_p = wts[:, j, None] * dyq
        grads["wts"][:, j] = np.sum(dyq * y_p, axis=-1)
        np.add.at(grads["wd"], e, np.einsum("tf,th->tfh", hq, dy_p))
        dh = np.einsum("th,tfh->tf", dy_p, wdq[e])
        dg = qt(dh * u * sig * (1.0 + g * (1.0 - sig)))
        du = qt(dh * g * sig)
        grads["x"] += np.einsum("tf,thf->th", dg, wgq[e]) + np.einsum("tf,thf->th", du, wuq[e])
        np.add.at(grads["wg"], e, np.einsum("th,tf->thf", xq, dg))
        np.add.at(grads["wu"], e, np.einsum("th,tf->thf", xq, du))
    return y, grads
