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

from moe_cases import check_parity, make_inputs, mesh, moe_fn, place, run, uniform_ids
from relaymoe_jax.dispatch import hop
from relaymoe_jax.kernels.gmm import mosaic_fp8


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


def test_the_fp8_ring_runs_the_e4m3_kernel(monkeypatch):
    """The ring (expert routing) with expert_fp8=True and the Mosaic GPU kernel: its weights are
    relayed as `Fp8` records and multiplied as they arrived, every grouped matmul of the forward
    and the dgrads is the e4m3 kernel (`gmm_fp8`, counted as it is traced), and y and the five
    gradients match the ring's FP8 recipe through the blocked XLA matmul (16-bit products of the
    same rounded values, the same bf16 intermediates) to a bf16 output's rounding, far below
    what one dropped or misweighted pair moves. (The dense reference dispatcher keeps its
    intermediates in float32, so its recipe rounds a few activations differently: up to 5% of a
    router weight's gradient here, for either matmul; test_fp8_op.py compares the recipes.) The
    all-to-all's: `test_the_fp8_alltoall_runs_the_e4m3_kernel`. Token routing's hop
    is the same code (`dispatch/hop`), its weights quantised once for every visitor instead of
    relayed: on one device it would run these same calls (module doc)."""
    calls, in_backward = [], []  # (in the hop's backward, transpose_rhs) per traced call
    real, backward = mosaic_fp8.gmm_fp8_call, hop.Hop.backward

    def counted(*a):
        calls.append((bool(in_backward), a[3]))
        return real(*a)

    def counted_backward(*a):
        in_backward.append(True)
        try:
            return backward(*a)
        finally:
            in_backward.pop()

    monkeypatch.setattr(mosaic_fp8, "gmm_fp8_call", counted)
    monkeypatch.setattr(hop.Hop, "backward", counted_backward)
    ids = uniform_ids(np.random.default_rng(1), 16, 4, 2)
    ids[::5, 0] = 3
    m = mesh("ep1")
    inp = place(make_inputs(ids, 4, h=64, f=64, dtype="bfloat16"), m, ("expert",))
    kw = dict(routing="expert", expert_fp8=True)
    xla = moe_fn("ring", m, gmm_impl="xla", **kw)
    got, _ = check_parity("ring", inp, m, rtol=1e-2, ref=xla, gmm_impl="mosaic-interpret", **kw)
    # and y against the dense reference dispatcher's recipe (no ring, no grouped matmul): a pair
    # the ring dropped or doubled moves its token's output by about its weight, past bf16's 2%
    dense = np.asarray(run("reference", inp, m, expert_fp8=True)[0], np.float64)
    err = np.max(np.abs(np.asarray(got.y, np.float64) - dense))
    assert err <= 2e-2 * np.max(np.abs(dense)), err
    # per trace of a hop, the forward's 3 products, the backward's 2 recomputed and 3 dgrads;
    # every w already K-major (transpose_rhs: the kernel transposes nothing per call)
    fwd, bwd = (sum(1 for b, _ in calls if b == part) for part in (False, True))
    assert fwd and fwd % 3 == 0 and bwd and bwd % 5 == 0, calls
    assert all(t for _, t in calls), calls


def test_the_fp8_alltoall_runs_the_e4m3_kernel(monkeypatch):
    """The all-to-all with expert_fp8=True and the Mosaic GPU kernel: every grouped matmul of the
    forward (gate, up, and the down projection with each row's router weight inside it:
    `dispatch.weighted_down`) and of the dgrads (dx of gate and up, d act of down, on the
    rounded dy itself) is the e4m3 kernel (`gmm_fp8`, counted as it is traced: 16-bit before),
    and y and the five gradients match the all-to-all's FP8 recipe through the blocked XLA
    matmul (16-bit products of the same rounded values) to a bf16 output's rounding; y also
    matches the dense reference dispatcher's recipe to bf16's 2% (a dropped or doubled pair
    moves its token's output by about its weight)."""
    calls = []
    real = mosaic_fp8.gmm_fp8_call

    def counted(*a):
        calls.append(a[3])
        return real(*a)

    monkeypatch.setattr(mosaic_fp8, "gmm_fp8_call", counted)
    ids = uniform_ids(np.random.default_rng(2), 16, 4, 2)
    ids[::5, 0] = 3
    m = mesh("ep1")
    inp = place(make_inputs(ids, 4, h=64, f=64, dtype="bfloat16"), m, ("expert",))
    xla = moe_fn("alltoall", m, gmm_impl="xla", expert_fp8=True)
    got, _ = check_parity(
        "alltoall", inp, m, rtol=1e-2, ref=xla, gmm_impl="mosaic-interpret", expert_fp8=True
    )
    dense = np.asarray(run("reference", inp, m, expert_fp8=True)[0], np.float64)
    err = np.max(np.abs(np.asarray(got.y, np.float64) - dense))
    assert err <= 2e-2 * np.max(np.abs(dense)), err
    # 3 per trace of the forward, 3 dgrads (transpose_rhs) per trace of the backward
    dgrads = calls.count(True)
    assert dgrads and dgrads % 3 == 0 and (len(calls) - dgrads) % 3 == 0, calls
