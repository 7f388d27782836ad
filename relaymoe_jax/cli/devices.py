"""Emulated CPU devices for entry points: `use_cpu_devices(8)` before jax's first operation.

Importing relaymoe_jax (or the trainer) never changes the environment: the programs that want an
emulated mesh on the CPU (`relaymoe-train` / `python -m train`, `python -m train.planner`, the
benchmarks) call `use_cpu_devices(n)` in their `main`, which sets jax's `jax_num_cpu_devices`
option. It only gives the CPU backend n devices; it does not choose the platform, so with a GPU
present and `jax[cuda12]` installed jax still uses the GPU as usual.
"""

import os

import jax

from relaymoe_jax.util.tracing import backends_started

_FLAG = "xla_force_host_platform_device_count"
_ours: int | None = None  # the jax_num_cpu_devices value use_cpu_devices set


def user_set_cpu_devices() -> bool:
    """True when the user chose the CPU device count: `--xla_force_host_platform_device_count` in
    XLA_FLAGS, or jax's `jax_num_cpu_devices` set other than by `use_cpu_devices` (e.g. by the
    JAX_NUM_CPU_DEVICES environment variable)."""
    num = jax.config.jax_num_cpu_devices
    return _FLAG in os.environ.get("XLA_FLAGS", "") or (num >= 0 and num != _ours)


def use_cpu_devices(n: int) -> None:
    """Give jax's CPU backend `n` devices, unless the user already chose a count.

    Call it before jax's first operation (device query, array, compile). When the user chose a
    count (`user_set_cpu_devices()`) it does nothing, so XLA_FLAGS and JAX_NUM_CPU_DEVICES win.
    If jax's backends already started, it does nothing when the CPU backend has `n` devices (or
    the user chose its count) and raises RuntimeError otherwise: jax cannot change the count once
    it started. It never changes os.environ.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"use_cpu_devices({n!r}): expected a device count >= 1")
    if backends_started():
        try:
            have = len(jax.local_devices(backend="cpu"))
        except RuntimeError:  # backends started without a CPU backend
            have = None
        if have == n or (have is not None and user_set_cpu_devices()):
            return
        raise RuntimeError(
            f"use_cpu_devices({n}): jax's backends are already initialised with "
            f"{have if have is not None else 'no'} CPU devices; call it before jax's first "
            f"operation, or set XLA_FLAGS=--{_FLAG}={n} before starting Python"
        )
    if user_set_cpu_devices():
        return
    global _ours
    jax.config.update("jax_num_cpu_devices", n)
    _ours = n
