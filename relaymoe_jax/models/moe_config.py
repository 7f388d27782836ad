"""`MoEConfig`: the MoE block's sizes, its router and its experts, and how `moe_ffn` runs.

One validator per field; a field that the chosen router or activation does not use must stay at
its default (a value that would be ignored is refused, naming the field that uses it).

The router (`routers.py` has the formulas):
    router                 "softmax_topk" (Qwen, default), "topk_softmax" (GPT-OSS, Mixtral),
                           "sigmoid_group" (DeepSeek-V3)
    norm_topk_prob         renormalise the k weights (softmax_topk, sigmoid_group)
    router_bias            a learned bias in the router's logits (GPT-OSS)
    expert_bias            the aux-loss-free selection bias (DeepSeek-V3), updated outside the
                           optimizer at `expert_bias_rate`
    n_group, topk_group    sigmoid_group: expert groups, and how many are kept per token
    routed_scaling_factor  sigmoid_group: the weights' scale
The experts (`relaymoe_jax.dispatch.activation`):
    activation             "swiglu" (default), "geglu", "geglu_exact", "gpt_oss"
    swiglu_limit           gpt_oss: the clamp L (GPT-OSS's config key; alpha is 1.702)
    expert_biases          b_gate, b_up [E, F] and b_down [E, H] parameters (GPT-OSS)
The shared expert:
    shared_expert_intermediate_size   its ffn (0: none)
    shared_expert_gated    Qwen2-MoE's sigmoid gate on it (default); False: added as it is
                           (DeepSeek-V3's shared experts, one MLP of n_shared * F)
"""

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.dispatch.activation import ACTIVATIONS, GPT_OSS_LIMIT, Activation
from relaymoe_jax.models.routers import ROUTERS, RouterKind
from relaymoe_jax.op.options import FIELDS as OPTION_KEYS
from relaymoe_jax.op.options import MoEOptions

# field -> (the value it takes, the only router or activation that uses another one)
ROUTER_ONLY = {
    "n_group": (1, "sigmoid_group"),
    "topk_group": (1, "sigmoid_group"),
    "routed_scaling_factor": (1.0, "sigmoid_group"),
}


def check_rate(what, v) -> None:
    """A finite number >= 0: a Python or numpy scalar, or a 0-d array (a traced one passes)."""
    if isinstance(v, jax.core.Tracer):
        return
    number = isinstance(v, (int, float, np.number, jax.Array)) and not isinstance(
        v, (bool, np.bool_)
    )
    if not (number and np.ndim(v) == 0 and not jnp.issubdtype(jnp.result_type(v), jnp.bool_)):
        raise ValueError(f"{what}={v!r}: expected a finite number >= 0")
    if not 0 <= float(v) < math.inf:
        raise ValueError(f"{what}={v!r}: expected a finite number >= 0")


def _positive_int(name, v, zero_ok=False):
    low = 0 if zero_ok else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"MoEConfig.{name}={v!r}: expected an int >= {low}")


def _one_of(name, v, allowed):
    if not isinstance(v, str) or v not in allowed:
        raise ValueError(f"MoEConfig.{name}={v!r}: expected one of {allowed}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE block's sizes, router and experts, and how `moe_ffn` runs (`options`, one
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
    router: RouterKind = "softmax_topk"
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    activation: str = "swiglu"
    swiglu_limit: float = GPT_OSS_LIMIT
    expert_biases: bool = False
    shared_expert_gated: bool = True

    def __post_init__(self):
        for name in ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _positive_int(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"MoEConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        bools = ("norm_topk_prob", "expert_bias", "router_bias", "expert_biases")
        for name in (*bools, "shared_expert_gated"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r}: expected a bool")
        _positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size, True)
        for name in ("expert_bias_rate", "initializer_range"):
            check_rate(f"MoEConfig.{name}", getattr(self, name))
        if not isinstance(self.options, MoEOptions):
            raise ValueError(f"MoEConfig.options={self.options!r}: expected a MoEOptions")
        _one_of("router", self.router, ROUTERS)
        _one_of("activation", self.activation, ACTIVATIONS)
        self._check_unused()
        if not self.shared_expert_gated and not self.shared_expert_intermediate_size:
            raise ValueError(
                "MoEConfig.shared_expert_gated=False applies to a shared expert only "
                "(shared_expert_intermediate_size=0): it would be ignored"
            )
        self._check_groups()
        self.expert_activation()  # alpha and limit: the activation's own checks

    def _check_unused(self):
        for name, (default, user) in ROUTER_ONLY.items():
            if getattr(self, name) != default and self.router != user:
                raise ValueError(
                    f"MoEConfig.{name}={getattr(self, name)!r} applies to router={user!r} only "
                    f"(got router={self.router!r}): it would be ignored; leave it at {default!r}"
                )
        if self.swiglu_limit != GPT_OSS_LIMIT and self.activation != "gpt_oss":
            raise ValueError(
                f"MoEConfig.swiglu_limit={self.swiglu_limit!r} applies to activation='gpt_oss' "
                f"only (got {self.activation!r}): it would be ignored"
            )

    def _check_groups(self):
        if self.router != "sigmoid_group":
            return
        e, g, tg, k = self.num_experts, self.n_group, self.topk_group, self.num_experts_per_tok
        _positive_int("n_group", g)
        _positive_int("topk_group", tg)
        if e % g or tg > g or k > tg * (e // g):
            raise ValueError(
                f"MoEConfig: n_group={g}, topk_group={tg} with num_experts={e} and "
                f"num_experts_per_tok={k}: expected n_group dividing num_experts, topk_group <= "
                "n_group, and num_experts_per_tok <= topk_group * num_experts / n_group (the "
                "experts the kept groups hold)"
            )
        f = self.routed_scaling_factor
        ok = isinstance(f, (int, float, np.number)) and not isinstance(f, (bool, np.bool_))
        if not (ok and 0 < f < math.inf):
            raise ValueError(f"MoEConfig.routed_scaling_factor={f!r}: expected a finite number > 0")

    def expert_activation(self) -> Activation:
        """The experts' `Activation` (its own errors name `MoEConfig.`)."""
        try:
            if self.activation == "gpt_oss":
                return Activation("gpt_oss", limit=self.swiglu_limit)
            return Activation(self.activation)
        except ValueError as e:
            raise ValueError(f"MoEConfig.{e}") from None

    @classmethod
    def from_dict(cls, d: Mapping) -> "MoEConfig":
        """From flat keys: the fields, with `MoEOptions`' fields (dispatcher, routing, ...) in
        place of `options`; an option's error names the key (`MoEConfig.dispatcher=...`)."""
        options = MoEOptions.from_mapping(d, where="MoEConfig.")
        return cls(**{k: v for k, v in d.items() if k not in OPTION_KEYS}, options=options)

    @classmethod
    def from_model(cls, cfg) -> "MoEConfig":
        """The MoE block of a `ModelConfig` (a Qwen model: the fields it has; the router and
        expert fields it lacks stay at their defaults)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "options"]
        return cls(
            **{n: getattr(cfg, n) for n in names if hasattr(cfg, n)}, options=cfg.moe_options
        )
