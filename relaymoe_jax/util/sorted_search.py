"""`jnp.searchsorted(ends, q, side="right")` written so that it traces in a partial-manual
`jax.shard_map` and on arrays sharded over a mesh that is not the context's (jax 0.12's
`searchsorted` fails there: an `AssertionError` on the manual axis type, and under vmap):
`count_at_most` for short sorted rows (a compare and a sum), `count_at_most_bisect` for long
sorted columns (a binary search)."""

import jax
import jax.numpy as jnp


def count_at_most(ends: jax.Array, queries: jax.Array) -> jax.Array:
    """Holds, for each query, how many of `ends` (sorted, last axis) are <= it: int32 of shape
    ends.shape[:-1] + queries.shape[-1:] (leading axes broadcast against each other).

    One compare per (query, end): meant for a few hundred ends at most (the experts or groups of
    one device), which XLA fuses into the sum without materialising the comparison."""
    at_most = ends[..., None, :] <= queries[..., :, None]
    return jnp.sum(at_most, axis=-1, dtype=jnp.int32)


def count_at_most_bisect(a_nb: jax.Array, y_mb: jax.Array) -> jax.Array:
    """int32 [m, B]: how many of a[:, b] (non-decreasing along axis 0) are <= y[i, b]. A binary
    search, log2(n) + 1 gathers: for columns too long for `count_at_most`'s n x m compares (the
    attention's blocks at a million tokens)."""
    n = a_nb.shape[0]
    count = jnp.zeros_like(y_mb)
    step = 1 << (n.bit_length() - 1)
    while step:  # the largest count c with a[c - 1] <= y, found bit by bit
        cand = count + step
        fits = cand <= n
        a_mb = jnp.take_along_axis(a_nb, jnp.where(fits, cand, n) - 1, axis=0)
        count = jnp.where(fits & (a_mb <= y_mb), cand, count)
        step >>= 1
    return count
