"""One decoder layer of `qwen.QwenMoe`: attention (q/k norm, RoPE, grouped-query attention) and the
MLP / MoE block, each pre-norm with a residual, and how they are checkpointed.

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

With `QwenMoe.hidden(layer_weights=...)` (the trainer's gather from storage and cast to the
compute dtype, scanned layers only) each block applies that function to its own weights inside
its checkpoint (`prepared`), so a checkpoint keeps the stored slice, not a prepared copy.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.context import zigzag_order, zigzag_size
from relaymoe_jax.models.layers import MLP, RMSNorm, apply_rope, attend, param
from relaymoe_jax.models.moe_layer import MoELayer
from relaymoe_jax.models.sharding import constrain
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
        self.context_layout = cfg.context_layout
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
        index_bs = None
        b, s = q_bsnd.shape[:2]
        c = zigzag_size(self.context_layout, self.attention_impl, self.rules, b, s)
        if c is not None:  # the tokens arrive in the zigzag order (QwenMoe.hidden)
            index_bs = jnp.broadcast_to(jnp.asarray(zigzag_order(s, c)), (b, s))
        with jax.named_scope("attention"):
            o_bsnd = attend(
                q_bsnd,
                k_bskd,
                v_bskd,
                self.attention_impl,
                self.attention_block_k,
                seg_bs,
                kv_seg_bs,
                index_bs,
            )
        with jax.named_scope("o_proj"):
            y_bsh = jnp.einsum("bsnd,ndh->bsh", o_bsnd, self.o_proj[...])
            if self.o_has_bias:
                y_bsh = y_bsh + self.o_bias[...]
        return checkpoint_name(y_bsh, "o_proj")


class DenseMLP(MLP):
    def __call__(self, x_bsh):
        return super().__call__(x_bsh), None


def attention_block(norm, attn, x_bsh, cos_bsd, sin_bsd, seg_bs=None, prepare=None):
    """One layer's pre-norm self-attention: the unit the attention remat options checkpoint."""
    norm, attn = prepared(norm, prepare), prepared(attn, prepare)
    return attn(checkpoint_name(norm(x_bsh), "attn_norm"), cos_bsd, sin_bsd, seg_bs)


def _mlp_block(norm, mlp, x_bsh, prepare=None):
    norm, mlp = prepared(norm, prepare), prepared(mlp, prepare)
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

    def __call__(self, x_bsh, cos_bsd, sin_bsd, seg_bs=None, prepare=None):
        """Each block under its own `jax.checkpoint` (attention: `remat_option`; MLP/MoE:
        `moe_remat`), except when both recompute everything (`full` and `moe_remat`): then the
        whole layer is one checkpoint that keeps only its input, not also the MLP block's input
        (the same recomputation, one [B, S, H] activation less per layer); with
        `offload_layer_inputs` that input, named "layer_input" inside the checkpoint, is kept in
        pinned host memory instead (`remat.options.layer_policy`)."""
        if self.remat_option == "full" and self.moe_remat:
            policy = layer_policy(self.offload_input)
            layer = nnx.remat(_decoder_layer, policy=policy, static_argnums=(5, 6))
            with jax.named_scope("layer_remat"):
                return layer(self, x_bsh, cos_bsd, sin_bsd, seg_bs, False, prepare)
        return _decoder_layer(self, x_bsh, cos_bsd, sin_bsd, seg_bs, True, prepare)


def prepared(module, prepare):
    """`module` with `prepare` applied to each of its `nnx.Param`s (a new module; `module` is not
    changed); `module` itself when `prepare` is None."""
    if prepare is None:
        return module
    graphdef, state = nnx.split(module)
    is_var = lambda v: isinstance(v, nnx.Variable)
    state = jax.tree.map(
        lambda v: prepare(v) if isinstance(v, nnx.Param) else v, state, is_leaf=is_var
    )
    return nnx.merge(graphdef, state)


def _decoder_layer(layer, x_bsh, cos_bsd, sin_bsd, seg_bs, block_remat: bool, prepare=None):
    """One layer; `prepare` (`QwenMoe.hidden`'s `layer_weights`) is applied to each block's
    weights inside that block's checkpoint, if it has one, so that the checkpoint keeps the
    stored weights, not the prepared copy."""
    if not block_remat:  # inside the whole layer's checkpoint: the name its policy offloads
        x_bsh = checkpoint_name(x_bsh, "layer_input")
        layer, prepare = prepared(layer, prepare), None
    with jax.named_scope("attention_block"):
        block = attention_block
        if block_remat and layer.remat_option != "save_all":
            policy = remat_policy(layer.remat_option)
            block = nnx.remat(attention_block, policy=policy, static_argnums=(6,))
        x_bsh = x_bsh + block(
            layer.input_layernorm, layer.self_attn, x_bsh, cos_bsd, sin_bsd, seg_bs, prepare
        )
    with jax.named_scope("mlp_block"):
        block = _mlp_block
        if block_remat and layer.moe_remat:
            nothing = jax.checkpoint_policies.nothing_saveable
            block = nnx.remat(_mlp_block, policy=nothing, static_argnums=(3,))
        y_bsh, stats = block(layer.post_attention_layernorm, layer.mlp, x_bsh, prepare)
    return x_bsh + y_bsh, stats
