"""The Mosaic GPU grouped matmul (gmm_impl="mosaic") in jax's GPU interpreter on CPU, against
float64 numpy: the forward, dx (transpose_rhs) and dW (tgmm) kernels and the custom VJP.

The interpreter fills a kernel's outputs with NaN before it runs (`uninitialized_memory`), so
all-finite outputs with exact-zero padding rows prove every output element is stored once; NaN
in the padding rows of every operand proves no padding row reaches a stored row or a weight
gradient. The patterns share one compiled program (traced group sizes): balanced, skewed (half
the rows in one group, Zipf over the rest, every 4th group empty) and all-empty, each with
padding rows; a second shape has one group, M, K and N that are no multiple of the tiles. All
run with the race detector on. The deviceless H100 compile (PTX, registers) is in
test_gmm_mosaic_compile.py, moe_ffn through these kernels in test_dispatch_mosaic.py.
"""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from gmm_cases import F32_RTOL, assert_close, fails_close, rand, sabotaged
from relaymoe_jax.kernels.gmm import gmm, mosaic, mosaic_gmm, mosaic_tgmm, tgmm
from relaymoe_jax.kernels.gmm import reference as ref
from relaymoe_jax.kernels.gmm.mosaic_common import MosaicConfig

BF16 = jnp.bfloat16
G, M, K, N = 8, 192, 64, 64


def _skewed(m=M - 40, g=G):
    """Half of `m` rows in group 1, Zipf (1/rank) over the rest, every 4th group empty."""
    sizes = np.zeros(g, np.int64)
    sizes[1] = m // 2
    rest = [i for i in range(g) if i != 1 and i % 4 != 0]
    zipf = 1 / np.arange(1, len(rest) + 1)
    share = np.floor(zipf / zipf.sum() * (m - sizes[1])).astype(np.int64)
    share[0] += m - sizes[1] - share.sum()
    sizes[rest] = share
    return sizes


PATTERNS = {
    "balanced": np.full(G, (M - 16) // G),
    "skewed": _skewed(),
    "all-empty": np.zeros(G, np.int64),
}
# (M, K, N, group sizes): one group, M not a multiple of the 64-row tile nor of 8, K and N not
# multiples of 64 (the wrapper pads them: forward K to 64 and N to 128, dx's K to tiles of 16)
ODD = (100, 48, 40, [90])


def _operands(m, k, n, g, sizes, seed=0):
    """bf16 x [m, k], w [g, k, n], its [g, n, k] transpose, y [m, n], a float32 cotangent
    [m, n] and a float32 sum [g, k, n] for tgmm; every row past sum(sizes) NaN in x, y and the
    cotangent."""
    end = min(int(np.sum(sizes)), m)
    nan_rows = lambda a: a.at[end:].set(jnp.nan)
    x = nan_rows(rand(seed, (m, k), BF16))
    w = rand(seed + 1, (g, k, n), BF16)
    y = nan_rows(rand(seed + 2, (m, n), BF16))
    d = nan_rows(rand(seed + 3, (m, n), np.float32))
    return x, w, jnp.swapaxes(w, 1, 2), y, d, rand(seed + 4, (g, k, n), np.float32)


def _kernels(interpret):
    """One program: forward, transposed forward, tgmm into a float32 sum (`acc`, updated in
    place: an input-output alias of the kernel), and the VJP of the forward (its dx and dW: the
    transposed gmm and tgmm kernels) with a float32 cotangent (multiplied in bf16)."""
    kw = dict(impl="mosaic", interpret=interpret)

    def f(x, w, w_t, y, d, acc, gs):
        out, vjp = jax.vjp(
            lambda x, w: gmm(x, w, gs, preferred_element_type=jnp.float32, **kw), x, w
        )
        dx, dw = vjp(d)
        out_t = gmm(x, w_t, gs, transpose_rhs=True, preferred_element_type=jnp.float32, **kw)
        dw_direct = tgmm(x, y, gs, preferred_element_type=jnp.float32, acc=acc, **kw)
        return dict(out=out, out_t=out_t, tgmm=dw_direct, dx=dx, dw=dw)

    return jax.jit(f)


def _expected(x, w, y, d, acc, sizes):
    """float64 numpy of the same bf16 inputs (padding rows read as 0: never used); the gradients
    with the cotangent rounded to bf16, as the kernels multiply it."""
    x64, y64 = (np.nan_to_num(np.asarray(a, np.float64)) for a in (x, y))
    d16 = np.nan_to_num(np.asarray(jnp.asarray(d, BF16), np.float64))
    out = ref.gmm(x64, w, sizes)
    dx, dw = ref.gmm_grads(x64, w, sizes, d16)
    tgmm_acc = np.asarray(acc, np.float64) + ref.tgmm(x64, y64, sizes)
    return dict(out=out, out_t=out, tgmm=tgmm_acc, dx=dx, dw=dw, acc=np.asarray(acc))


@pytest.fixture(scope="module")
def results():
    """{case: (got, want, first padding row)} for every pattern and the odd shape."""
    out = {}
    run = _kernels(plgpu.InterpretGPUParams(detect_races=True))
    for name, sizes in PATTERNS.items():
        x, w, w_t, y, d, acc = _operands(M, K, N, G, sizes)
        got = run(x, w, w_t, y, d, acc, jnp.asarray(sizes, jnp.int32))
        out[name] = (got, _expected(x, w, y, d, acc, sizes), int(np.sum(sizes)))
    m, k, n, sizes = ODD
    x, w, w_t, y, d, acc = _operands(m, k, n, len(sizes), sizes)
    got = run(x, w, w_t, y, d, acc, jnp.asarray(sizes, jnp.int32))
    out["odd-shape"] = (got, _expected(x, w, y, d, acc, sizes), sum(sizes))
    return out


CASES = [*PATTERNS, "odd-shape"]


def _rounding(x, dtype):
    """The largest error of rounding float64 `x` to `dtype` (a bf16 output's own error)."""
    return np.abs(np.asarray(jnp.asarray(x, dtype), np.float64) - x).max()


@pytest.mark.parametrize("case", CASES)
def test_forward_and_transposed_forward(results, case):
    """float32 outputs within float32 accumulation of the float64 reference; padding rows exact
    zeros (stored, not left NaN)."""
    got, want, end = results[case]
    for key in ("out", "out_t"):
        assert_close(got[key], want[key], F32_RTOL)
        assert np.all(np.asarray(got[key])[end:] == 0.0), key


@pytest.mark.parametrize("case", CASES)
def test_weight_gradient_kernel(results, case):
    """tgmm into its float32 sum (in place): every group's product added once, an empty group's
    sum kept exactly, NaN padding rows of both operands never read."""
    got, want, _ = results[case]
    assert_close(got["tgmm"], want["tgmm"], F32_RTOL)
    empty = np.asarray(PATTERNS.get(case, ODD[3])) == 0
    np.testing.assert_array_equal(np.asarray(got["tgmm"])[empty], want["acc"][empty])


@pytest.mark.parametrize("case", CASES)
def test_vjp_runs_the_dx_and_dw_kernels(results, case):
    """dx (bf16, the transposed kernel) and dW (bf16, tgmm) within their own output rounding of
    float64; the rows past the groups get an exact zero gradient."""
    got, want, end = results[case]
    for key in ("dx", "dw"):
        bound = 2 * _rounding(want[key], BF16) + F32_RTOL * max(np.abs(want[key]).max(), 1)
        g = np.asarray(got[key], np.float64)
        assert np.isfinite(g).all(), key
        assert np.abs(g - want[key]).max() <= bound, key
    assert np.all(np.asarray(got["dx"], np.float64)[end:] == 0.0)


def test_patterns_hold_what_they_claim():
    sizes = PATTERNS["skewed"]
    assert sizes[1] == sizes.sum() // 2 and np.all(sizes[::4] == 0) and sizes.sum() < M
    assert sorted(sizes[[2, 3, 5, 6, 7]], reverse=True) == list(sizes[[2, 3, 5, 6, 7]])
    m, k, n, _ = ODD
    assert m % 8 and m % 64 and k % 64 and n % 64


# ------------------------------------------------------------- sabotage: the tests can fail

SMALL = (64, 128, 32, [30, 0, 20])  # two K steps, three groups (one empty), padding rows


def _small_forward_and_tgmm(which=("gmm", "tgmm")):
    """((gmm, its reference), (tgmm, its reference)) on SMALL; a kernel not in `which` is not
    run (None): each sabotage runs only the kernel it breaks."""
    m, k, n, sizes = SMALL
    x, w, _, y, *_ = _operands(m, k, n, len(sizes), sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    x64, y64 = (np.nan_to_num(np.asarray(a, np.float64)) for a in (x, y))
    out = dw = None
    if "gmm" in which:
        out = (mosaic.gmm(x, w, gs, preferred_element_type=jnp.float32, interpret=True),)
        out += (ref.gmm(x64, w, sizes),)
    if "tgmm" in which:
        dw = (mosaic.tgmm(x, y, gs, preferred_element_type=jnp.float32, interpret=True),)
        dw += (ref.tgmm(x64, y64, sizes),)
    return out, dw


def test_sabotage_is_caught(monkeypatch):
    """The comparisons above fail when the kernels skip a K block (gmm), drop a work item (a
    group's rows in one tile: left NaN) or skip a group's last row block (tgmm); the same inputs
    pass untouched."""
    (out, want), (dw, want_dw) = _small_forward_and_tgmm()
    assert not fails_close(out, want) and not fails_close(dw, want_dw)
    with sabotaged(monkeypatch) as mp:
        mp.setattr(mosaic_gmm._Spec, "k_steps", property(lambda sp: sp.k // sp.bk - 1))
        assert fails_close(_small_forward_and_tgmm(("gmm",))[0][0], want)
    with sabotaged(monkeypatch) as mp:
        items = mosaic_gmm.row_items
        mp.setattr(
            mosaic_gmm, "row_items", lambda *a: items(*a)._replace(count=items(*a).count - 1)
        )
        assert fails_close(_small_forward_and_tgmm(("gmm",))[0][0], want)
    with sabotaged(monkeypatch) as mp:
        tile = mosaic_tgmm._tile
        mp.setattr(mosaic_tgmm, "_tile", lambda *a: tile(*a)._replace(trips=tile(*a).trips - 1))
        assert fails_close(_small_forward_and_tgmm(("tgmm",))[1][0], want_dw)


# ------------------------------------------------------------------ the entry points' checks


def test_float32_operands_are_refused_with_the_dtype():
    x = jnp.ones((64, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"bfloat16 or float16 operands.*got float32.*'xla'"):
        gmm(x, jnp.ones((1, 64, 64), jnp.float32), jnp.array([64]), impl="mosaic", interpret=True)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(config=MosaicConfig(block_n=96)), r"MosaicConfig.block_n must be one of .*got 96"),
        (dict(config=MosaicConfig(stages=9)), r"MosaicConfig.stages=9: 9 x .* bytes"),
        (dict(zero_padding=1), "zero_padding must be a bool"),
    ],
)
def test_bad_configs_are_refused(kw, msg):
    x = jnp.ones((64, 256), BF16)  # 128-column halves: 40 KiB a stage
    with pytest.raises(ValueError, match=msg):
        mosaic.gmm(x, jnp.ones((1, 256, 256), BF16), jnp.array([64]), interpret=True, **kw)


def test_tile_m_other_than_64_is_refused():
    x = jnp.ones((64, 64), BF16)
    with pytest.raises(ValueError, match="tile_m=32 with impl='mosaic'"):
        gmm(x, jnp.ones((1, 64, 64), BF16), jnp.array([64]), impl="mosaic", tile_m=32)
