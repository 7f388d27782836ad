"""The dense single-device definition of the MoE FFN: the ground truth for every test.

    y[t] = sum_j expert_weights[t, j] * expert_{expert_ids[t, j]}(x[t])
    expert_e(x) = act(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]

with `act` the experts' gated activation (`dispatch.activation`; SwiGLU by default: silu(g) * u)
and the biases optional (GPT-OSS has them).

Computed pair by pair: for each slot j, every token's own expert weights are gathered ([T, H, F]
per slot), so a token meets only the experts it is routed to. A NaN in one expert's weights (or
in one token) stays in the tokens routed to that expert (or in that token), values and gradients,
as in the ring and the all-to-all. Ids outside [0, E) gather zero weights and contribute nothing
(no gradient either), as in every dispatcher. For tests and small shapes only.
"""

import jax
import jax.numpy as jnp

from relaymoe_jax.dispatch.activation import SWIGLU
from relaymoe_jax.dispatch.experts import Experts, expert_mlp
from relaymoe_jax.quant import fp8 as quant


def reference_moe(x_th, ids_tk, wts_tk, *experts, activation=SWIGLU, fp8=False):
    """y [T, H] (x's dtype). `experts`: the fields of an `Experts` in order, w_gate [E, H, F],
    w_up [E, H, F], w_down [E, F, H], then optionally b_gate, b_up [E, F] and b_down [E, H]
    (`reference_moe(x, ids, wts, *experts)` with a record). fp8: the FP8 recipe
    (docs/precision.md), in float32: weights, x and the activation rounded to e4m3, the
    gradients of the projections and of y rounded before their GEMMs."""
    experts = Experts(*experts).complete()
    if fp8:
        experts, x_th = experts.fake_quantized(), quant.quantize_operand(x_th)
    num_experts = experts.w_gate.shape[0]
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    x = x_th.astype(f32)
    valid_tk = (ids_tk >= 0) & (ids_tk < num_experts)
    rows_tk = jnp.where(valid_tk, ids_tk, num_experts)  # out of range: zero weights

    y_th = jnp.zeros(x.shape, f32)
    for j in range(ids_tk.shape[1]):
        rows_t = rows_tk[:, j]

        def matmul(a, w, a_rows=None, rows_t=rows_t):  # each token times its own expert's w
            w_t = w.astype(f32).at[rows_t].get(mode="fill", fill_value=0)
            return jnp.einsum("tk,tkn->tn", a, w_t, precision=hi)

        out_th = expert_mlp(experts, activation, x, matmul, lambda r=rows_t: r, f32, fp8_acts=fp8)
        y_th = y_th + wts_tk[:, j, None].astype(f32) * out_th
    return (quant.quantize_grad(y_th) if fp8 else y_th).astype(x_th.dtype)
