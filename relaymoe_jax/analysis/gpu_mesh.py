"""Abstract H100 / H200 meshes for deviceless XLA:GPU compiles: no GPU, no CUDA libraries.

    from relaymoe_jax import gpu_mesh
    mesh = gpu_mesh.mesh((8,), ("expert",), target="h100")          # 1 host x 8 H100
    mesh = gpu_mesh.mesh((2, 8), ("node", "local"), target="h200")  # 2 hosts x 8 H200
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).trace(*shape_dtype_structs).lower().compile()
    compiled.memory_analysis()    # XLA:GPU's own buffer assignment, per device
    compiled.as_text()            # the scheduled HLO (async collective start/done order)

It needs the `gpu-compile` extra (`pip install "relaymoe-jax[gpu-compile]"`: jax-cuda12-plugin and
jax-cuda12-pjrt at jax's version, about 0.5 GB, and nvidia-cuda-nvcc-cu12 for `ptxas`, which XLA
runs to finish a GPU compile; without ptxas a Pallas kernel's compile crashes the process) and
runs with `JAX_PLATFORMS=cpu`: the CUDA plugin then compiles for the topology while the host runs
on its CPU. The target configs (XLA's
GpuTargetConfig text protos) ship in `relaymoe_jax/analysis/gpu_targets/`. Inputs must be
`jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))`, compiled under
`jax.set_mesh(mesh)` (Pallas kernels need the mesh context to see a GPU).

What this cannot tell: time. There is no kernel to run, so no speed, no bandwidth and no overlap
in seconds; only what the GPU compiler decides (buffers, fusions, the schedule's order). Sorts
compile to a fallback algorithm ("Missing deviceless CUB scratch size data"), so their scratch
may differ slightly from a real GPU's.
"""

import functools
import importlib.util
import math
import os
import re
import shutil
from importlib import resources

import jax
from jax.sharding import AxisType, Mesh

from relaymoe_jax.util.platform import platform
from relaymoe_jax.util.tracing import cuda_path

# `platform` is imported for this module's users (gpu_mesh.platform); it lives in util.platform
__all__ = [
    "EXTRA",
    "GPUS_PER_HOST",
    "TARGETS",
    "PluginMissing",
    "device_kind",
    "device_memory",
    "mesh",
    "platform",
    "plugin_available",
    "ptxas",
    "require_plugin",
    "target_config",
    "topology",
]

TARGETS = ("h100", "h200")
EXTRA = "gpu-compile"
GPUS_PER_HOST = 8


class PluginMissing(RuntimeError):
    """The CUDA PJRT plugin that compiles for GPU topologies is not installed."""


def ptxas() -> str | None:
    """Where XLA finds `ptxas`: jax's CUDA path (nvidia-cuda-nvcc-cu12, or $CUDA_ROOT), else PATH,
    else /usr/local/cuda; None when there is none."""
    for root in (cuda_path(), "/usr/local/cuda"):
        if root and os.access(path := os.path.join(root, "bin", "ptxas"), os.X_OK):
            return path
    return shutil.which("ptxas")


def plugin_available() -> bool:
    """True when jax's CUDA plugin (`jax_plugins.xla_cuda12`) can be imported and XLA will find
    `ptxas` to finish a compile."""
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ImportError:
        return False
    return found and ptxas() is not None


def require_plugin() -> None:
    """Raise `PluginMissing`, naming the extra, when the CUDA plugin or ptxas is missing."""
    if not plugin_available():
        raise PluginMissing(
            f"deviceless GPU compiles need jax's CUDA plugin and ptxas: pip install "
            f"'relaymoe-jax[{EXTRA}]' (jax-cuda12-plugin and jax-cuda12-pjrt =={jax.__version__} "
            f"and nvidia-cuda-nvcc-cu12; no GPU or CUDA libraries needed)"
        )


def _check_target(target: str) -> str:
    if not isinstance(target, str) or target.lower() not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    return target.lower()


@functools.cache
def target_config(target: str = "h100") -> str:
    """The shipped GpuTargetConfig text proto of `target` ("h100" or "h200")."""
    target = _check_target(target)
    return (
        resources.files("relaymoe_jax.analysis.gpu_targets").joinpath(f"{target}.txtpb").read_text()
    )


def device_memory(target: str = "h100") -> int:
    """Bytes of device memory in `target`'s config (`device_memory_size`)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(target))[1])


def device_kind(target: str = "h100") -> str:
    """The device kind the compiler sees, e.g. "NVIDIA H100 80GB HBM3"."""
    return re.search(r'device_description_str:\s*"([^"]*)"', target_config(target))[1]


def _hosts(num_devices: int, gpus_per_host: int) -> tuple[int, int]:
    """(hosts, GPUs per host) holding `num_devices`: one partial host, or whole hosts."""
    if num_devices <= gpus_per_host:
        return 1, num_devices
    if num_devices % gpus_per_host:
        raise ValueError(
            f"{num_devices} devices do not fill whole hosts of {gpus_per_host} GPUs; "
            f"use a multiple of {gpus_per_host} or set gpus_per_host"
        )
    return num_devices // gpus_per_host, gpus_per_host


def topology(
    num_devices: int = GPUS_PER_HOST, *, target: str = "h100", gpus_per_host: int = GPUS_PER_HOST
):
    """The abstract topology of `num_devices` GPUs, `gpus_per_host` per host ("1xHxG")."""
    for name, v in (("num_devices", num_devices), ("gpus_per_host", gpus_per_host)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    text = target_config(target)
    require_plugin()
    hosts, per_host = _hosts(num_devices, gpus_per_host)
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            platform="cuda", target_config=text, topology=f"1x{hosts}x{per_host}"
        )
    except NotImplementedError as e:  # jax tried to start CUDA first, failed, dropped the plugin
        raise PluginMissing(
            "deviceless GPU compiles need JAX_PLATFORMS=cpu in the environment before jax is "
            "imported (without it jax tries to start CUDA, fails for lack of a GPU and drops "
            f"the CUDA plugin): {e}"
        ) from e


def mesh(
    axis_sizes,
    axis_names,
    *,
    target: str = "h100",
    gpus_per_host: int = GPUS_PER_HOST,
    axis_types=None,
) -> Mesh:
    """An abstract GPU `Mesh` of shape `axis_sizes`, devices filling hosts of `gpus_per_host`.

    Devices are laid out host-major: with (2, 8) on 2 hosts of 8, axis 0 is the host. Axis types
    default to Explicit, as `jax.make_mesh`'s do; pass `axis_types` for others.
    """
    axis_sizes, axis_names = tuple(axis_sizes), tuple(axis_names)
    if len(axis_sizes) != len(axis_names):
        raise ValueError(f"axis_sizes {axis_sizes} and axis_names {axis_names} differ in length")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in axis_sizes):
        raise ValueError(f"axis_sizes must be positive ints, got {axis_sizes}")
    topo = topology(math.prod(axis_sizes), target=target, gpus_per_host=gpus_per_host)
    from jax.experimental import topologies

    devices = topologies.make_mesh(topo, axis_sizes, axis_names).devices
    types = axis_types or (AxisType.Explicit,) * len(axis_names)
    return Mesh(devices, axis_names, axis_types=tuple(types))
