"""Qwen3-MoE / Qwen2-MoE decoder in Flax NNX, with the MoE block on `relaymoe_jax.moe_ffn`.

Architecture (Hugging Face `modeling_qwen3_moe.py` / `modeling_qwen2_moe.py`):

    x = embed_tokens[input_ids]
    per layer:  x = x + o_proj(attention(rope(q_norm(q_proj(h))), rope(k_norm(k_proj(h))),
                                         v_proj(h)))                 with h = input_layernorm(x)
                x = x + mlp(post_attention_layernorm(x))   mlp: MoE block or dense SwiGLU
    logits = lm_head(norm(x))                              lm_head tied to embed_tokens or not

- qwen3_moe: q/k RMSNorm over head_dim; bias on q/k/v/o iff `attention_bias`.
- qwen2_moe: no q/k norm; bias on q/k/v iff `qkv_bias`; a shared SwiGLU expert with a sigmoid
  gate, computed outside the ring and added: y += sigmoid(x @ shared_expert_gate) *
  shared_expert(x) (paper §3.1).
- Layer i holds the MoE block iff `config.is_moe_layer(i)` (`decoder_sparse_step`,
  `mlp_only_layers`), else a dense SwiGLU of `intermediate_size`.
- MoE block: `moe_layer.MoELayer` of `config.moe` (router, see `routers.py`, -> `moe_ffn` on the
  [B, S, H] activations as they are sharded, with the options of the config's dispatcher; the
  shared expert of qwen2_moe). Experts are stored stacked: w_gate, w_up [E, H, F], w_down [E, F, H].

Attribute names follow Hugging Face's modules (`self_attn.q_proj`, `mlp.experts`...) so the
checkpoint mapping in `hf_mapping.py` reads as a table. Weights are stored [in, out]:
q_proj [H, N, D], k_proj/v_proj [H, K, D], o_proj [N, D, H], router [H, E], dense [H, F] / [F, H].

`model(input_ids)` returns `(logits [B, S, V], aux)`; `aux` is a `router_losses.ModelAux` record
(a pytree, `aux.aux_loss`; formulas there):
    aux_loss            HF's load-balancing loss over all MoE layers (= HF `outputs.aux_loss`)
    aux_loss_per_layer  [L_moe] the same loss per MoE layer
    z_loss, z_loss_per_layer   router z-loss, mean over MoE layers and per layer
    router_loss         router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss: add it to
                        the LM loss
    expert_load         [L_moe, E] int32 pairs routed to each expert: feed it, summed over the
                        step, to `update_expert_bias`
    dropped_pairs       int32, pairs dropped by alltoall with a capacity factor (0 otherwise)
    router_logits       [L_moe, B, S, E] float32, only with `return_router_logits=True` (else None)

The decoder layer, its checkpoint names and its recomputation options: `decoder.py`.

Scanned layers (`config.scan_layers`): `model.layers` is then ONE `DecoderLayer` whose variables
are stacked on a leading axis of size L, logical name "layers" (never sharded, see
`sharding.py`): w_gate [L, E, H, F], q_proj [L, H, N, D], the expert bias [L, E]... The forward
runs `jax.lax.scan` over `nnx.split(model.layers)`: each step `nnx.merge`s one layer's slice and
calls it, so the compiled program holds one layer body whatever the depth (compile time and
program size do not grow with L), and the per-layer stats come out of the scan already stacked.
Same math as the unscanned model (tests/test_scan.py): the weights are made by L `DecoderLayer`s
drawn in the same order and stacked (`layers.stack_modules`), so a seed gives the same weights in
both layouts; remat (`nnx.remat` of the blocks, the checkpoint names) sits inside the body, once.
Requirements, checked by `ModelConfig`: all layers MoE or all dense, and one `attention_remat`
option. Choices: a plain `jax.lax.scan` over the split state rather than `nnx.scan`, because the
body only reads the layer (nothing to write back, no graph updates or Rngs to carry) and the
stacked Variables are ordinary pytrees, so nothing of NNX's transform machinery (its
`transform_metadata` for sharding metadata, which knows nothing of our `logical_axes`) is
needed; and stacking built modules rather than `nnx.vmap` over the constructor, so that the
initializers, shardings and random draws stay those of the unscanned model. `model.layers[i]`
does not exist then: row i of each stacked variable is layer i (`hf_mapping.py` maps names so).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from relaymoe_jax.kernels.attention import interpret as interpreter
from relaymoe_jax.models import router_losses as rt
from relaymoe_jax.models.attention import check_per_token, check_segment_ids
from relaymoe_jax.models.config import ModelConfig, check_mesh
from relaymoe_jax.models.context import from_zigzag, to_zigzag, zigzag_size
from relaymoe_jax.models.decoder import DecoderLayer
from relaymoe_jax.models.layers import (
    RMSNorm,
    embed_lookup,
    param,
    rope_cos_sin,
    stack_modules,
)
from relaymoe_jax.models.moe_layer import expert_load
from relaymoe_jax.models.sharding import LAYERS, AxisRules, constrain, rules_for


def _layer_stats(st, return_router_logits):
    """What the model keeps of one MoE layer's aux (`MoELayer`): the router logits [B, S, E]
    only when asked for."""
    return st if return_router_logits else st._replace(router_logits=None)


class QwenMoe(nnx.Module):
    """The decoder. `QwenMoe(config, mesh=mesh, rngs=nnx.Rngs(0))` draws random weights (normal,
    std `initializer_range`; norms 1, biases 0), created sharded per `rules` (default
    `rules_for(mesh)`); `from_pretrained` loads a Hugging Face checkpoint instead."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: jax.sharding.Mesh,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        rules: AxisRules | None = None,
    ):
        rules = rules or rules_for(mesh)
        if config.attention_impl == interpreter.IMPL:  # one device, enough XLA:CPU threads
            interpreter.check_devices(mesh.size, f"mesh {dict(mesh.shape)}")
            interpreter.check_threads()
        if not config.moe.is_dense:
            check_mesh(config, rules.size("experts"))
        self.config, self.rules, self.dtype = config, rules, jnp.dtype(dtype)
        h, v = config.hidden_size, config.vocab_size
        std = config.initializer_range
        self.embed_tokens = param(rules, rngs, (v, h), ("vocab", "embed"), dtype, std=std)
        make = lambda i: DecoderLayer(config, i, rules=rules, rngs=rngs, dtype=dtype)
        if config.scan_layers:  # one DecoderLayer whose variables are [L, ...]
            self.layers = stack_modules(make, config.num_hidden_layers, rules, LAYERS)
        else:
            self.layers = nnx.List([make(i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, eps=config.rms_norm_eps, rules=rules, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = param(rules, rngs, (h, v), ("embed", "vocab"), dtype, std=std)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.config.num_hidden_layers) if self.config.is_moe_layer(i))

    def __call__(self, input_ids, *, positions=None, segment_ids=None, return_router_logits=False):
        """input_ids [B, S] int -> (logits [B, S, V] in the model dtype, aux record).

        Packed documents: `segment_ids` [B, S] (attention stays within equal ids) with
        `positions` restarting at each document's start give each document the logits it has
        on its own."""
        x_bsh, aux = self.hidden(
            input_ids,
            positions=positions,
            segment_ids=segment_ids,
            return_router_logits=return_router_logits,
        )
        with jax.named_scope("lm_head"):
            if self.config.tie_word_embeddings:
                logits_bsv = jnp.einsum("bsh,vh->bsv", x_bsh, self.embed_tokens[...])
            else:
                logits_bsv = jnp.einsum("bsh,hv->bsv", x_bsh, self.lm_head[...])
        return logits_bsv, aux

    def head_hv(self):
        """The LM head as [H, V] (`embed_tokens.T` when tied), for `loss.lm_loss`."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...].T
        return self.lm_head[...]

    def hidden(
        self,
        input_ids,
        *,
        positions=None,
        segment_ids=None,
        return_router_logits=False,
        layer_weights=None,
    ):
        """input_ids [B, S] int -> (the final-norm hidden states [B, S, H], aux record): the model
        without its LM head (the trainer's chunked loss, `loss.lm_loss`, applies the head).

        `layer_weights` (scanned layers only): a function applied to each `nnx.Param` of one
        layer's slice (a Variable in, a Variable out) inside the layer scan, within each block's
        checkpoint (`DecoderLayer`, `_decoder_layer`): the trainer passes its gather from storage
        and cast to the compute dtype (`train.step.train_step.make_step`), so one layer's compute
        copy exists at a time, made again from the stored slice for that block's backward (as FSDP
        gathers again), instead of all L layers' copies kept for the backward. A block without a
        checkpoint (attention under "save_all", an MLP without `moe_remat`) keeps its prepared
        weights as residuals, one layer's per scan step."""
        cfg, rules, mesh = self.config, self.rules, self.rules.mesh
        if layer_weights is not None and not cfg.scan_layers:
            raise ValueError(
                "hidden(layer_weights=...) applies inside the layer scan: it needs "
                "scan_layers=True (an unscanned model's weights are prepared before the call)"
            )
        b, s = input_ids.shape
        act = rules.fit((b, s), "batch", "seq")
        ids_bs = constrain(jnp.asarray(input_ids, jnp.int32), mesh, act)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        positions = constrain(
            check_per_token("positions", jnp.asarray(positions), (b, s)), mesh, act
        )
        seg_bs = None
        if segment_ids is not None:
            seg_bs = constrain(check_segment_ids(jnp.asarray(segment_ids), (b, s)), mesh, act)
        zigzag = zigzag_size(cfg.context_layout, cfg.attention_impl, rules, b, s) is not None
        if zigzag:  # balanced context parallelism: the layers run in the zigzag order
            ids_bs, positions = to_zigzag(ids_bs, rules), to_zigzag(positions, rules)
            seg_bs = None if seg_bs is None else to_zigzag(seg_bs, rules)
        with jax.named_scope("embed"):
            x_bsh = embed_lookup(self.embed_tokens[...], ids_bs, mesh, P(*act, None))
        cos_bsd, sin_bsd = rope_cos_sin(positions, cfg.head_size, cfg.rope_theta, self.dtype)
        keep = lambda st: None if st is None else _layer_stats(st, return_router_logits)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x_bsh, layer_state):  # one layer: its slice of every stacked variable
                layer = nnx.merge(graphdef, layer_state)
                x_bsh, st = layer(x_bsh, cos_bsd, sin_bsd, seg_bs, prepare=layer_weights)
                return x_bsh, keep(st)

            with jax.named_scope("layers"):
                x_bsh, stats = jax.lax.scan(body, x_bsh, state)
        else:
            per_layer = []
            for i, layer in enumerate(self.layers):
                with jax.named_scope(f"layer_{i}"):
                    x_bsh, st = layer(x_bsh, cos_bsd, sin_bsd, seg_bs)
                if st is not None:
                    per_layer.append(keep(st))
            stats = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer) if per_layer else None
        if zigzag:  # back to the natural order for the loss and the logits
            x_bsh = from_zigzag(x_bsh, rules)
        with jax.named_scope("final_norm"):
            x_bsh = self.norm(x_bsh)
        e, logits_shape = cfg.moe.num_experts, (b, s) if return_router_logits else None
        aux = rt.model_aux(stats, e, cfg.router_aux_loss_coef, cfg.router_z_loss_coef, logits_shape)
        if zigzag and aux.router_logits is not None and aux.router_logits.shape[0]:
            lbse = aux.router_logits  # [L, B, S, E] -> natural order along S
            natural = jnp.moveaxis(from_zigzag(jnp.moveaxis(lbse, 0, 2), rules), 2, 0)
            aux = aux._replace(router_logits=natural)
        return x_bsh, aux

    def update_expert_bias(self, expert_load_le, rate: float | None = None):
        """Aux-loss-free balancing, outside the optimizer: for each MoE layer l,
        bias += rate * sign(mean(load[l]) - load[l]) (`router_losses.expert_bias_update`).
        `expert_load_le` is aux.expert_load summed over the step's micro-batches."""
        if not self.config.moe.expert_bias:
            raise ValueError("update_expert_bias: the config has expert_bias=False")
        if self.config.scan_layers:  # every layer is MoE: one [L, E] bias, updated row-wise
            self.layers.mlp.update_expert_bias(expert_load_le, rate)
        else:
            shape = (len(self.moe_layers), self.config.moe.num_experts)
            want = (
                f"{list(shape)}: one row of expert counts per MoE layer (aux.expert_load "
                "summed over the step)"
            )
            load_le = expert_load(expert_load_le, shape, want)
            for n, i in enumerate(self.moe_layers):
                self.layers[i].mlp.update_expert_bias(load_le[n], rate)
