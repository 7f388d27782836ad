"""Memory regression from XLA's buffer assignment (deterministic, per device, compile-only)."""

import jax
import pytest

from relaymoe_jax import memory

SHAPE = memory.LayerShape(experts=32, top_k=8, hidden=256, ffn=128, tokens_per_device=1024, ep=8)


@pytest.fixture(scope="module")
def measured():
    mesh = jax.make_mesh((8,), ("expert",))
    return {v: memory.measure_layer(SHAPE, mesh, v) for v in memory.VARIANTS}


def test_ring_uses_a_fraction_of_alltoall(measured):
    ring = measured["ring"]["fwdbwd"]
    # Measured with jax 0.12.0.1: ring 15.6 MiB, capacity 1.0: 6.19x, dropless: 24.75x.
    assert measured["a2a-cap1.0"]["fwdbwd"] >= 5.5 * ring
    assert measured["a2a-dropless"]["fwdbwd"] >= 20 * ring
    assert measured["a2a-cap1.0"]["fwd"] >= 2 * measured["ring"]["fwd"]


def test_ring_is_near_its_analytic_floor(measured):
    floor = memory.ring_floor_bytes(SHAPE)
    assert floor <= measured["ring"]["fwdbwd"] <= 1.3 * floor
    floor_fwd = memory.ring_floor_bytes(SHAPE, backward=False)
    assert floor_fwd <= measured["ring"]["fwd"] <= 1.3 * floor_fwd


def test_alltoall_keeps_several_expanded_buffers(measured):
    """The baseline's peak, in units of the [T*k, H] expanded buffer (paper Figure 4)."""
    unit = memory.expanded_bytes(SHAPE)
    assert measured["a2a-cap1.0"]["fwdbwd"] >= 10 * unit      # measured: 12.0 units
