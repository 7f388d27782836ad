"""The grouped matmul kernels' custom VJPs, shared by the Pallas Triton (`pallas.py`) and Mosaic
GPU (`mosaic.py`) entry points: the config's type picks the kernels (`pallas_kernels.Config` or
`mosaic_common.MosaicConfig`), and the backward passes are those same kernels.

Pallas kernels cannot be differentiated automatically, so both ops are `jax.custom_vjp`s:
dlhs = gmm(dout, rhs) with `transpose_rhs` flipped (no transpose of rhs is materialised), drhs =
tgmm(lhs, dout) (or tgmm(dout, lhs) for `transpose_rhs`, with the gather moved to the operand that
holds lhs). tgmm's own backward is two gmm calls. With a row gather, the row gradient [M, K] comes
from the gmm kernel in f32 and is scatter-added into [T, K] by XLA. Each rule passes its inputs
through `first_order`: the backward cannot be differentiated again.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.kernels.gmm import mosaic_gmm, mosaic_tgmm, pallas_kernels
from relaymoe_jax.kernels.gmm.common import check_acc, clamp_group_bounds, match_vma
from relaymoe_jax.kernels.gmm.mosaic_common import MosaicConfig
from relaymoe_jax.util.first_order import first_order


def _gmm_kernel(cfg):
    """The gmm kernel launcher for a config's backend."""
    return mosaic_gmm.gmm_call if isinstance(cfg, MosaicConfig) else pallas_kernels.gmm_call


def _tgmm_kernel(cfg):
    """The tgmm kernel launcher for a config's backend."""
    return mosaic_tgmm.tgmm_call if isinstance(cfg, MosaicConfig) else pallas_kernels.tgmm_call


def check_rows(rows, name: str):
    """Holds an optional row-gather index vector as int32 [M] (or None)."""
    if rows is None:
        return None
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got {rows.dtype}{rows.shape}")
    return rows.astype(jnp.int32)


def with_vma(*operands):
    """Holds the operands (None kept) made varying over the same shard_map axes."""
    present = [op for op in operands if op is not None]
    it = iter(match_vma(*present))
    return tuple(None if op is None else next(it) for op in operands)


def _scatter_rows(d_mk, rows_m, group_sizes_g, num_rows: int, dtype):
    """Holds the [num_rows, K] sum of grouped-row gradients d_mk into their source rows.

    Inverse of the fused gather: source row rows_m[r] (clamped as in the kernel)
    receives d_mk[r] for every grouped row r < sum(group_sizes); padding rows,
    whose indices may be garbage, are dropped. Accumulates in float32.
    """
    m = rows_m.shape[0]
    end = clamp_group_bounds(group_sizes_g, m)[1][-1]
    src_m = jnp.where(jnp.arange(m) < end, jnp.clip(rows_m, 0, num_rows - 1), num_rows)
    acc = jnp.zeros((num_rows, d_mk.shape[1]), jnp.float32)
    return acc.at[src_m].add(d_mk.astype(jnp.float32), mode="drop").astype(dtype)


def _grouped_grad(d_mk, rows_m, group_sizes_g, like):
    """Holds the gradient for operand `like` from the grouped-row gradient d_mk."""
    if rows_m is None:
        return d_mk.astype(like.dtype)
    return _scatter_rows(d_mk, rows_m, group_sizes_g, like.shape[0], like.dtype)


def _grad_dtype(rows_m, like):
    """Holds the dtype the kernel writes a grouped-row gradient in (f32 if scattered)."""
    return np.dtype(like.dtype if rows_m is None else jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def gmm_vjp(x, w_gkn, group_sizes_g, rows_m, transpose_rhs: bool, out_dtype, cfg):
    return _gmm_kernel(cfg)(x, w_gkn, group_sizes_g, rows_m, transpose_rhs, out_dtype, cfg)


def _gmm_fwd(x, w_gkn, group_sizes_g, rows_m, transpose_rhs, out_dtype, cfg):
    out = _gmm_kernel(cfg)(x, w_gkn, group_sizes_g, rows_m, transpose_rhs, out_dtype, cfg)
    return out, (x, w_gkn, group_sizes_g, rows_m)


def _gmm_bwd(transpose_rhs, out_dtype, cfg, res, dout_mn):
    res, dout_mn = first_order((res, dout_mn))
    x, w_gkn, group_sizes_g, rows_m = res
    # out = x_g @ W_g    -> dx = dout @ W_g.T, dW_g = x_g.T @ dout_g
    # out = x_g @ W_g.T  -> dx = dout @ W_g,   dW_g = dout_g.T @ x_g
    dx_mk = gmm_vjp(
        dout_mn, w_gkn, group_sizes_g, None, not transpose_rhs, _grad_dtype(rows_m, x), cfg
    )
    dx = _grouped_grad(dx_mk, rows_m, group_sizes_g, x)
    w_dtype = np.dtype(w_gkn.dtype)
    if transpose_rhs:
        dw = tgmm_vjp(dout_mn, x, group_sizes_g, None, rows_m, w_dtype, cfg)
    else:
        dw = tgmm_vjp(x, dout_mn, group_sizes_g, rows_m, None, w_dtype, cfg)
    return dx, dw, None, None


gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def tgmm_vjp(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg):
    return _tgmm_kernel(cfg)(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg)


def _tgmm_fwd(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg):
    out = _tgmm_kernel(cfg)(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg)
    return out, (x, y, group_sizes_g, x_rows_m, y_rows_m)


def _tgmm_bwd(out_dtype, cfg, res, dout_gkn):
    res, dout_gkn = first_order((res, dout_gkn))
    x, y, group_sizes_g, x_rows_m, y_rows_m = res
    # out_g = x_g.T @ y_g  -> dx_g = y_g @ dout_g.T, dy_g = x_g @ dout_g
    dx_mk = gmm_vjp(y, dout_gkn, group_sizes_g, y_rows_m, True, _grad_dtype(x_rows_m, x), cfg)
    dy_mn = gmm_vjp(x, dout_gkn, group_sizes_g, x_rows_m, False, _grad_dtype(y_rows_m, y), cfg)
    return (
        _grouped_grad(dx_mk, x_rows_m, group_sizes_g, x),
        _grouped_grad(dy_mn, y_rows_m, group_sizes_g, y),
        None,
        None,
        None,
    )


tgmm_vjp.defvjp(_tgmm_fwd, _tgmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def tgmm_acc_vjp(x, y, group_sizes_g, x_rows_m, y_rows_m, acc, cfg):
    """acc + tgmm(x, y), accumulated in place in acc's buffer."""
    return _tgmm_kernel(cfg)(x, y, group_sizes_g, x_rows_m, y_rows_m, acc.dtype, cfg, acc)


def _tgmm_acc_fwd(x, y, group_sizes_g, x_rows_m, y_rows_m, acc, cfg):
    out = _tgmm_kernel(cfg)(x, y, group_sizes_g, x_rows_m, y_rows_m, acc.dtype, cfg, acc)
    return out, (x, y, group_sizes_g, x_rows_m, y_rows_m)


def _tgmm_acc_bwd(cfg, res, dout_gkn):
    return (*_tgmm_bwd(dout_gkn.dtype, cfg, res, dout_gkn), dout_gkn)  # d acc = dout


tgmm_acc_vjp.defvjp(_tgmm_acc_fwd, _tgmm_acc_bwd)


def gmm_entry(lhs, rhs, group_sizes, lhs_rows, transpose_rhs, preferred_element_type, config):
    """A kernel's `gmm` after its own keyword arguments: the operand checks, then `config()` (the
    backend's checked config), the output dtype and the custom VJP."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"need lhs [M, K] and rhs 3-D, got {lhs.shape} and {rhs.shape}")
    cfg = config()
    out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    args = with_vma(lhs, rhs, group_sizes, check_rows(lhs_rows, "lhs_rows"))
    return gmm_vjp(*args, bool(transpose_rhs), out_dtype, cfg)


def tgmm_entry(lhs, rhs, group_sizes, lhs_rows, rhs_rows, preferred_element_type, acc, config):
    """A kernel's `tgmm` after its own keyword arguments, as `gmm_entry`."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lhs_rows, rhs_rows = check_rows(lhs_rows, "lhs_rows"), check_rows(rhs_rows, "rhs_rows")
    m_x = (lhs if lhs_rows is None else lhs_rows).shape[0]
    m_y = (rhs if rhs_rows is None else rhs_rows).shape[0]
    if lhs.ndim != 2 or rhs.ndim != 2 or m_x != m_y:
        raise ValueError(
            f"need lhs [M, K] and rhs [M, N] (M rows after any gather), got "
            f"{lhs.shape} and {rhs.shape}"
        )
    cfg = config()
    out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if acc is None:
        return tgmm_vjp(*with_vma(lhs, rhs, group_sizes, lhs_rows, rhs_rows), out_dtype, cfg)
    acc = check_acc(acc, (group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)
    return tgmm_acc_vjp(*with_vma(lhs, rhs, group_sizes, lhs_rows, rhs_rows, acc), cfg)
