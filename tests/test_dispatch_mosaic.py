"""Ring (expert routing) and all-to-all through the Mosaic GPU grouped matmul
(gmm_impl="mosaic-interpret": jax's GPU interpreter on CPU): the values and all five gradients
of moe_ffn against the dense reference dispatcher, padding NaN-poisoned, under
shard_map(check_vma=True). One device: jax 0.12's Mosaic GPU interpreter runs one device only
(several are refused: test_local_checks.py), so the ring makes one hop; the ring's hops on 8
devices are tested with the other implementations. The kernels themselves are tested in
test_gmm_mosaic.py. bf16 (the kernels' operands): a dropped or doubled (token, expert) pair
moves its token's output by about its weight, far past bf16's 2% bound.

The former case [ring-kw1] (ring, token routing) is covered by [ring-kw0]: on one device the
ring makes no transfer and both routing modes run the one hop (`dispatch/ring`: "N == 1:
out = hop(tk)"; `dispatch/hop` is shared by both modes), so the Mosaic calls are the same; token
routing's relay runs on 8 devices in test_dispatch.py::TestRingTokenRouting and with the Pallas
kernel in test_dispatch_pallas.py.
"""

import numpy as np
import pytest

from moe_cases import check_parity, make_inputs, mesh, place, uniform_ids


@pytest.mark.parametrize(
    "dispatcher,kw",
    [
        ("ring", {"routing": "expert"}),
        ("alltoall", {}),
    ],
)
def test_parity_with_the_mosaic_kernel_in_its_interpreter(dispatcher, kw):
    ids = uniform_ids(np.random.default_rng(0), 16, 4, 2)
    ids[::5, 0] = 3  # a skewed expert
    m = mesh("ep1")
    inp = place(make_inputs(ids, 4, h=64, f=64, dtype="bfloat16"), m, ("expert",))
    got, _ = check_parity(dispatcher, inp, m, rtol=2e-2, gmm_impl="mosaic-interpret", **kw)
    assert int(got.aux["dropped_pairs"]) == 0
