"""Collective-permute and all-to-all bytes, trip counts and host links read back from compiled
HLO."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.analysis import gpu_mesh, hlo

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
    return "\n".join(
        [
            "%hop (a: (s32[], f32[4])) -> (s32[], f32[4]) {",
            "  %a = f32[4] parameter(0)",
            "}",
            "%ring (p: f32[4]) -> f32[4] {",
            "  %p = f32[4] parameter(0)",
            *(lines[o] for o in order),
            "}",
            "ENTRY %main (x: f32[4]) -> f32[4] {",
            '  %w = f32[4] while(%x), condition=%c, body=%ring, backend_config={"known_trip_count":'
            '{"n":"7"}}',
            "}",
        ]
    )


@pytest.mark.parametrize(
    "order, overlapped",
    [
        (["start", "other", "loop", "done"], True),
        (["loop", "start", "done"], False),  # the transfer waits for the hop's compute
        (["start", "done", "loop"], False),  # waited for before the compute: nothing hidden
        (["start", "loop", "other", "done"], True),
    ],
)
def test_loop_schedules_reads_the_order(order, overlapped):
    (s,) = hlo.loop_schedules(_scheduled_body(order))
    assert s.computation == "ring"
    assert s.overlapped is overlapped
    assert len(s.starts) == len(s.dones) == len(s.loops) == 1


# ------------------------------------------------------------ pairs, all-to-all, host links

needs_plugin = pytest.mark.skipif(
    not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
)
SYNC_HLO = """\
HloModule jit_f, num_partitions=4

ENTRY %main (a: f32[8,4], b: s8[4], c: s8[2]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = s8[4]{0} parameter(1)
  %c = s8[2]{0} parameter(2)
  %cp = f32[8,4]{1,0} collective-permute(%a), channel_id=1, source_target_pairs={{0,1},{1,2},{2,2},{3,0}}
  %x = f32[8,4]{1,0} all-to-all(%a), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}
  %t = (s8[4], s8[2]) all-to-all(%b, %c), channel_id=3, replica_groups={{3,0},{1,2}}
  ROOT %s = ((f32[8,4]{1,0}), f32[8,4]{1,0}) all-to-all-start(%cp), channel_id=4, replica_groups={}, dimensions={1}
}
"""  # noqa: E501
HOSTS = (0, 0, 1, 1)


def test_permute_pairs_and_links():
    (p,) = hlo.collective_permutes(SYNC_HLO)
    assert p.pairs == ((0, 1), (1, 2), (2, 2), (3, 0))
    links = hlo.link_bytes(SYNC_HLO, HOSTS)
    assert links.intra == (128, 0, 0, 0)  # 0 -> 1; 2 -> 2 sends itself: no link
    assert links.inter == (0, 128, 0, 128)  # 1 -> 2 and 3 -> 0 cross hosts
    assert (links.max_intra, links.max_inter) == (128, 128)
    with pytest.raises(ValueError, match="partition 3 has no host"):
        hlo.link_bytes(SYNC_HLO, HOSTS[:3])


def test_all_to_alls_parsed():
    a, t, s = hlo.all_to_alls(SYNC_HLO)
    assert (a.bytes, a.groups, a.member_bytes) == (128, ((0, 2), (1, 3)), (64, 64))
    assert (t.bytes, t.groups, t.member_bytes) == (6, ((3, 0), (1, 2)), (4, 2))  # tuple form
    assert (s.name, s.groups, s.member_bytes) == ("s", ((0, 1, 2, 3),), (32,) * 4)  # {} = all
    links = hlo.all_to_all_link_bytes(SYNC_HLO, HOSTS)
    # a: every pair crosses (0<->2, 1<->3); t: 3 -> 0 sends t's 2nd operand (2 B) across, 0 -> 3
    # its 1st (4 B), 1 <-> 2 likewise; s: 1 other member on the host, 2 on the other
    assert links.intra == (32, 32, 32, 32)
    assert links.inter == (64 + 4 + 64, 64 + 2 + 64, 64 + 4 + 64, 64 + 2 + 64)


@pytest.mark.parametrize(
    "text, groups",
    [
        ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['a'=2,'b'=4] {'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
        ("mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'b'}", ((3, 1), (2, 0))),
    ],
)
def test_replica_group_spellings(text, groups):
    assert hlo.replica_groups(text) == groups


def _mesh_2x4():
    """8 CPU devices as (2, 4), not in id order, so partition ids and device ids differ."""
    devs = np.array(jax.devices())[[3, 1, 2, 0, 4, 5, 6, 7]].reshape(2, 4)
    return jax.sharding.Mesh(devs, ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def test_partition_ids_are_mesh_positions():
    mesh, ab = _mesh_2x4(), ("a", "b")
    ring = [(i, (i + 1) % N) for i in range(N)]
    f = jax.jit(
        jax.shard_map(
            lambda x: lax.ppermute(x, ab, ring), mesh=mesh, in_specs=P(ab), out_specs=P(ab)
        )
    )
    x = jax.device_put(jnp.arange(N * 2.0).reshape(N, 2), NamedSharding(mesh, P(ab)))
    compiled = f.lower(x).compile()
    # partition i runs on mesh.devices.flat[i]: the executable's device assignment
    assert compiled.runtime_executable().local_devices() == list(mesh.devices.flat)
    (p,) = hlo.collective_permutes(compiled.as_text())
    assert p.pairs == tuple(ring)
    np.testing.assert_array_equal(compiled(x), np.roll(np.asarray(x), 1, axis=0))
    links = hlo.link_bytes(compiled.as_text(), (0,) * 4 + (1,) * 4)  # a fake 2-host map
    block = 2 * 4  # one device's f32[1, 2]
    assert links.inter == tuple(block if i in (3, 7) else 0 for i in range(N))
    assert links.intra == tuple(0 if i in (3, 7) else block for i in range(N))
    assert hlo.host_of(mesh) == (0,) * N  # one process


@pytest.mark.parametrize("axes, inter", [(("a", "b"), 4), ("b", 0), ("a", 1)])
def test_cpu_all_to_all_links(axes, inter):
    """XLA:CPU's all-to-all (tuple form, one operand per member) over a fake 2-host (2, 4) mesh:
    each device sends one [1, 4] f32 row (16 B) to every other member of its group."""
    mesh = _mesh_2x4()
    ab = ("a", "b")
    f = jax.shard_map(
        lambda x: lax.all_to_all(x, axes, 0, 0, tiled=True),
        mesh=mesh,
        in_specs=P(ab),
        out_specs=P(ab),
    )
    n = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
    x = jax.ShapeDtypeStruct((N * n, 4), jnp.float32, sharding=NamedSharding(mesh, P(ab)))
    text = jax.jit(f).lower(x).compile().as_text()
    (a,) = hlo.all_to_alls(text)
    assert a.member_bytes == (16,) * n
    links = hlo.all_to_all_link_bytes(text, (0,) * 4 + (1,) * 4)
    assert links.inter == (16 * inter,) * N
    assert links.intra == (16 * (n - 1 - inter),) * N


@needs_plugin
@pytest.mark.gpu_compile
def test_gpu_flat_ring_crosses_hosts_at_the_boundary():
    """A flat ppermute ring over 2 hosts x 8 H100 (XLA:GPU, deviceless): only local index 7 of
    each host sends across hosts, one payload per hop; every other GPU sends to its neighbour on
    the same host. The all-to-all over the same devices sends 8 slices across, 7 within."""
    mesh, axes, hops = gpu_mesh.mesh((2, 8), ("node", "local")), ("node", "local"), 3
    n = 16
    ring = [(i, (i + 1) % n) for i in range(n)]
    hop = lambda i, x: lax.ppermute(x, axes, ring) * 2
    f = jax.shard_map(
        lambda x: lax.fori_loop(0, hops, hop, x), mesh=mesh, in_specs=P(axes), out_specs=P(axes)
    )
    a2a = jax.shard_map(
        lambda x: lax.all_to_all(x, axes, 0, 0, tiled=True),
        mesh=mesh,
        in_specs=P(axes),
        out_specs=P(axes),
    )
    x = jax.ShapeDtypeStruct((n * 16, 8), jnp.bfloat16, sharding=NamedSharding(mesh, P(axes)))
    with jax.set_mesh(mesh):
        ring_text, a2a_text = (jax.jit(g).trace(x).lower().compile().as_text() for g in (f, a2a))
    hosts = hlo.host_of(mesh)
    assert hosts == (0,) * 8 + (1,) * 8
    payload = 16 * 8 * 2  # one GPU's bf16[16, 8], as sent (bf16 stays bf16)
    links = hlo.link_bytes(ring_text, hosts)
    assert links.inter == tuple(hops * payload if i % 8 == 7 else 0 for i in range(n))
    assert links.intra == tuple(0 if i % 8 == 7 else hops * payload for i in range(n))
    links = hlo.all_to_all_link_bytes(a2a_text, hosts)
    assert links.inter == (8 * payload // n,) * n
    assert links.intra == (7 * payload // n,) * n
