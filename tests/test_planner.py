"""train.planner: the remat plan's budget comes from the compiled fully-recomputed step, the planned
step is compiled and fits, and its recompute FLOPs (cost_analysis) fall as the budget grows."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.models.config_files import load_config
from train.planner import args as planner_args
from train.planner import memory, predict
from train.planner import plan as planner
from train.planner import report as planner_report
from train.settings import TrainConfig
from train.step import mesh as tm
from train.step import train_step

TC = TrainConfig(batch_size=8, seq_len=256)


@pytest.fixture(scope="module")
def setup():
    """The dense variant of the tiny model (its MLP in place of the MoE block: nothing the
    attention's plan reads, and it compiles in half the time; the MoE block is compiled by
    test_moe_remat_plan_fits_its_compiled_step), its mesh and its compiled fully recomputed
    step."""
    cfg = load_config("configs/tiny.yaml", num_experts=0)
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


@pytest.mark.parametrize("text", ["A100x", "-5GB", "12 parsecs", "0", "1e", "1e999"])
def test_parse_memory_errors(text):
    with pytest.raises(ValueError, match="--memory"):
        planner.parse_memory(text)


def test_chunked_attention_cuts_the_step_peak():
    """At seq 2048 the XLA attention's [S, S] scores dominate the fully recomputed step; the
    chunked attention keeps O(S x block) (measured 328.5 -> 29.7 MiB per device). One layer of
    the dense variant (the peak is one layer's attention recomputed in the backward, whatever
    the MLP block and the number of layers; a third of the tiny MoE's compile time)."""
    tc = TrainConfig(batch_size=8, seq_len=2048)
    mesh = tm.make_mesh(tc.mesh)
    peak = {
        impl: planner.step_cost(
            load_config(
                "configs/tiny.yaml",
                attention_impl=impl,
                attention_remat="full",
                max_position_embeddings=4096,
                num_experts=0,
                num_hidden_layers=1,
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
    longer re-runs the forward (2 b N s S D FLOPs: the causal half) on top of the projections.
    XLA's cost_analysis counts a while loop's body once, so with 2 x 2 blocks it sees one pair of
    blocks, half the causal count (and the softmax's elementwise FLOPs, ~7 per score, on top:
    hence the 20%). save_all saves no more FLOPs, so even an unlimited budget plans
    save_attn_out. The dense variant of the tiny model: without moe_remat the MLP block is
    not recomputed in either step, so the FLOPs saved are the attention's whatever the block
    (the MoE block under the chunked attention is compiled by the next test). One layer (a
    third less to compile): what is read here is per layer; the plan's bytes and FLOPs summed
    over two layers are checked against the compiled steps by
    test_budget_respected_and_flops_fall_as_budget_grows (XLA attention) and, for the chunked
    attention, test_moe_remat_plan_fits_its_compiled_step (its planned peak)."""
    cfg = load_config(
        "configs/tiny.yaml",
        attention_impl="chunked",
        attention_block_k=TC.seq_len // 2,
        num_experts=0,
        num_hidden_layers=1,
    )
    mesh = tm.make_mesh(TC.mesh)
    costs = planner.remat.option_costs(
        planner.remat.AttentionShape.of(
            cfg, TC.batch_size, TC.seq_len, dict(mesh.shape), TC.compute_dtype
        )
    )
    assert costs["save_all"].flops == costs["save_attn_out"].flops
    full = planner.step_cost(dataclasses.replace(cfg, attention_remat="full"), TC, mesh)
    r = planner.plan_remat(cfg, TC, mesh, full.peak + costs["save_attn_out"].bytes)
    assert r.plan.options == ("save_attn_out",) and r.fits
    scan = costs["save_attn_out"].flops - costs["save_qkv"].flops
    seen = costs["save_qkv"].flops + scan // 2  # one layer, loop body once
    assert seen <= r.flops_saved < 1.2 * seen, (r.flops_saved, seen)
    unlimited = planner.remat.plan_attention_remat(
        cfg,
        batch=TC.batch_size,
        seq=TC.seq_len,
        mesh_shape=dict(mesh.shape),
        dtype=TC.compute_dtype,
        budget=10**12,
    )
    assert unlimited.options == ("save_attn_out",)


def test_moe_remat_plan_fits_its_compiled_step():
    """With moe_remat, `full` is one checkpoint around the whole layer, and any other option
    keeps the MLP block's input too: the solver counts it (it did not, and planned over its
    budget). Compiled on XLA:CPU (chunked attention, no [S, S] scores): a budget that the
    attention's bytes alone would fit but the plan does not gets all `full`; one that fits the
    whole cost gets the plan, whose compiled peak is the full peak plus what the solver
    counted (within 1%). The ring's grouped matmuls are lax.ragged_dot: with moe_remat the
    block keeps nothing of them (its input only), and its two steps compile in a third less
    time than with the blocked XLA one (CPU's "auto"); both grew by exactly the counted bytes."""
    cfg = load_config(
        "configs/tiny.yaml",
        moe_remat=True,
        attention_impl="chunked",
        attention_block_k=128,
        gmm_impl="ragged_dot",
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


@pytest.fixture(scope="module")
def target_two_hosts():
    """The planner's output for `--target h100 --hosts 2 mesh=node=2,expert=8` (16 experts, one
    layer, batch 16 x seq 32, ring, `--usable 0.5`), run once: the fully recomputed and the
    planned step compiled by XLA:GPU for 2 abstract hosts of 8 H100s. The next two tests read
    it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = planner.main(
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
                "--usable",
                "0.5",
                "mesh=node=2,expert=8",
                "num_experts=16",
                "num_hidden_layers=1",
            ]
        )
    assert status == 0
    return out.getvalue()


def _ring_line(out):
    """The plan table's ring row (the first; the prediction table's comes after it)."""
    return next(line for line in out.splitlines() if line.startswith("| ring |"))


def _ring_row(out):
    return [c.strip() for c in _ring_line(out).strip("|").split("|")]


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra")
def test_target_plans_on_the_gpu_compiler(target_two_hosts):
    """--target h100: the steps are compiled by XLA:GPU for abstract H100s (mesh over 16 of
    them, memory the H100's), the planned step fits, and the missing cost_analysis is said, not
    faked. Read from `target_two_hosts`' run, which also covers what this test's own run (8
    H100s of one host, mesh expert=8, two layers, seq 128) did: the --target path (abstract GPU
    mesh, the H100's memory at --usable, --host-memory's default, no cost_analysis, the
    formula's FLOPs, the planned step compiled and fitting) is the same for one host and two;
    the flat ring over one host is compiled by XLA:GPU in tests/test_gpu_compile.py."""
    out = target_two_hosts
    assert "XLA:GPU buffer assignment for 16 abstract NVIDIA H100 80GB HBM3" in out
    assert f"usable memory {0.5 * gpu_mesh.device_memory('h100') / 2**20:,.1f} MiB" in out
    assert (
        f"{0.5 * 2**38 / 2**20:,.1f} MiB of host memory per device (0.5 x 256 GiB: an 8-GPU H100 "
        "node's 2 TiB of RAM per GPU, --host-memory's default)"
    ) in out
    cells = _ring_row(out)
    assert cells[6] == "1x save_all"  # a plan other than `full`: the planned step compiled
    assert cells[8] == "yes" and cells[9] == "n/a" and float(cells[10]) > 0
    mib = lambda c: float(c.replace(",", ""))
    assert 0 < mib(cells[2]) < mib(cells[1]) < mib(cells[7]) + 1e3  # state < peak
    assert cells[3] == cells[4] == "0.0"  # nothing offloaded: no host bytes
    # the predicted step time of that plan (`predict`; its formula: tests/test_predict.py)
    cfg = load_config("configs/tiny.yaml", num_experts=16, num_hidden_layers=1, dispatcher="ring")
    tc = TrainConfig(batch_size=16, seq_len=32)
    params = train_step.abstract_state(cfg, tc, tm.make_mesh("expert=8"))[1].params
    mesh, kind = {"node": 2, "expert": 8}, gpu_mesh.device_kind("h100")
    want = predict.predict(cfg, tc, mesh, ("save_all",), params, kind, predict.Rates.load())
    row = next(ln for ln in out.splitlines() if ln.startswith("| ring |") and ln != _ring_line(out))
    got = [c.strip() for c in row.strip("|").split("|")]
    num = lambda c: float(c.replace(",", ""))
    assert got[1] == f"{want.tokens:,}" and num(got[4]) == pytest.approx(want.seconds, rel=1e-3)
    assert num(got[5]) == pytest.approx(want.attention_seconds, rel=1e-3)
    assert got[7] == f"{want.mfu:.1%}" and "attention backward: 346.3 TFLOP/s, assumed" in out


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
def test_target_two_hosts_node_mesh_runs_the_hierarchical_ring(target_two_hosts):
    """--hosts 2 mesh=node=2,expert=8: the step compiles for 2 abstract hosts of 8 H100s with the
    experts over ("node", "expert"), and ring="auto" picks the hierarchical ring (node across
    the hosts, expert within each), said in the header (`target_two_hosts`' run)."""
    out = target_two_hosts
    assert "mesh {'node': 2, 'expert': 8}" in out
    assert "XLA:GPU buffer assignment for 16 abstract NVIDIA H100 80GB HBM3" in out
    assert (
        "expert parallelism: ring: hierarchical (ring=auto): inner ring over 'expert' "
        "(8 devices, within a host), outer over 'node' (2, across hosts)"
    ) in out
    assert _ring_row(out)[8] == "yes"


# --------------------------------------------------------------------------- sizes the model takes


def _fake_step_cost(calls, over=0.0, host_per_token=0):
    """A stand-in for `planner.step_cost` that compiles nothing: 1 MiB per 1,024 tokens when
    fully recomputed, plus (1 + over) x the bytes the solver counts for the plan's options, and
    `host_per_token` host bytes per token (offloaded)."""

    def step_cost(cfg, tc, mesh, memo=True):
        calls.append((tc.batch_size, tc.seq_len, cfg.attention_remat))
        options = cfg.attention_remat
        options = (options,) * cfg.num_hidden_layers if isinstance(options, str) else options
        costs = planner.remat.layer_costs(
            cfg, tc.batch_size, tc.seq_len, dict(mesh.shape), tc.compute_dtype
        )
        kept = sum(costs[i][o].bytes for i, o in enumerate(options) if o != "full")
        tokens = tc.batch_size * tc.seq_len
        peak = tokens * 2**10 + int((1 + over) * kept)
        return planner.StepCost(peak, 0.0, host=tokens * host_per_token)

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


def test_run_only_trainer_keys_are_refused_before_compiling(monkeypatch):
    """Trainer keys the compiled step never reads (`settings.RUN_ONLY_FIELDS`) cannot change its
    memory: refused in one line naming them, in the command line's order, before compiling."""
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    extra = ["seed=3", "lr=1e-4", "save_every=5", "eval_batches=2"]
    with pytest.raises(ValueError) as e:
        planner.main([*PLAN, "--seq", "128", *extra])
    said = "seed, save_every, eval_batches: trainer settings that do not change a step's memory"
    assert str(e.value).startswith(said) and calls == [], str(e.value)
    assert "\n" not in str(e.value) and str(e.value).endswith("drop them")
    with pytest.raises(ValueError, match=r"^synthetic: .*: drop it$"):
        planner_args.refuse_run_only({"synthetic": True, "mesh": "expert=8"})
    planner_args.refuse_run_only({"lr": 0.1, "grad_accum": 2, "mesh": "expert=8"})  # compiled in


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


# --------------------------------------------------------------------------- host memory


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra")
def test_host_bytes_of_a_deviceless_gpu_compile():
    """An argument in pinned host memory, moved to the device, updated and put back (donated):
    XLA:GPU's buffer assignment counts it apart from the device's (host arguments and outputs,
    aliased), so the host footprint holds it once and the device only the moved copy; the train
    state columns read the device and the host arguments. A step that offloads nothing has no
    host bytes. (On abstract GPUs a pinned_host sharding given from outside is dropped, memory
    kind None: the argument is in host memory because it is donated to a host output.)"""
    mesh = gpu_mesh.mesh((8,), ("expert",), target="h100")
    sharding = NamedSharding(mesh, P("expert")).with_memory_kind("pinned_host")
    x = jax.ShapeDtypeStruct((8 * 1024, 256), jnp.float32, sharding=sharding)  # 1 MiB a device

    def offloaded(a):
        on_device = jax.device_put(a, jax.memory.Space.Device)
        return jax.device_put(on_device * 2, jax.memory.Space.Host)

    with jax.set_mesh(mesh):
        off = jax.jit(offloaded, donate_argnums=0).trace(x).lower().compile()
        plain = jax.jit(lambda a: a * 2, donate_argnums=0).trace(x).lower().compile()
    m = off.memory_analysis()
    assert m.host_argument_size_in_bytes == m.host_output_size_in_bytes == 2**20
    assert memory.host_footprint(m) == 2**20  # argument + output - the alias
    cost = planner.StepCost.of(off)
    assert (cost.state, cost.host_state, cost.host) == (0, 2**20, 2**20)
    assert cost.peak == memory.footprint(m) >= 2**20  # the copy on the device
    cost = planner.StepCost.of(plain)
    assert (cost.state, cost.host_state, cost.host, cost.peak) == (2**20, 0, 0, 2**20)


def test_a_step_over_host_memory_does_not_fit_and_the_table_says_so(monkeypatch):
    """A fully recomputed step that fits the device but not the host memory: `DoesNotFit` saying
    "host memory" (not the device's message), a row that says NO (host memory); with room for
    both it plans, and the table shows its host bytes beside the device's. A planned step whose
    host bytes are over is NO (host memory) too."""
    cfg, mesh = load_config("configs/tiny.yaml"), tm.make_mesh(TC.mesh)
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost([], host_per_token=2**9))
    full = TC.batch_size * TC.seq_len * 2**10  # 2 MiB device, 1 MiB host
    with pytest.raises(planner.DoesNotFit) as e:
        planner.plan_remat(cfg, TC, mesh, 2 * full, host_capacity=full // 4)
    assert e.value.over == "host memory" and e.value.cost.host == full // 2
    assert str(e.value).startswith(
        "the train step needs 1.0 MiB of host memory per device with full attention "
        "recomputation, more than the 0.5 MiB of host memory available (--host-memory)"
    ), str(e.value)
    with pytest.raises(planner.DoesNotFit) as both:
        planner.plan_remat(cfg, TC, mesh, full - 1, host_capacity=full // 2 - 1)
    assert both.value.over == "device and host memory"
    r = planner.plan_remat(cfg, TC, mesh, 2 * full, host_capacity=full // 2)
    assert r.fits and r.over == "" and r.full.host == r.planned.host == full // 2
    tight = dataclasses.replace(r, host_capacity=full // 2 - 1)
    misfit = planner_report.Misfit("alltoall (dropless)", e.value.cost, e.value.over)
    device = planner_report.Misfit("alltoall (capacity 1.0)", e.value.cost, "device memory")
    lines = planner_report.table([r, tight, misfit, device]).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[1:5] == [
        "full-recompute peak MiB",
        "of which train state",
        "host MiB",
        "of which host state",
    ]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[8] for row in rows] == ["yes", "NO (host memory)", "NO (host memory)", "NO"]
    assert rows[0][1:4] == ["2.0", "", "1.0"] and rows[2][1:4] == ["2.0", "", "1.0"]
    assert rows[2][5:8] == ["", "", ""]  # no plan for a step that does not fit


def test_offloaded_layer_inputs_plan_every_layer_full(monkeypatch):
    """offload_layer_inputs needs every layer `full` (the config refuses anything else): the
    plan is all `full` whatever the budget, not a plan the config would refuse."""
    cfg = load_config(
        "configs/tiny.yaml", offload_layer_inputs=True, moe_remat=True, attention_remat="full"
    )
    mesh = tm.make_mesh(TC.mesh)
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost([]))
    r = planner.plan_remat(cfg, TC, mesh, 2**40, host_capacity=2**40)
    assert r.plan.options == ("full", "full") and r.fits and r.planned == r.full


def test_max_seq_finds_the_longest_sequence_within_host_memory(monkeypatch, capsys):
    """The offload settings reach the compiled step (trainer and model keys, as the trainer takes
    them), and --max-seq at --batch 1 finds the longest sequence whose host bytes fit
    --host-memory as well as its device bytes (1 KiB a token of each, 1 GiB of device memory,
    2 MiB of host: 2,048); with less host memory than --seq needs, the row, the search and the
    error line say it is the host memory, and the exit status is 1. Without --target a note says
    that XLA:CPU's real figures hold no host bytes (what the offloads move counts as device
    memory there: the probe's `offload_optimizer=true --host-memory 1KiB` read "fits yes" with
    host 0.0 MiB and nothing said)."""
    seen, base = [], _fake_step_cost([], host_per_token=2**10)

    def step_cost(cfg, tc, mesh, memo=True):
        seen.append((cfg.offload_layer_inputs, tc.offload_optimizer))
        return base(cfg, tc, mesh, memo)

    monkeypatch.setattr(planner, "step_cost", step_cost)
    argv = (
        "--config configs/tiny.yaml --memory 1GiB --usable 1 --batch 1 --seq 128 --max-seq 8192 "
        "--dispatchers ring max_position_embeddings=8192 offload_optimizer=true "
        "offload_layer_inputs=true moe_remat=true attention_remat=full scan_layers=true"
    ).split()
    assert planner.main([*argv, "--host-memory", "2MiB"]) == 0
    out = capsys.readouterr().out
    assert set(seen) == {(True, True)}
    assert (
        "usable memory 1,024.0 MiB per device (1 x 1GiB), 2.0 MiB of host memory per device "
        "(1 x 2MiB)" in out
    )
    assert "  size 4096: 4.0 MiB, host 4.0 MiB does not fit (host memory)" in out
    assert "| ring | 2,048 | 2.0 | 2.0 | 10 | 2x full |" in out
    assert "- host memory: XLA's GPU client takes pinned host memory from one pool" in out
    assert f"- {planner_report.CPU_OFFLOAD_NOTE}" in out  # no --target: XLA:CPU's figures
    assert planner.main([*argv, "--host-memory", "64KiB"]) == 1
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if line.startswith("| ring | 0.1 |"))
    assert row.split("|")[9].strip() == "NO (host memory)"
    assert "| ring | none fits (host memory) | 0.1 | 0.1 | 1 |  |" in out
    assert err == (
        "error: nothing fits in 1,024.0 MiB per device (1 x 1GiB) at batch 1 x seq 128 nor at "
        "any size searched, with 0.1 MiB of host memory per device (1 x 64KiB)\n"
    ), err


def test_host_memory_default_and_usable_share():
    """--host-memory defaults to the per-GPU share of the target's 8-GPU node RAM (2 TiB / 8),
    the H100 node's without --target, said where it comes from; a size or a node name is taken
    as given; --usable applies to it as to --memory."""
    parse = lambda *extra: planner_args.parse(
        ["--config", "c.yaml", "--batch", "8", "--seq", "128", *extra], "planner"
    )
    a = parse("--memory", "1GiB")
    assert a.host_capacity == int(0.9 * 2**38)
    assert a.host_from == (
        "256 GiB: an 8-GPU H100 node's 2 TiB of RAM per GPU, --host-memory's default without "
        "--target"
    )
    a = parse("--target", "h200", "--usable", "1")
    assert a.host_capacity == 2**38 and a.host_from.endswith(
        "H200 node's 2 TiB of RAM per GPU, --host-memory's default"
    )
    a = parse("--memory", "1GiB", "--host-memory", "100GiB", "--usable", "0.5")
    assert (a.host_capacity, a.host_from, a.capacity) == (50 * 2**30, "100GiB", 2**29)
    assert parse("--memory", "1GiB", "--host-memory", "h200").host_capacity == int(0.9 * 2**38)
    helped = planner_args.build_parser("planner").format_help()
    assert "2 TiB / 8 = 256 GiB" in " ".join(helped.split())


@pytest.mark.parametrize("text", ["12 parsecs", "-5GB", "0", "1e", "A100", "1e999"])
def test_bad_host_memory_is_refused_in_one_line_before_compiling(monkeypatch, text):
    calls = []
    monkeypatch.setattr(planner, "step_cost", _fake_step_cost(calls))
    with pytest.raises(ValueError, match=rf"^--host-memory {text!r}: (expected|must)") as e:
        planner.main([*PLAN, "--seq", "128", f"--host-memory={text}"])
    assert "\n" not in str(e.value) and calls == []
