"""`platform()`: the platform ("gpu", "cpu", "tpu") that code traced now compiles for, and
`hopper()`: whether that is a Hopper GPU.

The grouped matmul's "auto" implementation asks both: a deviceless compile for an abstract GPU
mesh (`relaymoe_jax.gpu_mesh`) must get the GPU kernel although its process runs on a CPU
backend, and the Mosaic GPU kernel (wgmma) only on Hopper.
"""

import re

import jax
from jax.sharding import Mesh

# Hopper's device kinds (compute capability 9.0), as CUDA names them: "NVIDIA H100 80GB HBM3",
# "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA H20"; an abstract device (a
# deviceless mesh's) carries only its kind.
HOPPER_KINDS = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


def _device(mesh_or_none):
    """The device (or abstract device) code traced now compiles for: `mesh_or_none`'s, else the
    context mesh's (`jax.set_mesh`, the mesh inside `shard_map`), else JAX's default device."""
    if mesh_or_none is not None:
        dev = getattr(mesh_or_none, "abstract_device", None)
        if dev is None and isinstance(mesh_or_none, Mesh):
            return mesh_or_none.devices.flat[0]
        if dev is not None:
            return dev
    context = jax.sharding.get_abstract_mesh()
    dev = None if context.empty else getattr(context, "abstract_device", None)
    return dev if dev is not None else jax.devices()[0]


def platform(mesh_or_none=None) -> str:
    """The platform ("gpu", "cpu", "tpu") that code traced now compiles for.

    From `mesh_or_none`'s devices when given, else from the mesh context (`jax.set_mesh`, or the
    mesh inside `shard_map`), else `jax.default_backend()`. A deviceless GPU mesh says "gpu"
    although the process runs on its CPU.
    """
    if mesh_or_none is None and jax.sharding.get_abstract_mesh().empty:
        return jax.default_backend()
    return _platform_name(_device(mesh_or_none).platform)


def hopper(mesh_or_none=None) -> bool:
    """True when code traced now compiles for a Hopper GPU (compute capability 9.x), found as
    `platform` finds its device: a GPU's `compute_capability`, else (an abstract device) its kind
    (`HOPPER_KINDS`)."""
    dev = _device(mesh_or_none)
    if _platform_name(dev.platform) != "gpu":
        return False
    capability = getattr(dev, "compute_capability", None)
    if capability is not None:
        return str(capability).split(".")[0] == "9"
    return bool(HOPPER_KINDS.search(str(getattr(dev, "device_kind", ""))))


def _platform_name(p: str) -> str:
    return "gpu" if p in ("cuda", "rocm", "gpu") else p
