"""`platform()`: the platform ("gpu", "cpu", "tpu") that code traced now compiles for.

The grouped matmul's "auto" implementation asks it: a deviceless compile for an abstract GPU mesh
(`relaymoe_jax.gpu_mesh`) must get the GPU kernel although its process runs on a CPU backend.
"""

import jax
from jax.sharding import Mesh


def platform(mesh_or_none=None) -> str:
    """The platform ("gpu", "cpu", "tpu") that code traced now compiles for.

    From `mesh_or_none`'s devices when given, else from the mesh context (`jax.set_mesh`, or the
    mesh inside `shard_map`), else `jax.default_backend()`. A deviceless GPU mesh says "gpu"
    although the process runs on its CPU.
    """
    if mesh_or_none is not None:
        dev = getattr(mesh_or_none, "abstract_device", None)
        if dev is None and isinstance(mesh_or_none, Mesh):
            return _platform_name(mesh_or_none.devices.flat[0].platform)
        if dev is not None:
            return _platform_name(dev.platform)
    context = jax.sharding.get_abstract_mesh()
    dev = None if context.empty else getattr(context, "abstract_device", None)
    if dev is not None:
        return _platform_name(dev.platform)
    return jax.default_backend()


def _platform_name(p: str) -> str:
    return "gpu" if p in ("cuda", "rocm", "gpu") else p
