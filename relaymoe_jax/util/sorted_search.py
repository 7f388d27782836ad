"""`count_at_most`: `jnp.searchsorted(ends, q, side="right")` for short sorted rows, written with
a compare and a sum so that it traces in a partial-manual `jax.shard_map` (jax 0.12's
`searchsorted` fails there with an `AssertionError` on the manual axis type)."""

import jax
import jax.numpy as jnp


def count_at_most(ends: jax.Array, queries: jax.Array) -> jax.Array:
    """Holds, for each query, how many of `ends` (sorted, last axis) are <= it: int32 of shape
    ends.shape[:-1] + queries.shape[-1:] (leading axes broadcast against each other).

    One compare per (query, end): meant for a few hundred ends at most (the experts or groups of
    one device), which XLA fuses into the sum without materialising the comparison."""
    at_most = ends[..., None, :] <= queries[..., :, None]
    return jnp.sum(at_most, axis=-1, dtype=jnp.int32)
