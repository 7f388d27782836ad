"""Expert load per MoE layer, from the routing the step already counts (`StepMetrics.expert_load`:
the (token, slot) pairs routed to each expert, [L_moe, E], summed over the step's micro-batches).

Per layer, in metrics.jsonl as lists (one entry per MoE layer, in layer order):
  expert_overload  max over experts of load / mean load: 1.0 is perfectly balanced, E when one
                   expert takes every pair (Megatron's "overload factor");
  expert_min_load  the least-loaded expert's load / mean load: 0.0 when an expert is idle;
  experts_idle     how many experts received no pair this step.
The step's `dropped_pairs` (the all-to-all with a capacity factor) is logged beside them, summed
over layers. The progress line shows the worst layer (`worst`); `train.run.plot` draws the
overload as a layers x steps heatmap (expert_load.png)."""

import numpy as np

LOAD_KEYS = ("expert_overload", "expert_min_load", "experts_idle")


def load_stats(load_le) -> dict[str, list]:
    """The per-layer lists of `LOAD_KEYS` from the counts [L_moe, E] (host values). A layer that
    routed nothing (no tokens) has overload and min load 0."""
    load = np.asarray(load_le, np.float64)
    if load.ndim != 2:
        raise ValueError(f"expert load must be [layers, experts], got shape {load.shape}")
    mean = load.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    return {
        "expert_overload": [float(v) for v in np.where(mean > 0, load.max(axis=1) / safe, 0.0)],
        "expert_min_load": [float(v) for v in np.where(mean > 0, load.min(axis=1) / safe, 0.0)],
        "experts_idle": [int(v) for v in (load == 0).sum(axis=1)],
    }


def worst(rec: dict) -> str:
    """`load max/mean 1.83 (layer 3), idle 0`: the most overloaded layer of a metrics record,
    and the most idle experts of any layer; "" without load lists (a dense model)."""
    over = rec.get("expert_overload") or []
    if not over:
        return ""
    layer = int(np.argmax(over))
    return f"load max/mean {over[layer]:.2f} (layer {layer}), idle {max(rec['experts_idle'])} "
