"""The token-dropping all-to-all: exactly the expected pairs dropped, each one counted."""

import math

import numpy as np

from moe_cases import check_parity, make_inputs, mesh, moe_fn, place, run, uniform_ids

E, K, N = 16, 4, 8


def expected_kept(ids, n, capacity_factor):
    """float64-free numpy model: per device, per expert, the first `cap` pairs in token order."""
    t, k = ids.shape
    t_local = t // n
    cap = math.ceil(capacity_factor * t_local * k / E)
    kept = np.zeros(ids.shape, bool)
    for d in range(n):
        seen = np.zeros(E, int)
        for tok in range(d * t_local, (d + 1) * t_local):
            for j in range(k):
                e = ids[tok, j]
                if seen[e] < cap:
                    kept[tok, j] = True
                seen[e] += 1
    return kept


def test_capacity_drops_exactly_the_overflow_and_counts_it():
    rng = np.random.default_rng(0)
    ids = uniform_ids(rng, 128, E, K)
    ids[rng.random(128) < 0.5, 0] = 3  # skew: expert 3 is popular
    kept = expected_kept(ids, N, 1.0)
    assert (~kept).sum() > 0
    m = mesh("ep8")
    inp = place(make_inputs(ids, E), m, ("expert",))
    # The reference with the dropped pairs' weights at zero is what capacity 1.0 computes (and
    # those pairs get no weight gradient: the chain rule through `* kept` zeroes it).
    got, _ = check_parity(
        "alltoall", inp, m, ref=_without(kept, moe_fn("reference", m)), capacity_factor=1.0
    )
    assert int(got.aux["dropped_pairs"]) == int((~kept).sum())


def _without(kept, ref):
    """ref with the pairs where `kept` is False weighted zero."""
    return lambda x, ids, wts, *w: ref(x, ids, wts * kept, *w)


def test_large_capacity_drops_nothing():
    ids = uniform_ids(np.random.default_rng(1), 64, E, K)
    m = mesh("ep8")
    inp = place(make_inputs(ids, E), m, ("expert",))
    got, _ = check_parity("alltoall", inp, m, capacity_factor=float(E))
    assert int(got.aux["dropped_pairs"]) == 0


def test_dropless_overflow_from_repeated_ids_is_counted():
    """k > E/EP with a token repeating an id exceeds the T*min(k, E/EP) block: counted, not lost.

    It also ran the ring on these inputs (dropless: nothing dropped, values and gradients equal to
    the reference); that is test_dispatch.py's ring classes' test_routing_patterns
    [repeated_ids_and_ties] (a token repeating an id) and [all_to_one_expert_k1_chunk_5] (every
    pair on one expert): the ring's chunks have no block to overflow, whatever k and E/EP."""
    e = 8  # one expert per device
    ids = np.full((64, 2), 3)  # every token: expert 3 twice
    m = mesh("ep8")
    inp = place(make_inputs(ids, e), m, ("expert",))
    _, stats, _ = run("alltoall", inp, m)
    # Each device sends 16 pairs to device 3 through a block of 8 rows: 8 dropped per device.
    assert int(stats["dropped_pairs"]) == 8 * 8


def test_capacity_with_expert_tensor_parallelism_counts_each_drop_once():
    """(expert=4, expert_tensor=2), tokens over both axes: each ETP pair of devices all-gathers its
    tokens (a contiguous quarter) and both ranks see the same drops, which are counted once."""
    rng = np.random.default_rng(2)
    ids = uniform_ids(rng, 128, E, K)
    ids[rng.random(128) < 0.5, 0] = 3
    kept = expected_kept(ids, 4, 1.0)
    assert (~kept).sum() > 0
    m = mesh("ep4_etp2")
    ta, etp = ("expert", "expert_tensor"), "expert_tensor"
    inp = place(make_inputs(ids, E), m, ta, etp=etp)
    ref = _without(kept, moe_fn("reference", m, expert_tensor_axis=etp))
    got, _ = check_parity("alltoall", inp, m, ref=ref, capacity_factor=1.0, expert_tensor_axis=etp)
    assert int(got.aux["dropped_pairs"]) == int((~kept).sum())
