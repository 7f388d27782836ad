"""The MoE router and its losses (pure functions; the model collects them per MoE layer).

Notation for one MoE layer: `T` tokens, `E` experts, top-`k`, `x_th` the normalised hidden states,
`w_he` the router weight.

- Router (Hugging Face `Qwen3MoeTopKRouter` / `Qwen2MoeTopKRouter`, computed in float32):
      logits[t, e] = x[t] . w[:, e]                   (float32)
      p[t, e]      = softmax_e(logits[t, e])          (float32)
      ids[t, :]    = top_k_e(p[t, e] + bias[e])       (bias: the aux-loss-free expert bias, or 0)
      w[t, j]      = p[t, ids[t, j]]                  (the bias never enters the weights)
      w[t, j]     /= sum_j w[t, j]                    (only if norm_topk_prob)
  then cast to the model dtype. Ties in top-k pick the lower expert id (`lax.top_k`). Hugging
  Face computes the logits in the activation dtype; here they are float32 whatever the dtype
  (identical for float32 models, slightly more precise for bfloat16 ones).
- Load-balancing loss (Switch Transformer eq. 4-6, Hugging Face `load_balancing_loss_func` without
  an attention mask). Per layer `l`:
      f[l, e] = (number of pairs (t, j) with ids[t, j] = e) / T     (sums to k over e; no gradient)
      P[l, e] = mean_t p[t, e]                                      (differentiable)
      aux_loss_per_layer[l] = E * sum_e f[l, e] * P[l, e]
  Hugging Face concatenates the router logits of all MoE layers before averaging, so its loss is
      aux_loss = E * sum_e mean_l(f[l, e]) * mean_l(P[l, e])
  (every layer has the same T). That is the model's `aux_loss` (equal to HF's `outputs.aux_loss`);
  the per-layer values are reported too. A perfectly balanced router gives k. The counts use the
  selection actually made (with the expert bias, if any).
- Router z-loss (ST-MoE eq. 5): z_loss_per_layer[l] = mean_t logsumexp_e(logits[t, e])^2, and
  `z_loss` is its mean over the MoE layers.
- Aux-loss-free expert bias (DeepSeek-V3 §2.1.2): a per-expert float32 `bias` added to the scores
  for the top-k *selection* only. After each step, outside the optimizer,
      load[e] = number of pairs routed to expert e in the step  (summed over all tokens)
      bias[e] += rate * sign(mean_e(load) - load[e])
  so over-loaded experts become less likely to be selected and under-loaded ones more.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.models import routers


def route(x_th, w_he, *, top_k: int, norm_topk_prob: bool, bias_e=None, out_dtype=None):
    """Returns (logits_te f32, probs_te f32, ids_tk int32, weights_tk in out_dtype): the
    "softmax_topk" router (`routers.softmax_topk`) on x @ w."""
    f32 = jnp.float32
    logits_te = jnp.dot(x_th.astype(f32), w_he.astype(f32), preferred_element_type=f32)
    bias = None if bias_e is None else bias_e.astype(f32)
    r = routers.softmax_topk(logits_te, top_k, norm_topk_prob=norm_topk_prob, bias_e=bias)
    return logits_te, r.probs_te, r.ids_tk, r.weights_tk.astype(out_dtype or x_th.dtype)


def expert_load(ids_tk, num_experts: int):
    """[E] int32: the number of (token, slot) pairs routed to each expert (ids [..., k])."""
    ids_tk = jax.lax.stop_gradient(ids_tk)
    lead = tuple(range(ids_tk.ndim - 1))
    return sum(
        jnp.sum(ids_tk[..., j, None] == jnp.arange(num_experts), axis=lead, dtype=jnp.int32)
        for j in range(ids_tk.shape[-1])
    )


def balance_stats(probs_te, ids_tk):
    """(f_e, P_e): the fraction of pairs per expert over the tokens (sums to k) and the mean
    probability (probs [..., E], ids [..., k])."""
    num_experts = probs_te.shape[-1]
    num_tokens = math.prod(probs_te.shape[:-1])
    f_e = expert_load(ids_tk, num_experts).astype(jnp.float32) / num_tokens
    lead = tuple(range(probs_te.ndim - 1))
    return f_e, jnp.mean(probs_te.astype(jnp.float32), axis=lead)


def load_balancing_loss(f_le, p_le):
    """Hugging Face's loss over the MoE layers' stacked stats f_le, p_le [L, E] (see module doc)."""
    num_experts = f_le.shape[-1]
    return num_experts * jnp.sum(jnp.mean(f_le, axis=0) * jnp.mean(p_le, axis=0))


def load_balancing_loss_per_layer(f_le, p_le):
    """[L]: E * sum_e f[l, e] * P[l, e]."""
    return f_le.shape[-1] * jnp.sum(f_le * p_le, axis=-1)


def z_loss(logits_te):
    """mean_t logsumexp_e(logits[t, e])^2 (float32)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_te.astype(jnp.float32), axis=-1)))


def expert_bias_update(bias_e, load_e, rate: float):
    """DeepSeek-V3's update: bias + rate * sign(mean(load) - load), in float32."""
    load_e = load_e.astype(jnp.float32)
    return (bias_e + rate * jnp.sign(jnp.mean(load_e, axis=-1, keepdims=True) - load_e)).astype(
        bias_e.dtype
    )


def sequence_balance_loss(probs_bse, ids_bsk):
    """DeepSeek-V3's sequence-wise balance loss without its alpha (eq. 17-20), averaged over the
    sequences: per sequence of S tokens, f_e = E / (k S) * #pairs routed to e, P_e = mean_s of
    the normalised affinity (`routers.Routed.probs_te`), loss = sum_e f_e P_e (1 when balanced).
    probs [B, S, E], ids [B, S, k]; [S, E] and [S, k] are one sequence."""
    if probs_bse.ndim == 2:
        probs_bse, ids_bsk = probs_bse[None], ids_bsk[None]
    e, (s, k) = probs_bse.shape[-1], ids_bsk.shape[-2:]
    probs_bse = probs_bse.reshape(-1, s, e)
    ids_bsk = ids_bsk.reshape(-1, s, k)
    counts_be = jax.vmap(lambda ids: expert_load(ids, e))(ids_bsk).astype(jnp.float32)
    f_be = counts_be * e / (k * s)
    p_be = jnp.mean(probs_bse.astype(jnp.float32), axis=1)
    return jnp.mean(jnp.sum(f_be * p_be, axis=-1))


class LayerAux(NamedTuple):
    """One MoE layer's router statistics (`MoELayer`'s `aux`; formulas in the module docstring).

    `router_logits` [T, E] f32 (None where the model keeps them out of its scan), the balance
    statistics f_e and P_e, the Switch/Qwen `aux_loss` (E * sum f_e P_e), `z_loss`, `expert_load`
    [E] (pairs per expert), the op's `dropped_pairs`, and for `router="sigmoid_group"` DeepSeek-V3's
    `seq_aux_loss` (None for the other routers)."""

    router_logits: jax.Array | None
    expert_fraction: jax.Array
    mean_prob: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    expert_load: jax.Array
    dropped_pairs: jax.Array
    seq_aux_loss: jax.Array | None = None


class ModelAux(NamedTuple):
    """The model's router statistics over its MoE layers (`QwenMoe`'s `aux`; `qwen.py`'s module
    docstring has each field, the module docstring here the formulas)."""

    aux_loss: jax.Array
    aux_loss_per_layer: jax.Array
    z_loss: jax.Array
    z_loss_per_layer: jax.Array
    router_loss: jax.Array
    expert_load: jax.Array
    dropped_pairs: jax.Array
    router_logits: jax.Array | None = None


def model_aux(stats, num_experts: int, aux_coef: float, z_coef: float, logits_bs=None):
    """The `ModelAux` of the MoE layers' stats stacked on a leading layer axis (None when there
    is no MoE layer: zero losses over no layers); the router logits only with their (B, S)
    `logits_bs` given."""
    if stats is None:
        zero, no_layers = jnp.float32(0), jnp.zeros((0,))
        return ModelAux(
            aux_loss=zero,
            aux_loss_per_layer=no_layers,
            z_loss=zero,
            z_loss_per_layer=no_layers,
            router_loss=zero,
            expert_load=jnp.zeros((0, num_experts), jnp.int32),
            dropped_pairs=jnp.int32(0),
            router_logits=None if logits_bs is None else jnp.zeros((0, *logits_bs, num_experts)),
        )
    f_le, p_le, z_l = stats.expert_fraction, stats.mean_prob, stats.z_loss
    aux_loss, z = load_balancing_loss(f_le, p_le), jnp.mean(z_l)
    return ModelAux(
        aux_loss=aux_loss,
        aux_loss_per_layer=load_balancing_loss_per_layer(f_le, p_le),
        z_loss=z,
        z_loss_per_layer=z_l,
        router_loss=aux_coef * aux_loss + z_coef * z,
        expert_load=stats.expert_load,
        dropped_pairs=jnp.sum(stats.dropped_pairs, dtype=jnp.int32),
        router_logits=None if logits_bs is None else stats.router_logits,
    )
