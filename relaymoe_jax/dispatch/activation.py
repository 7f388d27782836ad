"""The experts' gated activation: what each expert computes between its two projections.

    h = act(x @ w_gate[e], x @ w_up[e]);   out = h @ w_down[e]

- `"swiglu"` (default): silu(g) * u. Qwen, DeepSeek, Mixtral, Llama-style MoEs.
- `"geglu"`: gelu(g) * u with GELU's tanh approximation (`jax.nn.gelu`'s default; Grok-1).
- `"geglu_exact"`: gelu(g) * u with the exact (erf) GELU (HF `hidden_act="gelu"`).
- `"gpt_oss"`: GPT-OSS's clamped SwiGLU, with g' = min(g, L):
  (clip(u, -L, L) + 1) * g' * sigmoid(alpha * g'), alpha 1.702, L = `swiglu_limit` 7.0. The
  clamps are `torch.clamp`'s, gradient included: 1 at the bound itself.

Computed in float32 on the projections' float32 outputs, then cast to the activations' dtype for
the down projection, in every dispatcher. The ring's backward recomputes the projections per hop
and differentiates `Activation.__call__` there (`jax.vjp` of this elementwise function), so every
activation gets the same recomputing backward.
"""

import dataclasses
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.util.checks import finite_number, one_of

ActivationName = Literal["swiglu", "geglu", "geglu_exact", "gpt_oss"]
ACTIVATIONS: tuple[str, ...] = typing.get_args(ActivationName)
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


@dataclasses.dataclass(frozen=True)
class Activation:
    """An expert activation (hashable: part of the op's static configuration).

    name: one of `ACTIVATIONS`. alpha, limit: "gpt_oss"'s sigmoid scale and clamp (GPT-OSS's
    1.702 and `swiglu_limit` 7.0); the other activations take neither.
    """

    name: ActivationName = "swiglu"
    alpha: float = GPT_OSS_ALPHA
    limit: float = GPT_OSS_LIMIT

    def __post_init__(self):
        one_of("activation", self.name, ACTIVATIONS)
        finite_number("activation alpha", self.alpha, low=0, strict=True)
        finite_number("activation limit", self.limit, low=0, strict=True)
        if self.name != "gpt_oss" and (self.alpha, self.limit) != (GPT_OSS_ALPHA, GPT_OSS_LIMIT):
            raise ValueError(
                f"activation {self.name!r} takes no alpha or limit (got alpha={self.alpha}, "
                f"limit={self.limit}): they are 'gpt_oss''s"
            )

    def __call__(self, gate, up):
        """h from the gate and up projections (float32 in, float32 out)."""
        if self.name == "swiglu":
            return jax.nn.silu(gate) * up
        if self.name == "geglu":
            return jax.nn.gelu(gate, approximate=True) * up
        if self.name == "geglu_exact":
            return gelu_erf(gate) * up
        g = clamp(gate, high=self.limit)
        u = clamp(up, low=-self.limit, high=self.limit)
        return (u + 1.0) * g * jax.nn.sigmoid(self.alpha * g)


SWIGLU = Activation()


def clamp(a, low=None, high=None):
    """`torch.clamp(a, low, high)`: the bound beyond it, `a` elsewhere, the gradient 1 at the
    bound itself (`jnp.minimum`/`jnp.clip` split a tie's gradient, 0.5 there); NaN stays NaN."""
    if high is not None:
        a = jnp.where(a > high, high, a)
    if low is not None:
        a = jnp.where(a < low, low, a)
    return a


@jax.custom_jvp
def gelu_erf(g):
    """The exact GELU, 0.5 * g * (1 + erf(g / sqrt(2))), with its derivative written out: jax
    0.12 differentiates `erf` through a `polynomial` primitive that fails inside a
    `shard_map(check_vma=True)` ("requires varying manual axes to match")."""
    return 0.5 * g * (1.0 + lax.erf(g * _SQRT_HALF))


@gelu_erf.defjvp
def _gelu_erf_jvp(primals, tangents):
    (g,), (dg,) = primals, tangents
    cdf = 0.5 * (1.0 + lax.erf(g * _SQRT_HALF))
    pdf = jnp.exp(-0.5 * g * g) * _INV_SQRT_2PI
    return g * cdf, (cdf + g * pdf) * dg


_SQRT_HALF, _INV_SQRT_2PI = math.sqrt(0.5), 1.0 / math.sqrt(2.0 * math.pi)


def as_activation(value) -> Activation:
    """`value` as an `Activation`: a record, or one of the names in `ACTIVATIONS`."""
    if isinstance(value, Activation):
        return value
    if isinstance(value, str):
        return Activation(value)
    raise ValueError(
        f"activation={value!r}: expected one of {ACTIVATIONS} or a relaymoe_jax.Activation"
    )
