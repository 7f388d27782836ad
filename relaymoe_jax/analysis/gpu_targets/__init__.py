"""Shipped XLA GpuTargetConfig text protos (`relaymoe_jax.analysis.gpu_mesh`)."""
