"""The planner's predicted step time (`train.planner.predict`) against the module doc's formula
worked out here by hand from the tiny config's sizes, in float64: the parameter counts from the
config's numbers (not the parameter tree), the recomputation from the remat options' definitions
(not the solver's cost table). Rates are made up and all different, so a FLOP count put at the
wrong rate, or a term dropped or counted twice, changes the time. No compile: the parameters are
abstract."""

import dataclasses

import jax
import pytest
from flax import nnx

from relaymoe_jax.analysis import costmodel as cm
from relaymoe_jax.models import QwenMoe
from relaymoe_jax.models.config_files import load_config
from train.planner import predict
from train.settings import TrainConfig

B, S, ACCUM = 8, 64, 3
MESH = {"data": 2, "expert": 4}  # 8 devices


def _rates(hop_bwd: bool) -> predict.Rates:
    rate = lambda t, origin="assumed": cm.Rate(t, origin, "made up")
    bwd = rate(50.0, "hop") if hop_bwd else rate(50.0)
    return predict.Rates(cm.ComputeRates(rate(100.0), bwd), rate(200.0), rate(150.0))


def _by_hand(cfg, options, ring: bool, moe_remat: bool, hop_bwd: bool):
    """(predicted seconds, model FLOPs per device, attention seconds) from the config's
    numbers."""
    h, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
    f, e, k, layers = cfg.moe.moe_intermediate_size, cfg.moe.num_experts, 2, cfg.num_hidden_layers
    attn_params = (
        h * n * d + 2 * h * kv * d + n * d * h + 2 * d + 2 * h
    )  # q k v o, q/k norms, 2 norms
    expert = 3 * h * f * k  # a token's k experts (gate, up, down)
    mlp = h * e + expert  # the router and the experts
    active = layers * (attn_params + mlp) + h + h * cfg.vocab_size  # final norm, LM head
    devices, rows = 8, B * ACCUM
    t, pairs = rows * S, rows * S * (S + 1) / 2
    b, s = B // 8, S  # the micro-batch's rows per device (over data and expert), all its seq
    attn = 4.0 * d * n * layers * pairs  # Q K^T and P V, causal
    qkv = 2 * b * s * h * (n + 2 * kv) * d  # the projections one layer recomputes, per device
    core = 2 * b * n * s * S * d  # Q K^T and P V of one layer, per device (causal half)
    proj_re = ACCUM * qkv * options.count("full")
    core_re = ACCUM * core * sum(o in ("full", "save_qkv") for o in options)
    fwd = (2 * active * t + (2 * layers * mlp * t if moe_remat else 0)) / devices + proj_re
    bwd = (4 * active * t + (4 / 3 * layers * expert * t if ring else 0)) / devices
    bwd_rate = 50.0 * (16 / 12 if hop_bwd else 1)
    attn_s = (attn / devices + core_re) / 200 + 2.5 * attn / devices / 150
    secs = fwd / 100 + bwd / bwd_rate + attn_s
    return secs / 1e12, (6 * active * t + 3 * attn) / devices, attn_s / 1e12


def _e4m3_saving(cfg, moe_remat: bool, ring: bool = True):
    """The seconds expert_fp8's e4m3 kernel saves on Hopper at `_rates(True)`: half the time of
    the experts' forward (again with moe_remat), of the ring's recomputed gate and up and of the
    three dgrads, from the config's numbers."""
    h, f, k, layers = cfg.hidden_size, cfg.moe.moe_intermediate_size, 2, cfg.num_hidden_layers
    a_exp_t = layers * 3 * h * f * k * B * ACCUM * S / 8  # per device
    fwd = 2 * a_exp_t * (2 if moe_remat else 1)  # the experts' forward, at 100 TFLOP/s
    bwd = (2 / 3 * 2 * a_exp_t if ring else 0) + 2 * a_exp_t  # gate and up again, the dgrads
    return 0.5 * (fwd / 100 + bwd / (50 * 16 / 12)) / 1e12


@pytest.mark.parametrize(
    "dispatcher,moe_remat,options,hop_bwd",
    [
        ("ring", True, ("full", "save_attn_out"), True),
        ("alltoall", False, ("save_qkv", "save_all"), False),
    ],
)
def test_the_prediction_is_the_formula(dispatcher, moe_remat, options, hop_bwd):
    cfg = load_config("configs/tiny.yaml").replace(
        dispatcher=dispatcher, attention_impl="chunked", moe_remat=moe_remat
    )
    tc = TrainConfig(batch_size=B, seq_len=S, grad_accum=ACCUM, compute_dtype="bfloat16")
    mesh = jax.make_mesh(tuple(MESH.values()), tuple(MESH))
    model = nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    got = predict.predict(cfg, tc, MESH, options, params, "NVIDIA H100 80GB HBM3", _rates(hop_bwd))
    secs, model_flops, attn_s = _by_hand(cfg, options, dispatcher == "ring", moe_remat, hop_bwd)
    assert got.seconds == pytest.approx(secs, rel=1e-12)
    assert got.attention_seconds == pytest.approx(attn_s, rel=1e-12)
    assert got.model_flops == pytest.approx(model_flops, rel=1e-12)
    assert got.tokens == B * S * ACCUM and got.tokens_per_s == got.tokens / got.seconds
    assert got.mfu == pytest.approx(model_flops / secs / 989.4e12, rel=1e-12)
    assert got.executed_flops > got.model_flops  # the recomputation and FlashAttention's bwd
    # no peak for the device kind: no MFU, the time all the same
    cpu = predict.predict(cfg, tc, MESH, options, params, "cpu", _rates(hop_bwd))
    assert cpu.mfu is None and cpu.seconds == got.seconds
    # one layer planned otherwise changes the time by that layer's recomputation
    other = ("save_attn_out", *options[1:])
    assert predict.predict(cfg, tc, MESH, other, params, "cpu", _rates(hop_bwd)).seconds == (
        pytest.approx(_by_hand(cfg, other, dispatcher == "ring", moe_remat, hop_bwd)[0])
    )


@pytest.mark.parametrize("moe_remat", [True, False])
def test_expert_fp8_runs_the_experts_e4m3_on_hopper(moe_remat):
    """With expert_fp8 the ring on an H100 is predicted faster by exactly the e4m3 kernel's
    share at twice the rate (the wgrads and everything else unchanged, the FLOPs and MFU's model
    FLOPs as without FP8), and the all-to-all by its share (no recomputed gate and up); on a GPU
    that is no Hopper, or with the Triton kernel, the time is bf16's."""
    cfg = load_config("configs/tiny.yaml").replace(
        dispatcher="ring", attention_impl="chunked", moe_remat=moe_remat
    )
    tc = TrainConfig(batch_size=B, seq_len=S, grad_accum=ACCUM, compute_dtype="bfloat16")
    mesh = jax.make_mesh(tuple(MESH.values()), tuple(MESH))
    params = nnx.state(nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0))), nnx.Param)
    options, h100 = ("full", "save_attn_out"), "NVIDIA H100 80GB HBM3"
    run = lambda c, kind: predict.predict(c, tc, MESH, options, params, kind, _rates(True))
    bf16, fp8 = run(cfg, h100), run(cfg.replace(expert_fp8=True), h100)
    assert fp8.seconds == pytest.approx(bf16.seconds - _e4m3_saving(cfg, moe_remat), rel=1e-12)
    assert (fp8.model_flops, fp8.executed_flops) == (bf16.model_flops, bf16.executed_flops)
    a2a = cfg.replace(dispatcher="alltoall")
    saved = run(a2a, h100).seconds - run(a2a.replace(expert_fp8=True), h100).seconds
    assert saved == pytest.approx(_e4m3_saving(cfg, moe_remat, ring=False), rel=1e-9)
    for c, kind in (
        (cfg.replace(expert_fp8=True), "NVIDIA A100-SXM4-80GB"),
        (cfg.replace(expert_fp8=True, gmm_impl="pallas"), h100),
    ):
        assert run(c, kind).seconds == run(c.replace(expert_fp8=False), kind).seconds, kind


def test_the_rates_report_says_where_each_comes_from():
    lines = _rates(True).report()
    assert len(lines) == 4 and all(line.endswith("made up") for line in lines)
    assert lines[2].startswith("attention forward: 200 TFLOP/s")
    assert dataclasses.replace(_rates(False), attn_bwd=cm.assumed_rate()).report()[3] == (
        f"attention backward: 346.3 TFLOP/s, {cm.assumed_rate().source}"
    )
