"""The RelayMoE trainer: `python -m train --config configs/tiny.yaml --steps N --out DIR`.

Installed, this folder is the package `relaymoe_train` (command `relaymoe-train`, or
`python -m relaymoe_train`); its modules import one another relatively, so both names work. It
needs the `train` extra (optax, orbax-checkpoint, matplotlib).

Modules, one job each: `cli` (arguments and the run), `mesh` (the `mesh=` option), `distributed`
(jax.distributed flags), `data` (tokenizers, packing, deterministic batches), `loop` (model,
optimizer, the jitted train step), `checkpoint` (orbax save/restore, checksums, the metrics log),
`identity` (what a checkpoint was trained with, which resumes it refuses, the lr's horizon),
`progress` (the per-step line), `plot` (loss-curve PNGs), `report` (memory per dispatcher),
`guards` (checks before a run: `--out`, does the state fit this machine; one-line write errors),
`interrupt` (SIGINT / SIGTERM: checkpoint the last completed step, exit 130 / 143).

Importing the package changes nothing in the environment. The command (`cli.entry`) and
`python -m train.planner` ask jax for 8 emulated CPU devices before it starts
(`relaymoe_jax.devices.use_cpu_devices`; unless XLA_FLAGS sets a device count), so they run
anywhere; that does not choose the platform, so with `jax[cuda12]` installed and a GPU present jax
uses the GPU as usual.
"""
