"""The hierarchical ring on the GPU compiler for 2 and 4 hosts of 8 abstract H100s (1x2x8, 1x4x8;
`relaymoe_jax.gpu_mesh`, no GPU): what crosses hosts, read from the compiled program's
collective-permute source-target pairs and the topology's process indices, and what XLA:GPU's
schedule hides those transfers behind (`relaymoe_jax.analysis.overlap`).

Compiled with `relaymoe_jax.XLA_OPTIONS`, as the trainer compiles (a hop's arrays sent as one
collective permute, and three in flight at once: the round's inter-node transfer, the inner
ring's and the loss's all-reduce; with fewer the scheduler starts the inter-node transfer after
the round).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax import XLA_OPTIONS, moe_ffn
from relaymoe_jax.analysis import gpu_mesh, hlo, overlap

needs_plugin = pytest.mark.skipif(
    not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
)
pytestmark = [pytest.mark.gpu_compile, needs_plugin]
AXES = ("node", "local")
LOCAL = gpu_mesh.GPUS_PER_HOST
# Sizes where it matters: a hop's arrays (4 experts' gate/up/down, 16 MiB each; 8,192 tokens of
# 4 KiB) are above XLA's 30 MiB permute-combining default, as at the paper's shape; with the small
# arrays this file first used, XLA combined them anyway and hid what the paper shape did not.
T_DEV, H, F, K, E_GPU = 8192, 2048, 1024, 4, 4


@functools.cache
def _mesh(nodes):
    return gpu_mesh.mesh((nodes, LOCAL), AXES)


def _args(mesh, e):
    n = mesh.devices.size
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P(AXES)))
    bf = jnp.bfloat16
    return (
        sds((n * T_DEV, H), bf),
        sds((n * T_DEV, K), jnp.int32),
        sds((n * T_DEV, K), jnp.float32),
        sds((e, H, F), bf),
        sds((e, H, F), bf),
        sds((e, F, H), bf),
    )


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_programs():
    """`_compiled`'s programs go with the module (conftest releases jax's caches)."""
    yield
    _compiled.cache_clear()


@functools.cache
def _compiled(nodes, routing, ring, backward=True):
    """The program's text, compiled once for the module (several tests read it)."""
    mesh = _mesh(nodes)
    e = E_GPU * nodes * LOCAL

    def fwd(x, ids, wts, wg, wu, wd):
        return moe_ffn(
            x,
            ids,
            wts,
            wg,
            wu,
            wd,
            mesh=mesh,
            expert_axis=AXES,
            routing=routing,
            ring=ring,
            gmm_impl="xla",
        )

    def loss(x, ids, wts, wg, wu, wd):
        return jnp.sum(fwd(x, ids, wts, wg, wu, wd).astype(jnp.float32) ** 2)

    fn = jax.grad(loss, argnums=(0, 2, 3, 4, 5)) if backward else fwd
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        return (
            jax.jit(fn)
            .trace(*_args(mesh, e))
            .lower()
            .compile(compiler_options=XLA_OPTIONS)
            .as_text()
        )


@pytest.mark.parametrize("nodes,routing", [(2, "expert"), (4, "token")])
def test_every_inter_node_transfer_hides_behind_a_round(nodes, routing):
    """fwd+bwd: every collective permute that crosses hosts starts before at least L - 1 = 7
    hops of compute and is waited for after them, except one per pass (forward, backward) at
    most: the accumulators' last trip home, which nothing is left to hide behind (as in the
    flat ring); or, at 2 hosts, where a pass's two rounds are independent (a ring of two: nothing
    trails), XLA may run the visiting payload's round first, hide the trip home behind the
    owner's round and leave the payload's transfer before it instead (token routing did).

    [2-token] is covered by these two: its outer ring of two takes `dispatch/ring.py`'s
    `n == 2` path with a trailing accumulator, which [2-expert]'s backward (its dW accumulators
    travel) takes too, and its token payload and accumulators are [4-token]'s (the routing
    chooses what travels, not how the rounds are relayed)."""
    found = overlap.cross_host_transfers(
        _compiled(nodes, routing, "hierarchical"), hlo.host_of(_mesh(nodes))
    )
    waits = [t for t in found if t.hops < LOCAL - 1]
    assert len(found) > len(waits), found
    assert len(waits) <= 2, waits


# The forward-only programs the two tests below read: at 4 hosts, one mesh for what the byte
# counts check (the same code at any host count; [2] of the bytes test is covered by [4], where
# rounds and hops differ more), and the flat ring's the negative control reads too.
BYTES_NODES = 4


def test_the_flat_ring_hides_each_transfer_behind_one_hop_only():
    """The same check fails on the flat ring: its boundary transfers each have one hop. Read
    from the flat ring's forward at 4 hosts, the program the byte counts below read (this test
    compiled the 2-host fwd+bwd of its own before; the forward's boundary transfers are the
    same kind as the backward's)."""
    program = _compiled(BYTES_NODES, "expert", "flat", backward=False)
    found = overlap.cross_host_transfers(program, hlo.host_of(_mesh(BYTES_NODES)))
    assert [t for t in found if 0 < t.hops < LOCAL - 1], found


def test_bytes_across_hosts_per_hop_and_per_round():
    """Forward, expert routing: a partition is E_GPU experts x (gate, up, down) bf16. The flat ring
    sends one per hop (N - 1 hops) across hosts from each of the `nodes` boundary GPUs and none
    from the others; the hierarchical ring one per round (nodes - 1 rounds) from every GPU, and
    N - 1 - (nodes - 1) within hosts. At 4 hosts (also covers what [2] checked: the same code)."""
    nodes = BYTES_NODES
    host_of = hlo.host_of(_mesh(nodes))
    n = nodes * LOCAL
    part = E_GPU * 3 * H * F * 2
    flat = hlo.link_bytes(_compiled(nodes, "expert", "flat", backward=False), host_of)
    boundary = [i for i in range(n) if i % LOCAL == LOCAL - 1]
    assert [i for i, b in enumerate(flat.inter) if b] == boundary
    assert {flat.inter[i] for i in boundary} == {(n - 1) * part}
    hier = hlo.link_bytes(_compiled(nodes, "expert", "hierarchical", backward=False), host_of)
    assert set(hier.inter) == {(nodes - 1) * part}
    assert set(hier.intra) == {nodes * (LOCAL - 1) * part}
    assert flat.max_inter / hier.max_inter == (n - 1) / (nodes - 1)
