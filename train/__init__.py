"""The RelayMoE trainer: `python -m train --config configs/tiny.yaml --steps N --out DIR`.

Modules, one job each: `cli` (arguments and the run), `data` (tokenizer, packing, deterministic
batches), `loop` (model, optimizer, the jitted train step), `checkpoint` (orbax save/restore and
the metrics log).

Importing the package before jax gives 8 emulated CPU devices and the CPU platform by default
(each only if not already set), so `python -m train` runs anywhere.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
