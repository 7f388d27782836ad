"""`gmm_fp8`: the grouped matmul on e4m3 operands with DeepSeek-V3's block scales, by our Mosaic
GPU kernel (`mosaic_fp8.py`, Hopper's FP8 wgmma at twice the bf16 rate), and its custom VJP.

    out = gmm_fp8(x, w, group_sizes)   # x [M, K]; w [G, K, N] (or [G, N, K], transpose_rhs)

x is rounded to e4m3 per 1 x 128 tile and w per 128 x 128 block (`quant.fp8.quantize`; values
already on that grid, such as the FP8 recipe's rounded operands, come back unchanged, so the
product is exactly the 16-bit product of the rounded values up to the order of the float32 sums).
w may also be an `fp8.Fp8` record (the ring's relayed weights: quantised once, no round trip).

Backward (the FP8 recipe, docs/precision.md): the cotangent is rounded per 1 x 128 tile of its
channels (the dgrad's contraction); dx is the e4m3 kernel again, on the forward's quantised w in
the other orientation (a 128 x 128 block's scale survives the transpose); dW is the 16-bit
`tgmm` kernel on the rounded values (its contraction runs over rows, along which the tile scales
vary: exact in bf16, at 16-bit speed). An `Fp8` w is a constant: it has no gradient.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.kernels.gmm import mosaic_fp8, mosaic_tgmm
from relaymoe_jax.kernels.gmm.common import match_vma
from relaymoe_jax.kernels.gmm.mosaic import make_config
from relaymoe_jax.kernels.gmm.vjp import check_rows
from relaymoe_jax.quant import fp8
from relaymoe_jax.util.first_order import first_order


def gmm_fp8(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    transpose_rhs=False,
    lhs_rows=None,
    interpret=False,
    zero_padding=True,
    config=None,
) -> jax.Array:
    """Grouped matmul of e4m3-rounded operands (module doc): out[M, N], rows of group g times
    Q(rhs[g]) (`.T` if `transpose_rhs`), float32 accumulation, in `preferred_element_type`
    (default lhs's dtype). lhs [M, K] float (or a [T, K] row source with `lhs_rows` [M],
    gathered by XLA first); rhs [G, K, N] ([G, N, K] with `transpose_rhs`), a float array or an
    `fp8.Fp8` in 128 x 128 blocks. `interpret`, `zero_padding`, `config`: as `mosaic.gmm`'s.
    Differentiable in lhs and an array rhs."""
    lhs = jnp.asarray(lhs)
    if lhs.ndim != 2 or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(
            f"gmm_fp8: lhs must be a 2-D float array [M, K], got {lhs.dtype}{lhs.shape}"
        )
    if isinstance(rhs, fp8.Fp8):
        if rhs.block != (fp8.BLOCK, fp8.BLOCK):
            raise ValueError(f"gmm_fp8: an Fp8 rhs must be in 128 x 128 blocks, got {rhs.block}")
    else:
        rhs = jnp.asarray(rhs)
        if not jnp.issubdtype(rhs.dtype, jnp.floating):
            raise ValueError(f"gmm_fp8: rhs must be a float array or an Fp8, got {rhs.dtype}")
    if len(rhs.shape) != 3:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(f"gmm_fp8: rhs must be 3-D {layout}, got shape {rhs.shape}")
    k_axis = 2 if transpose_rhs else 1
    if rhs.shape[k_axis] != lhs.shape[1]:
        raise ValueError(
            f"gmm_fp8: rhs.shape[{k_axis}]={rhs.shape[k_axis]} must equal K=lhs.shape[1]="
            f"{lhs.shape[1]}"
        )
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"gmm_fp8: group_sizes must be integer [G={rhs.shape[0]}], got "
            f"{group_sizes.dtype}{group_sizes.shape}"
        )
    rows = check_rows(lhs_rows, "lhs_rows")
    if rows is not None:
        lhs = jnp.take(lhs, rows, axis=0, mode="clip")
    cfg = make_config(interpret, zero_padding, config)
    out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    group_sizes = group_sizes.astype(jnp.int32)
    if isinstance(rhs, fp8.Fp8):
        x = fp8.quantize(lhs, fp8.TILE)
        return mosaic_fp8.gmm_fp8_call(x, rhs, group_sizes, bool(transpose_rhs), out_dtype, cfg)
    lhs, rhs, group_sizes = match_vma(lhs, rhs, group_sizes)
    return _gmm_fp8(lhs, rhs, group_sizes, bool(transpose_rhs), out_dtype, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_fp8(x, w, group_sizes, transpose_rhs, out_dtype, cfg):
    return _fwd(x, w, group_sizes, transpose_rhs, out_dtype, cfg)[0]


def _fwd(x, w, group_sizes, transpose_rhs, out_dtype, cfg):
    x_q, w_q = fp8.quantize(x, fp8.TILE), fp8.quantize(w)
    out = mosaic_fp8.gmm_fp8_call(x_q, w_q, group_sizes, transpose_rhs, out_dtype, cfg)
    return out, (x_q, w_q, group_sizes, np.zeros((), x.dtype), np.zeros((), w.dtype))


def _bwd(transpose_rhs, out_dtype, cfg, res, dout):
    (x_q, w_q, group_sizes, x_like, w_like), dout = first_order((res, dout))
    d_q = fp8.quantize(dout, fp8.TILE)
    # out = x_g @ W_g -> dx = dout @ W_g.T, dW_g = x_g.T @ dout_g (W_g.T: the other way round)
    dx = mosaic_fp8.gmm_fp8_call(d_q, w_q, group_sizes, not transpose_rhs, x_like.dtype, cfg)
    wide = jnp.bfloat16  # the rounded values are exact in bf16 (`quant.fp8`)
    x16, d16 = fp8.dequantize(x_q, wide), fp8.dequantize(d_q, wide)
    a, b = (d16, x16) if transpose_rhs else (x16, d16)
    dw = mosaic_tgmm.tgmm_call(a, b, group_sizes, None, None, w_like.dtype, cfg)
    return dx, dw, None


_gmm_fp8.defvjp(_fwd, _bwd)
