"""`MoELayer`: the drop-in Flax NNX MoE block (router, experts on `moe_ffn`, optional shared
expert), the one the Qwen model uses.

    layer = MoELayer(MoEConfig(hidden_size=1024, num_experts=64, num_experts_per_tok=8,
                               moe_intermediate_size=512), mesh=mesh, rngs=nnx.Rngs(0))
    y, aux = layer(x)          # x [..., hidden] (e.g. [batch, seq, hidden]); y like x

Parameters (Hugging Face Qwen3-MoE names; logical axes in brackets, mapped to the mesh by an
`AxisRules`, `rules_for(mesh)` by default, any name overridable):
    gate         [H, E]      ("embed", "router")                    the router
    expert_bias  [E] f32     ("router",)      an `ExpertBias`, not a Param (expert_bias=True)
    w_gate, w_up [E, H, F]   ("experts", "embed", "expert_ffn")
    w_down       [E, F, H]   ("experts", "expert_ffn", "embed")
    shared_expert (gate_proj, up_proj, down_proj), shared_expert_gate [H, 1]
                             Qwen2-MoE's sigmoid-gated shared expert
                             (shared_expert_intermediate_size > 0)
The experts run on `moe_ffn` over x as the caller has it: expert_axis and expert_tensor_axis come
from the rules' "experts" and "expert_ffn"; on an Auto mesh the tokens go over the rules'
"tokens" axes, on an Explicit one they stay where x is.

`aux` (this layer's, float32 unless said; formulas in `router.py`):
    router_logits   [..., E]   the router's logits
    expert_fraction [E]        pairs per expert over tokens (sums to k), no gradient
    mean_prob       [E]        mean router probability per expert
    aux_loss                   E * sum(expert_fraction * mean_prob): the load-balancing loss
    z_loss                     mean logsumexp(logits)^2
    expert_load     [E] int32  pairs routed to each expert (feed it to `update_expert_bias`)
    dropped_pairs   int32      pairs dropped by alltoall with a capacity factor (0 otherwise)
"""

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from relaymoe_jax.models import router as rt
from relaymoe_jax.models.layers import MLP, ExpertBias, param
from relaymoe_jax.models.sharding import AxisRules, is_explicit, rules_for
from relaymoe_jax.op import moe_ffn
from relaymoe_jax.op.options import FIELDS as OPTION_KEYS
from relaymoe_jax.op.options import MoEOptions


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE block's sizes and router options, and how `moe_ffn` runs (`options`, one
    `MoEOptions`; `MoEConfig.from_dict` takes its fields as flat keys, like the YAML files)."""

    hidden_size: int  # H
    num_experts: int  # E
    num_experts_per_tok: int  # k
    moe_intermediate_size: int  # F, one expert's ffn
    norm_topk_prob: bool = True  # renormalise the top-k weights
    expert_bias: bool = False  # aux-loss-free bias (DeepSeek-V3), selection only
    expert_bias_rate: float = 0.001
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    options: MoEOptions = dataclasses.field(default_factory=MoEOptions)
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEConfig.{name}={v!r}: expected an int >= 1")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"MoEConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        if not isinstance(self.options, MoEOptions):
            raise ValueError(f"MoEConfig.options={self.options!r}: expected a MoEOptions")

    @classmethod
    def from_dict(cls, d: Mapping) -> "MoEConfig":
        """From flat keys: the fields, with `MoEOptions`' fields (dispatcher, routing, ...) in
        place of `options`; an option's error names the key (`MoEConfig.dispatcher=...`)."""
        options = MoEOptions.from_mapping(d, where="MoEConfig.")
        return cls(**{k: v for k, v in d.items() if k not in OPTION_KEYS}, options=options)

    @classmethod
    def from_model(cls, cfg) -> "MoEConfig":
        """The MoE block of a `ModelConfig`."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "options"]
        return cls(**{n: getattr(cfg, n) for n in names}, options=cfg.moe_options)


class MoELayer(nnx.Module):
    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs,
        mesh=None,
        rules: AxisRules | None = None,
        dtype=jnp.float32,
    ):
        if rules is None:
            if mesh is None:
                raise ValueError("MoELayer: pass mesh= (default rules) or rules=")
            rules = rules_for(mesh)
        h, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        n = rules.size("experts")
        if e % n:
            raise ValueError(
                f"MoELayer: num_experts={e} is not divisible by the {n} devices of "
                f"the experts' mesh axes {rules.axes('experts')}"
            )
        std = cfg.initializer_range
        self.cfg, self.rules = cfg, rules
        self.gate = param(rules, rngs, (h, e), ("embed", "router"), dtype, std=std)
        if cfg.expert_bias:
            self.expert_bias = param(
                rules, None, (e,), ("router",), jnp.float32, init="zeros", kind=ExpertBias
            )
        w_in, w_out = ("experts", "embed", "expert_ffn"), ("experts", "expert_ffn", "embed")
        self.w_gate = param(rules, rngs, (e, h, f), w_in, dtype, std=std)
        self.w_up = param(rules, rngs, (e, h, f), w_in, dtype, std=std)
        self.w_down = param(rules, rngs, (e, f, h), w_out, dtype, std=std)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(
                h, cfg.shared_expert_intermediate_size, rules=rules, rngs=rngs, dtype=dtype, std=std
            )
            self.shared_expert_gate = param(rules, rngs, (h, 1), ("embed", None), dtype, std=std)

    def __call__(self, x):
        """x [..., H] -> (y like x, aux dict; see the module docstring)."""
        cfg, rules = self.cfg, self.rules
        with jax.named_scope("router"):
            bias_e = self.expert_bias[...] if cfg.expert_bias else None
            logits, probs, ids, weights = rt.route(
                x,
                self.gate[...],
                top_k=cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                bias_e=bias_e,
                out_dtype=x.dtype,
            )
        with jax.named_scope("experts"):
            y, st = moe_ffn(
                x,
                ids,
                weights,
                self.w_gate[...],
                self.w_up[...],
                self.w_down[...],
                mesh=rules.mesh,
                expert_axis=rules.expert_axis,
                expert_tensor_axis=rules.expert_tensor_axis,
                token_axes=None if is_explicit(rules.mesh) else rules.token_axes,
                **cfg.options.applicable().as_dict(),
                return_stats=True,
            )
        if self.has_shared:
            with jax.named_scope("shared_expert"):
                gate = jax.nn.sigmoid(jnp.dot(x, self.shared_expert_gate[...]))
                y = y + gate * self.shared_expert(x)
        f_e, p_e = rt.balance_stats(probs, ids)
        aux = {
            "router_logits": logits,
            "expert_fraction": f_e,
            "mean_prob": p_e,
            "aux_loss": cfg.num_experts * jnp.sum(f_e * p_e),
            "z_loss": rt.z_loss(logits),
            "expert_load": rt.expert_load(ids, cfg.num_experts),
            "dropped_pairs": st["dropped_pairs"],
        }
        return y, aux

    def update_expert_bias(self, expert_load_e, rate: float | None = None):
        """bias += rate * sign(mean(load) - load) (`router.expert_bias_update`), outside the
        optimizer; `expert_load_e` is aux["expert_load"] summed over the step ([L, E] for a
        stacked layer)."""
        if not self.cfg.expert_bias:
            raise ValueError("update_expert_bias: the layer has expert_bias=False")
        rate = self.cfg.expert_bias_rate if rate is None else rate
        old = self.expert_bias.get_value()
        new = rt.expert_bias_update(old, jnp.asarray(expert_load_e), rate)
        if not isinstance(old, jax.core.Tracer):  # eager: keep the placement (jit keeps it)
            new = jax.device_put(new, old.sharding)
        self.expert_bias.set_value(new)
