"""Choosing one recomputation option per attention layer under a memory budget (paper §3.4).

`greedy`: rank every (layer, option) by c/m (backward FLOPs saved per byte kept) and take them in
that order while they fit the budget, at most one option per layer: an option of a layer that
already holds one replaces it when it saves more and the extra bytes fit (without that upgrade,
the paper's plain rule, the plan was optimal in 45% of the random instances of
tests/test_remat.py, mean gap 12.9%; with it 73%, mean gap 3.0%). Ties go to the lower layer and
the cheaper option, so the same input always gives the same plan. `brute_force`: the best
plan over all (options + 1) ** layers assignments, for checking the greedy on small instances
(`optimality_gap`). Options are generic `Cost(bytes, flops)` per layer (`costs.py` makes them for
the model's attention blocks).
"""

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from relaymoe_jax.remat.costs import Cost
from relaymoe_jax.remat.options import OPTIONS, check_option

BRUTE_FORCE_LIMIT = 1 << 20  # assignments brute_force will enumerate


@dataclasses.dataclass(frozen=True)
class Plan:
    options: tuple[str, ...]  # per layer; "full" where nothing is kept
    bytes: int  # kept beyond full recomputation
    flops_saved: int  # backward FLOPs avoided
    budget: int

    def counts(self) -> dict[str, int]:
        return {o: self.options.count(o) for o in OPTIONS if o in self.options}

    def describe(self) -> str:
        parts = ", ".join(f"{n} x {o}" for o, n in self.counts().items())
        return (
            f"{parts}: keeps {self.bytes / 2**20:,.1f} MiB of {self.budget / 2**20:,.1f} "
            f"MiB budget, saves {self.flops_saved / 1e9:,.2f} GFLOP of recomputation"
        )


def _check(costs: Sequence[Mapping[str, Cost]], budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(f"budget={budget!r}: expected a number of bytes")
    if budget < 0:
        raise ValueError(
            f"budget={budget}: a memory budget must be >= 0 bytes (is the device "
            f"capacity below the full-recomputation peak?)"
        )
    for i, layer in enumerate(costs):
        for opt, c in layer.items():
            check_option(opt, f"layer {i} option")
            if opt == "full":
                raise ValueError(
                    f"layer {i}: 'full' is the baseline (0 bytes, 0 FLOPs), not an option to list"
                )
            if c.bytes <= 0 or c.flops < 0:
                raise ValueError(
                    f"layer {i} option {opt}: bytes={c.bytes} must be > 0 and flops={c.flops} >= 0"
                )


def _plan(costs, chosen: dict[int, str], budget) -> Plan:
    options = tuple(chosen.get(i, "full") for i in range(len(costs)))
    kept = sum(costs[i][o].bytes for i, o in chosen.items())
    saved = sum(costs[i][o].flops for i, o in chosen.items())
    return Plan(options, kept, saved, int(budget))


def greedy(costs: Sequence[Mapping[str, Cost]], budget) -> Plan:
    """The paper's greedy: by c/m, descending, within `budget` bytes, one option per layer."""
    _check(costs, budget)
    ranked = sorted(
        ((i, o) for i, layer in enumerate(costs) for o in layer),
        key=lambda io: (
            -costs[io[0]][io[1]].flops / costs[io[0]][io[1]].bytes,
            io[0],
            OPTIONS.index(io[1]),
        ),
    )
    chosen, left = {}, budget
    for i, o in ranked:
        held = costs[i][chosen[i]] if i in chosen else Cost(0, 0)
        extra, gain = costs[i][o].bytes - held.bytes, costs[i][o].flops - held.flops
        if extra <= left and gain > 0 and (i not in chosen or extra > 0):
            chosen[i] = o  # take it, or upgrade the layer's option
            left -= extra
    return _plan(costs, chosen, budget)


def uniform(costs: Sequence[Mapping[str, Cost]], budget) -> Plan:
    """The best plan that gives every layer the same option (a scanned model, `scan_layers`, has
    one layer body): the option saving the most FLOPs whose bytes over all layers fit `budget`
    (ties: fewer bytes); "full" everywhere when none fits. Exact for that constraint."""
    _check(costs, budget)
    n = len(costs)
    shared = set.intersection(*(set(layer) for layer in costs)) if costs else set()
    best = None
    for o in sorted(shared, key=OPTIONS.index):
        kept = sum(layer[o].bytes for layer in costs)
        saved = sum(layer[o].flops for layer in costs)
        if kept <= budget and saved > 0 and (best is None or (saved, -kept) > best[1]):
            best = (o, (saved, -kept))
    return _plan(costs, {} if best is None else dict.fromkeys(range(n), best[0]), budget)


def brute_force(costs: Sequence[Mapping[str, Cost]], budget) -> Plan:
    """The plan with the most FLOPs saved within `budget` (ties: fewer bytes, then the first in
    enumeration order). Exponential: refuses more than BRUTE_FORCE_LIMIT assignments."""
    _check(costs, budget)
    choices = [[None, *layer] for layer in costs]
    n = 1
    for c in choices:
        n *= len(c)
    if n > BRUTE_FORCE_LIMIT:
        raise ValueError(
            f"brute_force: {n} assignments exceed BRUTE_FORCE_LIMIT={BRUTE_FORCE_LIMIT}; use greedy"
        )
    best, best_key = {}, (0, 0)
    for combo in itertools.product(*choices):
        chosen = {i: o for i, o in enumerate(combo) if o is not None}
        kept = sum(costs[i][o].bytes for i, o in chosen.items())
        if kept > budget:
            continue
        key = (sum(costs[i][o].flops for i, o in chosen.items()), -kept)
        if key > best_key:
            best, best_key = chosen, key
    return _plan(costs, best, budget)


def optimality_gap(greedy_plan: Plan, best: Plan) -> float:
    """(best - greedy) / best of the FLOPs saved; 0 when both save nothing."""
    if best.flops_saved == 0:
        return 0.0
    return (best.flops_saved - greedy_plan.flops_saved) / best.flops_saved
