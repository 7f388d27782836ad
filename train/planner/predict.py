"""The planner's predicted step time and MFU: a planned step's FLOPs at the cost model's compute
rates. A prediction, not a measurement, and said so wherever it is printed.

Per optimizer step (`grad_accum` micro-batches of `batch_size` rows of `seq_len` tokens, each row
one document: the causal maximum of visible pairs), over the mesh's devices, with A the active
parameters (`train.step.flops`), A_mlp those of the MLP/MoE blocks, A_exp the routed experts'
(x k / E), T the tokens and P the visible (query, key) pairs:

    matmul forward   2 A T  + the plan's recomputed projections (`relaymoe_jax.remat.costs`:
                     q, k, v of every `full` layer) + 2 A_mlp T with `moe_remat` (the MLP block's
                     forward again)                                         at the forward rate
    matmul backward  4 A T  + 4/3 A_exp T for the ring (its backward hop recomputes gate and up)
                                                                            at the backward rate
    attention fwd    4 D N L P + what the plan recomputes of it (Q K^T and P V of the layers not
                     kept at save_attn_out or save_all)                     at the attention rates
    attention bwd    2.5 x 4 D N L P (FlashAttention's count: the scores recomputed)

With `expert_fp8` in the ring or the all-to-all on Hopper (its grouped matmul "auto" or "mosaic":
the e4m3 kernel, `kernels/gmm/fp8.py`), the routed experts' forward 2 A_exp T (twice with
`moe_remat`), the ring's recomputed gate and up 4/3 A_exp T and the dgrads 2 A_exp T run at
E4M3_SPEEDUP times their
rate (the tensor cores' e4m3 / bf16 ratio, assumed until a GPU times the kernel); the wgrads
2 A_exp T stay at the bf16 rate. FLOPs and MFU are counted as without FP8 (MFU against the bf16
peak).

Rates (`relaymoe_jax.analysis.costmodel`): the matmuls at `load_rates` (the GPU run's ring hop,
else its kernels, else 0.35 x the H100's dense bf16 peak), causal attention at
`load_attention_rates` (the GPU run's attention kernel, else the same assumed rate). A hop rate
counts 12 of the 16 units its backward computes, so it is scaled to executed FLOPs. Not counted:
communication (the ring's transfers hide behind its compute above the cost model's hiding point;
an all-to-all's do not), the offloads' PCIe copies, elementwise work, the optimizer, kernel
launch and imbalance. MFU = the model FLOPs (6 A T + 12 D N L P, the metrics line's) / devices /
the predicted time / the device's peak.
"""

import dataclasses
import math

from relaymoe_jax.analysis import costmodel
from relaymoe_jax.remat import layer_costs
from relaymoe_jax.util.platform import HOPPER_KINDS

from ..step import flops as flops_mod

E4M3_SPEEDUP = 2.0  # Hopper's dense e4m3 tensor-core peak over its bf16 one


def e4m3_flops(cfg, device_kind: str, a_exp: float, t: float) -> tuple[float, float]:
    """(forward, backward) expert FLOPs of T tokens that the e4m3 kernel runs (module doc): zero
    unless `expert_fp8`, the ring or the all-to-all, and its e4m3 grouped matmul on a Hopper
    `device_kind`. The backward's: the dgrads, and the ring's recomputed gate and up."""
    opts = cfg.moe.options
    on = (
        opts.expert_fp8
        and opts.dispatcher in ("ring", "alltoall")
        and opts.gmm_impl in ("auto", "mosaic")
        and HOPPER_KINDS.search(device_kind) is not None
    )
    if not on:
        return 0.0, 0.0
    recomputed = 4.0 / 3.0 if opts.dispatcher == "ring" else 0.0
    return 2.0 * a_exp * t * (2 if cfg.moe_remat else 1), (recomputed + 2.0) * a_exp * t


@dataclasses.dataclass(frozen=True)
class Rates:
    """The compute rates a prediction uses: matmuls (forward, backward) and causal attention."""

    matmul: costmodel.ComputeRates
    attn_fwd: costmodel.Rate
    attn_bwd: costmodel.Rate

    @classmethod
    def load(cls, path=None) -> "Rates":
        """The cost model's rates: measured from `path` (default: the GPU run's JSON if it
        exists), else assumed."""
        return cls(costmodel.load_rates(path), *costmodel.load_attention_rates(path))

    def report(self) -> list[str]:
        return [
            *self.matmul.report(),
            f"attention forward: {self.attn_fwd.tflops:,.4g} TFLOP/s, {self.attn_fwd.source}",
            f"attention backward: {self.attn_bwd.tflops:,.4g} TFLOP/s, {self.attn_bwd.source}",
        ]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One optimizer step's predicted time (module doc), per device."""

    tokens: int  # per optimizer step, all devices
    model_flops: float  # per device: 6 A T + 12 D N L P
    executed_flops: float  # per device: with the recomputation and FlashAttention's backward
    seconds: float
    attention_seconds: float  # of which causal attention's (forward, its recompute, backward)
    peak_tflops: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mfu(self) -> float | None:
        if not self.peak_tflops:
            return None
        return self.model_flops / self.seconds / (self.peak_tflops * 1e12)


def _recomputed_attention(cfg, tc, mesh_shape: dict, options) -> tuple[float, float]:
    """(projection, attention-core) FLOPs per device and micro-batch that the plan's options
    recompute, from the remat solver's own costs (`c` of each option against `full`)."""
    costs = layer_costs(cfg, tc.batch_size, tc.seq_len, mesh_shape, tc.compute_dtype)
    proj = core = 0.0
    for layer, option in zip(costs, options, strict=True):
        qkv, kept_all = layer["save_qkv"].flops, layer["save_all"].flops
        kept = 0 if option == "full" else layer[option].flops
        proj += 0 if option != "full" else qkv
        core += (kept_all - qkv) - max(kept - qkv, 0)
    return proj, core


def predict(cfg, tc, mesh_shape: dict, options, params, device_kind: str, rates: Rates):
    """The `Prediction` of `cfg`'s step under `tc` on a mesh of `mesh_shape` ({axis: size}) with
    the attention remat `options` (one per layer), `params` the model's (abstract) parameters."""
    moe = cfg.moe
    k, e = moe.num_experts_per_tok, moe.num_experts
    tied = cfg.tie_word_embeddings
    devices = math.prod(mesh_shape.values())
    rows = tc.batch_size * tc.grad_accum
    t = rows * tc.seq_len
    pairs = rows * tc.seq_len * (tc.seq_len + 1) // 2
    a = flops_mod.active_params(params, k, e, tied)
    a_mlp = flops_mod.active_params(params, k, e, tied, within="mlp")
    a_exp = flops_mod.expert_active_params(params, k, e)
    attn = 4.0 * cfg.head_size * cfg.num_attention_heads * cfg.num_hidden_layers * pairs
    proj, core = (tc.grad_accum * f for f in _recomputed_attention(cfg, tc, mesh_shape, options))
    fwd = 2.0 * a * t / devices + proj + (2.0 * a_mlp * t / devices if cfg.moe_remat else 0.0)
    ring = moe.options.dispatcher == "ring"
    bwd = (4.0 * a * t + (4.0 / 3.0 * a_exp * t if ring else 0.0)) / devices
    attn_fwd = attn / devices + core
    attn_bwd = costmodel.ATTN_BWD_UNITS * attn / devices
    bwd_rate = rates.matmul.bwd.tflops
    if rates.matmul.bwd.origin == "hop":  # counts HOP_BWD_UNITS of RING_BWD_UNITS computed
        bwd_rate *= costmodel.RING_BWD_UNITS / costmodel.HOP_BWD_UNITS
    attention_s = (attn_fwd / rates.attn_fwd.tflops + attn_bwd / rates.attn_bwd.tflops) / 1e12
    seconds = (fwd / rates.matmul.fwd.tflops + bwd / bwd_rate) / 1e12 + attention_s
    fp8_fwd, fp8_bwd = (f / devices for f in e4m3_flops(cfg, device_kind, a_exp, t))
    saved = 1.0 - 1.0 / E4M3_SPEEDUP  # of those FLOPs' time at the 16-bit rates
    seconds -= saved * (fp8_fwd / rates.matmul.fwd.tflops + fp8_bwd / bwd_rate) / 1e12
    model = (6.0 * a * t + 3.0 * attn) / devices
    executed = fwd + bwd + attn_fwd + attn_bwd
    peak = flops_mod.peak_tflops(device_kind)
    return Prediction(t, model, executed, seconds, attention_s, peak)
