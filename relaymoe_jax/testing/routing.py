"""Adversarial routings for MoE parity tests, and random inputs for them.

`CASES` names and describes each routing; `routing_case` builds one as int32 expert_ids
[num_tokens, top_k], `routing_cases` every one that applies to a shape; `moe_inputs` draws
moe_ffn's other arguments (and a cotangent for y) for a routing.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Every case is an int32 [num_tokens, top_k] array. Partition p (ring position p) holds experts
# [p * E_l, (p + 1) * E_l), E_l = num_experts / num_partitions.
CASES = {
    "uniform": "k distinct ids per token, uniformly at random",
    "one_expert": "slot 0 of every token is expert E // 3; the other slots distinct, random",
    "one_partition": "every pair in partition (P - 1) // 2, k distinct ids per token "
    "(only when k <= E_l)",
    "all_experts": "k == E: every token a random permutation of all experts (only when k == E)",
    "ragged": "expert 0 and, when P > 1, the whole last partition get no pair; the others are "
    "drawn with probabilities halving from one to the next (shuffled order), k distinct "
    "per token (only when k <= the experts left)",
    "ties": "repeated ids within a token (ties in the pairs' sort key): slot 1 repeats slot 0, "
    "and every third token sends all k slots to expert min(E // 2 + 1, E - 1) "
    "(only when k >= 2)",
    "out_of_range": "uniform, then up to three pairs (tokens ~T/6, T/2, 5T/6) get the ids -1, E "
    "and 2**31 - 1, which every dispatcher ignores",
}


def _not_applicable(name, num_tokens, top_k, num_experts, num_partitions):
    """Why case `name` cannot be built for this shape, or None."""
    e_local = num_experts // num_partitions
    left = num_experts - 1 - (e_local if num_partitions > 1 else 0)
    return {
        "one_partition": top_k > e_local and f"top_k={top_k} > experts per partition {e_local}",
        "all_experts": top_k != num_experts and f"top_k={top_k} != num_experts={num_experts}",
        "ragged": top_k > left and f"top_k={top_k} > the {left} experts that get pairs",
        "ties": top_k < 2 and "top_k=1 has no second slot to repeat",
    }.get(name) or None


def _distinct(rng, num_tokens, top_k, experts):
    """[T, k]: k distinct entries of `experts` per token, uniformly at random."""
    experts = np.asarray(experts)
    order = np.argsort(rng.random((num_tokens, len(experts))), axis=1)
    return experts[order[:, :top_k]]


def routing_case(name, num_tokens, top_k, num_experts, num_partitions, seed=0):
    """One adversarial routing, int32 expert_ids [num_tokens, top_k]; see `CASES` for each.

    num_partitions is the ring size (expert-parallel degree); seed an int or a numpy Generator.
    Raises ValueError when the case does not apply to the shape (e.g. "all_experts" needs
    top_k == num_experts) or the shape is invalid.
    """
    t, k, e, n = num_tokens, top_k, num_experts, num_partitions
    if name not in CASES:
        raise ValueError(f"routing_case({name!r}): unknown case; one of {list(CASES)}")
    if not (t >= 1 and 1 <= k <= e and n >= 1 and e % n == 0):
        raise ValueError(
            f"routing_case: need tokens >= 1, 1 <= top_k <= num_experts and "
            f"num_experts % num_partitions == 0; got T={t} k={k} E={e} P={n}"
        )
    why = _not_applicable(name, t, k, e, n)
    if why:
        raise ValueError(f"routing_case({name!r}) does not apply: {why}")
    rng = np.random.default_rng(seed)
    e_local = e // n
    if name in ("uniform", "all_experts", "out_of_range"):
        ids = _distinct(rng, t, k, np.arange(e))
        if name == "out_of_range":
            for i, bad in enumerate([-1, e, 2**31 - 1][:t]):
                ids[(2 * i + 1) * t // 6, i % k] = bad
    elif name == "one_expert":
        hot = e // 3
        ids = np.concatenate(
            [np.full((t, 1), hot), _distinct(rng, t, k - 1, np.delete(np.arange(e), hot))], axis=1
        )
    elif name == "one_partition":
        p = (n - 1) // 2
        ids = _distinct(rng, t, k, np.arange(p * e_local, (p + 1) * e_local))
    elif name == "ragged":
        empty = {0, *(range(e - e_local, e) if n > 1 else ())}
        busy = rng.permutation([i for i in range(e) if i not in empty])
        prob = 0.5 ** np.arange(len(busy))
        ids = np.stack([rng.choice(busy, k, replace=False, p=prob / prob.sum()) for _ in range(t)])
    else:  # ties
        ids = _distinct(rng, t, k, np.arange(e))
        ids[:, 1] = ids[:, 0]
        ids[::3] = min(e // 2 + 1, e - 1)
    return ids.astype(np.int32)


def routing_cases(num_tokens, top_k, num_experts, num_partitions, seed=0):
    """{case name: int32 expert_ids [num_tokens, top_k]} for every case in `CASES` that applies
    to this shape (the others are left out; `routing_case` says why)."""
    return {
        name: routing_case(name, num_tokens, top_k, num_experts, num_partitions, seed)
        for name in CASES
        if not _not_applicable(name, num_tokens, top_k, num_experts, num_partitions)
    }


class MoeInputs(NamedTuple):
    """moe_ffn's six positional arguments and a cotangent r for y (float32 [T, H])."""

    x: jax.Array
    expert_ids: jax.Array
    expert_weights: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    r: jax.Array

    @property
    def args(self):
        return tuple(self[:6])


def moe_inputs(
    ids_tk, num_experts, hidden=16, ffn=24, dtype=np.float32, seed=0, equal_weights=False
):
    """Random inputs for `ids_tk`: x ~ N(0, 1); router weights U(0.1, 1), not normalised, so a
    misweighted pair shows (equal_weights: all 1/k, weight ties); SwiGLU weights scaled by
    1/sqrt(fan-in); r ~ N(0, 1), the cotangent of y, so every output entry matters."""
    rng = np.random.default_rng(seed)
    t, k = np.shape(ids_tk)
    x_th = rng.standard_normal((t, hidden))
    wts_tk = np.full((t, k), 1 / k) if equal_weights else rng.uniform(0.1, 1.0, (t, k))
    w_gate_ehf, w_up_ehf = (
        rng.standard_normal((num_experts, hidden, ffn)) / np.sqrt(hidden) for _ in range(2)
    )
    w_down_efh = rng.standard_normal((num_experts, ffn, hidden)) / np.sqrt(ffn)
    r_th = rng.standard_normal((t, hidden))
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return MoeInputs(
        cast(x_th),
        jnp.asarray(ids_tk, jnp.int32),
        cast(wts_tk),
        cast(w_gate_ehf),
        cast(w_up_ehf),
        cast(w_down_efh),
        jnp.asarray(r_th, jnp.float32),
    )
