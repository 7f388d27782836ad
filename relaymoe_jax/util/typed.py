"""Giving a value another's type: its sharding (Explicit meshes), its varying manual axes
(shard_map's check_vma)."""

import jax
from jax import lax


def sharded_like(g, x):
    """`g` resharded to `x`'s sharding type where they differ (a no-op otherwise): what a
    custom_vjp's backward returns for an input `x`. jax's reshapes and moves of a dim of size
    one can drop its Explicit sharding (`bfloat16[1@expert, ...]` comes back as `[1, ...]`),
    and jax then refuses the cotangent for not having its primal's type."""
    want, got = jax.typeof(x).sharding, jax.typeof(g).sharding
    if getattr(want, "spec", None) is None or want.spec == getattr(got, "spec", None):
        return g
    return jax.sharding.reshard(g, want.spec)


def varying_like(x, *refs):
    """`x` varying over every manual axis any of `refs` varies over (inside a shard_map, a cond's
    branches, a scan's carry and a custom_vjp's cotangents must agree on that; a Pallas Mosaic GPU
    kernel's output comes back varying over none); outside a shard_map, `x` itself."""
    vma = lambda a: jax.typeof(a).manual_axis_type.varying
    missing = tuple(sorted(frozenset().union(*map(vma, refs)) - vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x
