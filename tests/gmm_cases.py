"""Shared helpers of the grouped-matmul tests (no test functions here)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

F32_RTOL = 1e-5  # relative to max |reference|
BF16_RTOL = 2e-2


def rand(seed, shape, dtype=np.float32):
    """Holds a standard-normal array of `shape` cast to `dtype`."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def assert_close(got, want, rtol=F32_RTOL):
    """Asserts |got - want| <= rtol * max|want| elementwise (and finiteness)."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(np.abs(want).max(), 1.0))


def fails_close(got, want, rtol=F32_RTOL) -> bool:
    """Whether `assert_close(got, want, rtol)` fails (a sabotage check's verdict)."""
    try:
        assert_close(got, want, rtol)
    except AssertionError:
        return True
    return False


@contextlib.contextmanager
def sabotaged(monkeypatch):
    """A monkeypatch context whose kernels are traced afresh inside it and again after it: a
    Mosaic GPU kernel's launch is a jitted function of its static description
    (`mosaic_common.launch`), whose cached trace would otherwise keep the sound kernel in the
    context, or the sabotaged one after it."""
    jax.clear_caches()
    try:
        with monkeypatch.context() as mp:
            yield mp
    finally:
        jax.clear_caches()
