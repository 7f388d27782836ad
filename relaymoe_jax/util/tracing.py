"""What jax is tracing now, and the mesh of `jax.set_mesh` with its devices.

jax has no public API for these three facts, so they read `jax._src` (checked against jax 0.12);
this module is the one place the op does.
"""

from jax._src import core as _core
from jax._src import mesh as _mesh


def eager() -> bool:
    """No transformation is tracing (a plain call on concrete arrays)."""
    return _core.trace_state_clean()


def under_jit() -> bool:
    """Some jit (or other staging transformation) is tracing."""
    return _core.unsafe_am_i_under_a_jit()


def concrete_mesh():
    """The mesh of `jax.set_mesh`, with its devices (also inside jit and shard_map), or None.
    (`jax.sharding.get_mesh` refuses to run under jit.)"""
    mesh = _mesh.get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh
