"""What jax is tracing now, the mesh of `jax.set_mesh` with its devices, whether jax's backends
have started, and where jax looks for CUDA's tools.

jax has no public API for these five facts, so they read `jax._src` (checked against jax 0.12);
this module is the one place the library and the trainer do (`tests/test_house_rules.py`).
"""

from jax._src import core as _core
from jax._src import lib as _lib
from jax._src import mesh as _mesh
from jax._src import xla_bridge as _xla_bridge


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


def backends_started() -> bool:
    """jax's backends are initialised (a device query, array or compile already ran)."""
    return _xla_bridge.backends_are_initialized()


def cuda_path() -> str | None:
    """The CUDA directory jax uses (nvidia-cuda-nvcc-cu12's, or $CUDA_ROOT), or None."""
    return _lib.cuda_path
