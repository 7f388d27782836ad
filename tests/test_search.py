"""train.search and the planner's size search: the largest size found against an exhaustive scan
(pure), and against compiled steps (the found size fits, one step more does not)."""
import pytest

from relaymoe_jax.models.configs import load_config
from train import loop, planner, search
from train import mesh as tm


@pytest.mark.parametrize("slope, capacity, step, limit", [
    (3, 100, 1, 64), (3, 100, 8, 64), (1, 10**6, 8, 64), (5, 4, 1, 10), (2, 41, 4, 4),
    (7, 700, 16, 1000)])
def test_largest_against_exhaustive_scan(slope, capacity, step, limit):
    peak = lambda n: slope * n + 1
    want = max((n for n in range(step, limit + 1, step) if peak(n) <= capacity), default=None)
    got, rec = search.largest(peak, capacity, step, limit)
    assert got == want
    assert len(rec.probes) <= 2 * (limit // step).bit_length() + 1      # logarithmic
    assert all(size % step == 0 and size <= limit for size, _ in rec.probes)


def test_largest_bad_input():
    with pytest.raises(ValueError, match="step=0"):
        search.largest(lambda n: n, 10, 0, 8)
    with pytest.raises(ValueError, match="limit=4"):
        search.largest(lambda n: n, 10, 8, 4)


def test_largest_sequence_by_compiling():
    cfg = load_config("configs/tiny.yaml")
    tc = loop.TrainConfig(batch_size=8, seq_len=64)
    mesh = tm.make_mesh(tc.mesh)
    capacity = 16 * 2**20                      # seq 256 needs 8.5 MiB, 384 more than 16
    seq, rec = planner.largest_size(cfg, tc, mesh, capacity, field="seq_len", step=128,
                                    limit=384)
    peaks = dict(rec.probes)                   # each a compiled step's memory_analysis
    assert seq == 256 and list(peaks) == [128, 256, 384]
    assert peaks[128] < peaks[256] <= capacity < peaks[384]
