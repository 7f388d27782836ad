"""Grouped matmul via `lax.ragged_dot_general`.

gmm is differentiated by JAX itself. tgmm (ragged *contracting* dimension) has
no JAX transpose rule for its rhs (jax 0.12: "Unimplemented grad_y_dims ... in
mode RAGGED_CONTRACTING"), so it carries a small custom_vjp whose backward pass
is two ragged gmm calls.

On CPU, XLA lowers ragged dots to a dense masked [G, M, K] computation, so this
path costs G x the memory of the blocked `xla` implementation. It is kept as an
independent cross-check and for backends with a native ragged-dot kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.kernels.gmm.common import clamp_group_sizes, match_vma, operand_dtype, precision
from relaymoe_jax.util.first_order import first_order


def gmm_ragged(x_mk, w_gkn, group_sizes_g, transpose_rhs: bool, out_dtype) -> jax.Array:
    """Holds out[M, N] = rows of group g @ w[g] (or w[g].T); rows past the sum are 0."""
    m = x_mk.shape[0]
    compute = operand_dtype(x_mk.dtype, w_gkn.dtype)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out_mn = lax.ragged_dot_general(
        x_mk.astype(compute),
        w_gkn.astype(compute),
        clamp_group_sizes(group_sizes_g, m),
        dims,
        precision=precision(compute),
        preferred_element_type=jnp.float32,
    )
    return out_mn.astype(out_dtype)


def tgmm_ragged(x_mk, y_mn, group_sizes_g, out_dtype) -> jax.Array:
    """Holds out[G, K, N] = x[rows of g].T @ y[rows of g] (differentiable in x, y)."""
    x_mk, y_mn, group_sizes_g = match_vma(x_mk, y_mn, group_sizes_g)
    return _tgmm_vjp(x_mk, y_mn, group_sizes_g, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tgmm_vjp(x_mk, y_mn, group_sizes_g, out_dtype) -> jax.Array:
    return _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, out_dtype)


def _tgmm_fwd(x_mk, y_mn, group_sizes_g, out_dtype):
    return _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, out_dtype), (x_mk, y_mn, group_sizes_g)


def _tgmm_bwd(out_dtype, res, dout_gkn):
    res, dout_gkn = first_order((res, dout_gkn))
    x_mk, y_mn, group_sizes_g = res
    # out_g = x_g.T @ y_g  -> dx_g = y_g @ dout_g.T, dy_g = x_g @ dout_g
    dx_mk = gmm_ragged(y_mn, dout_gkn, group_sizes_g, True, np.dtype(x_mk.dtype))
    dy_mn = gmm_ragged(x_mk, dout_gkn, group_sizes_g, False, np.dtype(y_mn.dtype))
    return dx_mk, dy_mn, None


_tgmm_vjp.defvjp(_tgmm_fwd, _tgmm_bwd)


def _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, out_dtype) -> jax.Array:
    """Holds out[G, K, N] = x[rows of g].T @ y[rows of g] (ragged contracting dim)."""
    m = x_mk.shape[0]
    compute = operand_dtype(x_mk.dtype, y_mn.dtype)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out_gkn = lax.ragged_dot_general(
        x_mk.astype(compute),
        y_mn.astype(compute),
        clamp_group_sizes(group_sizes_g, m),
        dims,
        precision=precision(compute),
        preferred_element_type=jnp.float32,
    )
    return out_gkn.astype(out_dtype)
