"""The experts: their weights as one record, and the MLP each expert computes.

    expert_e(x) = act(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]

`Experts` holds the three matrices and the optional biases (all three or none: None when the
experts have none). It is a pytree, built once by the op's front door (`op.api`); the ring sends it
around (`lax.ppermute` of the record) and its weight gradient is an `Experts` of the same shape.

`expert_mlp` is the formula above for a block of rows, each row meeting its own expert, written
once for every dispatcher. What differs between them is how a row meets its expert's matrices,
which they pass in: `matmul(a, w, a_rows=None)` (the ring's hop and the all-to-all: grouped
matmuls over rows sorted by expert; the reference: dense products with each row's gathered
matrix) and `experts_of_rows()`, each row's expert (called only when there are biases). The
projections are float32, the activation is cast to `dtype` for the down projection. The ring's
recomputing backward reuses `gate_up` and differentiates the rest itself (`dispatch.hop`).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.quant import fp8
from relaymoe_jax.util.typed import varying_like


class Experts(NamedTuple):
    """E experts' weights (or one device's share of them); a pytree."""

    w_gate: jax.Array  # [E, H, F]
    w_up: jax.Array  # [E, H, F]
    w_down: jax.Array  # [E, F, H]
    b_gate: jax.Array | None = None  # [E, F]
    b_up: jax.Array | None = None  # [E, F]
    b_down: jax.Array | None = None  # [E, H]

    @property
    def weights(self) -> tuple:
        """(w_gate, w_up, w_down)."""
        return self[:3]

    @property
    def biases(self) -> tuple:
        """(b_gate, b_up, b_down), None where not given."""
        return self[3:]

    @property
    def has_biases(self) -> bool:
        return any(b is not None for b in self.biases)

    def complete(self) -> "Experts":
        """With any bias given, all three: a missing one is zeros of w_gate's dtype, shaped and
        varying (inside a shard_map) like its weight's experts and output dimension."""
        if not self.has_biases:
            return self
        filled = (
            varying_like(jnp.zeros((w.shape[0], w.shape[2]), self.w_gate.dtype), w)
            if b is None
            else b
            for w, b in zip(self.weights, self.biases)
        )
        return Experts(*self.weights, *filled)

    def fake_quantized(self) -> "Experts":
        """The three matrices as e4m3 with 128 x 128 block scales sees them (`quant.fp8`,
        dequantised: exact in bf16), their gradient passed straight through to these weights;
        biases as they are."""
        return self._replace(**{n: fp8.fake_quantize_ste(w) for n, w in self.named_weights()})

    def quantized(self) -> "Experts":
        """The three matrices as `fp8.Fp8` records (e4m3 values and block scales: what the ring
        relays, half the bytes of bf16); biases as they are, and a matrix that is one already."""
        return self._replace(
            **{n: w if isinstance(w, fp8.Fp8) else fp8.quantize(w) for n, w in self.named_weights()}
        )

    def dequantized(self) -> "Experts":
        """`quantized()` undone (exact: the matrices the FP8 GEMMs multiply); a record of plain
        arrays is returned as it is."""
        return self._replace(
            **{n: fp8.dequantize(w) for n, w in self.named_weights() if isinstance(w, fp8.Fp8)}
        )

    def named_weights(self):
        """(name, matrix) of the three matrices."""
        return zip(self._fields[:3], self.weights)


BIAS_NAMES: tuple[str, ...] = Experts._fields[3:]

Matmul = Callable[..., jax.Array]  # (a [R, K], w [E, K, N], a_rows=None) -> [R, N] float32


def row_bias(b_en, expert_r):
    """[R, N] float32: each row's expert's bias (0 for a row past the experts)."""
    return b_en.astype(jnp.float32).at[expert_r].get(mode="fill", fill_value=0)


def gate_up(experts: Experts, x, matmul: Matmul, experts_of_rows, x_rows=None, fp8_grads=False):
    """(gate, up, expert_r): the float32 projections of the rows `x` (read through `x_rows` by a
    kernel that gathers rows), biases added; expert_r is each row's expert (None without biases).
    fp8_grads: the projections' gradients reach their GEMMs rounded to e4m3 (`fp8.quantize_grad`;
    the biases' gradients are not rounded)."""
    gate = matmul(x, experts.w_gate, a_rows=x_rows)
    up = matmul(x, experts.w_up, a_rows=x_rows)
    if fp8_grads:
        gate, up = fp8.quantize_grad(gate), fp8.quantize_grad(up)
    if not experts.has_biases:
        return gate, up, None
    expert_r = experts_of_rows()
    return (
        gate + row_bias(experts.b_gate, expert_r),
        up + row_bias(experts.b_up, expert_r),
        expert_r,
    )


def expert_mlp(
    experts: Experts,
    activation,
    x,
    matmul: Matmul,
    experts_of_rows,
    dtype,
    x_rows=None,
    fp8_acts=False,
):
    """[R, H] float32: each row's expert_e(x) (see the module docstring). fp8_acts: the FP8 recipe's
    activation side (docs/precision.md): the activation enters the down projection as e4m3 with
    1 x 128 tile scales (`act_operand`), the projections' gradients are rounded (`gate_up`);
    `x` and the weights arrive rounded, the output's gradient is rounded by the caller."""
    gate, up, expert_r = gate_up(experts, x, matmul, experts_of_rows, x_rows, fp8_grads=fp8_acts)
    y = matmul(act_operand(activation(gate, up), dtype, fp8_acts), experts.w_down)
    return y if expert_r is None else y + row_bias(experts.b_down, expert_r)


def act_operand(act_f32, dtype, fp8_acts: bool):
    """The down projection's left operand: the float32 activation in `dtype`, then (fp8_acts)
    rounded to e4m3 per row and 128 channels, its gradient straight through."""
    act = act_f32.astype(dtype)
    return fp8.quantize_operand(act) if fp8_acts else act


def check_experts_divide(
    num_experts: int, axis_size: int, *, name: str = "num_experts", axis: str = "the expert axis"
) -> None:
    """The experts split evenly over the expert axis (or axes) of `axis_size` devices, E / EP
    each: ValueError("{name}={E} is not divisible by the size {EP} of {axis}") otherwise, with
    `name` and `axis` as the caller's user spells them (an argument, a config key, mesh axes)."""
    if num_experts % axis_size:
        raise ValueError(f"{name}={num_experts} is not divisible by the size {axis_size} of {axis}")
