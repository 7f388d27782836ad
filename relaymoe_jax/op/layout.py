"""Where `moe_ffn`'s tokens live: x's own sharding, read rather than imposed.

`moe_ffn` takes x [..., H] as the caller has it. The leading (token) dimensions keep their
sharding: each device flattens its own block of x to [T_local, H] inside the `shard_map`, which
moves no data however the batch and sequence dimensions are split. y comes back with x's shape and
sharding.

The leading dimensions' mesh axes come from, in order:
  1. `token_axes`, when given: the axes are laid over the leading dimensions in order, each
     dimension taking the next axes while its size divides (x is put there first; y goes back to
     x's own sharding, when that is known);
  2. x's own sharding, when it is known: an Explicit mesh's array type, or a concrete array
     already placed on the mesh;
  3. otherwise (an Auto mesh under jit, or an array not on the mesh) every mesh axis, laid out as
     in 1.
Expert axes that no leading dimension is sharded over (a decode step with fewer tokens than
devices, a token count the shards do not divide) are *split* axes: each device of such an axis
takes an equal share of its block, padded with ignored pairs (id -1, weight 0), and the outputs
are all-gathered back. Exact; the padding never reaches y or a gradient.
"""

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    lead: tuple[tuple[str, ...], ...]  # the mesh axes of each leading dimension of x
    split: tuple[str, ...]  # expert axes the op splits each block over
    split_size: int  # their size product
    local_tokens: int  # tokens in one device's block of x
    ring_tokens: int  # tokens one ring member works on (split share, padded,
    # gathered over the expert-tensor axis when sharded there)
    gather_etp: bool  # tokens sharded over the expert-tensor axis
    known: NamedSharding | None  # x's own sharding, when known

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes the tokens vary over in x's layout (split axes excluded)."""
        return tuple(a for d in self.lead for a in d)

    @property
    def share(self) -> int:
        """Tokens per device after the split (padded)."""
        return -(-self.local_tokens // self.split_size)

    def spec(self, *tail) -> P:
        return P(*(spec_entry(d) for d in self.lead), *tail)


def is_explicit(mesh) -> bool:
    return all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def spec_entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def known_sharding(a, mesh) -> NamedSharding | None:
    """`a`'s NamedSharding when it is known and on a mesh with `mesh`'s axes: the type of an
    array on an Explicit mesh (traced or not), or the placement of a concrete array."""
    names = tuple(mesh.axis_names)
    if isinstance(a, jax.core.Tracer):
        s = getattr(jax.typeof(a), "sharding", None)
        explicit = s is not None and all(
            t == jax.sharding.AxisType.Explicit for t in s.mesh.axis_types
        )
        return s if explicit and tuple(s.mesh.axis_names) == names else None
    s = getattr(a, "sharding", None)
    if (
        isinstance(s, NamedSharding)
        and tuple(s.mesh.axis_names) == names
        and tuple(s.mesh.axis_sizes) == tuple(mesh.axis_sizes)
    ):
        return s
    return None


def fit(shape, axes, mesh) -> tuple[tuple[str, ...], ...]:
    """`axes` laid over the dimensions of `shape` in order, each taking the next ones while its
    size divides; axes left over shard nothing."""
    out, i = [], 0
    for d in shape:
        kept, size = [], 1
        while i < len(axes) and d % (size * mesh.shape[axes[i]]) == 0:
            size *= mesh.shape[axes[i]]
            kept.append(axes[i])
            i += 1
        out.append(tuple(kept))
    return tuple(out)


def resolve(x, mesh, expert_axes, etp, token_axes, known=None) -> TokenLayout:
    """x's token layout; `known`: x's sharding when the caller knows it (else read from x)."""
    lead_shape = tuple(x.shape[:-1])
    known = known or known_sharding(x, mesh)
    if token_axes is not None:
        lead = fit(lead_shape, tuple(token_axes), mesh)
    elif known is not None:
        spec = tuple(known.spec) + (None,) * len(x.shape)
        lead = tuple(spec_axes(e) for e in spec[: len(lead_shape)])
    else:
        lead = fit(lead_shape, tuple(mesh.axis_names), mesh)
    used = {a for d in lead for a in d}
    split = tuple(a for a in expert_axes if a not in used)
    split_size = math.prod(mesh.shape[a] for a in split)
    local = math.prod(n // math.prod(mesh.shape[a] for a in d) for n, d in zip(lead_shape, lead))
    gather = etp is not None and etp in used
    share = -(-local // split_size)
    ring = share * (mesh.shape[etp] if gather else 1)
    return TokenLayout(lead, split, split_size, local, ring, gather, known)
