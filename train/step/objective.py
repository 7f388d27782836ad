"""The train step's objective: next-token cross-entropy plus the router losses, as functions of
the parameters (`make_loss` for one batch; `make_terms` for its pieces, which
`train.step.accumulate` weights across micro-batches).

The parameters are gathered from their storage (`stored_sharding`) and, with
`compute_dtype="bfloat16"` (`TrainConfig` checks it), cast to bf16 for the forward and backward:
a scanned model's layers one at a time inside the layer scan, within each block's checkpoint
(`QwenMoe.hidden`'s `layer_weights`), everything else before the model runs (the stored master
weights, the optimizer and the update stay float32; the router and the losses compute in float32
anyway). The LM head and cross-entropy run in chunks of `loss_chunk` tokens per device
(`relaymoe_jax.models.loss.lm_loss`): no [tokens, vocab] logits are ever built.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models.loss import lm_loss

from ..data.source import Batch
from .offload import is_stacked
from .storage import gather_stored, is_variable


def next_token_targets(ids_bs, seg_bs=None):
    """(targets, weights) on ids' sharding: targets[b, s] = ids[b, s+1], weight 1 except 0 at the
    last position and, with segment ids `seg_bs` (packed documents, 0 = padding), 0 where the
    position is padding or its target is in another segment (the next document's first token:
    nothing to learn across documents). Built on ids gathered over the sequence, as a sequence
    dimension sharded over `context` cannot be sliced by one position."""
    sharding = jax.typeof(ids_bs).sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    gathered = NamedSharding(sharding.mesh, P(spec[0], None))
    whole = jax.sharding.reshard(ids_bs, gathered)
    targets = jax.sharding.reshard(jnp.roll(whole, -1, axis=1), sharding)
    s = ids_bs.shape[1]
    keep = jnp.broadcast_to(jnp.arange(s) < s - 1, ids_bs.shape)
    if seg_bs is not None:
        seg = jax.sharding.reshard(seg_bs, gathered)
        keep = keep & (seg != 0) & (jnp.roll(seg, -1, axis=1) == seg)
    weights = jax.sharding.reshard(keep.astype(jnp.float32), sharding)
    return targets, weights


def make_terms(graphdef, dtype, loss_chunk: int):
    """terms(params, rest, batch) -> (nll, weights, aux): the summed next-token negative
    log-likelihood of a [B, S] `Batch` (float32), the target weights `next_token_targets` gives
    it, and the model's router statistics (`router_losses.ModelAux`)."""

    def cast(v):
        v = gather_stored(v)
        x = v.get_value() if is_variable(v) else v
        x = x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        return v.replace(x) if is_variable(v) else x

    def terms(params, rest, batch: Batch):
        # a scanned model's layers are gathered and cast one at a time inside its scan; the
        # rest (embedding, final norm, LM head) here
        scanned = any(is_stacked(v) for v in jax.tree.leaves(params, is_leaf=is_variable))
        prepare = lambda v: v if is_stacked(v) else cast(v)
        model = nnx.merge(graphdef, jax.tree.map(prepare, params, is_leaf=is_variable), rest)
        model.dtype = dtype
        ids, seg = batch.tokens, batch.segment_ids
        x_bsh, aux = model.hidden(
            ids,
            segment_ids=seg,
            positions=batch.positions,
            layer_weights=cast if scanned else None,  # one layer's slice, inside the scan
        )
        targets, weights = next_token_targets(ids, seg)
        with jax.named_scope("lm_loss"):
            nll = lm_loss(x_bsh, model.head_hv(), targets, weights, model.rules, chunk=loss_chunk)
        return nll, weights, aux

    return terms


def make_loss(graphdef, dtype, loss_chunk: int, packed: bool):
    """loss_fn(params, rest, batch) -> (lm + router_loss, (lm, aux)) for `jax.value_and_grad`:
    `lm` the mean next-token cross-entropy over the targets `next_token_targets` keeps (every
    position but the last of each row; with `packed`, also none across documents)."""
    terms = make_terms(graphdef, dtype, loss_chunk)

    def loss_fn(params, rest, batch: Batch):
        nll, weights, aux = terms(params, rest, batch)
        ids = batch.tokens
        if packed:  # at least one target per batch: the loader's rows are seq_len >= 2 tokens
            lm = nll / jnp.maximum(jnp.sum(weights), 1.0)
        else:
            lm = nll / (ids.shape[0] * (ids.shape[1] - 1))
        return lm + aux.router_loss, (lm, aux)

    return loss_fn
