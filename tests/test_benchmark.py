"""The benchmark script runs end to end (tiny shape) and its ring-traffic columns are consistent."""

import pytest

from scripts import load_script


@pytest.fixture(scope="module")
def table():
    return load_script("benchmarks/moe_layer.py", "moe_layer_bench")


def test_tiny_table_with_time(table, capsys):
    """Both ring modes (routing="auto" picks one: the "x auto" columns) and one all-to-all, each
    compiled for the memory columns and run for the time. Also covers what the [a2a-dropless] row
    did: the script's all-to-all rows are one code path (no ring columns) whatever the variant's
    capacity, and every variant's memory is tests/test_memory.py's."""
    variants = ["ring-expert", "ring-token", "a2a-cap1.0"]
    argv = ["-E", "16", "-k", "2", "-H", "32", "-F", "32", "-T", "64", "--time", "--runs", "1"]
    table.main([*argv, "--variants", *variants])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# reproduce: python ") and "-E 16" in out[0]
    head = next(line for line in out if line.startswith("| E |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    rows = {
        r["variant"]: r
        for r in (
            dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
            for line in out
            if line.startswith("| 16 |")
        )
    }
    assert set(rows) == set(variants)
    assert rows["a2a-cap1.0"]["hop fwd KiB"] == rows["a2a-cap1.0"]["Table 2 fwd"] == ""
    # float32: what the expert ring sends forward is exactly Table 2's E/EP * W.
    assert rows["ring-expert"]["hop fwd KiB"] == rows["ring-expert"]["Table 2 fwd"]
    expert_kib = 16 // 8 * 3 * 32 * 32 * 4 / 1024
    assert float(rows["ring-expert"]["Table 2 fwd"]) == expert_kib
    auto = next(line for line in out if line.startswith("- E16 k2") and "auto picks" in line)
    picked = "ring-token" if "'token'" in auto else "ring-expert"
    assert rows[picked]["x auto"] == "1.00" and rows[picked]["time x auto"] == "1.00"
    assert all(float(r["fwd+bwd ms"].replace(",", "")) > 0 for r in rows.values())


@pytest.fixture(scope="module")
def capacity():
    return load_script("benchmarks/capacity.py", "capacity_bench")


def test_capacity_table_reads_the_search_probes(capacity):
    """Largest size, the first probe above the capacity and ring / it, from search records
    (MiB peaks, capacity 250 MiB); a ring search that stopped at its limit reads ">=" ."""
    mib, search = capacity.MIB, capacity.planner.search.Search
    probes = lambda *pairs: [(s, p * mib) for s, p in pairs]
    found = {
        "ring": (
            4096,
            search(
                256,
                8192,
                probes((256, 10), (512, 20), (1024, 40), (2048, 80), (4096, 160), (8192, 320)),
            ),
        ),
        "alltoall dropless": (None, search(256, 8192, probes((256, 500)))),
        "alltoall cap1.0": (
            1024,
            search(256, 8192, probes((256, 50), (512, 100), (1024, 200), (2048, 400), (1536, 300))),
        ),
    }
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in capacity.capacity_table(found, 250 * mib).splitlines()[2:]
    ]
    assert rows == [
        ["ring", "4,096", "160.0", "8,192", "320.0", "1.00x"],
        ["alltoall dropless", "none fits", "", "256", "500.0", ""],
        ["alltoall cap1.0", "1,024", "200.0", "1,536", "300.0", "4.00x"],
    ]
    found["ring"] = (8192, search(256, 8192, probes((8192, 100))))
    table = capacity.capacity_table(found, 250 * mib)
    assert "| ring | 8,192 (the limit) |" in table and "| >= 8.00x |" in table


@pytest.mark.parametrize("bad", ["1280", "1280:0", "a:8", "1280:8:2"])
def test_capacity_bad_throughput_sizes(capacity, bad):
    with pytest.raises(SystemExit, match="--throughput"):
        capacity.main(["--throughput", bad])


def test_target_defaults_to_the_full_size_gpu_shapes(table):
    args = table.parse_args(["--target", "h100"])
    assert args.compile_only and args.dtype == ["bfloat16"]
    got = [
        (s.experts, s.top_k, s.hidden, s.ffn, s.tokens_per_device, s.dtype)
        for s in table.shapes(args)
    ]
    assert got == [(*c, "bfloat16") for c in table.GPU_PRESET]
    # shape flags given: the user's shape, not the preset
    args = table.parse_args(["--target", "h200", "-E", "16", "-T", "64"])
    assert [(s.experts, s.tokens_per_device) for s in table.shapes(args)] == [(16, 64)]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--paper", "-E", "16"], "--paper sets the shapes, so --experts would be ignored"),
        (["--modes", "-k", "2", "-T", "64"], "--modes sets the shapes, so --top-k, --tokens-per"),
        (["--paper", "--dtype", "float32"], "--paper measures float32 and bfloat16, so --dtype"),
    ],
)
def test_presets_refuse_the_flags_they_would_ignore(table, argv, match, capsys):
    """--paper and --modes used to override shape flags (and --paper --dtype) silently."""
    with pytest.raises(SystemExit):
        table.parse_args(argv)
    assert match in capsys.readouterr().err
    table.parse_args(["--modes", "--dtype", "float32"])  # --modes runs each given dtype


def test_target_refuses_timing(table):
    with pytest.raises(SystemExit):
        table.parse_args(["--target", "h100", "--time"])


def test_capacity_probes_listed_lengths(capacity, monkeypatch):
    """--seqs: fully recomputed steps at the listed lengths that `largest_listed` picks (the
    smallest, the largest, then the interpolated boundary); the longest that fits is reported per
    dispatcher and compared with the ring's (peaks faked: linear in the sequence)."""
    per_token = {"ring": 1, "alltoall dropless": 9, "alltoall cap1.0": 3}
    seen = []

    def fake_cost(cfg, tc, mesh, memo=True):
        opts = cfg.moe.options
        seen.append(
            (opts.dispatcher, opts.capacity_factor, tc.seq_len, cfg.max_position_embeddings)
        )
        name = (
            "ring"
            if opts.dispatcher == "ring"
            else "alltoall cap1.0"
            if opts.capacity_factor
            else "alltoall dropless"
        )
        return capacity.planner.StepCost(per_token[name] * tc.seq_len * capacity.MIB, None)

    monkeypatch.setattr(capacity.planner, "step_cost", fake_cost)
    cfgs = {
        n: capacity.load_config("configs/tiny.yaml", expert_size=8, **capacity.FULL_SIZE, **over)
        for n, over in capacity.VARIANTS.items()
    }
    tc = capacity.TrainConfig(batch_size=8, seq_len=64)
    found = capacity.probe(cfgs, tc, None, 200_000 * capacity.MIB, [65536, 153600, 40960])
    assert {s[3] for s in seen} == {153600}  # positions cover the longest
    assert [s[2] for s in seen] == [40960, 153600, 40960, 40960, 153600, 65536]
    assert {n: s for n, (s, _) in found.items()} == {
        "ring": 153600,
        "alltoall dropless": None,
        "alltoall cap1.0": 65536,
    }
    table = capacity.capacity_table(found, 200_000 * capacity.MIB)
    assert "| ring | 153,600 (the limit) |" in table and "| >= 2.34x |" in table
    assert "| alltoall dropless | none fits |" in table


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--seqs", "40960,x"], "--seqs"),
        (["--seqs", "0"], "--seqs"),
        (["--hosts", "2"], "--hosts"),
    ],
)
def test_capacity_bad_target_arguments(capacity, argv, match):
    with pytest.raises(SystemExit, match=match):
        capacity.main(argv)


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_layer_inputs"])
def test_capacity_refuses_the_offload_settings_it_cannot_check(capacity, key):
    """Their bytes are in host memory; this experiment's search checks device memory only."""
    with pytest.raises(ValueError, match=rf"{key}=true: .*device memory only.*train.planner"):
        capacity.main(["--parts", "capacity", "--max-seq", "64", f"{key}=true"])
