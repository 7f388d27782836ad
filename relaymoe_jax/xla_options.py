"""XLA:GPU options without which the ring's transfers do not hide behind its compute.

Pass them to the jit that compiles a program holding `moe_ffn`'s ring (the trainer and the
benchmarks do):

    jax.jit(f, compiler_options=relaymoe_jax.XLA_OPTIONS)

or for every program of a process, before jax starts its backend:

    XLA_FLAGS="$XLA_FLAGS $(python -c 'import relaymoe_jax; print(relaymoe_jax.XLA_FLAGS)')"

- `xla_gpu_collective_permute_combine_threshold_bytes`: one ring hop sends several arrays (expert
  routing: gate, up and down weights, and in the backward their float32 dW accumulator). XLA sends
  them as one collective permute only while together they stay under its combining threshold,
  30 MiB by default; above it they stay separate, the scheduler keeps at most
  `..._overlap_limit` of them in flight and waits for the rest before the hop's compute. At the
  paper's shape (E=128, H=2048, F=768) every weight of a hop is 24-48 MiB, and the compiled 8 x H100
  program hid 1 of a forward hop's 3 transfers and 1 of a backward hop's 6. Combined, each hop's
  transfer starts before its chunk loop and ends after it (tests/test_gpu_compile.py).
- `xla_gpu_experimental_parallel_collective_overlap_limit`: async collectives in flight at once
  (XLA's default: one). The hierarchical ring keeps its inter-node transfer in flight across a
  whole round, beside the inner ring's own, and the loss's all-reduce may be in flight too; with
  fewer slots XLA starts the inter-node transfer after the round (tests/test_multinode_gpu.py).

XLA:CPU ignores both. What hiding costs in memory: the transfer's send and receive buffers are
live during the compute they hide behind (BENCHMARKS.md reports figures compiled with these
options).
"""

XLA_OPTIONS = {
    "xla_gpu_collective_permute_combine_threshold_bytes": 1 << 40,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 3,
}
XLA_FLAGS = " ".join(f"--{k}={v}" for k, v in XLA_OPTIONS.items())
