"""Where the train state is stored: the parameters (and, like them, the optimizer's moments)
sharded over the data-parallel axes that hold the same weights for the forward (`STORAGE_AXES`)
besides the model's own sharding, and gathered back to the model's sharding inside the step.
"""

import math

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["STORAGE_AXES", "gather_stored", "is_variable", "stored_sharding"]


def _spec_entries(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


# The mesh axes the train state is stored sharded over (beside the model's own sharding): the
# data-parallel axes whose devices hold the same parameters for the forward. `context` is one:
# with `mesh=context=8` each device stores an eighth of the state, not a replica (MaxText shards
# over its fsdp and context axes likewise). `data` is not: plain data parallelism keeps replicas.
STORAGE_AXES = ("fsdp", "context")


def stored_sharding(x, mesh) -> NamedSharding:
    """Where a parameter (or its optimizer moments) is stored: its model sharding plus the
    `STORAGE_AXES` of the mesh it does not use yet, together on its largest free dimension that
    divides by their product (or, when none does, each axis alone on the largest free dimension it
    divides, `fsdp` first); unchanged if nothing divides (e.g. norms of odd size) or no storage
    axis is left (folded experts already use every axis)."""
    spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
    used = {a for e in spec for a in _spec_entries(e)}
    axes = [a for a in STORAGE_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in used]
    groups = [tuple(axes)] + ([(a,) for a in axes] if len(axes) > 1 else [])
    for group in groups:
        n = math.prod(mesh.shape[a] for a in group)
        free = [d for d in range(x.ndim) if spec[d] is None and x.shape[d] % n == 0]
        if group and free:
            d = max(free, key=lambda i: (x.shape[i], -i))
            spec[d] = group[0] if len(group) == 1 else group
            return NamedSharding(mesh, P(*spec))
    return x.sharding


def gather_stored(x):
    """Inside the step: the parameter back on its model sharding, an all-gather whose transpose
    reduce-scatters the gradient back to the stored sharding.

    Give it the `nnx.Variable` (map with `is_leaf=is_variable`): its value is resharded to the
    model's spec (the Variable's `out_sharding` metadata), which keeps a storage axis that the
    model itself uses: with parallel folding (no `expert` axis) the experts are sharded over every
    axis, `fsdp` and `context` included, and `stored_sharding` leaves them as they are. A bare
    array can only have the `STORAGE_AXES` removed from its spec: right for everything but folded
    experts."""
    if isinstance(x, nnx.Variable):
        value, spec = x.get_value(), x.get_metadata().get("out_sharding")
        if spec is None:
            return x.replace(gather_stored(value))
        if len(spec) == value.ndim + 1:  # one layer's slice of a stacked [L, ...] variable (in
            spec = tuple(spec)[1:]  # the layer scan's body): its spec without the layer axis
        sharding = jax.typeof(value).sharding
        if tuple(sharding.spec) == tuple(spec):
            return x
        return x.replace(jax.sharding.reshard(value, NamedSharding(sharding.mesh, P(*spec))))
    sharding = jax.typeof(x).sharding
    spec = [tuple(a for a in _spec_entries(e) if a not in STORAGE_AXES) for e in sharding.spec]
    if all(len(a) == len(_spec_entries(e)) for a, e in zip(spec, sharding.spec)):
        return x
    spec = [None if not a else a[0] if len(a) == 1 else a for a in spec]
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P(*spec)))


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)
