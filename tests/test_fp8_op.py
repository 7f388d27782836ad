"""`moe_ffn(expert_fp8=True)`: the FP8 recipe (docs/precision.md) in every dispatcher, and the
ring relaying e4m3 weights.

Every dispatcher (the ring in both routings, the all-to-all, the dense reference) against the
float64 recipe written here (`fp8_cases.ref_fp8_moe`: numpy's e4m3 rounding, the gradients by
hand): y and the gradients of x, the router weights and the three matrices (the roundings'
gradients the identity). Against the unquantised float64 FFN, each quantity's error within a
bound derived from e4m3's precision. What the compiled programs send (e4m3 and scales) is read
from the H100 programs in tests/test_gpu_compile.py (`test_the_fp8_ring_sends_e4m3_weights`,
`test_fp8_tokens_travel_as_e4m3`; an XLA:CPU twin of the first was one compile of fwd+bwd per
precision more, for the same bytes).
"""

import functools

import numpy as np
import pytest
from fp8_cases import ref_fp8_moe

import moe_cases as mc
from relaymoe_jax.models.config_files import load_config, parse_overrides

E, H, F, K, T = 16, 256, 192, 2, 32  # F: one whole and one partial 128-column block


@functools.cache
def _inputs():
    ids = mc.uniform_ids(3, T, E, K)
    return mc.make_inputs(ids, E, h=H, f=F, seed=4)


@functools.cache
def _want(quantize=True):
    inp = _inputs()
    names = ("x", "ids", "wts", "wg", "wu", "wd", "r")
    return ref_fp8_moe(*(np.asarray(inp[n]) for n in names), quantize=quantize)


DISPATCHERS = [
    ("ring", dict(routing="expert")),
    ("ring", dict(routing="token")),
    ("alltoall", {}),
    ("reference", {}),
]
DISPATCHER_IDS = ["ring-expert", "ring-token", "alltoall", "reference"]


@functools.cache
def _run(dispatcher, kw):
    y, _, grads = mc.run(dispatcher, _inputs(), mc.mesh("ep8"), expert_fp8=True, **dict(kw))
    return np.asarray(y, np.float64), {n: np.asarray(g, np.float64) for n, g in grads.items()}


TIGHT, FLIPPED, ONE_STEP = 2e-5, 2 / T, 5e-3


@pytest.mark.parametrize("dispatcher, kw", DISPATCHERS, ids=DISPATCHER_IDS)
def test_every_dispatcher_computes_the_fp8_recipe(dispatcher, kw):
    """y and the gradients of x, the router weights and the three matrices against the float64
    recipe (`fp8_cases.ref_fp8_moe`: the same roundings, the gradients written out by hand), to
    float32's accumulation error: a dropped, doubled or misweighted pair, a skipped or misplaced
    rounding (of x, the activation, dy, the projections' gradients or a matrix) is far above it.
    The roundings of intermediates (the activation, the projections' gradients) are exact here
    because float32's relative error (~1e-7) leaves each value on its side of e4m3's steps (1/16
    relative); these fixed inputs are deterministic on XLA:CPU. The unquantised reference is
    more than 1% away, so a path that skipped every rounding fails too."""
    y, grads = _run(dispatcher, tuple(sorted(kw.items())))
    want_y, want_grads = _want()
    for name, got, want in [("y", y, want_y), *((n, grads[n], want_grads[n]) for n in grads)]:
        err = np.abs(got - want) / np.max(np.abs(want))
        flipped = np.mean(err > TIGHT)
        print(f"{dispatcher} {name}: {flipped:.2%} past {TIGHT}, largest {err.max():.1e}")
        assert flipped <= FLIPPED, (name, flipped)
        assert err.max() <= ONE_STEP, (name, err.max())
    plain_y, _ = _want(quantize=False)
    assert np.max(np.abs(y - plain_y)) > 1e-2 * np.max(np.abs(plain_y))


# The roundings to e4m3 on each quantity's path, of x, w_gate, w_up, the activation h, w_down,
# dy, d gate and d up (test_the_error_against_unquantised_float64_is_within_e4m3s_bound).
ROUNDINGS = {"y": 5, "wts": 6, "wd": 5, "wg": 6, "wu": 6, "x": 7}
U = 2.0**-4  # e4m3's unit roundoff: 3 fraction bits, round to nearest


@pytest.mark.parametrize("dispatcher, kw", DISPATCHERS[:1] + DISPATCHERS[2:3], ids=["ring", "a2a"])
def test_the_error_against_unquantised_float64_is_within_e4m3s_bound(dispatcher, kw):
    """Against the unquantised float64 FFN (`ref_fp8_moe(quantize=False)`), every quantity's
    relative Frobenius error is at most sqrt(n) * u: u = 2^-4 bounds one rounding's relative
    error (e4m3 keeps 3 fraction bits; a power-of-two scale puts a tile's largest value in
    (224, 448], so every value within 2^-14 of it is a normal e4m3 number), and the n
    independent roundings on a quantity's path add in quadrature (`ROUNDINGS`: y sees x, w_gate,
    w_up, h and w_down; dW_down those but w_down, and dy; the router weights' gradient y's five
    and dy; dW_gate x, w_gate, w_up, w_down, dy and d gate (dW_up: d up); dx all but h). Measured
    (printed with -s): 6.6-8.3%, about half the bound (docs/precision.md)."""
    y, grads = _run(dispatcher, tuple(sorted(kw.items())))
    want_y, want_grads = _want(quantize=False)
    for name, got, want in [("y", y, want_y), *((n, grads[n], want_grads[n]) for n in grads)]:
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        bound = np.sqrt(ROUNDINGS[name]) * U
        print(f"{dispatcher} {name}: relative error {err:.4f}, bound {bound:.4f}")
        assert err <= bound, (name, err, bound)


def test_tiny_gradients_keep_their_precision():
    """A cotangent 2^-90 times smaller gives gradients exactly 2^-90 times smaller: the output
    gradient's and the projections' tile scales follow it down (no amax clamp, which in a
    published design flushed small gradients and cost 17-20% dgrad error; the floor is float32's
    smallest normal, `fp8.MIN_SCALE_EXP`)."""
    inp, tiny = _inputs(), 2.0**-90
    mesh = mc.mesh("ep8")
    _, _, grads = mc.run("alltoall", inp, mesh, expert_fp8=True)
    _, _, small = mc.run("alltoall", dict(inp, r=inp["r"] * tiny), mesh, expert_fp8=True)
    for name in grads:
        np.testing.assert_array_equal(np.asarray(small[name]), np.asarray(grads[name]) * tiny)


def test_expert_tensor_slices_round_as_the_whole_matrix():
    """With the ffn dimension split over `expert_tensor_axis` (ETP 2), each device rounds its
    256 / 2 = 128-column slice (and its activation's 128-channel tiles): whole blocks and tiles
    of the matrix, so the ring equals the reference dispatcher's recipe on the whole matrix
    (itself checked against float64 in `test_every_dispatcher_computes_the_fp8_recipe`)."""
    ids = mc.uniform_ids(5, 32, 8, 2)
    inp = mc.make_inputs(ids, 8, h=128, f=256, seed=6)
    mesh = mc.mesh("ep4_etp2")
    placed = mc.place(inp, mesh, ("expert", "expert_tensor"), etp="expert_tensor")
    mc.check_parity(
        "ring",
        placed,
        mesh,
        ref_kw=dict(expert_fp8=True),
        expert_fp8=True,
        routing="expert",
        expert_tensor_axis="expert_tensor",
    )


def test_a_slice_that_splits_a_block_is_refused():
    """ffn 192 over ETP 2: 96-column slices would quantise blocks the whole matrix does not have
    (the reference would round other values): refused before tracing, naming the sizes."""
    inp = mc.make_inputs(mc.uniform_ids(5, 32, 8, 2), 8, h=128, f=192)
    with pytest.raises(
        ValueError, match=r"ffn slice \(96 = ffn / 2\) must be a multiple of the 128"
    ):
        mc.moe_fn("ring", mc.mesh("ep4_etp2"), expert_fp8=True, expert_tensor_axis="expert_tensor")(
            *mc.args(inp)
        )


def test_the_model_config_and_the_trainer_keys_reach_the_option():
    """`expert_fp8` is a `MoEOptions` field: the YAML / `key=value` form sets the model's
    `moe.options`, and a non-bool is refused naming the key."""
    cfg = load_config("configs/tiny.yaml", **parse_overrides(["expert_fp8=true"]))
    assert cfg.moe.options.expert_fp8 is True
    assert load_config("configs/tiny.yaml").moe.options.expert_fp8 is False
    with pytest.raises(ValueError, match="expert_fp8"):
        load_config("configs/tiny.yaml", expert_fp8="yes")
