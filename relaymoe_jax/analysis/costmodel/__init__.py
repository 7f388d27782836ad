"""A cost model on paper: per-layer time (forward + backward) of the all-to-all, the flat ring and
the hierarchical ring, for what cannot be timed here (multi-node H100 clusters).

It is a model, not a measurement. Its inputs are measured where this project can measure them:
the bytes each GPU sends come from the compiled XLA:GPU programs (`benchmarks/scaling.py`'s JSON:
collective-permute and all-to-all bytes per device by link class, and one ring hop's bytes), the
FLOPs from XLA:CPU's `cost_analysis()` of a stand-in program (`standin_flops`). What it adds is
three assumed constants and one simple rule per dispatcher.

Constants (public spec figures; override them with the command's flags):
  NVLINK_GBS = 450   NVLink 4 on an H100 SXM: 18 links, 900 GB/s bidirectional per GPU, i.e.
                     450 GB/s per direction (NVIDIA H100 Tensor Core GPU datasheet).
  NIC_GBS = 50       InfiniBand NDR, one ConnectX-7 per GPU: 400 Gb/s = 50 GB/s per direction
                     (NVIDIA ConnectX-7 / DGX H100: 8 x 400 Gb/s compute NICs for 8 GPUs).
  H100_BF16_TFLOPS = 989.4   H100 SXM dense bf16 tensor-core peak (datasheet: 1,979 TFLOP/s is
                     with 2:4 sparsity; dense is half).
  EFFICIENCY = 0.35  the fraction of that peak the expert matmuls reach: this project's Pallas
                     grouped matmul ran forward+backward at 314-357 TFLOP/s (32-36% of 989.4) on a
                     real H200 (BENCHMARKS.md, "On a real H200"); an H200 has the H100's tensor
                     cores (same 989.4 peak) and more HBM bandwidth.
  DEFAULT_TFLOPS = 0.35 x 989.4 = 346.3 TFLOP/s.

Measured compute (`load_rates`): where the prepared GPU run's JSON exists
(`python benchmarks/gpu.py --json benchmarks/results/gpu.json` on one H100/H200, MEASUREMENTS), the
forward and backward compute rates come from it instead: one ring hop at the paper shape, timed
(its "One ring hop" section, the default chunk), else its kernels (the default Pallas config).
Each figure says whether it is measured (file, device, date) or assumed (0.35 x peak). A measured
rate counts FLOPs as that run does (`hop_flops`: 6 and 12 x pairs x H x F, forward and backward),
so the model's hop compute is the measured hop time scaled by pairs x H x F; the all-to-all's
backward, which recomputes nothing, takes 12/16 of the ring's backward time per pair (the ring's
backward hop runs 8 matmuls, 2 of them its recompute; `ComputeRates.backward_s`). Assumed rates
apply to the stand-in's FLOPs, as before.

Bytes (`flat_ring_bytes`, `hier_ring_check`), per GPU:
  P     one payload transfer (an expert partition's weights, bf16): the compiled forward loop
        body's collective-permute bytes (`hop_fwd`);
  A     the dW accumulator trailing its weights (f32): the compiled backward loop body's bytes
        (`hop_bwd`, payload + accumulator) minus P;
  tail  dW's return home after the last hop: what the compiled backward (fwd+bwd program minus
        forward) sends beyond its hops (it is P, not A: XLA converts dW to bf16 first);
  share_c  which link a hop uses, for the GPU that sends most: max over GPUs of its class-c bytes
        / max over GPUs of all its bytes (fwd+bwd program). A flat ring over H > 1 hosts: the
        boundary GPU sends every hop across hosts, the others over NVLink, so both shares are 1;
        one host: intra 1, inter 0. The hierarchical ring: its outer ring crosses hosts, its
        inner one does not.
The hop schedule is `dispatch/ring.py`'s `relay` (`relay_sends`); its totals are checked against
the compiled totals of both rings (`flat_ring_bytes`' fwd_resid, `hier_ring_check`).

FLOPs (`standin_flops`): XLA:GPU gives no `cost_analysis()` for these programs (it returns None),
and XLA counts a while loop's body once, so the ring's loops could not be read anyway. The
stand-in does one hop's exact work under balanced routing: the E/EP local experts each see
T*k/E of this device's pairs, a dense batched SwiGLU [E_l, n, H] x [E_l, H, F] (forward, router
weights applied) and its VJP. The ring's hop: forward + the VJP program (which recomputes the
forward: the ring's backward recomputes per hop); the all-to-all: forward + the backward from
saved residuals, over all T*k pairs of the device once (E_l experts x EP*n pairs). Per pair that
is about 3 + 9 = 12 units of 2*H*F for the ring and 3 + 6 = 9 for the all-to-all (a check only;
the model uses the compiled counts). The ring's real backward hop (`dispatch/hop.py`) recomputes
gate and up but not the down projection (it gets d router weight from dy @ W_down^T), 11 units:
the stand-in overstates the ring's compute by about 1/12, against the ring.

The rules (seconds; c = FLOPs / throughput; t(b) = max(share_intra*b/NVLink, share_inter*b/NIC),
the busiest GPU's slowest link):
  one ring pass = sum over its hops of max(c, t(bytes of the hop)) + t(tail): each hop waits for
      its slowest transfer or its compute, whichever is longer (the transfer of the next hop
      overlaps this hop's compute); the tail (the accumulator's final return home) overlaps
      nothing.
  flat ring = forward pass + backward pass over EP positions.
  hierarchical ring = the same rule nested: a round is a whole inner pass over the L GPUs of a
      host (NVLink), and an outer pass over the M hosts has one round per hop (the payload goes to
      the next host, NIC, while the round's L hops compute). Per round about
      max(L * max(c, t_intra), t_inter).
  all-to-all = compute (no recompute) + its all-to-all bytes at max(intra/NVLink, inter/NIC),
      not overlapped.
Ignored: latency per transfer or kernel, kernel efficiency at small sizes, routing imbalance, the
all-to-all's permutation kernels, the router, contention between GPUs on a NIC or switch, and
whether the compiled schedule really overlaps (it does with `relaymoe_jax.XLA_OPTIONS`, with
which the programs are compiled; tests/test_multinode_gpu.py).

Modules (every public name is importable from this package): `rules` (links, ring levels, the
timing rules), `inputs` (bytes from the compiled programs, the FLOPs stand-in), `rates` (measured
or assumed compute rates, `load_rates`, `load_attention_rates`, `hop_flops`).
"""

from relaymoe_jax.analysis.costmodel.inputs import (
    alltoall_bytes,
    flat_ring_bytes,
    fp8_payload,
    hier_ring_check,
    pairs_per_expert,
    standin_flops,
)
from relaymoe_jax.analysis.costmodel.rates import (
    ATTN_BWD_UNITS,
    DEFAULT_TFLOPS,
    EFFICIENCY,
    H100_BF16_TFLOPS,
    HOP_BWD_UNITS,
    HOP_FWD_UNITS,
    MEASUREMENTS,
    REPO,
    RING_BWD_UNITS,
    ComputeRates,
    MeasurementError,
    Origin,
    Rate,
    assumed_rate,
    fp8_compute_factors,
    hop_flops,
    load_attention_rates,
    load_rates,
)
from relaymoe_jax.analysis.costmodel.rules import (
    NIC_GBS,
    NVLINK_GBS,
    Level,
    Links,
    alltoall_time,
    alltoall_time_s,
    bound,
    flat_levels,
    hier_levels,
    pass_time,
    relay_sends,
    relay_time,
    ring_layer_time,
    threshold_tokens,
    transfer_time,
)

__all__ = [
    "ATTN_BWD_UNITS",
    "DEFAULT_TFLOPS",
    "EFFICIENCY",
    "H100_BF16_TFLOPS",
    "HOP_BWD_UNITS",
    "HOP_FWD_UNITS",
    "MEASUREMENTS",
    "NIC_GBS",
    "NVLINK_GBS",
    "REPO",
    "RING_BWD_UNITS",
    "ComputeRates",
    "Level",
    "Links",
    "MeasurementError",
    "Origin",
    "Rate",
    "alltoall_bytes",
    "alltoall_time",
    "alltoall_time_s",
    "assumed_rate",
    "bound",
    "flat_levels",
    "flat_ring_bytes",
    "fp8_compute_factors",
    "fp8_payload",
    "hier_levels",
    "hier_ring_check",
    "hop_flops",
    "load_attention_rates",
    "load_rates",
    "pairs_per_expert",
    "pass_time",
    "relay_sends",
    "relay_time",
    "ring_layer_time",
    "standin_flops",
    "threshold_tokens",
    "transfer_time",
]
