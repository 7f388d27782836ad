"""Shipped XLA GpuTargetConfig text protos (`relaymoe_jax.gpu_mesh`)."""
