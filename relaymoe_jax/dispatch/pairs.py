"""Pair bookkeeping shared by the dispatchers: indices only, never activations.

A (token, slot) *pair* is one entry of `expert_ids[T, k]`, flattened to `pair = t * k + slot`.
Pairs whose id lies outside [0, E) are *ignored*: they sort after every real expert (key E), fall in
no segment and contribute nothing (documented in docs/api.md).
"""

import contextlib
import threading

import jax.numpy as jnp

from relaymoe_jax.util.sorted_search import count_at_most
from relaymoe_jax.util.typed import varying_like

_state = threading.local()


@contextlib.contextmanager
def poison_unwritten():
    """Fill every "never read" row (padding of chunks and buffers) with NaN instead of 0.

    Used by tests: a NaN that reaches an output or gradient means a padding row was read. GPUs leave
    unwritten memory as garbage while XLA:CPU zero-fills, so this is how CPU tests catch it. Read at
    trace time: call the op (or jit it) inside the context, and jit a *fresh* function there (jit
    caches traces per function, so a function traced before keeps its unpoisoned program).
    """
    old = getattr(_state, "poison", False)
    _state.poison = True
    try:
        yield
    finally:
        _state.poison = old


def poisoning() -> bool:
    return getattr(_state, "poison", False)


def take_rows(a, idx, ok, poison):
    """a[idx] where rows with `ok` False are don't-care: the consumer never reads them.

    Normally a plain gather (no mask, no extra buffer); poisoned, those rows are NaN, so a test
    sees it if a consumer does read them.
    """
    if not poison:
        return a[idx]
    return _take_or_fill(a, idx, ok, float("nan"))


def take_rows_masked_grad(a, idx, ok, poison):
    """`take_rows` whose gradient ignores the rows with `ok` False: those rows read an
    out-of-range index (filled with 0, or NaN when poisoned), so the transpose, a scatter-add in
    "drop" mode, discards their cotangent, which may be garbage (kernels that leave padding rows
    unwritten), with no mask or extra buffer."""
    return _take_or_fill(a, idx, ok, float("nan") if poison else 0.0)


def _take_or_fill(a, idx, ok, fill):
    """a[idx], with `fill` in the rows where `ok` is False (read through an out-of-range index)."""
    return a.at[jnp.where(ok, idx, a.shape[0])].get(mode="fill", fill_value=fill)


def pair_keys(ids_tk, num_experts):
    """[T*k] int32 sort keys: the global expert id, or `num_experts` for an out-of-range id."""
    flat = ids_tk.reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_experts)
    return jnp.where(valid, flat, num_experts)


def sort_pairs(ids_tk, num_experts):
    """Sort pairs once by (owning partition, local expert) == global expert id.

    Returns (order [T*k] int32 pair indices, counts_e [E] int32 pairs per global expert).
    The stable sort keeps pairs of one expert in token order.
    """
    key = pair_keys(ids_tk, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    return order, counts[:num_experts]


def exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def chunk_group_sizes(seg_counts_g, pos0, chunk):
    """Rows of each group in chunk [pos0, pos0 + chunk) of a segment with counts `seg_counts_g`.

    The segment's rows are sorted by group; the result sums to min(chunk, total - pos0).
    """
    end_g = jnp.cumsum(seg_counts_g)
    start_g = end_g - seg_counts_g
    return jnp.clip(end_g - pos0, 0, chunk) - jnp.clip(start_g - pos0, 0, chunk)


def group_of_rows(group_sizes_g, rows: int):
    """[rows] int32: the group of each row of a buffer sorted by group (G past the last group)."""
    return count_at_most(jnp.cumsum(group_sizes_g), jnp.arange(rows, dtype=jnp.int32))


def group_bias_grad(d_rf, group_r, num_groups: int):
    """[G, f] float32: the rows of d summed per group (rows past the groups dropped)."""
    zeros = varying_like(jnp.zeros((num_groups, d_rf.shape[-1]), jnp.float32), d_rf, group_r)
    return zeros.at[group_r].add(d_rf.astype(jnp.float32), mode="drop")
