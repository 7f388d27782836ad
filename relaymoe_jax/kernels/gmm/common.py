"""What the grouped-matmul implementations (`xla`, `ragged`, `pallas`, `mosaic`) share.

- The dtype a product is taken in (`operand_dtype`) and its precision (`precision`).
- The row ranges of the groups (`clamp_group_bounds`, `clamp_group_sizes`), the (row tile,
  group) work items of a blocked loop or kernel grid (`work_items`; `xla.py`'s module doc) and
  the gmm kernels' work list built from them (`row_items`, padding rows included).
- `match_vma`: operands made varying over the same shard_map axes; `check_acc`: tgmm's `acc`.

Operand dtypes. A 16-bit operand meeting a float32 one is the common accident: a matmul with
`preferred_element_type=float32` hands its float32 cotangent to the next grouped matmul under
autodiff. Promoting (float32 math, IEEE precision) would run the GPU kernel in f32 FMA without the
tensor cores: ~10x to 100x slower (our all-to-all's backward ran ~160x slower on an H200 that
way). So the wider operand is cast to the narrower one: bf16 x f32 multiplies in bf16 on the
tensor cores (accumulating in float32 as always), and the output dtype is unchanged. Two different
16-bit types (bf16 x f16) are refused: neither is "the" narrower one. Equal types, and float32 x
float64, multiply as before (promoted; float32 at `Precision.HIGHEST`, no TF32).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from relaymoe_jax.util.sorted_search import count_at_most

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


def clamp_group_bounds(group_sizes_g: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Holds the row range [start_g, end_g) of each group, truncated at m.

    Negative sizes count as 0; groups running past row m are cut at m (the
    caller promises sum(group_sizes) <= m; this is the defined fallback).
    """
    sizes_g = jnp.maximum(group_sizes_g.astype(jnp.int32), 0)
    end_g = jnp.minimum(jnp.cumsum(sizes_g), m)
    start_g = jnp.concatenate([jnp.zeros((1,), jnp.int32), end_g[:-1]])
    return start_g, end_g


def clamp_group_sizes(group_sizes_g: jax.Array, m: int) -> jax.Array:
    """Holds group sizes truncated so that they sum to at most m."""
    start_g, end_g = clamp_group_bounds(group_sizes_g, m)
    return end_g - start_g


class WorkItems(NamedTuple):
    """The (tile, group) pairs to visit; entries past `count` are padding."""

    start_g: jax.Array  # [G] first row of each group
    end_g: jax.Array  # [G] one past the last row of each group
    group_i: jax.Array  # [max_items] group of item i
    tile_i: jax.Array  # [max_items] row-tile index of item i
    count: jax.Array  # () number of real items


def work_items(group_sizes_g: jax.Array, m: int, tm: int) -> WorkItems:
    """Holds the (tile, group) work items for m rows tiled by tm."""
    num_groups = group_sizes_g.shape[0]
    max_items = -(-m // tm) + num_groups - 1
    start_g, end_g = clamp_group_bounds(group_sizes_g, m)
    first_tile_g = start_g // tm
    last_tile_g = (end_g - 1) // tm
    tiles_g = jnp.where(end_g > start_g, last_tile_g - first_tile_g + 1, 0)
    items_end_g = jnp.cumsum(tiles_g)  # inclusive: items of g end here
    item_i = jnp.arange(max_items, dtype=jnp.int32)
    group_i = count_at_most(items_end_g, item_i)
    group_i = jnp.minimum(group_i, num_groups - 1)
    first_item_i = items_end_g[group_i] - tiles_g[group_i]
    tile_i = first_tile_g[group_i] + item_i - first_item_i
    return WorkItems(start_g, end_g, group_i, tile_i, items_end_g[-1])


class RowItems(NamedTuple):
    """A gmm kernel's work list: item i computes rows [lo_i, hi_i) of row tile row0_i for group
    group_i (G: the padding rows, stored as zeros); entries past `count` are zeros."""

    group_i: jax.Array
    row0_i: jax.Array
    lo_i: jax.Array
    hi_i: jax.Array
    count: jax.Array  # [1] int32


def row_items(group_sizes_g: jax.Array, m: int, bm: int, zero_padding: bool = True) -> RowItems:
    """The int32 work items of a gmm kernel over m rows in tiles of bm: one per (tile, group)
    that meet; the padding rows [sum, M) are group G when `zero_padding` (their items store
    zeros), else not visited at all."""
    start_g, end_g = clamp_group_bounds(group_sizes_g, m)
    if zero_padding:
        sizes_ext = jnp.concatenate([end_g - start_g, (m - end_g[-1:])])  # group G = padding
        start_x = jnp.concatenate([start_g, end_g[-1:]])
        end_x = jnp.concatenate([end_g, jnp.full((1,), m, jnp.int32)])
    else:
        sizes_ext, start_x, end_x = end_g - start_g, start_g, end_g
    items = work_items(sizes_ext, m, bm)
    row0_i = items.tile_i * bm
    real_i = jnp.arange(items.group_i.shape[0]) < items.count
    lo_i = jnp.where(real_i, jnp.maximum(start_x[items.group_i], row0_i), 0)
    hi_i = jnp.where(real_i, jnp.minimum(end_x[items.group_i], row0_i + bm), 0)
    row0_i = jnp.where(real_i, row0_i, 0)
    return RowItems(items.group_i, row0_i, lo_i, hi_i, items.count.astype(jnp.int32)[None])


def match_vma(*operands):
    """Holds the operands, each made varying over every shard_map axis any varies over.

    Inside shard_map a custom_vjp backward rule must return cotangents of the
    primal's exact type; the weight gradient of a replicated rhs is varying,
    so rhs is made varying up front and JAX's own transpose of that step psums
    the gradient. Adding a scalar zero does this through public behaviour
    (binary ops auto-cast to varying) and XLA folds the add away.
    """
    if not any(isinstance(op, jax.core.Tracer) for op in operands):
        return operands  # concrete arrays: not inside shard_map, skip the eager add
    zero = sum(lax.full_like(op, 0, jnp.int32, shape=()) for op in operands)
    return tuple(op + zero.astype(op.dtype) for op in operands)
