"""Selective attention recomputation under a memory budget (paper §3.4).

- `options`: the four options of an attention block and their `jax.checkpoint` policies
  (`ModelConfig.attention_remat` applies them to `QwenMoe`).
- `costs`: bytes kept (m) and backward FLOPs avoided (c) per option, per device and layer.
- `solver`: the greedy c/m solver, a brute-force check and its optimality gap.

`plan_attention_remat(cfg, batch=, seq=, mesh_shape=, dtype=, budget=)` puts them together; the
budget (device capacity minus the full-recomputation peak, measured by compiling) and the
verification by compiling are in `train.planner`.
"""

from relaymoe_jax.remat.costs import AttentionShape, Cost, layer_costs, option_costs
from relaymoe_jax.remat.options import OPTIONS, policy
from relaymoe_jax.remat.solver import Plan, brute_force, greedy, optimality_gap, uniform


def plan_attention_remat(cfg, *, batch: int, seq: int, mesh_shape: dict, dtype, budget) -> Plan:
    """The greedy plan for `cfg`'s attention layers at this micro-batch, sequence length, mesh
    ({axis: size}) and compute dtype, within `budget` bytes per device; with `cfg.scan_layers`
    (one layer body for all layers) the best plan with one option for every layer (`uniform`)."""
    costs = layer_costs(cfg, batch, seq, mesh_shape, dtype)
    return (uniform if getattr(cfg, "scan_layers", False) else greedy)(costs, budget)


__all__ = [
    "OPTIONS",
    "AttentionShape",
    "Cost",
    "Plan",
    "brute_force",
    "greedy",
    "layer_costs",
    "optimality_gap",
    "option_costs",
    "plan_attention_remat",
    "policy",
    "uniform",
]
