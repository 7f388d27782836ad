"""Compile-only analysis of XLA programs: what the compiler decides, read without running it.

- `gpu_mesh`: abstract H100 / H200 meshes for deviceless XLA:GPU compiles (public as
  `relaymoe_jax.gpu_mesh`); its GPU target configs ship in `gpu_targets/` (*.txtpb).
- `hlo`: collective-permute and all-to-all bytes (per device, per link class, loop trips
  included) and ring loops' schedules, read from a compiled program's HLO text.
- `overlap`: what a scheduled multi-host program hides its cross-host transfers behind.
- `memory`: one MoE layer's per-device memory from XLA's buffer assignment, and the ring's
  analytic floor. It compiles the op (`moe_ffn`), so this package does not import it eagerly.
- `costmodel`: a cost model on paper (per-layer time of the all-to-all and the rings on H100
  clusters) from compiled bytes, stand-in FLOPs and assumed or measured rates.
- `triton_calls`: the Triton kernels a compiled GPU program calls, the operand types they
  receive, and whether their lowered code uses the tensor cores (`wgmma`).

Nothing below the op (kernels, dispatch, op, models) imports this package.
"""
