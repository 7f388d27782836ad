"""Test setup: 8 emulated CPU devices (jax's jax_num_cpu_devices, not XLA_FLAGS), set before jax
runs anything; the CPU platform unless JAX_PLATFORMS says otherwise; x64 off."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from relaymoe_jax.cli.devices import use_cpu_devices

use_cpu_devices(8)
jax.config.update("jax_enable_x64", False)
