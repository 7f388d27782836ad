"""The cost model's logic on small synthetic numbers (relaymoe_jax/analysis/costmodel/), its FLOPs
stand-in against plain arithmetic, and benchmarks/cost_model.py end to end on a synthetic
scaling JSON (no XLA:GPU compile)."""

import json
import math

import pytest

from relaymoe_jax.analysis import costmodel as cm
from scripts import load_script

LINKS = cm.Links(nvlink=400.0, nic=50.0)  # bytes/s, round numbers: NVLink 8x the NIC
FLAT = [cm.Level(8, 1.0, 0.0)]  # one host
FLAT2 = [cm.Level(16, 1.0, 1.0)]  # 2 hosts: the boundary GPU sends across


def test_hop_overlap_is_max_of_compute_and_transfer():
    assert cm.relay_time(3.0, [1.0, 5.0, 0.0]) == 3.0 + 5.0 + 3.0
    assert cm.relay_time(2.0, [1.0], tail=4.0) == 6.0
    # one link class: the slowest class of the busiest GPU
    assert cm.transfer_time(100.0, cm.Level(4, 1.0, 0.0), LINKS) == 100.0 / 400.0
    assert cm.transfer_time(100.0, cm.Level(4, 1.0, 1.0), LINKS) == 100.0 / 50.0
    assert cm.transfer_time(100.0, cm.Level(4, 0.5, 0.0), LINKS) == 50.0 / 400.0


def test_relay_schedule_matches_ring_py():
    # forward: the payload moves n-1 times, nothing trails it
    assert cm.relay_sends(4, 10.0) == ([10.0, 10.0, 10.0, 0.0], 0.0)
    # backward: payload, then payload + accumulator, then accumulator, then its return
    assert cm.relay_sends(4, 10.0, 20.0) == ([10.0, 30.0, 30.0, 20.0], 20.0)
    assert cm.relay_sends(4, 10.0, 20.0, tail=10.0)[1] == 10.0
    assert cm.relay_sends(2, 10.0, 20.0) == ([10.0, 0.0], 20.0)  # a ring of two: no trailing
    assert cm.relay_sends(1, 10.0, 20.0) == ([0.0], 0.0)
    sends, tail = cm.relay_sends(16, 3.0, 7.0)
    assert sum(sends) + tail == 15 * 3.0 + 16 * 7.0  # (n-1) payloads, n accumulators


def test_compute_bound_pass_costs_its_compute_plus_tail():
    c, p, a = 1.0, 100.0, 200.0  # NVLink: 0.25 s / 0.75 s per hop < 1 s
    assert cm.pass_time(FLAT, c, p, 0.0, LINKS) == 8 * c
    assert cm.pass_time(FLAT, c, p, a, LINKS) == 8 * c + a / 400.0
    r = cm.ring_layer_time(FLAT, c, 2 * c, p, a, LINKS, tail=p)
    assert r["total"] == pytest.approx(8 * c + 8 * 2 * c + p / 400.0)


def test_network_bound_pass_costs_its_transfers():
    c, p, a = 1.0, 100.0, 200.0  # NIC: 2 s per payload > 1 s of compute
    fwd = cm.pass_time(FLAT2, c, p, 0.0, LINKS)
    assert fwd == 15 * p / 50.0 + c  # 15 transfers, the last hop only computes
    bwd = cm.pass_time(FLAT2, c, p, a, LINKS)
    assert bwd == pytest.approx((p + 14 * (p + a) + a + a) / 50.0)
    # the same bytes one host over NVLink: compute-bound
    assert cm.pass_time([cm.Level(16, 1.0, 0.0)], c, p, 0.0, LINKS) == 16 * c
    assert cm.bound(c, p / 50.0) and not cm.bound(c, p / 400.0)


def test_hierarchical_round_hides_the_nic_behind_its_hops():
    # 2 hosts x 8: a round is 8 hops; its one NIC transfer (2 s) hides behind 8 s of compute
    c, p = 1.0, 100.0
    hier = cm.hier_levels(2, 8)
    assert hier == [cm.Level(2, 0.0, 1.0), cm.Level(8, 1.0, 0.0)]
    assert cm.pass_time(hier, c, p, 0.0, LINKS) == 16 * c
    assert cm.pass_time(FLAT2, c, p, 0.0, LINKS) == 15 * 2.0 + c  # the flat ring waits
    # a round shorter than the NIC transfer waits for it: max(L * max(c, t_intra), t_inter)
    c = 0.1  # NVLink 0.25 s > 0.1 s: NVLink-bound hops
    round_ = 7 * max(c, p / 400.0) + c
    assert cm.pass_time(hier, c, p, 0.0, LINKS) == pytest.approx(max(round_, p / 50.0) + round_)
    assert cm.hier_levels(1, 8) == [cm.Level(8, 1.0, 0.0)]


def _compute_bound_from(levels, p, flops_per_token, rate, links=LINKS, lo=1.0, hi=1e9):
    """Smallest T (bisection) at which the forward pass costs exactly its compute: the model's
    own answer, not the threshold formula."""
    n = math.prod(lv.n for lv in levels)
    ok = lambda t: (
        cm.pass_time(levels, flops_per_token * t / rate, p, 0.0, links)
        <= n * flops_per_token * t / rate * (1 + 1e-12)
    )
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def test_hierarchical_ring_moves_the_line_by_about_L():
    p, fpt, rate = 100.0, 1e3, 1e6  # payload bytes, FLOPs per token per hop, FLOP/s
    flat = _compute_bound_from(FLAT2, p, fpt, rate)
    hier = _compute_bound_from(cm.hier_levels(2, 8), p, fpt, rate)
    nic_line = cm.threshold_tokens(p / LINKS.nic, fpt, rate)
    assert flat == pytest.approx(nic_line, rel=1e-6)
    # L = 8 fewer tokens: the round's 8 hops of compute cover one NIC transfer ...
    assert flat / hier == pytest.approx(8.0, rel=1e-6)
    # ... unless the NVLink line is higher (NVLink < L x the NIC): then it is the floor
    slow = cm.Links(nvlink=4 * LINKS.nic, nic=LINKS.nic)
    floor = _compute_bound_from([cm.Level(8, 1.0, 0.0)], p, fpt, rate, slow)
    hier_slow = _compute_bound_from(cm.hier_levels(2, 8), p, fpt, rate, slow)
    assert floor == pytest.approx(nic_line / 4, rel=1e-6)
    assert hier_slow == pytest.approx(floor, rel=1e-6) and flat / hier_slow < 8


def test_alltoall_does_not_overlap():
    r = cm.alltoall_time(4e9, intra_bytes=800.0, inter_bytes=100.0, flops_per_s=1e9, links=LINKS)
    assert r["compute"] == 4.0 and r["comm"] == max(800.0 / 400.0, 100.0 / 50.0)
    assert r["total"] == 6.0
    assert cm.threshold_tokens(2.0, 10.0, 100.0) == 20.0


def synthetic_row(ep, hosts, p, a, tail, variant="ring-expert", tokens=1024):
    """A scaling.py JSON row whose bytes follow the schedule: flat ring, boundary GPUs (the last
    of each host) send across hosts, the others over NVLink."""
    local = ep // hosts
    sends_f, _ = cm.relay_sends(ep, p)
    sends_b, _ = cm.relay_sends(ep, p, a)
    f, b = sum(sends_f), sum(sends_b) + tail
    boundary = [hosts > 1 and i % local == local - 1 for i in range(ep)]
    row = dict(
        ep=ep,
        hosts=hosts,
        gpus_per_host=local,
        top_k=2,
        experts=16,
        hidden=64,
        ffn=32,
        tokens_per_device=tokens,
        variant=variant,
        hop_fwd=p,
        hop_bwd=p + a,
    )
    for prog, total in (("fwd", f), ("fwdbwd", f + b)):
        row[f"{prog}_permute_inter"] = [total if x else 0 for x in boundary]
        row[f"{prog}_permute_intra"] = [0 if x else total for x in boundary]
        row[f"{prog}_a2a_intra"] = row[f"{prog}_a2a_inter"] = [0] * ep
    return row


def test_bytes_are_read_from_the_compiled_row():
    row = synthetic_row(16, 2, p=1000, a=2000, tail=1000)
    b = cm.flat_ring_bytes(row)
    assert (b["payload"], b["acc"], b["tail"]) == (1000, 2000, 1000)
    assert (b["share_intra"], b["share_inter"], b["fwd_resid"]) == (1.0, 1.0, 0)
    one = cm.flat_ring_bytes(synthetic_row(8, 1, p=1000, a=2000, tail=2000))
    assert (one["share_intra"], one["share_inter"], one["tail"]) == (1.0, 0.0, 2000)


def test_hierarchical_ring_on_one_host_is_the_flat_ring():
    """One host: the hierarchical ring's one round is the flat ring, tail included (XLA sends
    the finished dW as bf16, P, not A): nothing is left over against the flat schedule."""
    row = synthetic_row(8, 1, p=1000, a=2000, tail=1000, variant="hier-expert")
    assert cm.hier_ring_check(row, 1000, 2000, 1000) == dict.fromkeys(
        ("fwd_inter", "fwd_intra", "bwd_inter", "bwd_intra"), 0.0
    )


def test_standin_flops_against_plain_arithmetic():
    e, n, h, f = 2, 64, 256, 128
    got = cm.standin_flops(e, n, h, f)
    pairs = e * n
    ref = 2 * 3 * h * f * pairs  # three matmuls of 2*H*F per pair, forward
    assert got["fwd"] == pytest.approx(ref, rel=0.02)
    assert got["fwd"] >= ref  # plus elementwise (silu, the router weight)
    assert got["bwd"] == pytest.approx(2 * ref, rel=0.02)  # six matmuls from residuals
    assert got["vjp"] == pytest.approx(3 * ref, rel=0.02)  # recomputed forward + those
    assert cm.pairs_per_expert(61440, 8, 128) == 3840
    assert cm.pairs_per_expert(100, 3, 16) == 19


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/cost_model.py", "cost_model")


def test_script_bad_arguments_exit_2(script, capsys):
    for argv in (
        ["--tflops", "0"],
        ["--nic-gbs", "-1"],
        ["--tokens", "0"],
        ["--ep", "12"],
        ["--scaling-json", "/nonexistent.json"],
        ["--measurements", "/nonexistent.json"],
    ):
        with pytest.raises(SystemExit) as e:
            script.parse_args(argv)
        assert e.value.code == 2


# ------------------------------------------------------------------ measured compute rates


def _hop(default, fwd, bwd, chunk):
    return dict(
        chunk=chunk,
        default_chunk=default,
        pairs=61440,
        experts=16,
        top_k=8,
        hidden=2048,
        ffn=768,
        fwd_ms=1.0,
        bwd_ms=2.0,
        fwd_tflops=fwd,
        bwd_tflops=bwd,
        error=None,
    )


def _kern(op, k, n, ms, tflops, config="default", groups="balanced", kernel="pallas"):
    return dict(
        shape="s",
        m=65536,
        k=k,
        n=n,
        g=16,
        groups=groups,
        kernel=kernel,
        config=config,
        op=op,
        ms=ms,
        tflops=tflops,
        err=0.001,
        error=None,
    )


def _measurements(tmp_path, hop=(), kernels=(), **header):
    doc = dict(
        command="python benchmarks/gpu.py --json x",
        device="NVIDIA H200",
        platform="gpu",
        jax="0.12.0.1",
        date="2026-12-02 10:00 UTC",
        tiny=False,
        interpret=False,
        peak_tflops=989.4,
        kernels=list(kernels),
        hop=list(hop),
        layer=[],
    )
    doc.update(header)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(doc))
    return path


# kernel rows the loader must ignore: another config, skewed groups, another shape, failed
DISTRACTORS = [
    _kern("fwd", 2048, 768, 1.0, 900.0, config="128,128,32,4,4"),
    _kern("fwd", 2048, 768, 1.0, 900.0, groups="skewed"),
    _kern("dx", 2048, 2048, 1.0, 900.0),
    _kern("dW", 2048, 768, None, None),
    _kern("fwd", 2048, 768, 1.0, 900.0, kernel="ragged_dot"),
]


def test_measured_hop_rates_are_used(tmp_path):
    path = _measurements(
        tmp_path,
        hop=[_hop(True, 400.0, 300.0, 16384), _hop(False, 123.0, 45.0, 61440)],
        kernels=[_kern("fwd", 2048, 768, 1.0, 200.0), *DISTRACTORS],
    )
    rates = cm.load_rates(path)
    assert (rates.fwd.tflops, rates.bwd.tflops) == (400.0, 300.0)  # the default-chunk row
    assert rates.fwd.origin == rates.bwd.origin == "hop"
    fwd, bwd = rates.report()
    assert fwd.startswith("forward compute: 400 TFLOP/s, measured (")
    assert bwd.startswith("backward compute: 300 TFLOP/s, measured (")
    for line in (fwd, bwd):
        assert f"{path}, NVIDIA H200, 2026-12-02 10:00 UTC" in line and "chunk 16,384" in line


def test_kernel_section_is_the_fallback(tmp_path):
    # the hop's backward failed (null): the backward comes from the kernels' dx and dW
    kernels = [
        _kern("fwd", 2048, 768, 1.0, 200.0),
        _kern("fwd", 768, 2048, 3.0, 100.0),
        _kern("dx", 2048, 768, 2.0, 150.0),
        _kern("dW", 768, 2048, 2.0, 250.0),
        *DISTRACTORS,
    ]
    rates = cm.load_rates(
        _measurements(tmp_path, hop=[_hop(True, 400.0, None, 16384)], kernels=kernels)
    )
    assert rates.fwd.origin == "hop" and rates.fwd.tflops == 400.0
    assert rates.bwd.origin == "kernels"
    # total FLOPs / total time: (150 * 2 + 250 * 2) / (2 + 2)
    assert rates.bwd.tflops == pytest.approx(200.0)
    rates = cm.load_rates(_measurements(tmp_path, kernels=kernels))
    assert rates.fwd.tflops == pytest.approx((200.0 * 1 + 100.0 * 3) / 4)  # 125
    assert "kernel section" in rates.fwd.source and rates.fwd.source.startswith("measured (")
    # kernels at other shapes only: nothing measured applies
    other = cm.load_rates(_measurements(tmp_path, kernels=kernels), hidden=4096, ffn=1024)
    assert not other.fwd.measured and not other.bwd.measured


def test_missing_file_is_assumed(tmp_path, monkeypatch):
    monkeypatch.setattr(
        cm.rates, "MEASUREMENTS", tmp_path / "absent.json"
    )  # where load_rates reads
    rates = cm.load_rates()
    assert rates.fwd == rates.bwd == cm.assumed_rate()
    assert rates.fwd.tflops == round(0.35 * 989.4, 1) and not rates.fwd.measured
    assert rates.report()[0] == (
        "forward compute: 346.3 TFLOP/s, assumed (0.350 x the H100 SXM dense bf16 peak 989.4)"
    )
    assert cm.load_rates(assumed_tflops=500.0).bwd.tflops == 500.0
    with pytest.raises(cm.MeasurementError, match=r"absent\.json: no such file"):
        cm.load_rates(tmp_path / "absent.json")  # a path given must exist


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("device"), r"missing key 'device' \(expected a string\)"),
        (lambda d: d.update(hop={"chunk": 1}), r"hop: expected a list, got \{'chunk': 1\}"),
        (
            lambda d: d["hop"][0].update(fwd_tflops="fast"),
            r"hop\[0\]\.fwd_tflops: expected a number or null, got 'fast'",
        ),
        (lambda d: d["hop"][0].pop("default_chunk"), r"missing key 'hop\[0\]\.default_chunk'"),
        (
            lambda d: d["kernels"][0].update(op="bwd"),
            r"kernels\[0\]\.op: expected 'fwd', 'dx' or 'dW', got 'bwd'",
        ),
        (lambda d: d["kernels"][0].update(k=2048.5), r"kernels\[0\]\.k: expected an integer"),
    ],
)
def test_malformed_file_names_the_key(tmp_path, change, message):
    path = _measurements(
        tmp_path,
        hop=[_hop(True, 400.0, 300.0, 16384)],
        kernels=[_kern("fwd", 2048, 768, 1.0, 200.0)],
    )
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(cm.MeasurementError, match=message):
        cm.load_rates(path)


def test_not_json_is_a_clear_error(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{not json")
    with pytest.raises(cm.MeasurementError, match=r"gpu\.json: not JSON"):
        cm.load_rates(path)
    path.write_text("[1, 2]")
    with pytest.raises(cm.MeasurementError, match="expected a JSON object at the top, got list"):
        cm.load_rates(path)


def test_measured_seconds_scale_the_work():
    pairs, h, f = 1000, 100, 10  # 12 * pairs * H * F = 1.2e7 FLOPs
    hop = cm.ComputeRates(cm.Rate(6.0, "hop", "m"), cm.Rate(12.0, "hop", "m"))
    assert hop.forward_s(1e30, pairs, h, f) == pytest.approx(1e-6)  # stand-in ignored
    assert hop.backward_s(1e30, pairs, h, f, recompute=True) == pytest.approx(1e-6)
    assert hop.backward_s(1e30, pairs, h, f, recompute=False) == pytest.approx(0.75e-6)
    kern = cm.ComputeRates(cm.Rate(6.0, "kernels", "m"), cm.Rate(12.0, "kernels", "m"))
    assert kern.backward_s(1e30, pairs, h, f, recompute=False) == pytest.approx(1e-6)
    assert kern.backward_s(1e30, pairs, h, f, recompute=True) == pytest.approx(16 / 12 * 1e-6)
    assumed = cm.ComputeRates(cm.assumed_rate(2.0), cm.assumed_rate(4.0))
    assert assumed.forward_s(6e12, pairs, h, f) == 3.0  # the stand-in's FLOPs
    assert assumed.backward_s(8e12, pairs, h, f, recompute=True) == 2.0


def _synthetic_scaling(tmp_path):
    rows = []
    for ep, hosts in ((8, 1), (16, 2)):
        p = 16 // ep * 3 * 64 * 32 * 2
        rows += [
            synthetic_row(ep, hosts, p, 2 * p, p),
            synthetic_row(ep, hosts, p, 2 * p, p, variant="hier-expert"),
        ]
        a2a = synthetic_row(ep, hosts, 0, 0, 0, variant="a2a-cap1.0")
        a2a["fwdbwd_a2a_intra"] = [4 * 1024 * 2 * 64 * (min(ep, 8) - 1) // ep] * ep
        a2a["fwdbwd_a2a_inter"] = [4 * 1024 * 2 * 64 * (ep - min(ep, 8)) // ep] * ep
        rows.append(a2a)
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_script_end_to_end_on_synthetic_rows(script, tmp_path, capsys):
    path = _synthetic_scaling(tmp_path)
    out = tmp_path / "cm.png"
    script.main(
        [
            "--scaling-json",
            str(path),
            "--ep",
            "8",
            "16",
            "-k",
            "2",
            "--scaling-tokens",
            "1024",
            "--tokens",
            "1024",
            "--out",
            str(out),
            "--measurements",
            "none",
        ]
    )
    text = capsys.readouterr().out
    assert text.startswith("# reproduce: python benchmarks/cost_model.py --scaling-json")
    assert "NOT A MEASUREMENT" in text and "nothing here ran on a GPU" in text
    assert "# forward compute: 346.3 TFLOP/s, assumed (" in text
    assert "| 16 | 2 | 1,024 |" in text and out.stat().st_size > 0
    assert "the hierarchical ring moves that line" in text


def test_fp8_relay_lines(script, tmp_path, capsys):
    """The expert_fp8 lines: the forward line scales with the e4m3 payload (P8 / P, with
    `fp8_payload`'s scales), the backward's with (P8 + A) / (P + A) (the float32 accumulator
    travels as before); with the e4m3 kernel the forward's compute halves and the backward's
    takes 11/16 of its time (the 2 recomputed matmuls and 3 dgrads, 10 of its 16 units, at twice
    the rate; the 3 wgrads, 6 units, 16-bit), each line growing by the inverse."""
    path = _synthetic_scaling(tmp_path)
    argv = ["--scaling-json", str(path), "--ep", "8", "-k", "2", "--scaling-tokens", "1024"]
    script.main([*argv, "--tokens", "1024", "--out", str(tmp_path / "cm.png")])
    text = capsys.readouterr().out
    bf16 = _row(text, "### Where the ring stops hiding its transfers (tokens per device)", "8")
    fp8 = _row(text, "### Where the ring stops hiding its transfers with expert_fp8", "8")
    fwd16, bwd16 = (_num(x) for x in bf16[2].split(" / "))
    p16 = 16 // 8 * 3 * 64 * 32 * 2  # `_synthetic_scaling`'s payload at EP 8 (H 64, F 32)
    p8 = cm.fp8_payload(p16, 64, 32)
    assert p8 == p16 // 2 + 4 * 2 * 3  # one 128 x 128 block per matrix, 2 x 3 matrices
    fwd8, bwd8 = (_num(x) for x in fp8[4].split(" / "))
    assert abs(fwd8 / fwd16 - p8 / p16) < 1e-3, (fwd8, fwd16, p8, p16)
    assert bwd8 < bwd16 and _num(fp8[5]) == max(fwd8, bwd8)
    assert cm.fp8_compute_factors() == (0.5, (10 / 2 + 6) / 16)
    e4m3 = max(fwd8 / 0.5, bwd8 / (11 / 16))
    assert abs(_num(fp8[6]) / e4m3 - 1) < 1e-3, (fp8[6], e4m3)


def _row(text, heading, first):
    """The cells of the Markdown row starting with `first` in the table after `heading`."""
    table = text.split(heading, 1)[1].split("\n\n")[2]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == first:
            return cells
    raise AssertionError(f"no row {first} under {heading!r}:\n{table}")


def _num(cell):
    return float(cell.replace(",", ""))


def test_script_uses_measured_rates(script, tmp_path, capsys):
    """The synthetic shape (E=16, k=2, H=64, F=32) at EP=8, T=1024: a hop has 2 experts x 128
    pairs = 256; measured rates 0.001 (fwd) and 0.002 (bwd) TFLOP/s give a hop
    6*256*64*32 / 1e9 + 12*256*64*32 / 2e9 s = 6.29 ms, 8 hops 50.3 ms of ring compute."""
    gpu_json = _measurements(tmp_path, hop=[dict(_hop(True, 0.001, 0.002, 256), hidden=64, ffn=32)])
    argv = [
        "--scaling-json",
        str(_synthetic_scaling(tmp_path)),
        "--ep",
        "8",
        "-k",
        "2",
        "--scaling-tokens",
        "1024",
        "--tokens",
        "1024",
        "--out",
        str(tmp_path / "cm.png"),
        "--measurements",
        str(gpu_json),
    ]
    script.main(argv)
    text = capsys.readouterr().out
    assert "its compute rates were measured on one GPU" in text
    assert "# forward compute: 0.001 TFLOP/s, measured (" in text
    assert "# backward compute: 0.002 TFLOP/s, measured (" in text
    ring_ms = 8 * (6 * 256 * 64 * 32 / 1e9 + 12 * 256 * 64 * 32 / 2e9) * 1e3
    assert f"| 8 | 1 | 1,024 | {ring_ms:,.1f} |" in text
    # malformed: the script exits naming the key
    doc = json.loads(gpu_json.read_text())
    doc["hop"][0]["bwd_tflops"] = "slow"
    gpu_json.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=r"--measurements: .*hop\[0\]\.bwd_tflops: expected"):
        script.main(argv)


def _attn(tokens, impl, fwd, bwd, documents=None):
    """An attention row as benchmarks/gpu.py --json writes it (`AttnTiming`)."""
    return dict(
        tokens=tokens,
        documents=documents,
        impl=impl,
        heads=32,
        kv_heads=4,
        head_dim=128,
        fwd_flops=1.0,
        fwd_ms=1.0,
        bwd_ms=1.0,
        fwd_tflops=fwd,
        bwd_tflops=bwd,
        err=None,
        error=None,
    )


def test_attention_rates_are_our_kernels_longest_causal_row(tmp_path):
    """The longest plain-causal row of our kernel with both figures; documents, the chunked path
    and a row whose backward failed are not it; no such row, or no attention section: assumed."""
    rows = [
        _attn(8192, "pallas", 300.0, 200.0),
        _attn(32768, "pallas", 420.0, 310.0),
        _attn(131072, "pallas", 500.0, None),  # its backward failed
        _attn(131072, "pallas", 900.0, 900.0, documents=4096),
        _attn(131072, "chunked", 100.0, 90.0),
    ]
    fwd, bwd = cm.load_attention_rates(_measurements(tmp_path, attention=rows))
    assert (fwd.tflops, bwd.tflops) == (420.0, 310.0) and fwd.origin == bwd.origin == "attention"
    assert "causal, 32,768 tokens" in fwd.source and fwd.source.startswith("measured (")
    for doc in (dict(attention=rows[2:]), {}):
        fwd, bwd = cm.load_attention_rates(_measurements(tmp_path, **doc), assumed_tflops=123.0)
        assert fwd == bwd == cm.assumed_rate(123.0)
    with pytest.raises(cm.MeasurementError, match=r"attention\[0\]\.tokens"):
        cm.load_attention_rates(_measurements(tmp_path, attention=[dict(rows[0], tokens="x")]))
