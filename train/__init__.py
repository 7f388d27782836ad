"""The RelayMoE trainer: `python -m train --config configs/tiny.yaml --steps N --out DIR`.

Installed, this folder is the package `relaymoe_train` (command `relaymoe-train`, or
`python -m relaymoe_train`); its modules import one another relatively, so both names work. It
needs the `train` extra (optax, orbax-checkpoint, matplotlib, grain).

Packages by job (each `__init__` says what it owns):

- `settings` (the typed trainer settings: `TrainConfig`, `RunSettings`) and `errors` (the
  one-line errors every command prints: a missing extra, a failed write);
- `data`: the prepared-dataset format, `prepare`, the loader, the tokenizers, and the synthetic
  and prepared sources behind one `Source` protocol;
- `step`: the train step (`train_step`: the `TrainState`, the jitted step, its `StepMetrics`),
  its loss (`objective`), `accumulate` (grad_accum), `offload` (offload_optimizer), `optimizer`,
  `storage`, `evaluate` (the held-out forward) and `mesh` (the `mesh=` option);
- `state`: what a run keeps, `checkpoint` (orbax save/restore, checksums, the metrics log) and
  `identity` (what a checkpoint was trained with, which resumes it refuses);
- `planner` (`python -m train.planner`): `plan` (the training memory plan, attention remat per
  dispatcher, the largest sizes that fit), `args`, `search`, `report` (its tables), `memory` (a
  compiled step's bytes, the `--memory-table`) and `fit` (does the train state fit the machine);
- `hf`: Hugging Face checkpoints, `init` (`--init-from-hf`) and `export`
  (`relaymoe-train export RUN_DIR --out HF_DIR`);
- `run`: one run, `loop` (build or resume, the steps, checkpoints, the end-of-run report), `io`,
  `guards` (`--out`, the diverged loss), `interrupt` (SIGINT / SIGTERM: checkpoint the last
  completed step, exit 130 / 143), `progress`, `plot` (loss-curve PNGs) and `distributed`;
- the commands at the root: `cli` and `cli_help` (the command line), `__main__`, and `plot`,
  `export`, `prepare`, which keep the older `python -m train.X` commands working.

Floors, lowest first: `errors` and `settings`; `data`; `step`; `state`; `planner`; `hf`; `run`;
the root commands. A module imports only from its own floor and those below it (inside a
package, its modules import one another one way too: no import circle), checked by
tests/test_house_rules.py.

Importing the package changes nothing in the environment. The command (`cli.entry`) and
`python -m train.planner` ask jax for 8 emulated CPU devices before it starts
(`relaymoe_jax.cli.devices.use_cpu_devices`; unless XLA_FLAGS sets a device count), so they run
anywhere; that does not choose the platform, so with `jax[cuda12]` installed and a GPU present jax
uses the GPU as usual.
"""
