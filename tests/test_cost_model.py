"""The cost model's logic on small synthetic numbers (relaymoe_jax/costmodel.py), its FLOPs
stand-in against plain arithmetic, and benchmarks/cost_model.py end to end on a synthetic
scaling JSON (no XLA:GPU compile)."""

import json
import math

import pytest

from relaymoe_jax import costmodel as cm
from scripts import load_script

LINKS = cm.Links(nvlink=400.0, nic=50.0)     # bytes/s, round numbers: NVLink 8x the NIC
FLAT = [cm.Level(8, 1.0, 0.0)]                # one host
FLAT2 = [cm.Level(16, 1.0, 1.0)]              # 2 hosts: the boundary GPU sends across


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
    assert cm.relay_sends(2, 10.0, 20.0) == ([10.0, 0.0], 20.0)   # a ring of two: no trailing
    assert cm.relay_sends(1, 10.0, 20.0) == ([0.0], 0.0)
    sends, tail = cm.relay_sends(16, 3.0, 7.0)
    assert sum(sends) + tail == 15 * 3.0 + 16 * 7.0      # (n-1) payloads, n accumulators


def test_compute_bound_pass_costs_its_compute_plus_tail():
    c, p, a = 1.0, 100.0, 200.0                # NVLink: 0.25 s / 0.75 s per hop < 1 s
    assert cm.pass_time(FLAT, c, p, 0.0, LINKS) == 8 * c
    assert cm.pass_time(FLAT, c, p, a, LINKS) == 8 * c + a / 400.0
    r = cm.ring_layer_time(FLAT, c, 2 * c, p, a, LINKS, tail=p)
    assert r["total"] == pytest.approx(8 * c + 8 * 2 * c + p / 400.0)


def test_network_bound_pass_costs_its_transfers():
    c, p, a = 1.0, 100.0, 200.0                # NIC: 2 s per payload > 1 s of compute
    fwd = cm.pass_time(FLAT2, c, p, 0.0, LINKS)
    assert fwd == 15 * p / 50.0 + c            # 15 transfers, the last hop only computes
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
    assert cm.pass_time(FLAT2, c, p, 0.0, LINKS) == 15 * 2.0 + c    # the flat ring waits
    # a round shorter than the NIC transfer waits for it: max(L * max(c, t_intra), t_inter)
    c = 0.1                                      # NVLink 0.25 s > 0.1 s: NVLink-bound hops
    round_ = 7 * max(c, p / 400.0) + c
    assert cm.pass_time(hier, c, p, 0.0, LINKS) == pytest.approx(max(round_, p / 50.0) + round_)
    assert cm.hier_levels(1, 8) == [cm.Level(8, 1.0, 0.0)]


def _compute_bound_from(levels, p, flops_per_token, rate, links=LINKS, lo=1.0, hi=1e9):
    """Smallest T (bisection) at which the forward pass costs exactly its compute: the model's
    own answer, not the threshold formula."""
    n = math.prod(lv.n for lv in levels)
    ok = lambda t: cm.pass_time(levels, flops_per_token * t / rate, p, 0.0, links) <= \
        n * flops_per_token * t / rate * (1 + 1e-12)
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def test_hierarchical_ring_moves_the_line_by_about_L():
    p, fpt, rate = 100.0, 1e3, 1e6               # payload bytes, FLOPs per token per hop, FLOP/s
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
    r = cm.alltoall_time(4e9, intra_bytes=800.0, inter_bytes=100.0, flops_per_s=1e9,
                         links=LINKS)
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
    row = dict(ep=ep, hosts=hosts, gpus_per_host=local, top_k=2, experts=16, hidden=64, ffn=32,
               tokens_per_device=tokens, variant=variant, hop_fwd=p, hop_bwd=p + a)
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
        ("fwd_inter", "fwd_intra", "bwd_inter", "bwd_intra"), 0.0)


def test_standin_flops_against_plain_arithmetic():
    e, n, h, f = 2, 64, 256, 128
    got = cm.standin_flops(e, n, h, f)
    pairs = e * n
    ref = 2 * 3 * h * f * pairs                  # three matmuls of 2*H*F per pair, forward
    assert got["fwd"] == pytest.approx(ref, rel=0.02)
    assert got["fwd"] >= ref                     # plus elementwise (silu, the router weight)
    assert got["bwd"] == pytest.approx(2 * ref, rel=0.02)        # six matmuls from residuals
    assert got["vjp"] == pytest.approx(3 * ref, rel=0.02)        # recomputed forward + those
    assert cm.pairs_per_expert(61440, 8, 128) == 3840
    assert cm.pairs_per_expert(100, 3, 16) == 19


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/cost_model.py", "cost_model")


def test_script_bad_arguments_exit_2(script, capsys):
    for argv in (["--tflops", "0"], ["--nic-gbs", "-1"], ["--tokens", "0"], ["--ep", "12"],
                 ["--scaling-json", "/nonexistent.json"]):
        with pytest.raises(SystemExit) as e:
            script.parse_args(argv)
        assert e.value.code == 2


def test_script_end_to_end_on_synthetic_rows(script, tmp_path, capsys):
    rows = []
    for ep, hosts in ((8, 1), (16, 2)):
        p = 16 // ep * 3 * 64 * 32 * 2
        rows.append(synthetic_row(ep, hosts, p, 2 * p, p))
        h = synthetic_row(ep, hosts, p, 2 * p, p, variant="hier-expert")
        rows.append(h)
        a2a = synthetic_row(ep, hosts, 0, 0, 0, variant="a2a-cap1.0")
        a2a["fwdbwd_a2a_intra"] = [4 * 1024 * 2 * 64 * (min(ep, 8) - 1) // ep] * ep
        a2a["fwdbwd_a2a_inter"] = [4 * 1024 * 2 * 64 * (ep - min(ep, 8)) // ep] * ep
        rows.append(a2a)
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "cm.png"
    script.main(["--scaling-json", str(path), "--ep", "8", "16", "-k", "2",
                 "--scaling-tokens", "1024", "--tokens", "1024", "--out", str(out)])
    text = capsys.readouterr().out
    assert text.startswith("# reproduce: python benchmarks/cost_model.py --scaling-json")
    assert "NOT A MEASUREMENT" in text
    assert "| 16 | 2 | 1,024 |" in text and out.stat().st_size > 0
    assert "the hierarchical ring moves that line" in text
