"""Memory-efficient causal grouped-query attention for long sequences, in pure JAX.

`chunked_causal_attention(q_bsnd, k_btkd, v_btkd, block_k=512)` equals
`jax.nn.dot_product_attention(q, k, v, is_causal=True)` (N query heads, K kv heads, K divides N,
query head n reads kv head n // (N // K)) without ever building the [B, N, S, S] scores.

It cuts the queries into blocks of `block_q` and the keys into blocks of `block_k` and computes
only the pairs of blocks that hold a visible (query, key) pair (`kernels/attention/blocks.py`):
under the causal rule about half of them, and with packed documents only those within one
document. Two cores compute them (`kernel`): `attention_xla` (XLA: a custom_vjp whose forward
and backward scan one side's blocks with a `fori_loop` over each block's visible partners;
temporaries a few [B, block_q, N, block_k] float32 blocks) and `kernels.attention` (our Pallas
Mosaic GPU flash-attention kernels, blocks of 64, on Hopper GPUs). Both keep q, k, v, o and
the float32 log-sum-exp between forward and backward, named "attn_out" and "attn_lse"
(`checkpoint_name`).

Token indices. Causality compares each token's index in its sequence: query i sees key j iff
k_index[j] <= q_index[i] (and, with segment ids, equal ids). By default the indices are 0, 1,
... along each side; given explicitly, queries and keys can sit anywhere in the sequence (a
device's share under context parallelism, a reordered sequence). Keys must then be given in
order of index for the causal skipping to be exact (it stays correct otherwise, visiting more).

Packed sequences. With `segment_ids` [B, S] (int; documents packed into one row, e.g. 1, 1, 2, 2,
2, 0 for padding), query i also sees key j only if segment_ids[i] == segment_ids[j]: attention
stays inside a document, and pairs of blocks from different documents are skipped.

Sequence length. S need not be a multiple of the blocks: the padded queries see nothing and the
padded keys are seen by none, and neither is returned.

Sharding. It works on global arrays. On an Explicit mesh whose axes shard q along S (context
parallelism), it runs under a `shard_map`: k and v are gathered along their sequence (resharded
if they are not already), each device attends its own queries to all keys with its queries'
indices (its shard's offset), so each device skips the blocks its own queries do not see. The
batch and head axes may be sharded too, the kv heads as the query heads (tensor parallel). With
an Auto mesh it leaves the partitioning to XLA. The Pallas kernel (`kernel="pallas"`) runs under
that shard_map whenever q is sharded at all, on each device's arrays.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.kernels.attention import api
from relaymoe_jax.kernels.attention import interpret as interpreter
from relaymoe_jax.kernels.attention.blocks import default_index
from relaymoe_jax.models import attention_xla
from relaymoe_jax.util.tracing import allow_ordered_io_in_remat, concrete_mesh
from relaymoe_jax.util.typed import varying_like


def chunked_causal_attention(
    q_bsnd,
    k_btkd,
    v_btkd,
    *,
    block_k: int = 512,
    block_q: int | None = None,
    scale=None,
    segment_ids=None,
    kv_segment_ids=None,
    q_index=None,
    k_index=None,
):
    """Causal GQA attention o [B, S, N, D] in the inputs' dtype, over blocks of `block_q`
    queries (default `block_k`) and `block_k` keys, skipping the pairs of blocks nothing sees.

    q [B, S, N, D], k and v [B, T, K, D] with K dividing N (T = S unless indices say where the
    queries sit); `scale` defaults to D**-0.5; `segment_ids` [B, S] int, optional: attention
    within equal ids only (packed documents); `kv_segment_ids` [B, T] the keys' ids, default
    `segment_ids` (required when T != S); `q_index` [B, S] and `k_index` [B, T] int: each token's
    index in the sequence, default 0, 1, ... (see the module docstring).
    Softmax statistics and accumulators are float32. Differentiable (custom VJP; the backward
    recomputes the probabilities block by block).
    """
    (b, s), t = q_bsnd.shape[:2], k_btkd.shape[1]
    seg_bs = seg_kv = None
    if segment_ids is not None:
        seg_bs = check_segment_ids(segment_ids, (b, s))
        if kv_segment_ids is None and t != s:
            raise ValueError(
                f"kv_segment_ids: required when the keys ({t}) are not the queries ({s})"
            )
        seg_kv = check_per_token(
            "kv_segment_ids", segment_ids if kv_segment_ids is None else kv_segment_ids, (b, t)
        )
    elif kv_segment_ids is not None:
        raise ValueError("kv_segment_ids given without segment_ids (the queries' ids)")
    qi = None if q_index is None else check_per_token("q_index", q_index, (b, s))
    ki = None if k_index is None else check_per_token("k_index", k_index, (b, t))
    return blockwise_attention(
        q_bsnd,
        k_btkd,
        v_btkd,
        block_k=block_k,
        block_q=block_q,
        scale=scale,
        seg_bs=seg_bs,
        seg_kv=seg_kv,
        q_index=qi,
        k_index=ki,
    )


def blockwise_attention(
    q_bsnd,
    k_btkd,
    v_btkd,
    *,
    block_k: int,
    scale,
    seg_bs,
    seg_kv,
    block_q: int | None = None,
    q_index=None,
    k_index=None,
    kernel: str = "xla",
):
    """`chunked_causal_attention` on per-token arrays already checked (`check_per_token`: int32
    [B, S] for the queries, [B, T] for the keys, or None): what the model calls in every layer,
    having checked its segment ids once at its entry. `kernel`: the core that computes the
    blocks, "xla" (`attention_xla`, blocks of `block_q` x `block_k`) or "pallas" /
    "pallas-interpret" (`kernels.attention.flash_attention`, its own blocks; the GPU
    interpreter on CPU)."""
    b, s, n, d = q_bsnd.shape
    if k_btkd.shape != v_btkd.shape or k_btkd.shape[0] != b or k_btkd.shape[3] != d:
        raise ValueError(
            f"k {k_btkd.shape} and v {v_btkd.shape} must be [B, T, K, D] with "
            f"B, D of q {q_bsnd.shape}"
        )
    if k_btkd.shape[1] != s and q_index is None:
        raise ValueError(
            f"k has {k_btkd.shape[1]} positions and q {s}: give q_index (where the queries sit)"
        )
    if n % k_btkd.shape[2]:
        raise ValueError(f"kv heads {k_btkd.shape[2]} must divide query heads {n}")
    block_q = block_k if block_q is None else block_q
    for name, v in (("block_k", block_k), ("block_q", block_q)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    scale = d**-0.5 if scale is None else float(scale)
    core = _core(kernel, (min(block_q, s), min(block_k, k_btkd.shape[1])), scale, q_bsnd)
    args = (q_bsnd, k_btkd, v_btkd, seg_bs, seg_kv, q_index, k_index)
    spec = _spec(q_bsnd)
    seq = None if spec is None else spec[1]
    # the Pallas kernel takes each device's arrays whole: under a shard_map whenever q is sharded
    kernel_sharded = kernel != "xla" and spec is not None and any(spec)
    if seq or kernel_sharded:
        return _context_parallel(*args, seq, core)
    return _local(*args, None, core)


KERNELS = ("xla", "pallas", "pallas-interpret")


def _core(kernel: str, blocks, scale, q_bsnd):
    """f(q, k, v, qi, ki, qseg, kseg) -> o: the chosen core with its static arguments; the
    Pallas kernel's checks (head_dim, dtypes; the interpreter's mesh and threads,
    `kernels.attention.interpret`) run here, before tracing."""
    if kernel == "xla":
        return lambda *a: attention_xla.attention(*a, *blocks, scale)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    api.check_static(q_bsnd)
    interpret = kernel == "pallas-interpret"
    if interpret:  # where the interpreter runs; its io_callbacks under the model's checkpoints
        interpreter.check_devices(_mesh_size(q_bsnd), "a mesh")
        interpreter.check_threads()
        allow_ordered_io_in_remat()
    return lambda *a: api.flash_attention(*a, scale=scale, interpret=interpret)


def _local(q_bsnd, k_btkd, v_btkd, seg_bs, seg_kv, q_index, k_index, offset, core):
    """The attention of these queries to these keys; default indices from `offset` (a device's
    first query)."""
    b, s = q_bsnd.shape[:2]
    t = k_btkd.shape[1]
    qi = default_index(b, s, 0 if offset is None else offset) if q_index is None else q_index
    ki = default_index(b, t) if k_index is None else k_index
    return core(q_bsnd, k_btkd, v_btkd, qi, ki, seg_bs, seg_kv)


def _spec(x):
    """`x`'s PartitionSpec padded to its rank on an Explicit mesh, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names or not mesh.explicit_axes:
        return None
    return tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


def _mesh_size(x) -> int:
    """The devices of the mesh `x` is typed on (else of `jax.set_mesh`'s; 1 without a mesh): a
    jit on a mesh of several devices may partition the kernel's calls over all of them."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or not mesh.axis_names:
        mesh = concrete_mesh()
    return 1 if mesh is None or not mesh.axis_names else math.prod(mesh.shape.values())


def _context_parallel(q_bsnd, k_btkd, v_btkd, seg_bs, seg_kv, q_index, k_index, seq, core):
    """Under a shard_map over q's mesh (q sharded along the sequence over `seq`, or the Pallas
    kernel with q sharded at all: a kernel takes whole per-device arrays): each device's queries
    against all keys (gathered along the sequence)."""
    batch, _, heads, head_dim = _spec(q_bsnd)
    kv_heads = _spec(k_btkd)[2]
    if head_dim is not None:
        raise ValueError(f"q is sharded along head_dim ({head_dim}); attention needs it whole")
    if kv_heads != heads:
        raise ValueError(
            f"q's heads are sharded over {heads} but k's and v's over {kv_heads}: shard both "
            "head axes alike (query head n reads kv head n // (N // K) on each device)"
        )
    mesh = jax.typeof(q_bsnd).sharding.mesh
    q_spec, kv_spec = P(batch, seq, heads, None), P(batch, None, heads, None)
    q_tok, k_tok = P(batch, seq), P(batch, None)
    put = lambda a, spec: jax.sharding.reshard(a, NamedSharding(mesh, spec))
    k_btkd, v_btkd = put(k_btkd, kv_spec), put(v_btkd, kv_spec)
    arrays = {"q": q_bsnd, "k": k_btkd, "v": v_btkd}
    specs = {"q": q_spec, "k": kv_spec, "v": kv_spec}
    for name, a, spec in (
        ("seg_q", seg_bs, q_tok),
        ("seg_k", seg_kv, k_tok),
        ("qi", q_index, q_tok),
        ("ki", k_index, k_tok),
    ):
        if a is not None:
            arrays[name], specs[name] = put(a, spec), spec

    def local(arrays):
        g = arrays.get
        offset = None
        if g("qi") is None and seq:  # this device's first query: its shard of the sequence
            offset = lax.axis_index(seq) * arrays["q"].shape[1]
        q = g("q")  # the keys' side varies with the queries from here (its cotangent is summed)
        k, v, seg_k, ki = (
            None if a is None else varying_like(a, q) for a in map(g, "k v seg_k ki".split())
        )
        return _local(q, k, v, g("seg_q"), seg_k, g("qi"), ki, offset, core)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=q_spec)(arrays)


def check_per_token(name: str, a, shape):
    """`a`, one integer per token (segment ids, positions), as int32 [B, S]: a ValueError names
    another shape or a non-integer dtype (a float would be truncated)."""
    got = getattr(a, "shape", None)
    if got is None or tuple(got) != tuple(shape):
        raise ValueError(f"{name}: shape {got}, expected [batch, seq] = {tuple(shape)}")
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer dtype, got {a.dtype}")
    return a.astype(jnp.int32)


def check_segment_ids(segment_ids, shape):
    """`segment_ids` as int32 [B, S] (`check_per_token`)."""
    return check_per_token("segment_ids", segment_ids, shape)
