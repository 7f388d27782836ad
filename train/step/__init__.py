"""The train step: `train_step` (the `TrainState` record, its shardings, the jitted step on a
`data.Batch` and its `StepMetrics`, compiled and memoised), `objective` (the next-token loss and
the router losses it differentiates), `accumulate` (`grad_accum`: micro-batches summed in one
`lax.scan`), `offload` (`offload_optimizer`: weights and moments in host memory, streamed through
the update), `optimizer` (AdamW and its schedule), `storage` (how parameters are stored under an
`fsdp` or `context` axis), `evaluate` (the held-out forward on the step's loss terms), `mesh`
(the `mesh=` option), `expert_load` (the per-layer load statistics of the metrics line) and
`flops` (a step's model FLOPs and MFU). It imports only `settings` and `data` of the trainer;
importing the package imports none of its modules."""
