"""`MoELayer`: the drop-in Flax NNX MoE block (router, experts on `moe_ffn`, optional shared
expert), the one the Qwen model uses.

    layer = MoELayer(MoEConfig(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512),
                     hidden_size=1024, mesh=mesh, rngs=nnx.Rngs(0))

The hidden size and the initializer's std (`initializer_range`, default 0.02) are the model's,
given as arguments. The layer runs one dispatcher, so a config whose options `moe_ffn` would
refuse (`MoEOptions.check_combination`, by the one table `op.options.USED_BY`: a capacity factor
with the ring, a chunk size with the all-to-all, a grouped matmul with the reference) is refused
here too, although a `MoEConfig` may hold them (the Qwen model hands its layers
`options.applicable()`); a dense config (num_experts=0) too.

The router (`MoEConfig.router`: Qwen's softmax then top-k, GPT-OSS's top-k then softmax,
DeepSeek-V3's grouped sigmoid; `routers.py`) and the experts' activation and biases are the
config's (`moe_config.py`).
    y, aux = layer(x)          # x [..., hidden] (e.g. [batch, seq, hidden]); y like x

Parameters (Hugging Face Qwen3-MoE names; logical axes in brackets, mapped to the mesh by an
`AxisRules`, `rules_for(mesh)` by default, any name overridable):
    gate         [H, E]      ("embed", "router")                    the router
    gate_bias    [E]         ("router",)      its logits' bias (router_bias=True: GPT-OSS)
    b_gate, b_up [E, F], b_down [E, H]        the experts' biases (expert_biases=True: GPT-OSS)
    expert_bias  [E] f32     ("router",)      an `ExpertBias`, not a Param (expert_bias=True)
    w_gate, w_up [E, H, F]   ("experts", "embed", "expert_ffn")
    w_down       [E, F, H]   ("experts", "expert_ffn", "embed")
    shared_expert (gate_proj, up_proj, down_proj), shared_expert_gate [H, 1]
                             Qwen2-MoE's sigmoid-gated shared expert
                             (shared_expert_intermediate_size > 0; shared_expert_gated=False:
                             DeepSeek's, added without a gate)
The experts run on `moe_ffn` over x as the caller has it: expert_axis and expert_tensor_axis come
from the rules' "experts" and "expert_ffn"; on an Auto mesh the tokens go over the rules'
"tokens" axes, on an Explicit one they stay where x is, and y comes back with x's sharding
(replicated when x is not on the mesh: a numpy batch, or an unplaced one under jit), so the
caller's next layer sees what it would without the MoE. Arguments that contradict each other
(the rules, the sizes, x's hidden size or mesh) are refused before tracing, naming both sides.

`aux` (this layer's `router_losses.LayerAux` record, float32 unless said; formulas there):
    router_logits   [..., E]   the router's logits
    expert_fraction [E]        pairs per expert over tokens (sums to k), no gradient
    mean_prob       [E]        mean router probability per expert
    aux_loss                   E * sum(expert_fraction * mean_prob): the load-balancing loss
    z_loss                     mean logsumexp(logits)^2
    seq_aux_loss               router="sigmoid_group" only (None otherwise): DeepSeek-V3's balance
                               loss without its alpha (per sequence along x's last token
                               dimension, averaged over the sequences; 1 when balanced)
    expert_load     [E] int32  pairs routed to each expert (feed it to `update_expert_bias`)
    dropped_pairs   int32      pairs dropped by alltoall with a capacity factor (0 otherwise)
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.dispatch.experts import check_experts_divide
from relaymoe_jax.models import router_losses as rt
from relaymoe_jax.models import routers
from relaymoe_jax.models.layers import MLP, ExpertBias, param
from relaymoe_jax.models.moe_config import MoEConfig
from relaymoe_jax.models.sharding import AxisRules, is_explicit, rules_for
from relaymoe_jax.op import moe_ffn
from relaymoe_jax.op.layout import known_sharding
from relaymoe_jax.util.checks import finite_number, int_at_least

# the expert weights' logical axes: w_gate and w_up [E, H, F], w_down [E, F, H]; their biases
W_IN, W_OUT = ("experts", "embed", "expert_ffn"), ("experts", "expert_ffn", "embed")
B_IN, B_OUT = ("experts", "expert_ffn"), ("experts", "embed")


def _layer_rules(mesh, rules) -> AxisRules:
    """The layer's rules: `rules`, else `rules_for(mesh)`; a mesh given with rules is theirs."""
    if rules is None:
        if mesh is None:
            raise ValueError("MoELayer: pass mesh= (default rules) or rules=")
        return rules_for(mesh)
    if not isinstance(rules, AxisRules):
        raise ValueError(
            f"MoELayer: rules={type(rules).__name__}: expected an AxisRules (rules_for(mesh, ...))"
        )
    if mesh is not None and mesh != rules.mesh:
        raise ValueError(
            f"MoELayer: mesh= {dict(mesh.shape)} is not the rules' mesh "
            f"{dict(rules.mesh.shape)}; pass one of them (the rules carry their mesh)"
        )
    return rules


def _check_rules(cfg, h, rules, dtype) -> None:
    """What the experts need of the rules, and every parameter's sizes against its axes."""
    if not rules.axes("experts"):
        raise ValueError(
            "MoELayer: the rules map 'experts' to no mesh axis; moe_ffn runs the experts over "
            "one: rules_for(mesh, experts=AXIS)"
        )
    rules.expert_tensor_axis  # noqa: B018  (raises for more than one expert_ffn axis)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"MoELayer: dtype={jnp.dtype(dtype)}: expected a floating dtype")
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    n = rules.size("experts")
    check_experts_divide(e, n, axis=f"the experts' mesh axes {rules.axes('experts')}")
    for what, shape, names in (
        ("gate [hidden_size, num_experts]", (h, e), ("embed", "router")),
        ("w_gate [num_experts, hidden_size, moe_intermediate_size]", (e, h, f), W_IN),
    ):
        rules.check_divides(shape, names, f"MoELayer: {what}")


def y_sharding(x, mesh):
    """Where the layer puts y on an Explicit mesh: x's own sharding when x is on the mesh,
    replicated when it is not (an unplaced array, e.g. a batch straight from numpy); None on an
    Auto mesh (the compiler places it). x on another mesh is refused."""
    s = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    on = getattr(s, "mesh", None) if isinstance(s, NamedSharding) else None
    if on is not None and on.axis_names and dict(on.shape) != dict(mesh.shape):
        raise ValueError(
            f"MoELayer: x is on the mesh {dict(on.shape)}, but the layer's parameters are on "
            f"{dict(mesh.shape)}: build the layer on the model's mesh (MoELayer(cfg, mesh=...) "
            "or rules=rules_for(mesh, ...))"
        )
    if not is_explicit(mesh):
        return None
    return known_sharding(x, mesh) or NamedSharding(mesh, P())


class MoELayer(nnx.Module):
    def __init__(
        self,
        cfg: MoEConfig,
        *,
        hidden_size: int,
        rngs: nnx.Rngs,
        initializer_range: float = 0.02,
        mesh=None,
        rules: AxisRules | None = None,
        dtype=jnp.float32,
    ):
        if not isinstance(cfg, MoEConfig):
            raise ValueError(f"MoELayer: cfg={type(cfg).__name__}: expected a MoEConfig")
        int_at_least("MoELayer: num_experts", cfg.num_experts, 1)  # not a dense config
        cfg.options.check_combination()  # what moe_ffn refuses
        int_at_least("MoELayer: hidden_size", hidden_size, 1)
        finite_number("MoELayer: initializer_range", initializer_range, low=0)
        if not isinstance(rngs, nnx.Rngs):
            raise ValueError(f"MoELayer: rngs={type(rngs).__name__}: expected an nnx.Rngs")
        rules = _layer_rules(mesh, rules)
        _check_rules(cfg, hidden_size, rules, dtype)
        h, e, f = hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        std = initializer_range
        self.cfg, self.rules, self.hidden_size = cfg, rules, hidden_size
        self.gate = param(rules, rngs, (h, e), ("embed", "router"), dtype, std=std)
        if cfg.expert_bias:
            self.expert_bias = param(
                rules, None, (e,), ("router",), jnp.float32, init="zeros", kind=ExpertBias
            )
        if cfg.router_bias:
            self.gate_bias = param(rules, None, (e,), ("router",), dtype, init="zeros")
        self.w_gate = param(rules, rngs, (e, h, f), W_IN, dtype, std=std)
        self.w_up = param(rules, rngs, (e, h, f), W_IN, dtype, std=std)
        self.w_down = param(rules, rngs, (e, f, h), W_OUT, dtype, std=std)
        if cfg.expert_biases:  # zero at init, as GPT-OSS's
            self.b_gate = param(rules, None, (e, f), B_IN, dtype, init="zeros")
            self.b_up = param(rules, None, (e, f), B_IN, dtype, init="zeros")
            self.b_down = param(rules, None, (e, h), B_OUT, dtype, init="zeros")
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(
                h, cfg.shared_expert_intermediate_size, rules=rules, rngs=rngs, dtype=dtype, std=std
            )
            if cfg.shared_expert_gated:
                self.shared_expert_gate = param(
                    rules, rngs, (h, 1), ("embed", None), dtype, std=std
                )

    def __call__(self, x):
        """x [..., H] -> (y like x, aux dict; see the module docstring)."""
        cfg, rules = self.cfg, self.rules
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < 2 or shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoELayer: x has shape {shape}, expected [..., hidden_size] with the layer's "
                f"hidden_size={self.hidden_size} and at least one token dimension"
            )
        out = y_sharding(x, rules.mesh)
        with jax.named_scope("router"):
            logits, probs, ids, weights = self._route(x)
        biases = {}
        if cfg.expert_biases:
            biases = {n: getattr(self, n)[...] for n in ("b_gate", "b_up", "b_down")}
        with jax.named_scope("experts"):
            y, st = moe_ffn(
                x,
                ids,
                weights,
                self.w_gate[...],
                self.w_up[...],
                self.w_down[...],
                activation=cfg.expert_activation(),
                **biases,
                mesh=rules.mesh,
                expert_axis=rules.expert_axis,
                expert_tensor_axis=rules.expert_tensor_axis,
                token_axes=None if is_explicit(rules.mesh) else rules.token_axes,
                out_sharding=out,
                **cfg.options.applicable().as_dict(),
                return_stats=True,
            )
        if self.has_shared:
            with jax.named_scope("shared_expert"):
                shared = self.shared_expert(x)
                if cfg.shared_expert_gated:
                    shared = jax.nn.sigmoid(jnp.dot(x, self.shared_expert_gate[...])) * shared
                y = y + shared
            if out is not None:
                y = jax.sharding.reshard(y, out)
        f_e, p_e = rt.balance_stats(probs, ids)
        seq_aux = rt.sequence_balance_loss(probs, ids) if cfg.router == "sigmoid_group" else None
        aux = rt.LayerAux(
            router_logits=logits,
            expert_fraction=f_e,
            mean_prob=p_e,
            aux_loss=cfg.num_experts * jnp.sum(f_e * p_e),
            z_loss=rt.z_loss(logits),
            expert_load=rt.expert_load(ids, cfg.num_experts),
            dropped_pairs=st["dropped_pairs"],
            seq_aux_loss=seq_aux,
        )
        return y, aux

    def _route(self, x):
        """(logits f32, probs f32, ids int32, weights in x's dtype) of `cfg.router`."""
        cfg, f32 = self.cfg, jnp.float32
        logits = jnp.dot(x.astype(f32), self.gate[...].astype(f32), preferred_element_type=f32)
        if cfg.router_bias:
            logits = logits + self.gate_bias[...].astype(f32)
        bias = self.expert_bias[...].astype(f32) if cfg.expert_bias else None
        k = cfg.num_experts_per_tok
        if cfg.router == "softmax_topk":
            r = routers.softmax_topk(logits, k, norm_topk_prob=cfg.norm_topk_prob, bias_e=bias)
        elif cfg.router == "topk_softmax":
            r = routers.topk_softmax(logits, k, bias_e=bias)
        else:
            r = routers.sigmoid_group(
                logits,
                k,
                n_group=cfg.n_group,
                topk_group=cfg.topk_group,
                routed_scaling_factor=cfg.routed_scaling_factor,
                norm_topk_prob=cfg.norm_topk_prob,
                bias_e=bias,
            )
        return logits, r.probs_te, r.ids_tk, r.weights_tk.astype(x.dtype)

    def update_expert_bias(self, expert_load_e, rate: float | None = None):
        """bias += rate * sign(mean(load) - load) (`router_losses.expert_bias_update`), outside the
        optimizer; `expert_load_e` is aux.expert_load summed over the step, shaped like the
        bias: [E], or [L, E] for a stacked layer."""
        if not self.cfg.expert_bias:
            raise ValueError("update_expert_bias: the layer has expert_bias=False")
        rate = self.cfg.expert_bias_rate if rate is None else rate
        check_rate(rate)
        old = self.expert_bias.get_value()
        want = (
            f"int or float counts shaped like the bias, {list(old.shape)} ([L, E] for stacked "
            "layers, [E] otherwise): aux.expert_load summed over the step"
        )
        load = expert_load(expert_load_e, old.shape, want)
        new = rt.expert_bias_update(old, load, rate)
        if not isinstance(old, jax.core.Tracer):  # eager: keep the placement (jit keeps it)
            new = jax.device_put(new, old.sharding)
        self.expert_bias.set_value(new)


def check_rate(rate) -> None:
    """`update_expert_bias`'s rate: a finite number >= 0 (a Python or numpy scalar, a 0-d array;
    a traced one passes)."""
    if isinstance(rate, jax.core.Tracer):
        return
    if isinstance(rate, jax.Array) and rate.ndim == 0 and not jnp.issubdtype(rate.dtype, jnp.bool_):
        rate = rate.item()
    finite_number("update_expert_bias: rate", rate, low=0)


def expert_load(load, shape, want: str):
    """`load` (aux.expert_load summed over the step) as an array; refused, saying `want`,
    unless int or float counts of `shape` (the shape of the bias it updates)."""
    load = jnp.asarray(load)
    numeric = jnp.issubdtype(load.dtype, jnp.integer) or jnp.issubdtype(load.dtype, jnp.floating)
    if tuple(load.shape) != tuple(shape) or not numeric:
        raise ValueError(
            f"update_expert_bias: expert_load is {load.dtype}{list(load.shape)}, expected {want}"
        )
    return load
