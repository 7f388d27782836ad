"""Pallas (Triton lowering, deprecated) grouped matmul `gmm` and its ragged-contracting form
`tgmm`: the public entry points and their argument checks.

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

Differentiation: the custom VJPs of `vjp.py` (shared with the Mosaic GPU kernels), whose backward
passes are these same kernels.

Deprecated: the Pallas Triton backend is deprecated in jax 0.12 (it warns at every lowering that
it will be removed in favour of Mosaic GPU). On Hopper, `gmm_impl="auto"` runs our Mosaic GPU
kernels (`mosaic.py`: TMA, wgmma, warp specialisation); this one stays for Ampere (and float32
operands on a GPU) until jax removes the backend. What it has over Mosaic GPU: one source for
Ampere and Hopper, and a fused row gather (Hopper's TMA cannot gather rows).
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

import jax
import numpy as np

from relaymoe_jax.kernels.gmm.pallas_kernels import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_M,
    DEFAULT_BLOCK_N,
    Config,
    check_block,
)
from relaymoe_jax.kernels.gmm.vjp import gmm_entry, tgmm_entry


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
    return gmm_entry(
        lhs,
        rhs,
        group_sizes,
        lhs_rows,
        transpose_rhs,
        preferred_element_type,
        lambda: _config(block_m, block_n, block_k, num_warps, num_stages, interpret, zero_padding),
    )


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
    return tgmm_entry(
        lhs,
        rhs,
        group_sizes,
        lhs_rows,
        rhs_rows,
        preferred_element_type,
        acc,
        lambda: _config(block_m, block_n, block_k, num_warps, num_stages, interpret),
    )
