"""Which ring runs over the expert axes: flat, or hierarchical over (node, local) mesh axes.

A flat ring over devices on H hosts crosses the network once per host boundary, and every hop
waits for its slowest link. The hierarchical ring (`dispatch/ring.py`) runs an inner ring over the
last expert axis (the GPUs of one host, NVLink) once per round, and moves each payload to the next
host once per round, by every GPU in parallel, while the round's inner hops compute.

`choose_ring` decides (`moe_ffn(ring=...)`):
  "flat"          one ring over all expert axes together (the default on one host);
  "hierarchical"  expert_axis must be a tuple of >= 2 axes: the last is the inner ring, the ones
                  before it the outer ring;
  "auto"          hierarchical when the expert axes are >= 2 axes, the last of them stays on one
                  host (every line of devices along it has one process index), the ones before it
                  reach other hosts, and both rings have more than one device; else flat. Needs
                  the mesh's devices (their `process_index`); with only an abstract mesh
                  (`moe_ffn_local` without `jax.set_mesh`) it is flat.
"""

import math

import numpy as np


def check_ring_axes(ring: str, expert_axes: tuple) -> None:
    """A hierarchical ring needs (outer..., inner) expert axes (the name itself is checked by
    `op.options`)."""
    if ring == "hierarchical" and len(expert_axes) < 2:
        raise ValueError(
            f"ring='hierarchical' needs expert_axis as a tuple of >= 2 mesh axes "
            f"(outer..., inner), e.g. ('node', 'local'); got {expert_axes!r}"
        )


def hosts(mesh) -> np.ndarray | None:
    """The process index of each device of `mesh` (mesh-shaped), or None for an abstract mesh."""
    devices = getattr(mesh, "devices", None)
    if not isinstance(devices, np.ndarray) or devices.dtype != object:
        return None
    return np.vectorize(lambda d: d.process_index, otypes=[int])(devices)


def spans(mesh, expert_axes) -> tuple[bool, bool] | None:
    """(the inner axis stays on one host, the outer axes reach other hosts) for expert axes
    (outer..., inner) of a concrete `mesh`; None when the mesh has no devices."""
    proc = hosts(mesh)
    if proc is None or len(expert_axes) < 2:
        return None
    names = list(mesh.axis_names)
    inner = names.index(expert_axes[-1])
    lines = np.moveaxis(proc, inner, -1).reshape(-1, proc.shape[inner])
    local = bool((lines == lines[:, :1]).all())
    outer = [names.index(a) for a in expert_axes[:-1]]
    by_outer = np.moveaxis(proc, outer, range(len(outer))).reshape(
        math.prod(proc.shape[i] for i in outer), -1
    )
    return local, bool((by_outer != by_outer[:1]).any())


def ring_hosts(mesh, expert_axes) -> int:
    """How many hosts one ring over `expert_axes` spans (the most over the rings of `mesh`); 1 for
    an abstract mesh."""
    proc = hosts(mesh)
    if proc is None:
        return 1
    names = list(mesh.axis_names)
    axes = [names.index(a) for a in expert_axes]
    rings = np.moveaxis(proc, axes, range(-len(axes), 0)).reshape(
        -1, math.prod(proc.shape[i] for i in axes)
    )
    return max(len(set(r)) for r in rings.tolist())


def choose_ring(ring, mesh, expert_axes) -> bool:
    """Whether the ring is hierarchical (see the module docstring); `ring` already checked."""
    if ring != "auto":
        return ring == "hierarchical"
    if len(expert_axes) < 2:
        return False
    sizes = dict(mesh.shape)
    if sizes[expert_axes[-1]] < 2 or math.prod(sizes[a] for a in expert_axes[:-1]) < 2:
        return False
    found = spans(mesh, expert_axes)
    return bool(found and all(found))
