"""What the metrics line reports besides the losses (`train.step.expert_load`, `train.step.flops`):
the per-layer expert load against a numpy count of the step's own routing on a fixed batch, the
model FLOPs against hand arithmetic and against XLA's `cost_analysis()` of the step (the progress
line's reading of both: tests/test_train_resume.py, beside its other fields).

The step is the tiny config's (2 MoE layers, 8 experts, k = 2) with the dense reference
dispatcher (no loops: XLA:CPU's cost analysis counts a loop body once, which would hide the
ring's hops), compiled once for the module."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from relaymoe_jax.models.config_files import load_config
from train.data.source import Batch
from train.planner.memory import footprint
from train.settings import TrainConfig
from train.step import expert_load, flops, train_step
from train.step import mesh as tm

B, S = 8, 32


@functools.cache
def _step():
    """(cfg, the parameters, the metrics of one step on a fixed batch, the router logits of the
    same batch from the same weights, XLA's FLOP counts of the step)."""
    cfg = load_config("configs/tiny.yaml").replace(dispatcher="reference")
    tc = TrainConfig(batch_size=B, seq_len=S, warmup_steps=0)
    mesh = tm.make_mesh(tc.mesh)
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    model = nnx.merge(graphdef, jax.tree.map(train_step.gather_stored, state.params), state.rest)
    logits = nnx.jit(lambda m, i: m(i, return_router_logits=True)[1].router_logits)(
        model, jnp.asarray(tokens)
    )
    ids_sharding = NamedSharding(mesh, rules.fit((B, S), "batch", "seq"))
    step = train_step.make_step(graphdef, tx)
    compiled = train_step.compile_step(step, state, ids_sharding, (B, S))
    batch = jax.device_put(Batch(tokens), ids_sharding)
    xla = {  # XLA's counts of the program before and after its optimisation
        "hlo": jax.jit(step).lower(state, batch).cost_analysis()["flops"],
        "compiled": compiled.cost_analysis()["flops"],
        "memory line": train_step.memory_summary(compiled),  # the trainer's, for the test below
        "footprint": footprint(compiled.memory_analysis()),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
    }
    params = state.params
    _, metrics = compiled(state, batch)
    return cfg, params, jax.device_get(metrics), np.asarray(logits), xla


def test_expert_load_is_the_count_of_the_steps_routing():
    """The step's counts equal numpy's count of the top-k of the router logits (the tiny model's
    softmax top-k router), and the metrics line's per-layer lists are those counts'
    max / mean, min / mean and zeros, computed here."""
    cfg, _, metrics, logits, _ = _step()
    k, e = cfg.moe.num_experts_per_tok, cfg.moe.num_experts
    top = np.argsort(-logits, axis=-1)[..., :k]  # [L, B, S, k]
    counts = np.stack([np.bincount(t.ravel(), minlength=e) for t in top])
    np.testing.assert_array_equal(np.asarray(metrics.expert_load), counts)
    assert counts.sum(axis=1).tolist() == [B * S * k] * cfg.num_hidden_layers
    rec = metrics.record()
    mean = counts.mean(axis=1)
    np.testing.assert_allclose(rec["expert_overload"], counts.max(axis=1) / mean, rtol=1e-12)
    np.testing.assert_allclose(rec["expert_min_load"], counts.min(axis=1) / mean, rtol=1e-12)
    assert rec["experts_idle"] == (counts == 0).sum(axis=1).tolist()


def test_load_statistics_of_skewed_idle_and_empty_layers():
    stats = expert_load.load_stats([[4, 4, 4, 4], [16, 0, 0, 0], [0, 0, 0, 0]])
    assert stats == {
        "expert_overload": [1.0, 4.0, 0.0],
        "expert_min_load": [1.0, 0.0, 0.0],
        "experts_idle": [0, 3, 4],
    }
    with pytest.raises(ValueError, match=r"\[layers, experts\], got shape \(4,\)"):
        expert_load.load_stats([1, 2, 3, 4])


def test_model_flops_by_hand_and_against_the_compiled_step():
    """6 x active parameters x tokens + 12 x L x heads x head_dim x causal pairs, the active
    parameters written out for the tiny config (H 64, 4 heads of 16, 2 KV heads, experts
    [8, 64, 64] with k = 2, vocab 256, untied, 2 layers). XLA's count of the step's HLO
    (`Lowered.cost_analysis()`: forward, backward, optimizer, all elementwise work; its one loop
    is the RNG's split) is above the model FLOPs by what the formula leaves out by convention:
    the loss's and the router's softmax, the norms, the activations and AdamW's elementwise
    updates, which weigh a lot at H = 64 (1.14x here). The optimised program's count on XLA:CPU
    is below the model FLOPs (0.70x): it leaves out the products XLA:CPU hands to XNNPACK, so it
    cannot check the formula."""
    cfg, params, _, _, xla = _step()
    h, n, kv, d, f, e, k, v, layers = 64, 4, 2, 16, 64, 8, 2, 256, 2
    attn = h * n * d + 2 * h * kv * d + n * d * h + 2 * d  # q, k, v, o; q_norm, k_norm
    per_layer = attn + h * e + 3 * h * f * k + 2 * h  # router, k experts, two norms
    active = layers * per_layer + h * v + h  # LM head, final norm; the embedding is a lookup
    assert flops.active_params(params, k, e, tied_embeddings=False) == active
    sf = flops.StepFlops.of(cfg, params, "cpu")
    pairs = flops.visible_pairs(np.zeros((B, S), np.int32))
    assert pairs == B * S * (S + 1) // 2
    model = 6 * active * B * S + 12 * layers * n * d * pairs
    assert sf.step(B * S, pairs) == model and sf.peak_tflops is None
    print(
        f"model {model:,.0f} FLOPs; XLA: HLO {xla['hlo']:,.0f} ({xla['hlo'] / model:.2f}x), "
        f"compiled on XLA:CPU {xla['compiled']:,.0f} ({xla['compiled'] / model:.2f}x)"
    )
    assert model < xla["hlo"] < 1.3 * model


def test_visible_pairs_count_each_document_of_a_packed_row():
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    assert flops.visible_pairs(np.zeros_like(seg), seg) == 6 + 3 + 21


def test_mfu_needs_a_known_peak():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert flops.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert flops.peak_tflops("cpu") is None
    sf = flops.StepFlops(per_token=1e12, per_pair=0.0, peak_tflops=1000.0)
    assert sf.record(tokens=100, pairs=0, seconds=0.5, devices=8) == {
        "model_tflops_per_device": 25.0,
        "mfu": 0.025,
    }


def test_the_memory_line_shows_the_planners_peak():
    """The trainer's memory line (`train_step.memory_summary`): its peak is the planner's count
    of the same compiled step (`train.planner.memory.footprint`), never below the temporaries
    (XLA:CPU's own `peak_memory_in_bytes` estimate was: the probe's case), and each part is
    shown."""
    line = _step()[4]["memory line"]
    got = dict(re.findall(r"(\w+)=([\d.]+) MiB", line))
    xla = _step()[4]
    assert float(got["peak"]) == pytest.approx(xla["footprint"] / 2**20, abs=0.005)
    assert float(got["temp"]) == pytest.approx(xla["temp"] / 2**20, abs=0.005)
    assert float(got["peak"]) >= float(got["temp"]) > 0
    assert set(got) == {"argument", "output", "alias", "temp", "peak"}
