"""The routers `MoELayer` can be built with (`MoEConfig.router`), as today's MoE families define
them. Each takes the float32 router logits [..., E] and returns a `Routed`; `router.py` holds the
losses. `top_k_ids` keeps the top-k where the tokens live.

- `"softmax_topk"` (Qwen2/3-MoE; `router.route`): p = softmax(logits); ids = top_k(p + bias);
  weights = p[ids], renormalised over the k if `norm_topk_prob`.
- `"topk_softmax"` (GPT-OSS, Mixtral): ids = top_k(logits + bias); weights = softmax over the k
  selected logits (so they sum to 1). GPT-OSS's router has a bias of its own inside its logits
  (`MoEConfig.router_bias`); `bias` here is the aux-loss-free selection bias.
- `"sigmoid_group"` (DeepSeek-V3, Kimi K2, GLM-4.5): s = sigmoid(logits); c = s + bias (the
  aux-loss-free bias, for the selection only); the E experts form `n_group` groups, each scored by
  the sum of its two best c; the `topk_group` best groups are kept and every other expert's c is
  set to -inf (Hugging Face 5.x's `masked_fill(..., float("-inf"))`: a kept expert with a
  negative biased score still beats a masked one); ids = top_k(c); weights = s[ids],
  renormalised over the k (+ 1e-20) if `norm_topk_prob`, times `routed_scaling_factor`.

`probs` is what the load-balancing statistics read: softmax(logits) for the two softmax routers
(Hugging Face's `load_balancing_loss_func` takes the softmax of the logits, whatever the router),
and the affinities normalised per token, s / sum_e s, for the sigmoid router (DeepSeek-V3's
sequence-wise balance loss, eq. 17-20, `router.sequence_balance_loss`). Ties in top-k pick the lower
expert id (`lax.top_k`). A NaN logit makes its token's weights NaN under every router (it cannot
be refused: it is a value inside the trace), so a diverged run shows NaN rather than routing
around the expert.
"""

import typing
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_group"]
ROUTERS: tuple[str, ...] = typing.get_args(RouterKind)


def top_k_ids(scores_te, top_k: int):
    """`lax.top_k` indices [..., k], computed where the tokens live.

    XLA's SPMD partitioner does not partition the TopK custom call along its batch dimensions: on
    an Explicit mesh with the tokens sharded it all-gathers the whole [T_global, E] scores onto
    every device and selects for all tokens there (measured: 8 MiB of temporaries per MoE layer
    for 16K tokens and 128 experts on 8 devices, growing with the global batch). Selection is
    per token, so a `shard_map` over the token dimensions' sharding gives the same ids with no
    gather.
    """
    sharding = getattr(jax.typeof(scores_te), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    nd = scores_te.ndim
    spec = tuple(sharding.spec) + (None,) * nd if mesh is not None else ()
    if (
        mesh is None
        or not mesh.axis_names
        or not mesh.explicit_axes
        or spec[nd - 1] is not None
        or all(e is None for e in spec[: nd - 1])
    ):
        return jax.lax.top_k(scores_te, top_k)[1]
    tokens = P(*spec[: nd - 1], None)
    return jax.shard_map(
        lambda s_te: jax.lax.top_k(s_te, top_k)[1], mesh=mesh, in_specs=tokens, out_specs=tokens
    )(scores_te)


class Routed(NamedTuple):
    probs_te: jax.Array  # [..., E] float32: what the load-balancing statistics read
    ids_tk: jax.Array  # [..., k] int32
    weights_tk: jax.Array  # [..., k] float32


def softmax_topk(logits_te, top_k: int, *, norm_topk_prob: bool, bias_e=None) -> Routed:
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    scores_te = probs_te if bias_e is None else probs_te + bias_e
    ids_tk = top_k_ids(scores_te, top_k)
    weights_tk = jnp.take_along_axis(probs_te, ids_tk, axis=-1)
    if norm_topk_prob:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return Routed(probs_te, ids_tk.astype(jnp.int32), weights_tk)


def topk_softmax(logits_te, top_k: int, *, bias_e=None) -> Routed:
    scores_te = logits_te if bias_e is None else logits_te + bias_e
    ids_tk = top_k_ids(scores_te, top_k)
    weights_tk = jax.nn.softmax(jnp.take_along_axis(logits_te, ids_tk, axis=-1), axis=-1)
    return Routed(jax.nn.softmax(logits_te, axis=-1), ids_tk.astype(jnp.int32), weights_tk)


def sigmoid_group(
    logits_te,
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    bias_e=None,
) -> Routed:
    e = logits_te.shape[-1]
    scores_te = jax.nn.sigmoid(logits_te)
    choice_te = scores_te if bias_e is None else scores_te + bias_e
    if n_group > 1:
        grouped = choice_te.reshape(*choice_te.shape[:-1], n_group, e // n_group)
        # the sum of each group's two best (a sort: partitioned along the tokens, unlike TopK)
        group_score = jnp.sum(jnp.sort(grouped, axis=-1)[..., -2:], axis=-1)
        kept_g = top_k_ids(group_score, topk_group)
        keep = jnp.any(kept_g[..., :, None] == jnp.arange(n_group), axis=-2)  # [..., G]
        keep_te = jnp.repeat(keep, e // n_group, axis=-1)
        choice_te = jnp.where(keep_te, choice_te, -jnp.inf)
    ids_tk = top_k_ids(choice_te, top_k)
    weights_tk = jnp.take_along_axis(scores_te, ids_tk, axis=-1)
    if norm_topk_prob:
        weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + 1e-20)
    # a NaN score (sigmoid's NaN sorts below every number in top_k, so the selection would route
    # around it) makes the token's weights NaN, as the softmax routers' do
    nan_t = jnp.any(jnp.isnan(scores_te), axis=-1, keepdims=True)
    weights_tk = jnp.where(nan_t, jnp.nan, weights_tk)
    probs_te = scores_te / jnp.sum(scores_te, axis=-1, keepdims=True)
    return Routed(probs_te, ids_tk.astype(jnp.int32), weights_tk * routed_scaling_factor)
