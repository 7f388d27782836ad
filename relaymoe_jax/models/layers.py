"""Building blocks of the decoder: sharded parameters, RMSNorm, RoPE, causal attention, SwiGLU.

Parameters are created already sharded: each is drawn by a `jax.jit` whose `out_shardings` is its
`NamedSharding` (never materialised whole on one device), and carries `out_sharding` (the mesh
`PartitionSpec`, used by NNX) and `logical_axes` (its logical names, see `sharding.py`) metadata.
"""

import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.kernels.attention.common import HEAD_DIMS
from relaymoe_jax.models.attention import blockwise_attention, check_segment_ids
from relaymoe_jax.models.sharding import AxisRules, constrain, is_explicit
from relaymoe_jax.util.platform import platform

F32 = jnp.float32


class ExpertBias(nnx.Variable):
    """The aux-loss-free expert bias: not a `nnx.Param`, so the optimizer never touches it."""


def param(
    rules: AxisRules,
    rngs: nnx.Rngs | None,
    shape,
    names,
    dtype,
    *,
    init="normal",
    std=0.02,
    kind=nnx.Param,
):
    """A parameter of `shape` with logical axis `names`, created sharded per `rules`."""
    sharding = rules.sharding(*names)
    make = _initializer(tuple(shape), jnp.dtype(dtype), sharding, init, float(std))
    value = make(rngs.params()) if init == "normal" else make()
    return kind(value, out_sharding=sharding.spec, mesh=rules.mesh, logical_axes=tuple(names))


@functools.cache
def _initializer(shape, dtype, sharding, init, std):
    """A jitted initializer whose output is born sharded (cached: one compile per kind)."""
    if init == "normal":
        return jax.jit(
            lambda k: (std * jax.random.normal(k, shape, F32)).astype(dtype), out_shardings=sharding
        )
    fill = {"ones": 1.0, "zeros": 0.0}[init]
    return jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=sharding)


@functools.cache
def _layer_writer(sharding: NamedSharding):
    """buf[i] = v for a stacked buffer `buf` [L, ...] on `sharding`, in place (donated). Both
    are put on their sharding first: under `nnx.eval_shape` the (abstract) values need not carry
    their mesh sharding type yet, which an Explicit mesh's dynamic_update_slice requires."""
    row = P(*tuple(sharding.spec)[1:])

    def write(buf, v, i):
        buf = constrain(buf, sharding.mesh, sharding.spec)
        v = constrain(v.astype(buf.dtype), sharding.mesh, row)
        return jax.lax.dynamic_update_index_in_dim(buf, v, i, 0)

    return jax.jit(write, out_shardings=sharding, donate_argnums=0)


def stack_modules(make, n: int, rules: AxisRules, axis: str):
    """The module `make(0)` with each of its variables replaced by the stack over
    `make(0), ..., make(n - 1)` of that variable, on a new leading dimension of size `n` named
    `axis` (a logical name of `sharding.py`; the `logical_axes` and `out_sharding` metadata get
    it too, and the value is placed on `rules.sharding(axis, *names)`).

    The modules are made in order (so they draw from a shared `nnx.Rngs` exactly as `n` separate
    modules would) and each is written into preallocated stacks (donated) and dropped: memory
    holds the stacks plus one module. Works on abstract values too (inside `nnx.eval_shape`)."""

    def variables(module):
        return {path: v for path, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}

    first = make(0)
    template = variables(first)
    stacks, shardings = {}, {}
    for path, var in template.items():
        value = var.get_value()
        names = (axis, *var.get_metadata()["logical_axes"])
        shardings[path] = rules.sharding(*names)
        buf = _initializer(
            (n, *value.shape), jnp.dtype(value.dtype), shardings[path], "zeros", 0.0
        )()
        stacks[path] = _layer_writer(shardings[path])(buf, value, 0)
    for i in range(1, n):
        found = variables(make(i))
        if found.keys() != template.keys():
            raise ValueError(
                f"stack_modules: module {i} differs in structure from module 0 "
                f"at {sorted(map(str, found.keys() ^ template.keys()))}"
            )
        for path, var in found.items():
            stacks[path] = _layer_writer(shardings[path])(stacks[path], var.get_value(), i)
    for path, var in template.items():
        var.set_value(stacks[path])
        var.set_metadata("out_sharding", shardings[path].spec)
        var.set_metadata("logical_axes", (axis, *var.get_metadata()["logical_axes"]))
    return first


class RMSNorm(nnx.Module):
    """Hugging Face's Qwen RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, then weight * x."""

    def __init__(self, size, *, eps, rules, dtype, axis="embed"):
        self.eps = eps
        self.weight = param(rules, None, (size,), (axis,), dtype, init="ones")

    def __call__(self, x):
        x32 = x.astype(F32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class MLP(nnx.Module):
    """Dense SwiGLU down(silu(x @ gate) * (x @ up)): dense layers and Qwen2's shared expert."""

    def __init__(self, hidden, ffn, *, rules, rngs, dtype, std):
        self.gate_proj = param(rules, rngs, (hidden, ffn), ("embed", "ffn"), dtype, std=std)
        self.up_proj = param(rules, rngs, (hidden, ffn), ("embed", "ffn"), dtype, std=std)
        self.down_proj = param(rules, rngs, (ffn, hidden), ("ffn", "embed"), dtype, std=std)

    def __call__(self, x_th):
        gate = jnp.dot(x_th, self.gate_proj[...])
        up = jnp.dot(x_th, self.up_proj[...])
        return jnp.dot(jax.nn.silu(gate) * up, self.down_proj[...])


def embed_lookup(table_vh, ids_bs, mesh, spec):
    """table[ids] on `spec`. An Explicit mesh cannot infer a gather's output sharding from
    indices sharded over several axes, so it is given."""
    if is_explicit(mesh):
        return table_vh.at[ids_bs].get(out_sharding=NamedSharding(mesh, spec))
    return constrain(jnp.take(table_vh, ids_bs, axis=0), mesh, spec)


def rope_cos_sin(positions, head_dim: int, theta: float, dtype):
    """Hugging Face's default RoPE tables: cos, sin [..., head_dim] with the halves repeated."""
    inv_freq_d = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim))
    freqs = positions.astype(F32)[..., None] * inv_freq_d
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_bsnd, cos_bsd, sin_bsd):
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] (HF's layout)."""
    half = x_bsnd.shape[-1] // 2
    rot = jnp.concatenate([-x_bsnd[..., half:], x_bsnd[..., :half]], axis=-1)
    return x_bsnd * cos_bsd[:, :, None, :] + rot * sin_bsd[:, :, None, :]


# `causal_attention`'s impl (ModelConfig.attention_impl): "auto" is "pallas" where the code
# compiles for a GPU and the kernel takes the heads (`resolve_attention_impl`), else "chunked"
AttentionImpl = Literal["xla", "chunked", "pallas", "pallas-interpret", "auto"]
ATTENTION_IMPLS: tuple[str, ...] = typing.get_args(AttentionImpl)
BLOCKWISE_IMPLS = ("chunked", "pallas", "pallas-interpret", "auto")  # attend blocks, by index


def resolve_attention_impl(impl: str, head_dim: int, dtype) -> str:
    """The concrete implementation of `impl` for q's head_dim and dtype: "auto" is "pallas"
    when the code compiles for a GPU (the mesh in context, `util.platform`) and the kernel takes
    the head_dim and dtype (`kernels.attention`: 64 or 128, bf16 or f16), else "chunked"."""
    if impl != "auto":
        return impl
    takes = head_dim in HEAD_DIMS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "pallas" if takes and platform() == "gpu" else "chunked"


def causal_attention(
    q_bsnd,
    k_bskd,
    v_bskd,
    impl: str = "xla",
    block_k: int = 512,
    segment_ids=None,
    kv_segment_ids=None,
):
    """Causal grouped-query attention, softmax scale head_dim**-0.5, in the inputs' dtype.

    impl="xla": `jax.nn.dot_product_attention` with its default implementation, which in jax 0.12
    is XLA's attention on every backend (its selector's "automatic" choice is XLA for now): it
    materialises [B, N, S, S] scores, and its backward takes the score gradient in float32 (two
    f32 XLA dots per layer in the compiled bf16 train step; no Pallas kernel involved).
    impl="chunked": `attention.chunked_causal_attention` (query and key blocks of `block_k`, only
    the pairs of blocks holding a visible pair, online softmax, a custom_vjp keeping only q, k,
    v, o and the log-sum-exp): O(block_k^2) temporaries and the causal FLOPs, for long
    sequences.
    impl="pallas": the same blocks and skipping in our Pallas Mosaic GPU flash-attention kernel
    (`kernels.attention`: Hopper wgmma, bf16/f16 operands, head_dim 64 or 128; its own blocks,
    `block_k` unused); "pallas-interpret" runs it in the GPU interpreter on CPU (tests);
    "auto" is "pallas" on GPUs and "chunked" elsewhere (`resolve_attention_impl`).
    segment_ids [B, S] (optional, packed documents): query i sees key j only if their ids are
    equal, in every implementation (the XLA one through a [B, 1, S, S] boolean mask);
    kv_segment_ids: the same ids on the keys' sharding where it differs from the queries'
    (context parallelism), default segment_ids.
    """
    seg_bs = seg_kv = None
    if segment_ids is not None:
        seg_bs = check_segment_ids(segment_ids, q_bsnd.shape[:2])
        seg_kv = segment_ids if kv_segment_ids is None else kv_segment_ids
        seg_kv = check_segment_ids(seg_kv, k_bskd.shape[:2])
    return attend(q_bsnd, k_bskd, v_bskd, impl, block_k, seg_bs, seg_kv)


def attend(q_bsnd, k_bskd, v_bskd, impl: str, block_k: int, seg_bs, seg_kv, index_bs=None):
    """`causal_attention` on segment ids already checked (`check_segment_ids`: int32 [B, S] for
    the queries and the keys, or both None): what the model calls in every layer, having checked
    its segment ids once at its entry. `index_bs` (blockwise impls only): each token's index in
    the sequence when the tokens are not in order (the zigzag layout, `models/context.py`)."""
    impl = resolve_attention_impl(impl, q_bsnd.shape[-1], q_bsnd.dtype)
    if impl != "xla":  # names its own residuals o and lse "attn_out" and "attn_lse"
        return blockwise_attention(
            q_bsnd,
            k_bskd,
            v_bskd,
            block_k=block_k,
            scale=None,
            seg_bs=seg_bs,
            seg_kv=seg_kv,
            q_index=index_bs,
            k_index=index_bs,
            kernel={"chunked": "xla"}.get(impl, impl),
        )
    if index_bs is not None:
        raise ValueError(f"attention_impl={impl!r} attends in place order: no index_bs")
    mask = None if seg_bs is None else (seg_bs[:, :, None] == seg_kv[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(
        q_bsnd, k_bskd, v_bskd, mask=mask, scale=q_bsnd.shape[-1] ** -0.5, is_causal=True
    )
    return checkpoint_name(out, "attn_out")
