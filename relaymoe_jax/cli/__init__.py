"""Command-line plumbing shared by the trainer, the planner and the benchmarks.

- `devices`: `use_cpu_devices(n)`, emulated CPU devices for an entry point's `main`.
- `argtypes`: argparse types (`positive_int`, `non_negative_int`, `positive_float`).
"""
