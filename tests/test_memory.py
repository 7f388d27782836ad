"""Memory regression from XLA's buffer assignment (deterministic, per device, compile-only)."""

import jax
import pytest

from relaymoe_jax.analysis import memory

SHAPE = memory.LayerShape(experts=32, top_k=8, hidden=256, ffn=128, tokens_per_device=1024, ep=8)


@pytest.fixture(scope="module")
def measured():
    mesh = jax.make_mesh((8,), ("expert",))
    return {v: memory.measure_layer(SHAPE, mesh, v) for v in memory.VARIANTS}


@pytest.mark.parametrize("ring", ["ring-expert", "ring-token"])
def test_ring_uses_a_fraction_of_alltoall(measured, ring):
    ring = measured[ring]
    # Measured with jax 0.12.0.1: expert routing 11.6 MiB, token routing 11.2 MiB (10.1 before
    # its accumulator trailed one hop for overlap); capacity 1.0: 6.59x / 6.81x.
    assert measured["a2a-cap1.0"]["fwdbwd"] >= 5.5 * ring["fwdbwd"]
    assert measured["a2a-dropless"]["fwdbwd"] >= 20 * ring["fwdbwd"]
    assert measured["a2a-cap1.0"]["fwd"] >= 2 * ring["fwd"]


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_ring_is_near_its_analytic_floor(measured, routing):
    """Within 22% below and 30% above the analytic live set. Since the loop accumulators are made
    late (`relaymoe_jax.util.late`) XLA overlaps part of what the model counts as live together, and
    since the hop's dW sums in place into its accumulator (`tgmm(acc=)`) no per-chunk dW partial
    is live (measured fwd / fwd+bwd: expert 1.11 / 0.81, token 0.92 / 0.80; before the in-place
    sum the fwd+bwd were 0.88 / 0.88)."""
    got = measured[f"ring-{routing}"]
    floor = memory.ring_floor_bytes(SHAPE, routing=routing)
    assert 0.78 * floor <= got["fwdbwd"] <= 1.3 * floor
    floor_fwd = memory.ring_floor_bytes(SHAPE, backward=False, routing=routing)
    assert 0.85 * floor_fwd <= got["fwd"] <= 1.3 * floor_fwd


def test_alltoall_keeps_several_expanded_buffers(measured):
    """The baseline's peak, in units of the [T*k, H] expanded buffer (paper Figure 4)."""
    unit = memory.expanded_bytes(SHAPE)
    assert measured["a2a-cap1.0"]["fwdbwd"] >= 9 * unit  # measured: 9.5 units


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_ring_sends_what_the_volume_model_says(measured, routing):
    """Per-hop bytes read from the compiled HLO's collective permutes (f32: XLA:CPU sends bf16 as
    f32) equal `routing_volumes`' sent_* model; Table 2 itself omits the travelling accumulators
    (token routing forward: measured 2,116 KiB against Table 2's 1,088 KiB at this shape)."""
    vol = memory.table2(SHAPE)
    got = measured[f"ring-{routing}"]
    assert got["hop_fwd"] == getattr(vol, f"sent_{routing}_fwd")
    assert got["hop_bwd"] == getattr(vol, f"sent_{routing}_bwd")
    assert measured["a2a-cap1.0"]["hop_fwd"] == measured["a2a-cap1.0"]["hop_bwd"] == 0
