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

Names for remat (`jax.ad_checkpoint.checkpoint_name`, per layer, for
`jax.checkpoint_policies.save_only_these_names` and friends):
    "layer_input"  the decoder layer's input (the residual stream), named only inside the
                 whole-layer checkpoint ("full" with `moe_remat`; `offload_layer_inputs`
                 offloads it by this name)
    "attn_norm"  input_layernorm output              [B, S, H]
    "q_proj", "k_proj", "v_proj"   projections (bias included, before q/k norm and RoPE)
    "q_norm", "k_norm"             after the q/k RMSNorm (qwen3_moe only)
    "attn_out"   attention output, before o_proj     [B, S, N, D]
    "o_proj"     o_proj output (before the residual) [B, S, H]
    "mlp_norm"   post_attention_layernorm output     [B, S, H]
The MoE block has no names: the ring's backward already recomputes each hop.

Attention recomputation: `config.attention_remat` (one option, or one per layer) wraps each
layer's attention block (input norm through o_proj) in `nnx.remat` with the option's policy
(`relaymoe_jax.remat.options`); "save_all", the default, applies none. The MLP/MoE block is
wrapped (nothing saved but its input) only with `config.moe_remat`: the ring's custom_vjp keeps
only its inputs anyway, and a checkpoint around it re-runs the whole ring forward; the all-to-all
drops the dispatch buffers it would keep for the backward. With "full" and `moe_remat` both, the
whole layer is one checkpoint whose only residual is its input; `config.offload_layer_inputs`
(which needs both) keeps that input in pinned host memory instead of on the device: the policy
`remat.options.layer_policy(True)` offloads the value named "layer_input" inside the checkpoint
(a name outside it, on the scan's carry, would offload nothing: jax#23869), so the forward copies
each layer's input to the host (into one [L, B, S, H] host buffer with `scan_layers`) and the
backward copies it back for that layer. XLA:CPU compiles the copies to nothing (jax lowers memory
placements inside a jit for TPU and GPU only).

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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models import router_losses as rt
from relaymoe_jax.models.attention import check_per_token, check_segment_ids
from relaymoe_jax.models.config import ModelConfig, check_mesh
from relaymoe_jax.models.layers import (
    MLP,
    RMSNorm,
    apply_rope,
    attend,
    embed_lookup,
    param,
    rope_cos_sin,
    stack_modules,
)
from relaymoe_jax.models.moe_layer import MoELayer, expert_load
from relaymoe_jax.models.sharding import LAYERS, AxisRules, constrain, rules_for
from relaymoe_jax.remat.options import layer_policy
from relaymoe_jax.remat.options import policy as remat_policy


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rules, rngs, dtype):
        h, n, kv, d = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_size,
        )
        std = cfg.initializer_range
        qkv_bias = cfg.qkv_bias if cfg.arch == "qwen2_moe" else cfg.attention_bias
        self.o_has_bias = cfg.arch == "qwen3_moe" and cfg.attention_bias
        proj = lambda shape, names: param(rules, rngs, shape, names, dtype, std=std)
        self.q_proj = proj((h, n, d), ("embed", "heads", "head_dim"))
        self.k_proj = proj((h, kv, d), ("embed", "kv_heads", "head_dim"))
        self.v_proj = proj((h, kv, d), ("embed", "kv_heads", "head_dim"))
        self.o_proj = proj((n, d, h), ("heads", "head_dim", "embed"))
        zeros = lambda shape, names: param(rules, None, shape, names, dtype, init="zeros")
        if qkv_bias:
            self.q_bias = zeros((n, d), ("heads", "head_dim"))
            self.k_bias = zeros((kv, d), ("kv_heads", "head_dim"))
            self.v_bias = zeros((kv, d), ("kv_heads", "head_dim"))
        if self.o_has_bias:
            self.o_bias = zeros((h,), ("embed",))
        self.qk_norm = cfg.arch == "qwen3_moe"
        self.attention_impl, self.attention_block_k = cfg.attention_impl, cfg.attention_block_k
        if self.qk_norm:
            norm = lambda: RMSNorm(
                d, eps=cfg.rms_norm_eps, rules=rules, dtype=dtype, axis="head_dim"
            )
            self.q_norm, self.k_norm = norm(), norm()
        self.has_qkv_bias = qkv_bias
        self.rules = rules

    def _proj(self, x_bsh, w_hnd, bias, name):
        y_bsnd = jnp.einsum("bsh,hnd->bsnd", x_bsh, w_hnd[...])
        if self.has_qkv_bias:
            y_bsnd = y_bsnd + getattr(self, bias)[...]
        return checkpoint_name(y_bsnd, name)

    def __call__(self, x_bsh, cos_bsd, sin_bsd, seg_bs=None):
        with jax.named_scope("qkv_proj"):
            q_bsnd = self._proj(x_bsh, self.q_proj, "q_bias", "q_proj")
            k_bskd = self._proj(x_bsh, self.k_proj, "k_bias", "k_proj")
            v_bskd = self._proj(x_bsh, self.v_proj, "v_bias", "v_proj")
        if self.qk_norm:
            q_bsnd = checkpoint_name(self.q_norm(q_bsnd), "q_norm")
            k_bskd = checkpoint_name(self.k_norm(k_bskd), "k_norm")
        with jax.named_scope("rope"):
            q_bsnd = apply_rope(q_bsnd, cos_bsd, sin_bsd)
            k_bskd = apply_rope(k_bskd, cos_bsd, sin_bsd)
        kv_seg_bs = seg_bs  # checked at the model's entry
        if self.rules.axes("seq"):  # context parallelism: every query shard needs all keys
            b, s = k_bskd.shape[:2]
            kv_spec = P(self.rules.fit((b, s), "batch", "seq")[0], None, None, None)
            k_bskd = constrain(k_bskd, self.rules.mesh, kv_spec)
            v_bskd = constrain(v_bskd, self.rules.mesh, kv_spec)
            if seg_bs is not None:  # and the keys' segment ids
                kv_seg_bs = constrain(seg_bs, self.rules.mesh, P(*kv_spec[:2]))
        with jax.named_scope("attention"):
            o_bsnd = attend(
                q_bsnd,
                k_bskd,
                v_bskd,
                self.attention_impl,
                self.attention_block_k,
                seg_bs,
                kv_seg_bs,
            )
        with jax.named_scope("o_proj"):
            y_bsh = jnp.einsum("bsnd,ndh->bsh", o_bsnd, self.o_proj[...])
            if self.o_has_bias:
                y_bsh = y_bsh + self.o_bias[...]
        return checkpoint_name(y_bsh, "o_proj")


class DenseMLP(MLP):
    def __call__(self, x_bsh):
        return super().__call__(x_bsh), None


def attention_block(norm, attn, x_bsh, cos_bsd, sin_bsd, seg_bs=None):
    """One layer's pre-norm self-attention: the unit the attention remat options checkpoint."""
    return attn(checkpoint_name(norm(x_bsh), "attn_norm"), cos_bsd, sin_bsd, seg_bs)


def _mlp_block(norm, mlp, x_bsh):
    return mlp(checkpoint_name(norm(x_bsh), "mlp_norm"))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, i: int, *, rules, rngs, dtype):
        eps = cfg.rms_norm_eps
        self.remat_option = cfg.remat_option(i)  # relaymoe_jax.remat.options
        self.moe_remat = cfg.moe_remat
        self.offload_input = cfg.offload_layer_inputs  # only with full + moe_remat (config)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=eps, rules=rules, dtype=dtype)
        self.self_attn = Attention(cfg, rules=rules, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=eps, rules=rules, dtype=dtype)
        if cfg.is_moe_layer(i):  # with the options its dispatcher uses (`applicable`)
            moe = cfg.moe.replace(options=cfg.moe.options.applicable())
            std, h = cfg.initializer_range, cfg.hidden_size
            kw = dict(rules=rules, rngs=rngs, dtype=dtype)
            self.mlp = MoELayer(moe, hidden_size=h, initializer_range=std, **kw)
        else:
            self.mlp = DenseMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                rules=rules,
                rngs=rngs,
                dtype=dtype,
                std=cfg.initializer_range,
            )

    def __call__(self, x_bsh, cos_bsd, sin_bsd, seg_bs=None):
        """Each block under its own `jax.checkpoint` (attention: `remat_option`; MLP/MoE:
        `moe_remat`), except when both recompute everything (`full` and `moe_remat`): then the
        whole layer is one checkpoint that keeps only its input, not also the MLP block's input
        (the same recomputation, one [B, S, H] activation less per layer); with
        `offload_layer_inputs` that input, named "layer_input" inside the checkpoint, is kept in
        pinned host memory instead (`remat.options.layer_policy`)."""
        if self.remat_option == "full" and self.moe_remat:
            policy = layer_policy(self.offload_input)
            layer = nnx.remat(_decoder_layer, policy=policy, static_argnums=(5,))
            with jax.named_scope("layer_remat"):
                return layer(self, x_bsh, cos_bsd, sin_bsd, seg_bs, False)
        return _decoder_layer(self, x_bsh, cos_bsd, sin_bsd, seg_bs, True)


def _decoder_layer(layer, x_bsh, cos_bsd, sin_bsd, seg_bs, block_remat: bool):
    if not block_remat:  # inside the whole layer's checkpoint: the name its policy offloads
        x_bsh = checkpoint_name(x_bsh, "layer_input")
    with jax.named_scope("attention_block"):
        block = attention_block
        if block_remat and layer.remat_option != "save_all":
            block = nnx.remat(attention_block, policy=remat_policy(layer.remat_option))
        x_bsh = x_bsh + block(
            layer.input_layernorm, layer.self_attn, x_bsh, cos_bsd, sin_bsd, seg_bs
        )
    with jax.named_scope("mlp_block"):
        block = _mlp_block
        if block_remat and layer.moe_remat:
            block = nnx.remat(_mlp_block, policy=jax.checkpoint_policies.nothing_saveable)
        y_bsh, stats = block(layer.post_attention_layernorm, layer.mlp, x_bsh)
    return x_bsh + y_bsh, stats


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

    def hidden(self, input_ids, *, positions=None, segment_ids=None, return_router_logits=False):
        """input_ids [B, S] int -> (the final-norm hidden states [B, S, H], aux record): the model
        without its LM head (the trainer's chunked loss, `loss.lm_loss`, applies the head)."""
        cfg, rules, mesh = self.config, self.rules, self.rules.mesh
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
        with jax.named_scope("embed"):
            x_bsh = embed_lookup(self.embed_tokens[...], ids_bs, mesh, P(*act, None))
        cos_bsd, sin_bsd = rope_cos_sin(positions, cfg.head_size, cfg.rope_theta, self.dtype)
        keep = lambda st: None if st is None else _layer_stats(st, return_router_logits)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x_bsh, layer_state):  # one layer: its slice of every stacked variable
                x_bsh, st = nnx.merge(graphdef, layer_state)(x_bsh, cos_bsd, sin_bsd, seg_bs)
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
        with jax.named_scope("final_norm"):
            x_bsh = self.norm(x_bsh)
        e, logits_shape = cfg.moe.num_experts, (b, s) if return_router_logits else None
        aux = rt.model_aux(stats, e, cfg.router_aux_loss_coef, cfg.router_z_loss_coef, logits_shape)
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
