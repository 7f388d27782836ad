"""The memory planner (`python -m train.planner`): what a train step needs and what fits. `plan`
compiles (never runs) the step per dispatcher and plans attention recomputation into the room
left (the command: `plan.main`), `args` checks its command line before anything compiles,
`search` finds the largest micro-batch or sequence length that fits, `report` prints its tables,
`memory` reads a compiled step's device and host bytes (the trainer's `--memory-table` too), and
`fit` is the trainer's start-up check that the train state alone fits the machine. It sits above
`step` (it compiles the train step) and below `hf` and `run`; nothing here is imported when the
package is."""
