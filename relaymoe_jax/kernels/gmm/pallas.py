"""Pallas (Triton lowering) grouped matmul `gmm` and its ragged-contracting form `tgmm`: the
public entry points, with their argument checks and custom VJPs.

Row layout and contract are those of `api.py`. Rows of `lhs` are sorted by group,
and group g owns rows [start_g, end_g). Sizes are clamped: a negative size counts
as 0, and groups are cut at row M. Rows >= sum(group_sizes) are padding. gmm
returns exact zeros there, and neither op ever loads them, so NaN/Inf in padding
rows cannot leak into other rows or into the weight gradient. Math accumulates
in float32. float32 operands use IEEE dots (`Precision.HIGHEST`, no TF32), and
narrower operands use the tensor cores' native bf16/f16 path (wgmma on Hopper).
Mixed operands follow `common.operand_dtype`: a 16-bit operand with a float32
one (a float32 cotangent, in the backward of a float32-output gmm) multiplies in
the 16-bit type, the float32 operand cast down before the kernel; promoting
would lower to `tt.dot(f32, f32)` in IEEE f32 FMA, spilling registers (it ran
our all-to-all's backward ~160x slower on an H200). bf16 x f16 is refused.

The kernels themselves (their grids, work items, masking, zero-row guarantee and fused row
gather) are described and written in `pallas_kernels.py`.

Differentiation. Pallas kernels cannot be differentiated automatically, so both
ops are `jax.custom_vjp`s whose backward passes are these same kernels:
dlhs = gmm(dout, rhs) with `transpose_rhs` flipped (no transpose of rhs is
materialised), drhs = tgmm(lhs, dout) (or tgmm(dout, lhs) for `transpose_rhs`,
with the gather moved to the operand that holds lhs). tgmm's own backward is
two gmm calls. With a fused gather, the row gradient [M, K] comes from the gmm
kernel in f32 and is scatter-added into [T, K] by XLA.

Why Triton and not Mosaic GPU. Mosaic GPU (`plgpu.kernel`, wgmma, TMA, warp
specialisation) is the route to peak Hopper throughput, and JAX's
`ragged_dot_mgpu` is the anchor to beat there. But it is Hopper/Blackwell only.
Its kernels are written against warpgroup and TMA primitives rather than
generic BlockSpec grids, and its CPU interpreter runs only such whole-ref
kernels (a generic BlockSpec pallas_call fails an assertion). The masked, generic
design here would have to be rewritten, not ported. The Triton lowering of
`pl.pallas_call` has three advantages:
  * the same kernel body runs with `interpret=True` on CPU, which is how it is
    tested here;
  * it lowers for CUDA from a CPU-only host (see tests);
  * one source serves Ampere and Hopper.
Caveats:
  * JAX 0.12 warns at lowering that the Pallas Triton backend is deprecated in
    favour of Mosaic GPU (or jax_triton).
  * Triton needs power-of-two block shapes, and `tl.dot` needs >= 16; both are
    checked here (`pallas_kernels.check_block`).
  * The block defaults are untuned guesses for H100/H200 bf16: 64 x 128 x 64,
    4 warps, 3 stages (2 for 4-byte dtypes, to fit shared memory). On an H200
    they run at 300-377 TFLOP/s forward (BENCHMARKS.md, "On a real H200").
    Shared memory is checked when a kernel is loaded, not compiled: 128 x 256 x 64
    with 3 stages compiles but its tgmm needs 245,760 bytes (> 232,448) at launch,
    so stages are fitted to SMEM_BYTES up front (`pallas_kernels.compiler_params`).
  * A tile shared by two groups is computed once per group. That is at most G
    extra tiles of `block_m` rows, about 12% at M=8192, G=16, block_m=64.
  * Interpret mode fails under `shard_map(check_vma=True)` in JAX 0.12: the
    interpreter mixes varying and non-varying values. Real lowering works
    there; in interpret mode use `check_vma=False` (see tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.kernels.gmm.common import check_acc, clamp_group_bounds, match_vma
from relaymoe_jax.kernels.gmm.pallas_kernels import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_M,
    DEFAULT_BLOCK_N,
    Config,
    check_block,
    gmm_call,
    tgmm_call,
)
from relaymoe_jax.util.first_order import first_order


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
def _gmm_vjp(x, w_gkn, group_sizes_g, rows_m, transpose_rhs: bool, out_dtype, cfg: Config):
    return gmm_call(x, w_gkn, group_sizes_g, rows_m, transpose_rhs, out_dtype, cfg)


def _gmm_fwd(x, w_gkn, group_sizes_g, rows_m, transpose_rhs, out_dtype, cfg):
    out = gmm_call(x, w_gkn, group_sizes_g, rows_m, transpose_rhs, out_dtype, cfg)
    return out, (x, w_gkn, group_sizes_g, rows_m)


def _gmm_bwd(transpose_rhs, out_dtype, cfg, res, dout_mn):
    res, dout_mn = first_order((res, dout_mn))
    x, w_gkn, group_sizes_g, rows_m = res
    # out = x_g @ W_g    -> dx = dout @ W_g.T, dW_g = x_g.T @ dout_g
    # out = x_g @ W_g.T  -> dx = dout @ W_g,   dW_g = dout_g.T @ x_g
    dx_mk = _gmm_vjp(
        dout_mn, w_gkn, group_sizes_g, None, not transpose_rhs, _grad_dtype(rows_m, x), cfg
    )
    dx = _grouped_grad(dx_mk, rows_m, group_sizes_g, x)
    w_dtype = np.dtype(w_gkn.dtype)
    if transpose_rhs:
        dw = _tgmm_vjp(dout_mn, x, group_sizes_g, None, rows_m, w_dtype, cfg)
    else:
        dw = _tgmm_vjp(x, dout_mn, group_sizes_g, rows_m, None, w_dtype, cfg)
    return dx, dw, None, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tgmm_vjp(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg: Config):
    return tgmm_call(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg)


def _tgmm_fwd(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg):
    out = tgmm_call(x, y, group_sizes_g, x_rows_m, y_rows_m, out_dtype, cfg)
    return out, (x, y, group_sizes_g, x_rows_m, y_rows_m)


def _tgmm_bwd(out_dtype, cfg, res, dout_gkn):
    res, dout_gkn = first_order((res, dout_gkn))
    x, y, group_sizes_g, x_rows_m, y_rows_m = res
    # out_g = x_g.T @ y_g  -> dx_g = y_g @ dout_g.T, dy_g = x_g @ dout_g
    dx_mk = _gmm_vjp(y, dout_gkn, group_sizes_g, y_rows_m, True, _grad_dtype(x_rows_m, x), cfg)
    dy_mn = _gmm_vjp(x, dout_gkn, group_sizes_g, x_rows_m, False, _grad_dtype(y_rows_m, y), cfg)
    return (
        _grouped_grad(dx_mk, x_rows_m, group_sizes_g, x),
        _grouped_grad(dy_mn, y_rows_m, group_sizes_g, y),
        None,
        None,
        None,
    )


_tgmm_vjp.defvjp(_tgmm_fwd, _tgmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _tgmm_acc_vjp(x, y, group_sizes_g, x_rows_m, y_rows_m, acc, cfg: Config):
    """acc + tgmm(x, y), accumulated in place in acc's buffer."""
    return tgmm_call(x, y, group_sizes_g, x_rows_m, y_rows_m, acc.dtype, cfg, acc)


def _tgmm_acc_fwd(x, y, group_sizes_g, x_rows_m, y_rows_m, acc, cfg):
    out = tgmm_call(x, y, group_sizes_g, x_rows_m, y_rows_m, acc.dtype, cfg, acc)
    return out, (x, y, group_sizes_g, x_rows_m, y_rows_m)


def _tgmm_acc_bwd(cfg, res, dout_gkn):
    return (*_tgmm_bwd(dout_gkn.dtype, cfg, res, dout_gkn), dout_gkn)  # d acc = dout


_tgmm_acc_vjp.defvjp(_tgmm_acc_fwd, _tgmm_acc_bwd)


# -------------------------------------------------------------- public entry


def _config(
    block_m, block_n, block_k, num_warps, num_stages, interpret, zero_padding=True
) -> Config:
    """Holds the checked static configuration."""
    if not isinstance(zero_padding, (bool, np.bool_)):
        raise ValueError(f"zero_padding must be a bool, got {zero_padding!r}")
    return Config(
        check_block("block_m", block_m),
        check_block("block_n", block_n),
        check_block("block_k", block_k),
        num_warps,
        num_stages,
        bool(interpret),
        bool(zero_padding),
    )


def _rows(rows, name: str):
    """Holds an optional fused-gather row-index vector as int32 [M] (or None)."""
    if rows is None:
        return None
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got {rows.dtype}{rows.shape}")
    return rows.astype(jnp.int32)


def _with_vma(*operands):
    """Holds the operands (None kept) made varying over the same shard_map axes."""
    present = [op for op in operands if op is not None]
    it = iter(match_vma(*present))
    return tuple(None if op is None else next(it) for op in operands)


def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    transpose_rhs=False,
    lhs_rows=None,
    interpret=False,
    block_m=DEFAULT_BLOCK_M,
    block_n=DEFAULT_BLOCK_N,
    block_k=DEFAULT_BLOCK_K,
    num_warps=None,
    num_stages=None,
    zero_padding=True,
) -> jax.Array:
    """Grouped matmul by the Pallas kernel: out[M, N], rows of group g @ rhs[g].

    Args:
      lhs: [M, K] rows sorted by group; with `lhs_rows`, a [T, K] row source.
      rhs: [G, K, N], or [G, N, K] when `transpose_rhs` (then rhs[g].T is used).
      group_sizes: [G] integer rows per group (traced values are fine).
      preferred_element_type: output dtype (default lhs.dtype); math is float32.
        bf16 x f32 operands multiply in bf16 (the f32 one cast down; module doc).
      transpose_rhs: see `rhs`.
      lhs_rows: optional [M] integer row indices, the fused row gather: grouped
        row r is lhs[lhs_rows[r]] (clamped into [0, T)), read straight from
        `lhs` by the kernel, so the gathered [M, K] matrix is never built.
        Entries past sum(group_sizes) are never read. The lhs gradient is
        scatter-added back into [T, K] by XLA (float32 accumulation).
      interpret: run the kernel with the Pallas interpreter (works on CPU).
      block_m, block_n, block_k: tile sizes, powers of two >= 16; each is
        shrunk to the next power of two of its dimension when that is smaller.
      num_warps, num_stages: Triton launch parameters (None: see module doc).
      zero_padding: False leaves rows >= sum(group_sizes) unwritten, in the output
        and in the (unfused) lhs gradient: garbage on a GPU, NaN in interpret mode.
        No program is launched for them, so the work is that of the real rows only.
        For callers whose every reader of those rows masks them with a select
        (never a multiply: 0 * NaN is NaN), as the all-to-all's does.

    Rows >= sum(group_sizes) come back as exact zeros (see `zero_padding`) and are
    never read. Differentiable in lhs and rhs; the backward pass is gmm and tgmm kernels.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"need lhs [M, K] and rhs 3-D, got {lhs.shape} and {rhs.shape}")
    cfg = _config(block_m, block_n, block_k, num_warps, num_stages, interpret, zero_padding)
    out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    args = _with_vma(lhs, rhs, group_sizes, _rows(lhs_rows, "lhs_rows"))
    return _gmm_vjp(*args, bool(transpose_rhs), out_dtype, cfg)


def tgmm(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    lhs_rows=None,
    rhs_rows=None,
    interpret=False,
    block_m=DEFAULT_BLOCK_M,
    block_n=DEFAULT_BLOCK_N,
    block_k=DEFAULT_BLOCK_K,
    num_warps=None,
    num_stages=None,
    acc=None,
) -> jax.Array:
    """Transposed grouped matmul by the Pallas kernel: out[g] = lhs[g rows].T @ rhs[g rows].

    lhs [M, K], rhs [M, N], group_sizes [G] integer; out [G, K, N] in
    `preferred_element_type` (default lhs.dtype). `lhs_rows` / `rhs_rows`
    (optional [M] integer) fuse a row gather into either operand, as in `gmm`.
    `block_m` is the row chunk of the reduction; `block_k` x `block_n` is the
    output tile. Rows >= sum(group_sizes) are never read; empty groups give
    exact zero slices. Differentiable in lhs and rhs.

    `acc` (optional [G, K, N], in the output dtype): return acc + the product,
    accumulated in acc's own buffer (aliased to the output): a group with no rows
    is neither read nor written, so a caller summing many small chunks' weight
    gradients pays for the groups each chunk touches, not for all G. Differentiable
    in acc too (its cotangent is the output's).
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    lhs_rows, rhs_rows = _rows(lhs_rows, "lhs_rows"), _rows(rhs_rows, "rhs_rows")
    m_x = (lhs if lhs_rows is None else lhs_rows).shape[0]
    m_y = (rhs if rhs_rows is None else rhs_rows).shape[0]
    if lhs.ndim != 2 or rhs.ndim != 2 or m_x != m_y:
        raise ValueError(
            f"need lhs [M, K] and rhs [M, N] (M rows after any gather), got "
            f"{lhs.shape} and {rhs.shape}"
        )
    cfg = _config(block_m, block_n, block_k, num_warps, num_stages, interpret)
    out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if acc is None:
        return _tgmm_vjp(*_with_vma(lhs, rhs, group_sizes, lhs_rows, rhs_rows), out_dtype, cfg)
    acc = check_acc(acc, (group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)
    return _tgmm_acc_vjp(*_with_vma(lhs, rhs, group_sizes, lhs_rows, rhs_rows, acc), cfg)
