"""Per-device memory of one MoE layer from XLA's buffer assignment, and the ring's analytic floor.

All figures are per device. `measure_layer` compiles (never runs) the forward and the forward +
backward of `moe_ffn` from abstract shapes and reads `compiled.memory_analysis()`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.op import moe_ffn

VARIANTS = {   # name -> moe_ffn keyword arguments
    "ring": dict(dispatcher="ring"),
    "a2a-dropless": dict(dispatcher="alltoall"),
    "a2a-cap1.0": dict(dispatcher="alltoall", capacity_factor=1.0),
}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens_per_device: int
    ep: int
    dtype: str = "float32"
    chunk: int | None = None

    @property
    def chunk_rows(self):
        return self.chunk or -(-self.tokens_per_device * self.top_k // self.ep)


def expanded_bytes(s: LayerShape) -> int:
    """One top-k-expanded activation [T*k, H] in the layer dtype: the all-to-all's unit."""
    return s.tokens_per_device * s.top_k * s.hidden * jnp.dtype(s.dtype).itemsize


def ring_floor_bytes(s: LayerShape, backward: bool = True) -> int:
    """The live set the ring's schedule cannot avoid at its peak (temp bytes, per device).

    forward:  out accumulator [T,H] f32 + visiting and next partition 2*W_p
              + one chunk: gate and up [C,F] f32 (both live until the activation)
    fwd+bwd:  dy [T,H] + dx accumulator [T,H] f32 + pair order and d expert_weights [T*k]*(4+4)
              + visiting and next partition 2*W_p + dW partial and travelling accumulator 2*W_p f32
              + one chunk: x, dy, dx rows [C,H] + gate, up, act, d act [C,F] in f32
    with W_p = (E/EP) * 3 * H * F weights of one partition.
    """
    b = jnp.dtype(s.dtype).itemsize
    t, h, f, c = s.tokens_per_device, s.hidden, s.ffn, s.chunk_rows
    w_p = s.experts // s.ep * 3 * h * f
    if not backward:
        return t * h * 4 + 2 * w_p * b + c * 2 * f * 4
    return (t * h * (b + 4) + t * s.top_k * 8 + 2 * w_p * b + 2 * w_p * 4
            + c * (2 * h * b + h * 4 + 4 * f * 4))


def abstract_args(s: LayerShape, mesh, axis="expert"):
    dt = jnp.dtype(s.dtype)
    t = s.tokens_per_device * s.ep
    tok, exp = NamedSharding(mesh, P(axis)), NamedSharding(mesh, P(axis))
    sds = jax.ShapeDtypeStruct
    return (sds((t, s.hidden), dt, sharding=tok), sds((t, s.top_k), jnp.int32, sharding=tok),
            sds((t, s.top_k), dt, sharding=tok),
            sds((s.experts, s.hidden, s.ffn), dt, sharding=exp),
            sds((s.experts, s.hidden, s.ffn), dt, sharding=exp),
            sds((s.experts, s.ffn, s.hidden), dt, sharding=exp))


def layer_fns(s: LayerShape, mesh, variant: str, axis="expert"):
    """(forward, forward+backward) callables over (x, ids, wts, w_gate, w_up, w_down)."""
    kw = dict(VARIANTS[variant], mesh=mesh, expert_axis=axis)
    if variant == "ring":
        kw["chunk_size"] = s.chunk

    def fwd(x, ids, wts, wg, wu, wd):
        return moe_ffn(x, ids, wts, wg, wu, wd, **kw)

    def loss(x, wts, wg, wu, wd, ids):
        y = fwd(x, ids, wts, wg, wu, wd).astype(jnp.float32)
        return 0.5 * jnp.sum(y * y)      # dy = y: a real [T, H] cotangent buffer

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    return fwd, lambda x, ids, wts, wg, wu, wd: grad(x, wts, wg, wu, wd, ids)


def compiled_memory(fn, args):
    return jax.jit(fn).lower(*args).compile().memory_analysis()


def measure_layer(s: LayerShape, mesh, variant: str, axis="expert"):
    """{"fwd": temp bytes, "fwdbwd": temp bytes} for one variant, compile-only."""
    fwd, fwdbwd = layer_fns(s, mesh, variant, axis)
    args = abstract_args(s, mesh, axis)
    return {"fwd": compiled_memory(fwd, args).temp_size_in_bytes,
            "fwdbwd": compiled_memory(fwdbwd, args).temp_size_in_bytes}


def mib(nbytes):
    return nbytes / 2**20


def ratio(a, b):
    return a / b if b else math.inf
