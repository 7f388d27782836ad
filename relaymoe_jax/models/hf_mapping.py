"""The names and layouts of a Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint's weights against
`QwenMoe`'s parameters: `mapping(cfg)` lists one `Entry` per parameter (`hf.py` reads and writes
the files with it).

Torch `Linear.weight` is [out, in], ours are [in, out]; `mapping` is the code.
Prefix `model.layers.i.` = ours `layers[i].`; e = expert; T = transpose:

    model.embed_tokens.weight [V, H]           embed_tokens [V, H]
    input_layernorm / post_attention_layernorm.weight [H]     same names, .weight [H]
    self_attn.q_proj.weight [N*D, H]           self_attn.q_proj [H, N, D]           T, reshape
    self_attn.{k,v}_proj.weight [K*D, H]       self_attn.{k,v}_proj [H, K, D]       T, reshape
    self_attn.{q,k,v}_proj.bias [N*D | K*D]    self_attn.{q,k,v}_bias [N | K, D]    reshape
    self_attn.o_proj.weight [H, N*D]           self_attn.o_proj [N, D, H]           T, reshape
    self_attn.o_proj.bias [H] (qwen3)          self_attn.o_bias [H]
    self_attn.{q,k}_norm.weight [D] (qwen3)    self_attn.{q,k}_norm.weight [D]
    mlp.gate.weight [E, H]                     mlp.gate [H, E]                      T
    mlp.experts.e.{gate,up}_proj.weight [F, H] mlp.w_{gate,up}[e] [H, F]            T, stack
    mlp.experts.e.down_proj.weight [H, F]      mlp.w_down[e] [F, H]                 T, stack
    mlp.experts.gate_up_proj [E, 2F, H] (fused)  w_gate = [:, :F]^T, w_up = [:, F:]^T per expert
    mlp.experts.down_proj [E, H, F] (fused)    mlp.w_down [E, F, H]                 T per expert
    mlp.shared_expert.{gate,up,down}_proj.weight (qwen2)  mlp.shared_expert.*       T
    mlp.shared_expert_gate.weight [1, H] (qwen2)          mlp.shared_expert_gate [H, 1]  T
    mlp.{gate,up,down}_proj.weight (dense layers)         mlp.{gate,up,down}_proj   T
    model.norm.weight [H]                      norm.weight [H]
    lm_head.weight [V, H] (absent when tied)   lm_head [H, V]                       T

With `scan_layers=True` the model holds one stacked tensor per parameter of the layers, [L, ...]
(`qwen.py`): loading stacks the L per-layer tensors of each (`model.layers.i.<name>` goes to
`layers.<name>[i]`), each device reading its own slice of every layer, and export writes one
tensor per layer as above. The files are the same either way.

The fused expert names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are read too.
"""

import dataclasses

from relaymoe_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: our path, its Hugging Face name, and how the layouts relate.

    kind: "same"; "T" (torch Linear: ours = W.T reshaped; `n_in` leading dims of ours are the
    input); "reshape" (a bias); "expert" (stacked experts: `name` is the experts prefix and
    `which` is "gate", "up" or "down").
    """

    path: tuple
    name: str
    kind: str
    n_in: int = 1
    which: str = ""


def mapping(cfg: ModelConfig) -> list[Entry]:
    """Every parameter of a `QwenMoe` of `cfg`, in Hugging Face's state-dict order."""
    out = [Entry(("embed_tokens",), "model.embed_tokens.weight", "same")]
    for i in range(cfg.num_hidden_layers):
        p, q = ("layers", i), f"model.layers.{i}"
        out.append(Entry((*p, "input_layernorm", "weight"), f"{q}.input_layernorm.weight", "same"))
        out += _attention(cfg, (*p, "self_attn"), f"{q}.self_attn")
        out.append(
            Entry(
                (*p, "post_attention_layernorm", "weight"),
                f"{q}.post_attention_layernorm.weight",
                "same",
            )
        )
        m, sm = (*p, "mlp"), f"{q}.mlp"
        out += _moe(cfg, m, sm) if cfg.is_moe_layer(i) else _linears(m, sm, "")
    out.append(Entry(("norm", "weight"), "model.norm.weight", "same"))
    if not cfg.tie_word_embeddings:
        out.append(Entry(("lm_head",), "lm_head.weight", "T"))
    return out


def _attention(cfg: ModelConfig, a: tuple, sa: str) -> list[Entry]:
    """One layer's self-attention: q/k/v (and their biases), o (and its bias), q/k norms."""
    qwen3 = cfg.arch == "qwen3_moe"
    qkv_bias = cfg.attention_bias if qwen3 else cfg.qkv_bias
    out = []
    for x in "qkv":
        out.append(Entry((*a, f"{x}_proj"), f"{sa}.{x}_proj.weight", "T"))
        if qkv_bias:
            out.append(Entry((*a, f"{x}_bias"), f"{sa}.{x}_proj.bias", "reshape"))
    out.append(Entry((*a, "o_proj"), f"{sa}.o_proj.weight", "T", n_in=2))
    if qwen3 and cfg.attention_bias:
        out.append(Entry((*a, "o_bias"), f"{sa}.o_proj.bias", "same"))
    if qwen3:
        out += [Entry((*a, f"{x}_norm", "weight"), f"{sa}.{x}_norm.weight", "same") for x in "qk"]
    return out


def _linears(m: tuple, sm: str, sub: str) -> list[Entry]:
    """The gate/up/down projections of a SwiGLU MLP (`sub`: "" or "shared_expert")."""
    path, name = (*m, sub) if sub else m, f"{sm}.{sub}" if sub else sm
    return [
        Entry((*path, f"{w}_proj"), f"{name}.{w}_proj.weight", "T") for w in ("gate", "up", "down")
    ]


def _moe(cfg: ModelConfig, m: tuple, sm: str) -> list[Entry]:
    """One MoE block: the router, the stacked experts, Qwen2's shared expert and its gate."""
    out = [Entry((*m, "gate"), f"{sm}.gate.weight", "T")]
    out += [
        Entry((*m, f"w_{w}"), f"{sm}.experts", "expert", which=w) for w in ("gate", "up", "down")
    ]
    if cfg.moe.shared_expert_intermediate_size:
        out += _linears(m, sm, "shared_expert")
        out.append(Entry((*m, "shared_expert_gate"), f"{sm}.shared_expert_gate.weight", "T"))
    return out
