"""train.planner: the remat plan's budget comes from the compiled fully-recomputed step, the planned
step is compiled and fits, and its recompute FLOPs (cost_analysis) fall as the budget grows."""

import dataclasses

import jax
import pytest

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.models.config_files import load_config
from train import mesh as tm
from train import planner, train_step
from train.settings import TrainConfig

TC = TrainConfig(batch_size=8, seq_len=256)


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("configs/tiny.yaml")
    mesh = tm.make_mesh(TC.mesh)
    full = planner.step_cost(dataclasses.replace(cfg, attention_remat="full"), TC, mesh)
    return cfg, mesh, full


def test_budget_respected_and_flops_fall_as_budget_grows(setup):
    cfg, mesh, full = setup
    per_layer = {
        o: c
        for o, c in planner.remat.option_costs(
            planner.remat.AttentionShape.of(
                cfg, TC.batch_size, TC.seq_len, dict(mesh.shape), TC.compute_dtype
            )
        ).items()
    }
    budgets = [0, per_layer["save_attn_out"].bytes * 2, per_layer["save_all"].bytes * 2]
    reports = [planner.plan_remat(cfg, TC, mesh, full.peak + b) for b in budgets]
    assert reports[0].plan.options == ("full", "full")
    assert reports[1].plan.options == ("save_attn_out", "save_attn_out")
    assert reports[2].plan.options == ("save_all", "save_all")
    for r in reports:
        assert r.full == full  # the budget is the compiled full peak
        assert r.plan.budget == r.capacity - full.peak
        assert r.fits, (r.planned.peak, r.capacity)  # measured, compiled
    saved = [r.flops_saved for r in reports]
    assert saved[0] == 0 < saved[1] < saved[2]
    # formula (matmuls) against cost_analysis: P @ V and projections exact up to elementwise
    # ops; save_all adds the softmax's elementwise FLOPs that the formula does not count
    assert abs(saved[1] - reports[1].plan.flops_saved) < 0.05 * saved[1]
    assert reports[2].plan.flops_saved <= saved[2] < 1.3 * reports[2].plan.flops_saved
    assert planner.plan_remat(cfg, TC, mesh, full.peak + budgets[1]) == reports[1]  # deterministic


def test_capacity_below_full_recompute_peak(setup):
    cfg, mesh, full = setup
    with pytest.raises(ValueError, match="with full attention recomputation, more than"):
        planner.plan_remat(cfg, TC, mesh, full.peak - 1)


def test_abstract_state_matches_init_state():
    tc = TrainConfig(mesh="fsdp=2,expert=4")
    cfg = load_config("configs/tiny.yaml")
    mesh = tm.make_mesh(tc.mesh)
    _, real, _, _ = train_step.init_state(cfg, tc, mesh)
    _, abstract, _, _ = train_step.abstract_state(cfg, tc, mesh)
    describe = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), t)
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    assert describe(real) == describe(abstract)


@pytest.mark.parametrize(
    "text, want",
    [
        ("H100", 84_929_347_584),
        ("h200", 143_771 * 2**20),
        ("80GiB", 80 * 2**30),
        ("12.5MB", 12_500_000),
        ("1e9", 10**9),
    ],
)
def test_parse_memory(text, want):
    assert planner.parse_memory(text) == want


@pytest.mark.parametrize("text", ["A100x", "-5GB", "12 parsecs", "0"])
def test_parse_memory_errors(text):
    with pytest.raises(ValueError, match="--memory"):
        planner.parse_memory(text)


def test_chunked_attention_cuts_the_step_peak():
    """At seq 2048 the XLA attention's [S, S] scores dominate the fully recomputed step; the
    chunked attention keeps O(S x block) (measured 332.5 -> 126.6 MiB per device)."""
    tc = TrainConfig(batch_size=8, seq_len=2048)
    mesh = tm.make_mesh(tc.mesh)
    peak = {
        impl: planner.step_cost(
            load_config(
                "configs/tiny.yaml",
                attention_impl=impl,
                attention_remat="full",
                max_position_embeddings=4096,
            ),
            tc,
            mesh,
        ).peak
        for impl in ("xla", "chunked")
    }
    scores = 4 * 2048 * 2048 * 4  # N S S float32 per device (one sequence each)
    assert peak["xla"] > 3 * scores  # several score-sized buffers
    assert peak["chunked"] < 0.5 * peak["xla"], peak


def test_chunked_attention_plan_skips_the_forward_scan():
    """With the chunked attention, save_attn_out keeps o and the log-sum-exp, so the backward no
    longer re-runs the forward scan (4 b N s S D FLOPs) on top of the projections. XLA's
    cost_analysis counts a while loop's body once, so with J = 2 key blocks it sees half the
    scan (with one block XLA merges the re-run scores with the backward's, which hides them).
    save_all saves no more FLOPs, so even an unlimited budget plans save_attn_out."""
    cfg = load_config(
        "configs/tiny.yaml", attention_impl="chunked", attention_block_k=TC.seq_len // 2
    )
    mesh = tm.make_mesh(TC.mesh)
    costs = planner.remat.option_costs(
        planner.remat.AttentionShape.of(
            cfg, TC.batch_size, TC.seq_len, dict(mesh.shape), TC.compute_dtype
        )
    )
    assert costs["save_all"].flops == costs["save_attn_out"].flops
    full = planner.step_cost(dataclasses.replace(cfg, attention_remat="full"), TC, mesh)
    r = planner.plan_remat(cfg, TC, mesh, full.peak + 2 * costs["save_attn_out"].bytes)
    assert r.plan.options == ("save_attn_out", "save_attn_out") and r.fits
    scan = costs["save_attn_out"].flops - costs["save_qkv"].flops
    seen = 2 * (costs["save_qkv"].flops + scan // 2)  # per layer, loop body once
    assert seen <= r.flops_saved < 1.1 * seen, (r.flops_saved, seen)
    unlimited = planner.remat.plan_attention_remat(
        cfg,
        batch=TC.batch_size,
        seq=TC.seq_len,
        mesh_shape=dict(mesh.shape),
        dtype=TC.compute_dtype,
        budget=10**12,
    )
    assert unlimited.options == ("save_attn_out", "save_attn_out")


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra")
def test_target_plans_on_the_gpu_compiler(capsys):
    """--target h100: the steps are compiled by XLA:GPU for abstract H100s (mesh over 8 of them,
    memory the H100's), the planned step fits, and the missing cost_analysis is said, not faked."""
    assert (
        planner.main(
            [
                "--config",
                "configs/tiny.yaml",
                "--target",
                "h100",
                "--batch",
                "8",
                "--seq",
                "128",
                "--dispatchers",
                "ring",
                "--usable",
                "0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "XLA:GPU buffer assignment for 8 abstract NVIDIA H100 80GB HBM3" in out
    assert f"usable memory {0.5 * gpu_mesh.device_memory('h100') / 2**20:,.1f} MiB" in out
    row = next(line for line in out.splitlines() if line.startswith("| ring |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[6] == "yes" and cells[7] == "n/a" and float(cells[8]) > 0
    mib = lambda c: float(c.replace(",", ""))
    assert 0 < mib(cells[2]) < mib(cells[1]) < mib(cells[5]) + 1e3  # state < peak


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--batch", "8", "--seq", "128"], "--memory is required without --target"),
        (
            ["--batch", "8", "--seq", "128", "--memory", "H100", "--hosts", "2"],
            "only with --target",
        ),
    ],
)
def test_target_argument_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        planner.main(["--config", "configs/tiny.yaml", *argv])


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra")
def test_target_two_hosts_node_mesh_runs_the_hierarchical_ring(capsys):
    """--hosts 2 mesh=node=2,expert=8: the step compiles for 2 abstract hosts of 8 H100s with the
    experts over ("node", "expert"), and ring="auto" picks the hierarchical ring (node across
    the hosts, expert within each), said in the header."""
    assert (
        planner.main(
            [
                "--config",
                "configs/tiny.yaml",
                "--target",
                "h100",
                "--hosts",
                "2",
                "--batch",
                "16",
                "--seq",
                "32",
                "--dispatchers",
                "ring",
                "mesh=node=2,expert=8",
                "num_experts=16",
                "num_hidden_layers=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "mesh {'node': 2, 'expert': 8}" in out
    assert "XLA:GPU buffer assignment for 16 abstract NVIDIA H100 80GB HBM3" in out
    assert (
        "expert parallelism: ring: hierarchical (ring=auto): inner ring over 'expert' "
        "(8 devices, within a host), outer over 'node' (2, across hosts)"
    ) in out
    row = next(line for line in out.splitlines() if line.startswith("| ring |"))
    assert [c.strip() for c in row.strip("|").split("|")][6] == "yes"


# --------------------------------------------------------------------------- sizes the model takes


def _fake_step_cost(calls, over=0.0):
    """A stand-in for `planner.step_cost` that compiles nothing: 1 MiB per 1,024 tokens when
    fully recomputed, plus (1 + over) x the bytes the solver counts for the plan's options."""

    def step_cost(cfg, tc, mesh, memo=True):
        calls.append((tc.batch_size, tc.seq_len, cfg.attention_remat))
        options = cfg.attention_remat
        options = (options,) * cfg.num_hidden_layers if isinstance(options, str) else options
        costs = planner.remat.layer_costs(
            cfg, tc.batch_size, tc.seq_len, dict(mesh.shape), tc.compute_dtype
        )
        kept = sum(costs[i][o].bytes for i, o in enumerate(options) if o != "full")
        return planner.StepCost(tc.batch_size * tc.seq_len * 2**10 + int((1 + over) * kept), 0.0)

    return step_cost


PLAN = ["--config", "configs/tiny.yaml", "--memory", "40MiB", "--usable", "1", "--batch", "8"]


def test_seq_beyond_the_models_positions_is_refused_before_compiling(monkeypatch):
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    with pytest.raises(
        ValueError,
        match=r"^--seq 512 exceeds max_position_embeddings=256 of configs/tiny\.yaml: the model "
        r"cannot take it \(plan at most --seq 256, or set max_position_embeddings=512 if the "
        r"model can\)$",
    ):
        planner.main([*PLAN, "--seq", "512"])
    assert calls == []
    assert planner.main([*PLAN, "--seq", "512", "max_position_embeddings=512"]) == 0


def test_max_seq_search_stops_at_the_models_positions(monkeypatch, capsys):
    """--max-seq past max_position_embeddings: searched up to it, and said; the largest-size
    helper never probes past it either (it used to raise the config's limit to the search's)."""
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    argv = [*PLAN, "--seq", "128", "--max-seq", "1024", "--dispatchers", "ring"]
    assert planner.main(argv) == 0
    out = capsys.readouterr().out
    note = (
        "--max-seq 1024 searched up to max_position_embeddings=256 of configs/tiny.yaml only: "
        "the model takes no longer sequence"
    )
    assert f"# {note}" in out and f"\n- {note}" in out
    assert max(seq for _, seq, _ in calls) == 256
    assert "| ring | 256 |" in out
    cfg, tc = load_config("configs/tiny.yaml"), TrainConfig(batch_size=8, seq_len=128)
    seq, rec = planner.largest_size(
        cfg, tc, tm.make_mesh(tc.mesh), 2**40, field="seq_len", step=128, limit=4096
    )
    assert seq == rec.limit == 256 and max(s for s, _ in rec.probes) == 256
    with pytest.raises(ValueError, match=r"below --seq-step 512: no length to search"):
        planner.main([*argv[:-2], "--seq-step", "512"])


def test_seq_step_without_max_seq_is_refused():
    with pytest.raises(
        ValueError,
        match=r"^--seq-step 256 only sets the lengths --max-seq searches: add --max-seq LIMIT, "
        r"or drop --seq-step$",
    ):
        planner.main([*PLAN, "--seq", "128", "--seq-step", "256"])


# --------------------------------------------------------------------------- plans that fit


def test_a_plan_over_capacity_is_planned_again(monkeypatch):
    """XLA's peak is not the full peak plus the kept bytes: a compiled plan over the capacity
    is planned again within less (each miss recorded and noted); at worst every layer is
    `full`, which fits by construction."""
    cfg = load_config("configs/tiny.yaml")
    mesh = tm.make_mesh(TC.mesh)
    costs = planner.remat.layer_costs(cfg, TC.batch_size, TC.seq_len, dict(mesh.shape), "float32")
    one = costs[0]["save_attn_out"].bytes
    full = TC.batch_size * TC.seq_len * 2**10
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls, over=0.5))
    r = planner.plan_remat(cfg, TC, mesh, full + 2 * one)  # 2 layers' worth: 3 of them compiled
    assert [m[0].options for m in r.misses] == [("save_attn_out", "save_attn_out")]
    assert r.misses[0][1] == full + 3 * one and r.fits
    assert r.plan.options == ("save_attn_out", "full") and r.planned.peak == full + 1.5 * one
    (note,) = planner.replan_notes(r, "batch 8 x seq 256")
    assert note.startswith(
        "ring at batch 8 x seq 256: the plan 2x save_attn_out compiled to "
        f"{(full + 3 * one) / 2**20:,.1f} MiB, {one / 2**20:,.1f} MiB over"
    ), note
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls, over=100))
    r = planner.plan_remat(cfg, TC, mesh, full + 2 * one)
    assert 1 <= len(r.misses) <= planner.REPLANS and r.plan.options == ("full", "full")
    assert r.planned == r.full and r.fits


def test_moe_remat_plan_fits_its_compiled_step():
    """With moe_remat, `full` is one checkpoint around the whole layer, and any other option
    keeps the MLP block's input too: the solver counts it (it did not, and planned over its
    budget). Compiled on XLA:CPU (chunked attention, no [S, S] scores): a budget that the
    attention's bytes alone would fit but the plan does not gets all `full`; one that fits the
    whole cost gets the plan, whose compiled peak is the full peak plus what the solver
    counted (within 1%)."""
    cfg = load_config(
        "configs/tiny.yaml", moe_remat=True, attention_impl="chunked", attention_block_k=128
    )
    mesh = tm.make_mesh(TC.mesh)
    sh = planner.remat.AttentionShape.of(
        cfg, TC.batch_size, TC.seq_len, dict(mesh.shape), "float32"
    )
    qkv = planner.remat.option_costs(sh)["save_qkv"].bytes
    mlp_input = sh.b * sh.s * sh.H * sh.e
    full = planner.step_cost(dataclasses.replace(cfg, attention_remat="full"), TC, mesh)
    below = planner.plan_remat(cfg, TC, mesh, full.peak + qkv - mlp_input + 1024)
    assert below.plan.options == ("full", "full") and below.fits
    r = planner.plan_remat(cfg, TC, mesh, full.peak + qkv + 1024)
    assert r.plan.options == ("save_qkv", "full") and r.plan.bytes == qkv
    assert r.fits and not r.misses
    grew = r.planned.peak - full.peak
    assert abs(grew - qkv) < 0.01 * qkv, (grew, qkv)
    assert grew > qkv - mlp_input + 1024  # the attention's bytes alone: over that budget


@pytest.mark.parametrize(
    "extra, said",
    [  # a TypeError traceback, a misleading "nothing fits", a TypeError traceback before
        (["batch_size=16"], "batch_size=16: set it with --batch (here 8)"),
        (["seq_len=64"], "seq_len=64: set it with --seq (here 128)"),
        (["compute_dtype=float16"], "compute_dtype='float16': expected one of ('float32', "),
        (["lr=fast"], "trainer option lr='fast': expected float"),
        (["warmup_steps=-1"], "trainer option warmup_steps=-1: expected >= 0"),
    ],
)
def test_trainer_keys_are_checked_before_compiling(monkeypatch, extra, said):
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    with pytest.raises(ValueError) as e:
        planner.main([*PLAN, "--seq", "128", *extra])
    assert str(e.value).startswith(said) and calls == [], str(e.value)


# --------------------------------------------------------------------------- the dispatchers


@pytest.mark.parametrize(
    "extra, said",
    [  # planned without a word before
        (
            ["--dispatchers", "ring", "capacity_factor=1.0"],
            "capacity_factor=1.0 applies to dispatcher='alltoall' only, and the planner plans "
            "ring only: it would be ignored; drop it or plan alltoall too (--dispatchers "
            "ring,alltoall)",
        ),
        (
            ["--dispatchers", "alltoall", "routing=token"],
            "routing='token' applies to dispatcher='ring' only, and the planner plans alltoall",
        ),
        (
            ["dispatcher=reference", "gmm_impl=xla"],
            "gmm_impl='xla' applies to dispatcher='ring' or dispatcher='alltoall' only",
        ),
        # a TypeError traceback before (load_config got `dispatcher` twice)
        (
            ["dispatcher=alltoall", "--dispatchers", "ring"],
            "dispatcher='alltoall' and --dispatchers ring: give the dispatchers once",
        ),
        (["--dispatchers", "ring,a2a"], "--dispatchers='a2a': expected one of ('ring', "),
        (["dispatcher=a2a"], "dispatcher='a2a': expected one of ('ring', "),
    ],
)
def test_what_no_planned_dispatcher_uses_is_refused_before_compiling(monkeypatch, extra, said):
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    with pytest.raises(ValueError) as e:
        planner.main([*PLAN, "--seq", "128", *extra])
    assert str(e.value).startswith(said) and calls == [], str(e.value)


@pytest.mark.parametrize(
    "extra, rows",
    [
        ([], ["ring", "alltoall (dropless)"]),
        (["capacity_factor=1.0"], ["ring", "alltoall (capacity 1.0)"]),
        (["dispatcher=alltoall", "capacity_factor=0.5"], ["alltoall (capacity 0.5)"]),
        (["dispatcher=ring", "--dispatchers", "ring", "chunk_size=64"], ["ring"]),
    ],
)
def test_the_plan_table_names_each_rows_capacity(monkeypatch, capsys, extra, rows):
    """`dispatcher=` is taken like the other keys (it plans that dispatcher alone), and each
    all-to-all row says the capacity it was planned at."""
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    assert planner.main([*PLAN, "--seq", "128", *extra]) == 0
    out = capsys.readouterr().out
    table = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert table == ["dispatcher", *rows], out
