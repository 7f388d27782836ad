"""What jax is tracing now, the mesh of `jax.set_mesh` with its devices, whether jax's backends
have started, and where jax looks for CUDA's tools; and letting `jax.checkpoint` differentiate
through the Pallas GPU interpreter.

and a Pallas kernel over a mesh whose output is written into an input's buffer. jax has no
public API for these seven, so they read `jax._src` (checked against jax 0.12);
this module is the one place the library and the trainer do (`tests/test_house_rules.py`).
"""

from jax._src import callback as _callback
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import lib as _lib
from jax._src import mesh as _mesh
from jax._src import xla_bridge as _xla_bridge
from jax._src.pallas import mpmd as _mpmd


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


def allow_ordered_io_in_remat() -> None:
    """Let `jax.checkpoint` (remat) differentiate functions with ordered io_callbacks.

    The Pallas Mosaic GPU interpreter (`plgpu.InterpretGPUParams`: the "pallas-interpret"
    attention on CPU) runs each kernel through ordered io_callbacks; jax refuses the effect in
    the AD of a checkpoint ("Effects not supported in AD of checkpoint/remat"). Allowing it is
    sound for those kernels, which are pure functions of their inputs: a recomputed checkpoint
    runs the kernel again. Idempotent; affects every ordered io_callback in the process."""
    _effects.remat_allowed_effects.add_type(_callback.OrderedIOEffect)


def kernel_in_place(body, mesh, out_type, aliases: dict, *, interpret, name: str):
    """`pl.kernel(body, out_type=out_type, mesh=mesh)` (what `plgpu.kernel` builds on) with
    `aliases` {input index: output index}: each such output is written into that input's buffer,
    an input-output alias of the custom call, as `pallas_call`'s `input_output_aliases`. The
    public way, a `jax.new_ref` operand, is refused inside a `shard_map` that checks varying
    axes (jax 0.12: "mpmd_map does not support Refs with varying manual axis types"), which is
    where the ring calls its kernels."""
    return _mpmd._mpmd_map(
        [(mesh, body)], out_type, input_output_aliases=aliases, interpret=interpret, name=name
    )
