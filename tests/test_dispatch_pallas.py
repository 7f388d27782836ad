"""Ring (both routing modes) and all-to-all with the Pallas grouped-matmul kernel, run in the
Pallas interpreter on CPU: values and all five gradients against the dense reference.

Small on purpose: the interpreter is slow. The kernel itself is tested in test_gmm_pallas.py.
"""

import numpy as np
import pytest

from moe_cases import assert_matches, make_inputs, mesh, place, run, uniform_ids


@pytest.mark.parametrize("dispatcher,kw", [
    ("ring", {"routing": "expert"}),
    ("ring", {"routing": "token"}),
    ("alltoall", {}),
])
def test_parity_with_the_pallas_kernel_in_interpret_mode(dispatcher, kw):
    ids = uniform_ids(np.random.default_rng(0), 32, 16, 2)      # 4 tokens per device
    ids[::5, 0] = 3                                            # a skewed expert
    m = mesh("ep8")
    inp = place(make_inputs(ids, 16, h=16, f=16), m, ("expert",))
    y, stats, g = run(dispatcher, inp, m, gmm_impl="pallas-interpret", **kw)
    y_ref, _, g_ref = run("reference", inp, m, poison=False)
    assert_matches((y, g), (y_ref, g_ref), 1e-5, f"{dispatcher} {kw} pallas-interpret")
    assert int(stats["dropped_pairs"]) == 0
