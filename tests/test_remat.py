"""relaymoe_jax.remat: the solver against brute force (and brute force against a dynamic-programming
knapsack), the cost formulas against the residuals jax really saves, the options applied to the
model (same loss and gradients as no checkpoint), bad input, determinism."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import relaymoe_jax.remat as remat
from relaymoe_jax.models import QwenMoe, decoder
from relaymoe_jax.models.config_files import load_config
from relaymoe_jax.models.layers import rope_cos_sin
from relaymoe_jax.remat import Cost, brute_force, greedy, optimality_gap, uniform


def _random_instance(rng, layers):
    """Per layer, nested options (more bytes buy more FLOPs) with random sizes."""
    costs = []
    for _ in range(layers):
        m = np.cumsum(rng.integers(1, 40, 3))
        c = np.cumsum(rng.integers(0, 100, 3))
        costs.append({o: Cost(int(mi), int(ci)) for o, mi, ci in zip(remat.OPTIONS[1:], m, c)})
    return costs


def _knapsack_dp(costs, budget):
    """Multiple-choice knapsack by dynamic programming over integer bytes: the best FLOPs."""
    best = np.zeros(budget + 1, dtype=np.int64)
    for layer in costs:
        new = best.copy()
        for c in layer.values():
            if c.bytes <= budget:
                new[c.bytes :] = np.maximum(new[c.bytes :], best[: budget + 1 - c.bytes] + c.flops)
        best = new
    return int(best[budget])


def test_greedy_against_brute_force():
    rng = np.random.default_rng(0)
    gaps = []
    for _ in range(300):
        costs = _random_instance(rng, int(rng.integers(1, 6)))
        budget = int(rng.integers(0, 150))
        g, b = greedy(costs, budget), brute_force(costs, budget)
        assert b.flops_saved == _knapsack_dp(costs, budget)  # brute force is optimal
        for plan in (g, b):
            assert plan.bytes <= budget and len(plan.options) == len(costs)
            assert plan.bytes == sum(
                costs[i][o].bytes for i, o in enumerate(plan.options) if o != "full"
            )
        assert g.flops_saved <= b.flops_saved
        gaps.append(optimality_gap(g, b))
    gaps = np.array(gaps)
    print(
        f"greedy optimality gap over 300 random instances: mean {gaps.mean():.3f}, "
        f"max {gaps.max():.3f}, optimal in {np.mean(gaps == 0):.0%}"
    )
    assert np.mean(gaps == 0) > 0.6 and gaps.mean() < 0.05


def test_uniform_is_the_best_single_option_plan():
    """For a scanned model: brute force restricted to one option for all layers, by enumeration."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        costs = _random_instance(rng, int(rng.integers(1, 6)))
        budget = int(rng.integers(0, 200))
        plan = uniform(costs, budget)
        assert len(set(plan.options)) == 1 and plan.bytes <= budget
        fits = [
            (sum(c[o].flops for c in costs), -sum(c[o].bytes for c in costs), o)
            for o in remat.OPTIONS[1:]
            if sum(c[o].bytes for c in costs) <= budget
        ]
        best = max((f for f in fits if f[0] > 0), default=None)
        assert plan.options[0] == (best[2] if best else "full"), (costs, budget, plan)
        assert plan.flops_saved == (best[0] if best else 0)
        assert plan.flops_saved <= brute_force(costs, budget).flops_saved


def test_scanned_model_gets_a_uniform_plan():
    cfg = load_config("configs/tiny.yaml", num_hidden_layers=4)
    costs = remat.layer_costs(cfg, 8, 256, {"expert": 8}, "float32")
    budget = int(2.5 * costs[0]["save_attn_out"].bytes)  # fits 2 layers' save_attn_out, not 4
    mixed = remat.plan_attention_remat(
        cfg, batch=8, seq=256, mesh_shape={"expert": 8}, dtype="float32", budget=budget
    )
    assert len(set(mixed.options)) > 1
    scanned = remat.plan_attention_remat(
        dataclasses.replace(cfg, scan_layers=True),
        batch=8,
        seq=256,
        mesh_shape={"expert": 8},
        dtype="float32",
        budget=budget,
    )
    assert len(set(scanned.options)) == 1 and scanned.bytes <= budget
    assert scanned.flops_saved <= mixed.flops_saved


def test_greedy_on_model_costs_and_gap():
    cfg = load_config("configs/qwen3-30b-a3b.yaml")
    costs = remat.layer_costs(cfg, 1, 4096, {"expert": 8}, jnp.bfloat16)[:6]
    per_layer_all = costs[0]["save_all"].bytes
    for budget in (0, per_layer_all // 3, per_layer_all, 3 * per_layer_all + 12345, 10**12):
        g, b = greedy(costs, budget), brute_force(costs, budget)
        assert g.bytes <= budget
        assert optimality_gap(g, b) < 0.35, (budget, g, b)
    assert greedy(costs, 10**12).options == ("save_all",) * 6
    assert greedy(costs, 0).options == ("full",) * 6


def test_greedy_ranks_by_flops_per_byte():
    costs = [{"save_qkv": Cost(10, 100)}, {"save_qkv": Cost(10, 300)}, {"save_qkv": Cost(10, 200)}]
    assert greedy(costs, 20).options == ("full", "save_qkv", "save_qkv")
    assert greedy(costs, 10).options == ("full", "save_qkv", "full")


def test_determinism():
    costs = [{"save_qkv": Cost(8, 16), "save_all": Cost(16, 32)} for _ in range(5)]  # all ties
    plans = {greedy([dict(c) for c in costs], 40) for _ in range(5)}
    assert len(plans) == 1
    assert plans.pop().options == ("save_all", "save_all", "save_qkv", "full", "full")
    cfg = load_config("configs/tiny.yaml")
    a = remat.plan_attention_remat(
        cfg, batch=8, seq=256, mesh_shape={"expert": 8}, dtype="float32", budget=10**6
    )
    b = remat.plan_attention_remat(
        cfg, batch=8, seq=256, mesh_shape={"expert": 8}, dtype="float32", budget=10**6
    )
    assert a == b


@pytest.mark.parametrize(
    "call, msg",
    [
        (lambda: greedy([{"save_qkv": Cost(1, 1)}], -1), "budget=-1"),
        (lambda: greedy([{"save_qkv": Cost(1, 1)}], "lots"), "budget='lots'"),
        (lambda: greedy([{"save_everything": Cost(1, 1)}], 10), "save_everything"),
        (lambda: greedy([{"full": Cost(1, 1)}], 10), "'full' is the baseline"),
        (lambda: greedy([{"save_qkv": Cost(0, 1)}], 10), "bytes=0"),
        (lambda: remat.policy("nothing"), "'nothing'"),
        (lambda: load_config("configs/tiny.yaml", attention_remat="fast"), "attention_remat"),
        (lambda: load_config("configs/tiny.yaml", attention_remat=("full",)), "2 \\(num_hidden"),
        (lambda: load_config("configs/tiny.yaml", moe_remat="yes"), "moe_remat"),
        (lambda: brute_force([{"save_qkv": Cost(1, 1)}] * 30, 5), "BRUTE_FORCE_LIMIT"),
    ],
)
def test_bad_input(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def _residual_bytes(cfg, option, b, s, dtype):
    """Bytes of the residuals jax saves for one attention block beyond "full" (arguments
    excluded), from `print_saved_residuals` (one device)."""
    mesh = jax.make_mesh((1,), ("expert",))
    layer = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0), dtype=dtype).layers[0]
    x = jax.random.normal(jax.random.key(1), (b, s, cfg.hidden_size)).astype(dtype)
    cos, sin = rope_cos_sin(
        jnp.broadcast_to(jnp.arange(s), (b, s)), cfg.head_size, cfg.rope_theta, dtype
    )
    graphdef, state = nnx.split((layer.input_layernorm, layer.self_attn))

    def residual_bytes(option):
        def block(x, state):  # cos, sin closed over: constants, as in the model
            norm, attn = nnx.merge(graphdef, state)
            f = decoder.attention_block
            if option != "save_all":
                f = nnx.remat(f, policy=remat.policy(option))
            return f(norm, attn, x, cos, sin)

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(block, x, state)
        total = 0
        for line in out.getvalue().splitlines():
            if "from the argument" in line or "from a literal" in line:
                continue
            kind, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
            n = int(np.prod([int(d) for d in dims.split(",") if d]))
            total += n * {"f32": 4, "bf16": 2, "bool": 1, "i32": 4}[kind]
        return total

    # "full" keeps only the RoPE tables (shared by all layers in the model): the baseline
    return residual_bytes(option) - residual_bytes("full")


@pytest.mark.parametrize(
    "config, dtype, impl",
    [
        ("tiny", jnp.float32, "xla"),
        ("tiny", jnp.bfloat16, "xla"),
        ("tiny-qwen2", jnp.float32, "xla"),
        ("tiny", jnp.bfloat16, "chunked"),
    ],
)
def test_memory_formula_matches_saved_residuals(config, dtype, impl):
    block = dict(attention_block_k=64) if impl == "chunked" else {}
    cfg = load_config(f"configs/{config}.yaml", attention_impl=impl, **block)
    b, s = 2, 256
    costs = remat.option_costs(remat.AttentionShape.of(cfg, b, s, {}, dtype))
    for opt in ("save_qkv", "save_attn_out"):
        assert _residual_bytes(cfg, opt, b, s, dtype) == costs[opt].bytes, opt
    measured = _residual_bytes(cfg, "save_all", b, s, dtype)
    assert abs(measured - costs["save_all"].bytes) < 0.05 * measured, (measured, costs)


def _model_residual_bytes(cfg, b, s, dtype):
    """Bytes of every residual jax saves for the whole model's backward (arguments excluded),
    from `print_saved_residuals`, on one device (so the shapes are per device)."""
    mesh = jax.make_mesh((1,), ("expert",))
    model = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0), dtype=dtype)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(0), (b, s), 0, cfg.vocab_size)
    out = io.StringIO()
    with jax.set_mesh(mesh), contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: jnp.sum(nnx.merge(graphdef, p, rest).hidden(ids)[0]), params
        )
    total = 0
    for line in out.getvalue().splitlines():
        if "from the argument" in line or "from a literal" in line:
            continue
        kind, dims = re.match(r"(\w+)\[([^\]]*)\]", line).groups()
        n = int(np.prod([int(d.split("@")[0]) for d in dims.split(",") if d]))
        total += n * {"f32": 4, "bf16": 2, "bool": 1, "i32": 4, "u32": 4}[kind]
    return total


@pytest.mark.parametrize(
    "moe_remat, dtype, impl",
    [(True, jnp.float32, "xla"), (True, jnp.bfloat16, "chunked"), (False, jnp.float32, "xla")],
)
def test_option_bytes_are_what_the_model_keeps_beyond_full(moe_remat, dtype, impl):
    """Per layer, what an option keeps beyond `full` in the whole model, as the fully
    recomputed step (the planner's budget) has it: with moe_remat, `full` is one checkpoint
    around the layer and any other option also keeps the MLP block's input, which
    `layer_costs` counts (it did not: a plan within its budget was over it by one [b, s, H]
    activation per planned layer). Exact for save_qkv and save_attn_out, within 5% for
    save_all, one option in layer 0 at a time."""
    block = dict(attention_block_k=32) if impl == "chunked" else {}
    cfg = load_config("configs/tiny.yaml", moe_remat=moe_remat, attention_impl=impl, **block)
    b, s = 2, 64
    base = _model_residual_bytes(dataclasses.replace(cfg, attention_remat="full"), b, s, dtype)
    costs = remat.layer_costs(cfg, b, s, {"expert": 1}, dtype)
    for o in ("save_qkv", "save_attn_out", "save_all"):
        plan = dataclasses.replace(cfg, attention_remat=(o, "full"))
        kept = _model_residual_bytes(plan, b, s, dtype) - base
        if o == "save_all":
            assert abs(kept - costs[0][o].bytes) < 0.05 * kept, (o, kept, costs[0][o])
        else:
            assert kept == costs[0][o].bytes, (o, kept, costs[0][o])
    plain = remat.layer_costs(dataclasses.replace(cfg, moe_remat=False), b, s, {"expert": 1}, dtype)
    mlp_input = b * s * cfg.hidden_size * np.dtype(dtype).itemsize
    assert costs[0]["save_qkv"].bytes - plain[0]["save_qkv"].bytes == moe_remat * mlp_input


def test_attention_shape_follows_the_mesh():
    cfg = load_config("configs/tiny.yaml")
    sh = remat.AttentionShape.of(cfg, 16, 512, {"data": 2, "expert": 2, "context": 2}, "bfloat16")
    assert (sh.b, sh.s, sh.S, sh.e) == (4, 256, 512, 2)
    sh = remat.AttentionShape.of(cfg, 2, 64, {"data": 4, "expert": 2}, "float32")
    assert sh.b == 2  # batch 2 does not split over data=4: replicated
    c = remat.option_costs(
        remat.AttentionShape.of(cfg, 16, 512, {"data": 2, "context": 2}, "float32")
    )
    plain = remat.option_costs(remat.AttentionShape.of(cfg, 8, 256, {}, "float32"))
    assert c["save_qkv"] == plain["save_qkv"]  # same local q, k, v
    assert c["save_all"].flops > plain["save_all"].flops  # local queries see all keys


def test_options_give_the_same_loss_and_gradients():
    """Every attention option, and the MoE block's recomputation (moe_remat, around the ring and
    around the all-to-all), give the loss and gradients of no checkpoint at all (and the dense
    reference dispatcher)."""
    mesh = jax.make_mesh((8,), ("expert",))
    ids = jax.random.randint(jax.random.key(0), (8, 32), 0, 256)

    def loss_and_grads(**over):
        cfg = load_config("configs/tiny.yaml", **over)
        model = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def f(params):
            logits, aux = nnx.merge(graphdef, params, rest)(ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1)) + aux.router_loss

        with jax.set_mesh(mesh):
            return jax.value_and_grad(f)(params)

    # the baseline with the dense reference dispatcher (its program compiles in about half the
    # ring's time); the two runs below use the ring and the all-to-all
    ref_loss, ref_grads = loss_and_grads(attention_remat="save_all", dispatcher="reference")
    for over in (
        dict(attention_remat=("save_qkv", "save_attn_out"), moe_remat=True),
        dict(attention_remat="full", moe_remat=True, dispatcher="alltoall"),
    ):
        loss, grads = loss_and_grads(**over)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=str(over))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(over))


@pytest.mark.parametrize("moe_remat, layer_outputs", [(True, 2), (False, 4)])
def test_full_recompute_keeps_only_each_layer_input(moe_remat, layer_outputs):
    """attention_remat=full with moe_remat=true checkpoints the whole decoder layer: the model
    keeps one [B, S, H] residual per layer (its input; here the outputs of the residual adds
    that feed the next layer and the final norm), not also the MLP block's input, which the
    attention block alone under its own checkpoint must keep. Read from print_saved_residuals."""
    mesh = jax.make_mesh((8,), ("expert",))
    cfg = load_config("configs/tiny.yaml", attention_remat="full", moe_remat=moe_remat)
    model = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(0), (8, 32), 0, cfg.vocab_size)
    out = io.StringIO()
    with jax.set_mesh(mesh), contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids)[0]), params
        )
    adds = [
        line
        for line in out.getvalue().splitlines()
        if re.match(rf"f32\[8(@\w+)?,32,{cfg.hidden_size}\] output of add .*decoder\.py", line)
    ]
    assert cfg.num_hidden_layers == 2 and len(adds) == layer_outputs, out.getvalue()
