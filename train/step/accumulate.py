"""Gradient accumulation (`grad_accum=N`): N micro-batches of `batch_size` rows per optimizer step.

The data source reads one global batch of `N * batch_size` rows per optimizer step, so the data
order, the loader's state and position, the checkpoints and resume all count optimizer steps,
and `grad_accum=4, batch_size=2` reads exactly the rows `batch_size=8` reads, in the same order.
Micro-batch n of a step is rows `n*B .. n*B+B-1` of that global batch. The step takes it as
[N, B, S] arrays on the micro-batch's sharding with a leading unsharded axis (`step_batch`,
`put_batch`; each process fills only its own devices' rows, `rows_of_process`).

Inside the compiled step (`accumulated_value_and_grad`, called by `train_step.make_step`) a
`lax.scan` runs the forward and backward of one micro-batch per iteration and sums the gradients
into a float32 accumulator shaped and sharded like the gradients (with `offload_optimizer`, like
the fetched compute weights, on the device); then the ordinary single update applies the sum.
Only one micro-batch's activations are live at a time: the step's peak is one micro-batch's plus
the accumulator. How each term is averaged:

* LM loss: a token mean over the whole step. The step first counts the target weights of all N
  micro-batches (`objective.next_token_targets`, packed documents included), W; micro-batch n
  contributes nll_n / W, so the summed gradient and the reported `lm_loss` equal those of one
  batch of N * B rows (up to float summation order).
* z-loss: a mean over a micro-batch's tokens; every micro-batch has B * S of them, so weighting
  each by 1/N is the mean over the step's tokens, as one batch of N * B rows gives.
* Switch-style load-balancing `aux_loss`: a product of per-expert fractions over the batch, not
  additive over micro-batches. Each micro-batch's aux loss is computed on its own routing and
  weighted 1/N (the mean over micro-batches, as Megatron-LM and MaxText do); it differs from
  the aux loss of one batch of N * B rows.
* The aux-loss-free expert bias (`train_step.update_expert_bias`, after the step) reads the
  expert counts summed over the N micro-batches: the bias is fixed within a step, so the routing
  and the counts equal those of one batch of N * B rows exactly.

Reported: `loss` and `lm_loss` the step's token means, `aux_loss`, `z_loss` and `router_loss`
the means over micro-batches, `dropped_pairs` summed, `grad_norm` that of the summed gradient.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..data.source import Batch
from . import objective


def accumulated_value_and_grad(graphdef, dtype, loss_chunk: int, packed: bool, n: int):
    """fn(params, rest, batch) -> ((loss, (lm_loss, aux)), grads) like
    `jax.value_and_grad(objective.make_loss(...), has_aux=True)`, for a `Batch` of [N, B, S]
    arrays: the gradients (float32) summed over the N micro-batches by a `lax.scan`, each term
    averaged as the module docstring says; `aux` a `ModelAux` of the means over micro-batches
    (its integer counts, `expert_load` and `dropped_pairs`, summed)."""
    terms = objective.make_terms(graphdef, dtype, loss_chunk)

    def weight_total(batch: Batch):
        if not packed:
            b, s = batch.tokens.shape[1:]
            return n * b * (s - 1)
        per_micro = jax.lax.map(
            lambda mb: jnp.sum(objective.next_token_targets(mb.tokens, mb.segment_ids)[1]),
            batch,
        )  # at least one target per step: the loader's rows are seq_len >= 2 tokens
        return jnp.maximum(jnp.sum(per_micro), 1.0)

    def micro_loss(params, rest, mb: Batch, w_total):
        nll, _, aux = terms(params, rest, mb)
        return nll / w_total + aux.router_loss / n, (nll, aux)

    grad_micro = jax.value_and_grad(micro_loss, has_aux=True)

    def fn(params, rest, batch: Batch):
        if batch.tokens.ndim != 3 or batch.tokens.shape[0] != n:
            raise ValueError(
                f"grad_accum={n}: the step takes [{n}, B, S] batches, got "
                f"{list(batch.tokens.shape)}"
            )
        w_total = weight_total(batch)

        def body(acc, mb):
            (_, (nll, aux)), g = grad_micro(params, rest, mb, w_total)
            acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
            return acc, (nll, aux)

        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)
        with jax.named_scope("grad_accum"):
            grads, (nll_n, aux_n) = jax.lax.scan(body, zeros, batch)
        lm = jnp.sum(nll_n) / w_total
        aux = jax.tree.map(_over_micro_batches, aux_n)
        return (lm + aux.router_loss, (lm, aux)), grads

    return fn


def _over_micro_batches(x):
    """A router statistic stacked over the micro-batches: counts summed, losses averaged."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.sum(x, axis=0, dtype=x.dtype)
    return jnp.mean(x, axis=0)


# --------------------------------------------------------------------------- the batch


def describe(tc) -> str:
    """The step's batch for the logs: "batch 8 x seq 64", with `grad_accum` N > 1 "batch 2 x seq
    64, grad_accum 4 (8 rows, 512 tokens per optimizer step)"."""
    text = f"batch {tc.batch_size} x seq {tc.seq_len}"
    if tc.grad_accum == 1:
        return text
    rows = tc.batch_size * tc.grad_accum
    return (
        f"{text}, grad_accum {tc.grad_accum} ({rows} rows, {rows * tc.seq_len:,} tokens per "
        "optimizer step)"
    )


def step_batch(ids_sharding: NamedSharding, batch_size: int, seq_len: int, grad_accum: int):
    """(sharding, shape) of each array of the batch the step takes: `ids_sharding` (a
    micro-batch's) and (B, S) for `grad_accum` 1, else that sharding with a leading unsharded
    axis and (N, B, S)."""
    if grad_accum == 1:
        return ids_sharding, (batch_size, seq_len)
    sharding = NamedSharding(ids_sharding.mesh, P(None, *ids_sharding.spec))
    return sharding, (grad_accum, batch_size, seq_len)


def _rows(idx, lead) -> tuple[list[range], list[int]]:
    """(the index ranges of the leading dims `lead` that `idx` selects, the global-batch rows
    they are in order): row n * B + b of micro-batch n's row b."""
    ranges = [range(*i.indices(d)) for i, d in zip(idx, lead)]
    flat = [int(np.ravel_multi_index(ix, lead)) for ix in itertools.product(*ranges)]
    return ranges, flat


def rows_of_process(sharding: NamedSharding, shape) -> list[int]:
    """The rows of the global batch (of prod(shape[:-1]) rows) that this process's devices
    hold under `sharding`, for the step's (B, S) or (N, B, S) arrays (`step_batch`)."""
    rows = set()
    for idx in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(_rows(idx[:-1], shape[:-1])[1])
    return sorted(rows)


def put_batch(batch: Batch, sharding: NamedSharding, shape, rows=None) -> Batch:
    """The step's batch, a `Batch` of `shape` arrays ((B, S) or (N, B, S), `step_batch`) on
    `sharding`, from this process's rows `rows` (default all) of the global batch of
    prod(shape[:-1]) rows; as `train_step.put_batch`, each process fills only its own devices'
    shards."""
    lead = tuple(shape[:-1])
    rows = range(math.prod(lead)) if rows is None else rows
    where = {r: i for i, r in enumerate(rows)}

    def put(key, value):
        if value is None:
            return None
        value = np.asarray(value, np.int32)
        if value.shape[0] != len(where):
            raise ValueError(f"{key}: {value.shape[0]} rows, this process reads {len(where)}")

        def piece(idx):
            ranges, flat = _rows(idx[:-1], lead)
            picked = value[[where[r] for r in flat]]
            return picked.reshape(*map(len, ranges), value.shape[1])[..., idx[-1]]

        return jax.make_array_from_callback((*lead, value.shape[1]), sharding, piece)

    return Batch(*(put(k, v) for k, v in batch._asdict().items()))
