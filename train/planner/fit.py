"""Does the train state fit this machine: `check_fits`, before anything is allocated or compiled,
compares the bytes the train state needs per device (parameters, AdamW's two moments and the
gradients, all float32 master copies, plus with `grad_accum` > 1 the float32 gradient accumulator
(`train.step.accumulate`), from `train_step.abstract_state`: shapes and shardings only, nothing
allocated) with what the machine has: on a GPU or TPU its `memory_stats()["bytes_limit"]`; on CPU
the host's available RAM (`MemAvailable` of /proc/meminfo, else physical pages), shared by the
emulated devices. It is a lower bound (activations and temporaries come on top), so a config it
refuses cannot fit; `DoesNotFitError` names both numbers and `--force`. The trainer runs it at
start-up (`train.run.loop`); the planner measures the whole compiled step instead.
"""

import dataclasses
import math
import os
from pathlib import Path

import jax

from relaymoe_jax.models.param_count import param_count


class DoesNotFitError(ValueError):
    """The train state alone needs more memory than the machine has."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    params: int  # parameters of the model (`param_count`)
    state: int  # bytes per device of the train state in device memory (params, moments, rest)
    grads: int  # bytes per device of the gradients (the parameters' shards; + accumulator)
    host: int = 0  # bytes per device of the train state in pinned host memory (offload_optimizer)

    @property
    def per_device(self) -> int:
        return self.state + self.grads


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def estimate(cfg, tc, mesh) -> Estimate:
    """Per-device bytes of the train state and gradients, from shapes and shardings only."""
    from ..step import train_step  # the train extra (optax); this module itself needs only jax

    _, state, _, _ = train_step.abstract_state(cfg, tc, mesh)
    leaves = jax.tree.leaves(state)
    host = sum(_shard_bytes(x) for x in leaves if x.sharding.memory_kind == "pinned_host")
    device = sum(_shard_bytes(x) for x in leaves) - host
    grads = sum(_shard_bytes(x) for x in jax.tree.leaves(state.params))
    if tc.offload_optimizer:  # the gradients (and the fetched weights) in the compute dtype
        itemsize = 2 if tc.compute_dtype == "bfloat16" else 4
        grads = 2 * grads * itemsize // 4
    if tc.grad_accum > 1:  # the float32 accumulator of step.accumulate, like the gradients
        grads += sum(_shard_bytes(x) for x in jax.tree.leaves(state.params))  # f32 params
    return Estimate(param_count(cfg)["total"], device, grads, host)


def host_available() -> int | None:
    """Bytes of RAM available to a new allocation: MemAvailable (Linux), else physical RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def capacity(devices) -> tuple[int, int, str] | None:
    """(bytes, devices sharing them, what they are) for this process's `devices`, or None when
    unknown: an accelerator's own limit, or the host's available RAM for CPU devices."""
    if not devices:
        return None
    d = devices[0]
    try:
        stats = d.memory_stats() or {}
    except Exception:  # backends without memory stats raise
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), 1, f"memory of one {d.device_kind} (bytes_limit)"
    if d.platform == "cpu":
        avail = host_available()
        return (avail, len(devices), "available host RAM") if avail else None
    return None


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,}"


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_fits(cfg, tc, mesh, force: bool = False, devices=None) -> Estimate:
    """The `Estimate`; `DoesNotFitError` if it exceeds `capacity` (unless `force`)."""
    est = estimate(cfg, tc, mesh)
    if devices is None:
        devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    cap = capacity(devices)
    if cap is None or force:
        return est
    limit, sharing, what = cap
    # CPU devices' memory is the host's RAM: the state offloaded to pinned host memory counts too
    need = (est.per_device + (est.host if devices[0].platform == "cpu" else 0)) * sharing
    if need > limit:
        per = (
            f"{fmt_bytes(est.per_device)} per device x {sharing} {devices[0].platform} devices"
            if sharing > 1
            else "per device"
        )
        raise DoesNotFitError(
            f"the train state alone needs {fmt_bytes(need)} ({per}: {_fmt_count(est.params)} "
            f"parameters, AdamW moments and gradients in float32, before any activation), more "
            f"than the {fmt_bytes(limit)} of {what}; use a smaller config, more devices or an "
            f"fsdp axis (mesh=fsdp=N,...), or --force to try anyway"
        )
    return est
