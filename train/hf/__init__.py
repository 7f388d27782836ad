"""Hugging Face checkpoints in and out of the trainer: `init` (`--init-from-hf DIR`: the model
config from config.json and the weights loaded onto the trainer's stored sharding) and `export`
(`relaymoe-train export RUN_DIR --out HF_DIR`: a run's checkpoint as a Hugging Face checkpoint,
streamed one saved array at a time, read by `saved`, with DIR's tokenizer files,
`tokenizer_files`). It sits above `state` (export reads checkpoints); importing the package
imports none of its modules."""
