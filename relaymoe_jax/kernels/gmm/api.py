"""Public grouped-matmul entry points: argument checks and choice of implementation.

Row layout (both ops): rows of `lhs` are sorted by group; group g owns rows
[off_g, off_g + group_sizes[g]) with off = exclusive cumsum(group_sizes).
`sum(group_sizes) <= M` is the caller's promise. If it is broken, groups are
truncated at row M (rows past M do not exist, so they are simply ignored);
negative sizes count as 0. Rows >= sum(group_sizes) are "padding": gmm returns
exact zeros there and tgmm ignores them, even if they hold NaN/Inf (impl="xla"
masks with selects by construction; impl="ragged_dot" meets this on CPU in
jax 0.12, as the tests check, but that rests on XLA's lowering). Math is
accumulated in float32. Zero groups (G == 0) give all-zero outputs.

Operand dtypes (every impl, forward and backward: `common.operand_dtype`). A 16-bit operand
(bf16, f16) meeting a float32 one is multiplied in the 16-bit type: the float32 operand is cast
down, so the product runs on the tensor cores instead of in f32 FMA (a float32 cotangent from a
`preferred_element_type=float32` output is the usual way in). The output dtype is unchanged.
bf16 x f16 is refused (ValueError). Equal types multiply as they are: f32 x f32 at IEEE
precision (`Precision.HIGHEST`, no TF32).

impl="mosaic" is our Pallas Mosaic GPU kernel (`mosaic.py`; Hopper: TMA, wgmma, warp
specialisation; 16-bit operands), impl="pallas" the Pallas Triton kernel (`pallas.py`; deprecated
with jax's Triton backend), both with the custom VJPs of `vjp.py`; `interpret=True` runs either
on CPU in its interpreter (tests). "auto" picks "mosaic" when the code compiles for a Hopper GPU
and an operand is 16-bit, "pallas" on other GPUs (Ampere) and for float32 x float32 (which the
Mosaic GPU kernel refuses), and the blocked "xla" version elsewhere; the platform is that of the
mesh in context (`jax.set_mesh`, a shard_map's mesh), so a deviceless compile for an abstract
GPU mesh (`relaymoe_jax.gpu_mesh`) gets the kernel although its process runs on a CPU backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.kernels.gmm import mosaic, pallas
from relaymoe_jax.kernels.gmm.common import check_acc
from relaymoe_jax.kernels.gmm.ragged import gmm_ragged, tgmm_ragged
from relaymoe_jax.kernels.gmm.xla import DEFAULT_TILE_M, gmm_xla, tgmm_xla
from relaymoe_jax.util.platform import hopper, platform

IMPLS = ("auto", "xla", "ragged_dot", "mosaic", "pallas")
KERNELS = ("mosaic", "pallas")  # the Pallas kernels: interpretable, fused or in-op row gathers


def resolve_impl(impl: str, interpret: bool = False, mesh=None, dtypes=()) -> str:
    """Holds the concrete implementation name for `impl`.

    "auto": with `interpret`, "pallas" (its interpreter); where the code compiles for a GPU,
    "mosaic" on Hopper when one of the operand `dtypes` is 16-bit (the product runs in it:
    `common.operand_dtype`), else "pallas" (Ampere, or float32 x float32); elsewhere "xla". The
    platform is `mesh`'s when given, else the context mesh's, else JAX's default backend
    (`relaymoe_jax.util.platform`); no `dtypes` counts as 16-bit. `interpret` applies to the
    kernels ("mosaic", "pallas").
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if interpret:
            return "pallas"
        if platform(mesh) != "gpu":
            return "xla"
        narrow = not dtypes or any(np.dtype(d).itemsize == 2 for d in dtypes)
        return "mosaic" if narrow and hopper(mesh) else "pallas"
    if interpret and impl not in KERNELS:
        raise ValueError(
            f"interpret=True runs a Pallas kernel ({KERNELS}); it does not apply to impl={impl!r}"
        )
    return impl


KERNEL_NAMES = {"mosaic": "our Mosaic GPU kernel", "pallas": "the Pallas Triton kernel"}


def describe_impl(impl: str, mesh=None, dtype=jnp.bfloat16) -> str:
    """`impl` as a benchmark's header names it, resolved for `mesh` and `dtype` operands:
    "'auto' = 'mosaic' (our Mosaic GPU kernel)" on H100s, "'pallas' (the Pallas Triton kernel)"."""
    concrete = resolve_impl(impl, mesh=mesh, dtypes=(dtype,))
    name = repr(concrete) + (f" ({KERNEL_NAMES[concrete]})" if concrete in KERNEL_NAMES else "")
    return name if impl == concrete else f"{impl!r} = {name}"


# moe_ffn's `gmm_impl`: an `impl`, or a kernel in its interpreter on CPU.
MOE_IMPLS = (*IMPLS, "mosaic-interpret", "pallas-interpret")
INTERPRETERS = {"mosaic-interpret": "mosaic", "pallas-interpret": "pallas"}


def impl_kwargs(name: str) -> dict:
    """Holds the gmm/tgmm keyword arguments for a `MOE_IMPLS` name."""
    if name not in MOE_IMPLS:
        raise ValueError(f"gmm_impl must be one of {MOE_IMPLS}, got {name!r}")
    if name in INTERPRETERS:
        return {"impl": INTERPRETERS[name], "interpret": True}
    return {"impl": name}


def _kernel(impl: str, tile_m, mosaic_entry, pallas_entry):
    """(entry point, its block keywords) of a kernel impl. tile_m, when given, is the Triton
    kernel's block_m (a power of two >= 16); the Mosaic GPU kernel tiles 64 rows (one wgmma M
    tile per warpgroup): None or 64, else refused."""
    if impl == "pallas":
        return pallas_entry, {} if tile_m is None else {"block_m": tile_m}
    if tile_m not in (None, 64):
        raise ValueError(
            f"tile_m={tile_m!r} with impl='mosaic': the kernel tiles 64 rows (or None)"
        )
    return mosaic_entry, {}


def _check_tile_m(tile_m) -> int:
    """Holds the row-tile size to use (checked to be a positive int)."""
    if tile_m is None:
        return DEFAULT_TILE_M
    if isinstance(tile_m, bool) or not isinstance(tile_m, (int, np.integer)) or tile_m < 1:
        raise ValueError(f"tile_m must be a positive int (>= 1) or None, got {tile_m!r}")
    return int(tile_m)


def _check_group_sizes(group_sizes, num_groups: int) -> jax.Array:
    """Holds group_sizes as an int32 [G] array (checked: 1-D, integer, length G)."""
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must have an integer dtype, got {group_sizes.dtype}")
    if group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes must have length G={num_groups}, got length {group_sizes.shape[0]}"
        )
    return group_sizes.astype(jnp.int32)


def _out_dtype(preferred_element_type, lhs) -> np.dtype:
    """Holds the output dtype: preferred_element_type, else lhs.dtype."""
    return np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)


def _gather(a, rows, name):
    """a[rows] for the implementations without a fused gather (indices clipped into range)."""
    if rows is None:
        return a
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got {rows.dtype}{rows.shape}")
    return jnp.take(a, rows, axis=0, mode="clip")


def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    impl="auto",
    interpret=False,
    preferred_element_type=None,
    transpose_rhs=False,
    tile_m=None,
    lhs_rows=None,
    zero_padding=True,
) -> jax.Array:
    """Grouped matmul: out[M, N], rows of group g times rhs[g] (rhs[g].T if transpose_rhs).

    Args:
      lhs: [M, K] rows sorted by group.
      rhs: [G, K, N], or [G, N, K] when `transpose_rhs` (then rhs[g].T is used).
      group_sizes: [G] integer rows per group; traced values are fine.
      impl: "auto" | "xla" | "ragged_dot" | "mosaic" | "pallas".
      interpret: run the kernel ("mosaic", "pallas") in its interpreter (CPU tests).
      preferred_element_type: output dtype (default lhs.dtype); math is float32.
        Operands of a 16-bit and a 32-bit float type multiply in the 16-bit one
        (the wider is cast down: tensor cores, never f32 FMA by accident; see
        the module docstring); bf16 x f16 raises ValueError.
      transpose_rhs: see `rhs`.
      tile_m: row-tile size of "xla" (default 128) and block_m of "pallas"
        (a power of two >= 16; default 64).
      lhs_rows: optional [M] row indices: row r is lhs[lhs_rows[r]] (lhs is then a
        [T, K] row source). "pallas" reads the rows inside the kernel (the gathered
        matrix is never built); the others gather first.
      zero_padding: False lets "pallas" skip rows >= sum(group_sizes) (no work, left
        unwritten in the output and the lhs gradient: garbage on a GPU); the other
        impls still write zeros there. Only for callers that mask those rows with a
        select wherever they read them (`pallas.gmm`).

    Rows >= sum(group_sizes) come back as exact zeros (unless `zero_padding=False`). See the
    module docstring for sum(group_sizes) > M. Differentiable in lhs and rhs.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D [M, K], got shape {lhs.shape}")
    impl = resolve_impl(impl, interpret, dtypes=(lhs.dtype, rhs.dtype))
    if impl not in KERNELS:
        lhs, lhs_rows = _gather(lhs, lhs_rows, "lhs_rows"), None
    if rhs.ndim != 3:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(f"rhs must be 3-D {layout}, got shape {rhs.shape}")
    rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if rhs_k != lhs.shape[1]:
        axis = 2 if transpose_rhs else 1
        raise ValueError(
            f"rhs.shape[{axis}] must equal K=lhs.shape[1]={lhs.shape[1]} "
            f"(transpose_rhs={transpose_rhs}), got {rhs_k}"
        )
    group_sizes = _check_group_sizes(group_sizes, rhs.shape[0])
    tm = _check_tile_m(tile_m)
    out_dtype = _out_dtype(preferred_element_type, lhs)
    if rhs.shape[0] == 0:  # no groups: every row is padding
        m = lhs.shape[0] if lhs_rows is None else jnp.shape(lhs_rows)[0]
        return jnp.zeros((m, rhs.shape[1] if transpose_rhs else rhs.shape[2]), out_dtype)
    if impl in KERNELS:
        entry, blocks = _kernel(impl, tile_m, mosaic.gmm, pallas.gmm)
        return entry(
            lhs,
            rhs,
            group_sizes,
            preferred_element_type=out_dtype,
            transpose_rhs=bool(transpose_rhs),
            interpret=interpret,
            lhs_rows=lhs_rows,
            zero_padding=zero_padding,
            **blocks,
        )
    if impl == "xla":
        return gmm_xla(lhs, rhs, group_sizes, bool(transpose_rhs), tm, out_dtype)
    return gmm_ragged(lhs, rhs, group_sizes, bool(transpose_rhs), out_dtype)


def tgmm(
    lhs,
    rhs,
    group_sizes,
    *,
    num_groups=None,
    impl="auto",
    interpret=False,
    preferred_element_type=None,
    tile_m=None,
    lhs_rows=None,
    rhs_rows=None,
    acc=None,
) -> jax.Array:
    """Transposed grouped matmul: out[g] = lhs[rows of g].T @ rhs[rows of g], out [G, K, N].

    This is gmm's weight gradient. lhs [M, K], rhs [M, N], group_sizes [G]
    integer. `num_groups` (optional) states G and must equal len(group_sizes).
    Rows >= sum(group_sizes) are ignored in both operands, NaN included; empty
    groups give exact zeros. Differentiable in lhs and rhs. `impl`, `interpret`,
    `tile_m` and the operand-dtype rule (bf16 x f32 multiplies in bf16) as in `gmm`;
    `acc` (optional [G, K, N] in the output dtype): returns acc + the product, summed in place
    ("pallas": in acc's aliased buffer, a group with no rows neither read nor written; "xla":
    in its loop's carry; "ragged_dot": an add), so summing many chunks' weight gradients costs
    the groups each chunk touches; `lhs_rows` / `rhs_rows` gather either operand's
    rows like gmm's `lhs_rows` (fused into the kernel by "pallas").
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    impl = resolve_impl(impl, interpret, dtypes=(lhs.dtype, rhs.dtype))
    if impl not in KERNELS or lhs.ndim != 2 or rhs.ndim != 2:
        lhs, lhs_rows = _gather(lhs, lhs_rows, "lhs_rows"), None
        rhs, rhs_rows = _gather(rhs, rhs_rows, "rhs_rows"), None
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D [M, K], got shape {lhs.shape}")
    if rhs.ndim != 2:
        raise ValueError(f"rhs must be 2-D [M, N], got shape {rhs.shape}")
    m_l = lhs.shape[0] if lhs_rows is None else jnp.shape(lhs_rows)[0]
    m_r = rhs.shape[0] if rhs_rows is None else jnp.shape(rhs_rows)[0]
    if m_r != m_l:
        raise ValueError(f"rhs must have M={m_l} rows like lhs (after any row gather), got {m_r}")
    group_sizes = jnp.asarray(group_sizes)
    if num_groups is None:
        num_groups = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    elif isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)):
        raise ValueError(f"num_groups must be an int or None, got {num_groups!r}")
    group_sizes = _check_group_sizes(group_sizes, int(num_groups))
    tm = _check_tile_m(tile_m)
    out_dtype = _out_dtype(preferred_element_type, lhs)
    if acc is not None:
        acc = check_acc(acc, (int(num_groups), lhs.shape[1], rhs.shape[1]), out_dtype)
    if num_groups == 0:
        return jnp.zeros((0, lhs.shape[1], rhs.shape[1]), out_dtype)
    if impl in KERNELS:
        entry, blocks = _kernel(impl, tile_m, mosaic.tgmm, pallas.tgmm)
        return entry(
            lhs,
            rhs,
            group_sizes,
            preferred_element_type=out_dtype,
            interpret=interpret,
            lhs_rows=lhs_rows,
            rhs_rows=rhs_rows,
            acc=acc,
            **blocks,
        )
    if impl == "xla":
        return tgmm_xla(lhs, rhs, group_sizes, tm, out_dtype, acc)
    out = tgmm_ragged(lhs, rhs, group_sizes, out_dtype)
    return out if acc is None else acc + out
