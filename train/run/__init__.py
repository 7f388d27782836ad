"""One training run, start to end: `loop` (build or resume the train state, compile the step,
train, checkpoint, report), `io` (checkpoint saves and waits, metrics.jsonl, the stops a signal
makes), `guards` (`--out` checked before anything is built; the diverged-loss error; orbax's
background-save logs quieted), `interrupt` (SIGINT / SIGTERM: checkpoint the last completed step,
exit 130 / 143; a second signal: at once, unless a checkpoint is being written), `progress` (the
per-step line), `plot` (loss-curve and expert-load PNGs; `python -m train.run.plot`), `board`
(TensorBoard event files), `profile` (`--profile-steps`: jax.profiler traces) and `distributed`
(jax.distributed flags, printing on process 0). It is the top floor below the commands; importing
the package imports none of its modules."""
