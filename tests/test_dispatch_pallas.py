"""Ring (both routing modes) and all-to-all with the Pallas grouped-matmul kernel, run in the
Pallas interpreter on CPU: values and all five gradients against the dense reference.

Small on purpose: the interpreter is slow. The kernel itself is tested in test_gmm_pallas.py.
"""

import numpy as np
import pytest

from moe_cases import check_parity, make_inputs, mesh, place, uniform_ids


@pytest.mark.parametrize(
    "dispatcher,kw",
    [
        ("ring", {"routing": "token"}),
        ("alltoall", {}),
    ],
)
def test_parity_with_the_pallas_kernel_in_interpret_mode(dispatcher, kw):
    """On (expert=8). The former case [ring-kw0] (ring, expert routing, on (expert=8)) is
    test_interpret_mode_with_a_data_axis_sums_the_weight_gradients_once: the same ring hops and
    kernel calls on (data=2, expert=4), with the same skewed expert."""
    ids = uniform_ids(np.random.default_rng(0), 32, 16, 2)  # 4 tokens per device
    ids[::5, 0] = 3  # a skewed expert
    m = mesh("ep8")
    inp = place(make_inputs(ids, 16, h=16, f=16), m, ("expert",))
    got, _ = check_parity(dispatcher, inp, m, gmm_impl="pallas-interpret", **kw)
    assert int(got.aux["dropped_pairs"]) == 0


def test_interpret_mode_with_a_data_axis_sums_the_weight_gradients_once():
    """The interpreter runs under shard_map(check_vma=False), whose transpose already sums the
    weight gradients over `data`: summing them in the ring's backward too doubled them (fixed).
    The ring with expert routing through the kernel: also what the former
    test_parity_with_the_pallas_kernel_in_interpret_mode[ring-kw0] (on expert=8) did, with its
    skewed expert; its hops and kernel calls are the same on a 4-device ring."""
    ids = uniform_ids(np.random.default_rng(1), 32, 16, 2)
    ids[::5, 0] = 3  # a skewed expert
    m = mesh("dp2_ep4")
    inp = place(make_inputs(ids, 16, h=16, f=16), m, ("data", "expert"))
    got, _ = check_parity("ring", inp, m, gmm_impl="pallas-interpret", routing="expert")
    assert int(got.aux["dropped_pairs"]) == 0
