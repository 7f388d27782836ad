"""The RelayMoE trainer: `python -m train --config configs/tiny.yaml --steps N --out DIR`.

Installed, this folder is the package `relaymoe_train` (command `relaymoe-train`, or
`python -m relaymoe_train`); its modules import one another relatively, so both names work. It
needs the `train` extra (optax, orbax-checkpoint, matplotlib).

Modules, one job each: `cli` (arguments into `settings.RunSettings`, the command), `settings`
(the typed trainer settings: `TrainConfig`, `RunSettings`), `run` (one run: build or resume, the
steps, checkpoints, the end-of-run report), `mesh` (the `mesh=` option), `distributed`
(jax.distributed flags), `data` (the data package: the prepared-dataset format, prepare, the
loader, the tokenizers, and the synthetic and prepared sources behind one `Source` protocol),
`optimizer` (AdamW and its schedule), `train_step` (the `TrainState` record, its shardings, the
jitted train step on a `data.Batch`, its `StepMetrics`),
`checkpoint` (orbax save/restore, checksums, the metrics log), `identity` (what a checkpoint was
trained with, which resumes it refuses, the lr's horizon), `progress` (the per-step line), `plot`
(loss-curve PNGs), `report` (memory per dispatcher), `guards` (checks before a run: `--out`, does
the state fit this machine; one-line errors), `interrupt` (SIGINT / SIGTERM: checkpoint the last
completed step, exit 130 / 143), `export` (`relaymoe-train export RUN_DIR --out HF_DIR`: a
run's checkpoint as a Hugging Face checkpoint, streamed). `planner` (`python -m train.planner`:
the training memory plan, attention remat per dispatcher, and the largest sizes that fit;
`search` the size search, `planner_report` its tables).

Importing the package changes nothing in the environment. The command (`cli.entry`) and
`python -m train.planner` ask jax for 8 emulated CPU devices before it starts
(`relaymoe_jax.cli.devices.use_cpu_devices`; unless XLA_FLAGS sets a device count), so they run
anywhere; that does not choose the platform, so with `jax[cuda12]` installed and a GPU present jax
uses the GPU as usual.
"""
