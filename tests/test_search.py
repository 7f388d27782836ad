"""train.planner.search and the planner's size search: the largest size found against an
exhaustive scan (pure), and against compiled steps (the found size fits, one step more does not)."""

import pytest

from relaymoe_jax.models.config_files import load_config
from train.planner import plan as planner
from train.planner import search
from train.settings import TrainConfig
from train.step import mesh as tm


@pytest.mark.parametrize(
    "slope, capacity, step, limit",
    [
        (3, 100, 1, 64),
        (3, 100, 8, 64),
        (1, 10**6, 8, 64),
        (5, 4, 1, 10),
        (2, 41, 4, 4),
        (7, 700, 16, 1000),
    ],
)
def test_largest_against_exhaustive_scan(slope, capacity, step, limit):
    peak = lambda n: slope * n + 1
    want = max((n for n in range(step, limit + 1, step) if peak(n) <= capacity), default=None)
    got, rec = search.largest(peak, capacity, step, limit)
    assert got == want
    assert len(rec.probes) <= 2 * (limit // step).bit_length() + 1  # logarithmic
    assert all(size % step == 0 and size <= limit for size, _ in rec.probes)


PAPER = [40960, 65536, 92160, 100352, 116736, 126976, 153600]


@pytest.mark.parametrize(
    "peak",
    [
        lambda s: 0.35 * s + 28_000,  # affine, as the full-size steps nearly are
        lambda s: s * s / 300_000 + 20_000,  # convex
        lambda s: 60_000 if s > 90_000 else 10_000,  # a step
        lambda s: 2 ** (s // 20_000),  # wildly non-affine
    ],
)
@pytest.mark.parametrize("capacity", [5_000, 30_000, 50_000, 60_000, 72_000, 10**9])
def test_largest_listed_against_exhaustive_scan(peak, capacity):
    want = max((s for s in PAPER if peak(s) <= capacity), default=None)
    got, rec = search.largest_listed(peak, capacity, PAPER[::-1])
    assert got == want
    probed = dict(rec.probes)
    assert len(probed) == len(rec.probes) <= len(PAPER)  # never twice
    if want is not None:  # the boundary was measured
        assert probed[want] <= capacity
        assert want == PAPER[-1] or probed[PAPER[PAPER.index(want) + 1]] > capacity


def test_largest_listed_few_probes_when_affine():
    peak = lambda s: 0.35 * s + 28_000
    for capacity in (30_000, 50_000, 60_000, 72_000, 90_000):
        _, rec = search.largest_listed(peak, capacity, PAPER)
        assert len(rec.probes) <= 4, (capacity, rec.probes)
    _, rec = search.largest_listed(peak, 1_000, PAPER)
    assert rec.probes == [(40960, peak(40960))]  # smallest first


def test_largest_bad_input():
    with pytest.raises(ValueError, match="positive sizes"):
        search.largest_listed(lambda n: n, 10, [])
    with pytest.raises(ValueError, match="step=0"):
        search.largest(lambda n: n, 10, 0, 8)
    with pytest.raises(ValueError, match="limit=4"):
        search.largest(lambda n: n, 10, 8, 4)


def test_largest_sequence_by_compiling():
    """One layer of the tiny model's dense variant (the search reads each compiled step's peak,
    whatever the model; a third of the tiny MoE's compile time): seq 128, 256 and 384 compiled,
    the search stopped at max_position_embeddings."""
    cfg = load_config(
        "configs/tiny.yaml",
        max_position_embeddings=384,  # the search stops there
        num_experts=0,
        num_hidden_layers=1,
    )
    tc = TrainConfig(batch_size=8, seq_len=64)
    mesh = tm.make_mesh(tc.mesh)
    capacity = 12 * 2**20  # seq 256 needs 7.8 MiB, 384 15.7
    seq, rec = planner.largest_size(cfg, tc, mesh, capacity, field="seq_len", step=128, limit=384)
    peaks = dict(rec.probes)  # each a compiled step's memory_analysis
    assert seq == 256 and list(peaks) == [128, 256, 384]
    assert peaks[128] < peaks[256] <= capacity < peaks[384]


# --------------------------------------------------------------------------- host memory


@pytest.mark.parametrize("host_capacity", [None, 10**9, 700, 350, 50])
def test_a_size_fits_only_when_device_and_host_memory_both_fit(host_capacity):
    """peak_of gives (device, host) bytes: a size fits when both fit (a host capacity of None
    is not checked), in both searches, against an exhaustive scan; the record keeps the host
    bytes and says which memory a probe overflows."""
    peak = lambda n: (3 * n + 1, 10 * n)  # device-bound at capacity 300 (n <= 99) ...
    fits = lambda n: peak(n)[0] <= 300 and (host_capacity is None or peak(n)[1] <= host_capacity)
    want = max((n for n in range(8, 129, 8) if fits(n)), default=None)
    logged = []
    got, rec = search.largest(peak, 300, 8, 128, logged.append, host_capacity=host_capacity)
    assert got == want
    assert rec.hosts == {n: peak(n)[1] for n, _ in rec.probes}
    for n, _ in rec.probes:
        device, host = peak(n)[0] > 300, host_capacity is not None and peak(n)[1] > host_capacity
        assert (
            rec.over(n)
            == {
                (False, False): "",
                (True, False): "device memory",
                (False, True): "host memory",
                (True, True): "device and host memory",
            }[device, host]
        )
    first = logged[0]
    assert first.startswith("  size 8: 0.0 MiB, host 0.0 MiB ")
    if host_capacity == 50:  # 80 host bytes at size 8: nothing fits, and the log says why
        assert got is None and first.endswith("does not fit (host memory)")
    listed, _ = search.largest_listed(peak, 300, range(8, 129, 8), host_capacity=host_capacity)
    assert listed == want


def test_overflow_names_the_memory():
    assert search.overflow(10, 5, 10, 5) == ""
    assert search.overflow(11, 5, 10, 5) == "device memory"
    assert search.overflow(10, 6, 10, 5) == "host memory"
    assert search.overflow(11, 6, 10, 5) == "device and host memory"
    assert search.overflow(10, 10**12, 10, None) == ""  # the host is not checked
