"""Blocked XLA grouped matmul: a while_loop over (row tile, group) work items.

Memory is the output plus O(tile_m x (K + N)) temporaries; no [G, M, K] masked
copy is ever built (that is what `lax.ragged_dot` lowers to on CPU).

Work items. Rows are sorted by group; group g owns rows [start_g, end_g). With
row tiles of `tm` rows, group g touches tiles start_g // tm .. (end_g - 1) // tm
(none if it is empty). Consecutive groups share at most one boundary tile, so
there are at most cdiv(M, tm) + G - 1 items; the loop runs over the traced
item count. Each item computes one full [tm, K] x [K, N] dot and keeps only the
rows of its group in its tile, so the compute is at most
(cdiv(M, tm) + G - 1) * tm rows' worth, i.e. about M + (G - 1) * tm.

The last tile is shifted back to start at M - tm when M % tm != 0, so every
slice stays in bounds; each item masks rows by their true row index
(inside its own tile AND inside its group), so every row is produced once.

Both ops carry a `jax.custom_vjp` whose backward pass is again gmm/tgmm, so AD
never differentiates through the loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.kernels.gmm.common import (
    WorkItems,
    match_vma,
    operand_dtype,
    precision,
    work_items,
)
from relaymoe_jax.util.first_order import first_order
from relaymoe_jax.util.late import late_zero

DEFAULT_TILE_M = 128


_I0 = np.int32(0)  # a start index of int32 like the traced ones (x64 would make 0 an int64)


def _tile_rows(items: WorkItems, i: jax.Array, m: int, tm: int):
    """Holds item i's group, tile start row and [tm] mask of the rows it owns."""
    g = items.group_i[i]
    tile = items.tile_i[i]
    row0 = jnp.minimum(tile * tm, m - tm)  # shifted back so the slice fits
    rows_t = row0 + jnp.arange(tm, dtype=jnp.int32)
    lo = jnp.maximum(items.start_g[g], tile * tm)
    hi = jnp.minimum(items.end_g[g], (tile + 1) * tm)
    return g, row0, (rows_t >= lo) & (rows_t < hi)


def _zeros_like_vma(shape, dtype, *operands) -> jax.Array:
    """Holds zeros typed as varying over every shard_map axis any operand varies over.

    A while_loop carry must keep its type; the body mixes in the (varying)
    operands, so the initial zeros must already be varying. `lax.full_like`
    copies the operand's varying axes, so summing scalar zeros built from each
    operand gives the union, with no version-specific type inspection.
    """
    zero = sum(lax.full_like(op, 0, dtype, shape=()) for op in operands)
    zero = late_zero(zero, operands[0])  # made once the operands exist
    return jnp.broadcast_to(zero, shape)


def _gmm_fwd_impl(x_mk, w_gkn, group_sizes_g, transpose_rhs, tm, out_dtype):
    """Holds out[M, N]: rows of group g times w[g] (or w[g].T); other rows 0."""
    m, k = x_mk.shape
    n = w_gkn.shape[1] if transpose_rhs else w_gkn.shape[2]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    tm = min(tm, m)
    items = work_items(group_sizes_g, m, tm)
    compute = operand_dtype(x_mk.dtype, w_gkn.dtype)
    prec = precision(compute)
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def body(carry):
        i, out_mn = carry
        g, row0, own_t = _tile_rows(items, i, m, tm)
        x_tk = lax.dynamic_slice(x_mk, (row0, _I0), (tm, k)).astype(compute)
        w_kn = lax.dynamic_index_in_dim(w_gkn, g, keepdims=False).astype(compute)
        y_tn = lax.dot_general(
            x_tk,
            w_kn,
            (contract, ((), ())),
            precision=prec,
            preferred_element_type=jnp.float32,
        ).astype(out_dtype)
        cur_tn = lax.dynamic_slice(out_mn, (row0, _I0), (tm, n))
        new_tn = jnp.where(own_t[:, None], y_tn, cur_tn)
        return i + 1, lax.dynamic_update_slice(out_mn, new_tn, (row0, _I0))

    out_mn = _zeros_like_vma((m, n), out_dtype, x_mk, w_gkn, group_sizes_g)
    _, out_mn = lax.while_loop(lambda c: c[0] < items.count, body, (jnp.int32(0), out_mn))
    return out_mn


def _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, tm, out_dtype, acc_gkn=None):
    """Holds out[G, K, N] = x[rows of g].T @ y[rows of g] (+ acc_gkn, the loop's initial carry,
    when given); rows outside groups ignored."""
    m, k = x_mk.shape
    n = y_mn.shape[1]
    num_groups = group_sizes_g.shape[0]
    if m == 0:
        return jnp.zeros((num_groups, k, n), out_dtype) if acc_gkn is None else acc_gkn
    tm = min(tm, m)
    items = work_items(group_sizes_g, m, tm)
    compute = operand_dtype(x_mk.dtype, y_mn.dtype)
    prec = precision(compute)

    def body(carry):
        i, acc_gkn = carry
        g, row0, own_t = _tile_rows(items, i, m, tm)
        # Mask both operands with where (0 * NaN would be NaN).
        x_tk = lax.dynamic_slice(x_mk, (row0, _I0), (tm, k)).astype(compute)
        y_tn = lax.dynamic_slice(y_mn, (row0, _I0), (tm, n)).astype(compute)
        x_tk = jnp.where(own_t[:, None], x_tk, jnp.zeros((), compute))
        y_tn = jnp.where(own_t[:, None], y_tn, jnp.zeros((), compute))
        d_kn = lax.dot_general(
            x_tk,
            y_tn,
            (((0,), (0,)), ((), ())),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        cur_1kn = lax.dynamic_slice(acc_gkn, (g, _I0, _I0), (1, k, n))
        return i + 1, lax.dynamic_update_slice(acc_gkn, cur_1kn + d_kn[None], (g, _I0, _I0))

    if acc_gkn is None:
        acc_gkn = _zeros_like_vma((num_groups, k, n), jnp.float32, x_mk, y_mn, group_sizes_g)
    else:
        acc_gkn = acc_gkn.astype(jnp.float32)
    _, acc_gkn = lax.while_loop(lambda c: c[0] < items.count, body, (jnp.int32(0), acc_gkn))
    return acc_gkn.astype(out_dtype)


# ---------------------------------------------------------------- custom VJPs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_vjp(x_mk, w_gkn, group_sizes_g, transpose_rhs: bool, tm: int, out_dtype):
    """Holds gmm(x, w, group_sizes) computed by the blocked loop (see module doc)."""
    return _gmm_fwd_impl(x_mk, w_gkn, group_sizes_g, transpose_rhs, tm, out_dtype)


def _gmm_fwd(x_mk, w_gkn, group_sizes_g, transpose_rhs, tm, out_dtype):
    out = _gmm_fwd_impl(x_mk, w_gkn, group_sizes_g, transpose_rhs, tm, out_dtype)
    return out, (x_mk, w_gkn, group_sizes_g)


def _gmm_bwd(transpose_rhs, tm, out_dtype, res, dout_mn):
    res, dout_mn = first_order((res, dout_mn))
    x_mk, w_gkn, group_sizes_g = res
    # out = x_g @ W_g        -> dx = dout @ W_g.T, dW_g = x_g.T @ dout_g
    # out = x_g @ W_g.T      -> dx = dout @ W_g,   dW_g = dout_g.T @ x_g
    dx_mk = _gmm_vjp(dout_mn, w_gkn, group_sizes_g, not transpose_rhs, tm, np.dtype(x_mk.dtype))
    if transpose_rhs:
        dw = _tgmm_vjp(dout_mn, x_mk, group_sizes_g, tm, np.dtype(w_gkn.dtype))
    else:
        dw = _tgmm_vjp(x_mk, dout_mn, group_sizes_g, tm, np.dtype(w_gkn.dtype))
    return dx_mk, dw, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tgmm_vjp(x_mk, y_mn, group_sizes_g, tm: int, out_dtype):
    """Holds tgmm(x, y, group_sizes) computed by the blocked loop (see module doc)."""
    return _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, tm, out_dtype)


def _tgmm_fwd(x_mk, y_mn, group_sizes_g, tm, out_dtype):
    return _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, tm, out_dtype), (x_mk, y_mn, group_sizes_g)


def _tgmm_bwd(tm, out_dtype, res, dout_gkn):
    res, dout_gkn = first_order((res, dout_gkn))
    x_mk, y_mn, group_sizes_g = res
    # out_g = x_g.T @ y_g  -> dx_g = y_g @ dout_g.T, dy_g = x_g @ dout_g
    dx_mk = _gmm_vjp(y_mn, dout_gkn, group_sizes_g, True, tm, np.dtype(x_mk.dtype))
    dy_mn = _gmm_vjp(x_mk, dout_gkn, group_sizes_g, False, tm, np.dtype(y_mn.dtype))
    return dx_mk, dy_mn, None


_tgmm_vjp.defvjp(_tgmm_fwd, _tgmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tgmm_acc_vjp(x_mk, y_mn, group_sizes_g, acc_gkn, tm: int):
    """Holds acc + tgmm(x, y): the blocked loop carrying acc (only the items' groups touched)."""
    return _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, tm, acc_gkn.dtype, acc_gkn)


def _tgmm_acc_fwd(x_mk, y_mn, group_sizes_g, acc_gkn, tm):
    out = _tgmm_fwd_impl(x_mk, y_mn, group_sizes_g, tm, acc_gkn.dtype, acc_gkn)
    return out, (x_mk, y_mn, group_sizes_g)


def _tgmm_acc_bwd(tm, res, dout_gkn):
    return (*_tgmm_bwd(tm, dout_gkn.dtype, res, dout_gkn), dout_gkn)  # d acc = dout


_tgmm_acc_vjp.defvjp(_tgmm_acc_fwd, _tgmm_acc_bwd)


def gmm_xla(x_mk, w_gkn, group_sizes_g, transpose_rhs: bool, tm: int, out_dtype):
    """Holds out[M, N] of the blocked grouped matmul (differentiable in x, w)."""
    x_mk, w_gkn, group_sizes_g = match_vma(x_mk, w_gkn, group_sizes_g)
    return _gmm_vjp(x_mk, w_gkn, group_sizes_g, transpose_rhs, tm, out_dtype)


def tgmm_xla(x_mk, y_mn, group_sizes_g, tm: int, out_dtype, acc_gkn=None):
    """Holds out[G, K, N] of the blocked transposed grouped matmul, plus acc_gkn (in the loop's
    carry) when given (differentiable)."""
    if acc_gkn is None:
        x_mk, y_mn, group_sizes_g = match_vma(x_mk, y_mn, group_sizes_g)
        return _tgmm_vjp(x_mk, y_mn, group_sizes_g, tm, out_dtype)
    return _tgmm_acc_vjp(*match_vma(x_mk, y_mn, group_sizes_g, acc_gkn), tm)
