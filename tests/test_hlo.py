"""Collective-permute bytes and trip counts read back from compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import hlo

N, HOPS = 8, 7
RING = [(i, (i + 1) % N) for i in range(N)]


def compiled_hlo(body, *shapes_dtypes):
    mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    args = [
        jax.device_put(jnp.zeros((N * s[0], *s[1:]), d), NamedSharding(mesh, P("x")))
        for s, d in shapes_dtypes
    ]
    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return jax.jit(f).lower(*args).compile().as_text()


def wire_bytes(shape, dtype):
    """Bytes of one device's block as sent: XLA:CPU upcasts bf16 permutes to f32."""
    dtype = np.dtype(dtype)
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        dtype = np.dtype(np.float32)
    return int(np.prod(shape)) * dtype.itemsize


PAYLOADS = {
    "one_f32": [((16, 128), jnp.float32)],
    "mixed_tuple": [((32, 64), jnp.bfloat16), ((100,), jnp.int32), ((5,), jnp.float32)],
}


@pytest.mark.parametrize("payload", PAYLOADS)
def test_ring_loop(payload):
    specs = PAYLOADS[payload]

    def body(*xs):
        hop = lambda i, xs: tuple(x + 1 for x in lax.ppermute(xs, "x", RING))
        xs = lax.fori_loop(0, HOPS, hop, xs)
        return (lax.ppermute(xs[0], "x", RING), *xs[1:])  # one permute outside the loop

    text = compiled_hlo(body, *specs)
    per_hop = sum(wire_bytes(s, d) for s, d in specs)
    outside = wire_bytes(*specs[0])
    assert hlo.loop_permute_bytes(text) == [per_hop]
    perms = hlo.collective_permutes(text)
    assert sorted(p.trips for p in perms) == [1] + [HOPS] * len(specs)
    assert sum(p.bytes for p in perms if p.trips == 1) == outside
    assert hlo.total_permute_bytes(text) == HOPS * per_hop + outside


def test_nested_loop_and_cond():
    spec = ((4, 8), jnp.float32)

    def body(x):
        inner = lambda j, x: lax.ppermute(x, "x", RING) * 2
        maybe = lambda x: lax.ppermute(x, "x", RING[::-1])
        outer = lambda i, x: lax.cond(i > 2, maybe, lambda x: x, lax.fori_loop(0, 3, inner, x))
        return lax.fori_loop(0, 5, outer, x)

    text = compiled_hlo(body, spec)
    b = wire_bytes(*spec)
    trips = sorted(p.trips for p in hlo.collective_permutes(text))
    assert trips == [5, 15]  # inner loop 3 x 5; the cond branch counts as taken
    assert hlo.loop_permute_bytes(text) == [b]  # the branch is not directly in a loop body
    assert hlo.total_permute_bytes(text) == 20 * b


def test_no_permute():
    double = lambda x: lax.fori_loop(0, HOPS, lambda i, x: x * 2, x)
    text = compiled_hlo(double, ((16,), jnp.float32))
    assert hlo.collective_permutes(text) == []
    assert hlo.loop_permute_bytes(text) == []
    assert hlo.total_permute_bytes(text) == 0


ASYNC_HLO = """\
%body (p: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %p = (s32[], bf16[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,4]{1,0} get-tuple-element(%p), index=1
  %s = (bf16[8,4]{1,0}, bf16[8,4]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=1
  %d = bf16[8,4]{1,0} collective-permute-done(%s)
  ROOT %t = (s32[], bf16[8,4]{1,0}) tuple(%i, %d)
}

ENTRY %main (a: bf16[8,4]) -> bf16[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %w = (s32[], bf16[8,4]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %r = bf16[8,4]{1,0} get-tuple-element(%w), index=1
}
"""  # noqa: E501


def test_async_pair_counted_once():
    (p,) = hlo.collective_permutes(ASYNC_HLO)
    assert (p.computation, p.name, p.bytes, p.trips) == ("body", "s", 8 * 4 * 2, 6)
    assert hlo.total_permute_bytes(ASYNC_HLO) == 6 * 64


@pytest.mark.parametrize(
    "shape, nbytes",
    [
        ("f32[16,128]{1,0}", 8192),
        ("pred[]", 1),
        ("(s8[3], bf16[2,2]{1,0}, /*index=2*/c64[1])", 19),
        ("s4[5]", 3),
        ("token[]", 0),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert hlo.shape_bytes(shape) == nbytes


def _scheduled_body(order):
    """A scheduled while body whose instructions come in `order` (start / loop / done / other)."""
    lines = {
        "start": "  %cp-start = (f32[4], f32[4]) collective-permute-start(%p), channel_id=1",
        "loop": "  %chunks = (s32[], f32[4]) while(%t), condition=%cond, body=%hop",
        "done": "  %cp-done = f32[4] collective-permute-done(%cp-start)",
        "other": "  %add = f32[4] add(%p, %p)",
    }
    return "\n".join([
        "%hop (a: (s32[], f32[4])) -> (s32[], f32[4]) {", "  %a = f32[4] parameter(0)", "}",
        "%ring (p: f32[4]) -> f32[4] {", "  %p = f32[4] parameter(0)",
        *(lines[o] for o in order), "}",
        "ENTRY %main (x: f32[4]) -> f32[4] {",
        '  %w = f32[4] while(%x), condition=%c, body=%ring, backend_config={"known_trip_count":'
        '{"n":"7"}}', "}"])


@pytest.mark.parametrize("order, overlapped", [
    (["start", "other", "loop", "done"], True),
    (["loop", "start", "done"], False),        # the transfer waits for the hop's compute
    (["start", "done", "loop"], False),        # waited for before the compute: nothing hidden
    (["start", "loop", "other", "done"], True),
])
def test_loop_schedules_reads_the_order(order, overlapped):
    (s,) = hlo.loop_schedules(_scheduled_body(order))
    assert s.computation == "ring"
    assert s.overlapped is overlapped
    assert len(s.starts) == len(s.dones) == len(s.loops) == 1
