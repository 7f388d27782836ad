"""The RelayMoE trainer: `python -m train --config configs/tiny.yaml --steps N --out DIR`.

Modules, one job each: `cli` (arguments and the run), `mesh` (the `mesh=` option), `distributed`
(jax.distributed flags), `data` (tokenizers, packing, deterministic batches), `loop` (model,
optimizer, the jitted train step), `checkpoint` (orbax save/restore, checksums, the metrics log),
`progress` (the per-step line), `plot` (loss-curve PNGs), `report` (memory per dispatcher).

Importing the package before jax gives 8 emulated CPU devices (unless XLA_FLAGS already sets a
device count), so `python -m train` runs anywhere; it does not choose the platform, so with
`jax[cuda12]` installed and a GPU present jax uses the GPU as usual.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
