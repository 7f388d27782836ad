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

from relaymoe_jax.analysis import hlo
from relaymoe_jax.dispatch.chunking import default_chunk
from relaymoe_jax.dispatch.mode import routing_volumes
from relaymoe_jax.op import moe_ffn
from relaymoe_jax.xla_options import XLA_OPTIONS

VARIANTS = {  # name -> moe_ffn keyword arguments
    "ring-expert": dict(dispatcher="ring", routing="expert"),
    "ring-token": dict(dispatcher="ring", routing="token"),
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
    biases: bool = False  # the experts have b_gate, b_up, b_down (GPT-OSS)

    @property
    def chunk_rows(self):
        return self.chunk or default_chunk(
            self.tokens_per_device, self.top_k, self.ep, self.experts
        )


def expanded_bytes(s: LayerShape) -> int:
    """One top-k-expanded activation [T*k, H] in the layer dtype: the all-to-all's unit."""
    return s.tokens_per_device * s.top_k * s.hidden * jnp.dtype(s.dtype).itemsize


def ring_floor_bytes(s: LayerShape, backward: bool = True, routing: str = "expert") -> int:
    """The live set of the ring's schedule at its peak (temp bytes, per device), every buffer in
    flight counted as live together; XLA overlaps some of them, so measured temporaries can come
    in up to ~15% under it (tests/test_memory.py).

    Both modes hold one chunk's intermediates: forward gate and up [C,F] f32 (both live until the
    activation); backward x, dy, dx rows [C,H] + gate, up, act, d act [C,F] in f32.
    Expert routing (W_p = (E/EP) * 3 * H * F weights of one partition):
      forward:  out accumulator [T,H] f32 + visiting and next partition 2*W_p
      fwd+bwd:  dy [T,H] + dx accumulator [T,H] f32 + pair order and d expert_weights [T*k]*(4+4)
                + visiting and next partition 2*W_p + dW partial and travelling accumulator
                2*W_p f32
    Token routing (a token partition's metadata: pair order [T*k] int32 + router weights [T*k]):
      forward:  visiting and next tokens 2*[T,H] + their metadata + output accumulator and its
                transfer 2*[T,H] f32 + this hop's partial output [T,H] f32 (the accumulator
                trails one hop so that its transfer overlaps the compute; dispatch/ring.py)
      fwd+bwd:  visiting and next tokens and dy 4*[T,H] + their metadata + dx accumulator [T,H]
                f32 + d expert_weights [T*k] f32 + this hop's partials of both, [T,H] + [T*k]
                f32 + the local dW accumulator W_p f32
    """
    if routing not in ("expert", "token"):
        raise ValueError(f"routing={routing!r}: expected 'expert' or 'token'")
    b = jnp.dtype(s.dtype).itemsize
    t, h, f, c, k = s.tokens_per_device, s.hidden, s.ffn, s.chunk_rows, s.top_k
    w_p = s.experts // s.ep * 3 * h * f
    chunk_fwd, chunk_bwd = c * 2 * f * 4, c * (2 * h * b + h * 4 + 4 * f * 4)
    if routing == "token":
        meta = 2 * t * k * (4 + b)
        if not backward:
            return 2 * t * h * b + meta + 3 * t * h * 4 + chunk_fwd
        return 4 * t * h * b + meta + 2 * (t * h * 4 + t * k * 4) + w_p * 4 + chunk_bwd
    if not backward:
        return t * h * 4 + 2 * w_p * b + chunk_fwd
    return t * h * (b + 4) + t * k * 8 + 2 * w_p * b + 2 * w_p * 4 + chunk_bwd


def table2(s: LayerShape):
    """Paper Table 2's per-hop volumes for this shape (router weights in the layer dtype)."""
    return routing_volumes(
        experts=s.experts,
        top_k=s.top_k,
        hidden=s.hidden,
        ffn=s.ffn,
        ep=s.ep,
        tokens_per_device=s.tokens_per_device,
        act_dtype=s.dtype,
        router_dtype=s.dtype,
    )


def abstract_args_unsharded(s: LayerShape):
    """Global (x, ids, wts, w_gate, w_up, w_down) shapes and dtypes, then (b_gate, b_up, b_down)
    when `s.biases`."""
    dt, t = jnp.dtype(s.dtype), s.tokens_per_device * s.ep
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, s.hidden), dt),
        sds((t, s.top_k), jnp.int32),
        sds((t, s.top_k), dt),
        sds((s.experts, s.hidden, s.ffn), dt),
        sds((s.experts, s.hidden, s.ffn), dt),
        sds((s.experts, s.ffn, s.hidden), dt),
    )
    if s.biases:
        e = s.experts
        args += (sds((e, s.ffn), dt), sds((e, s.ffn), dt), sds((e, s.hidden), dt))
    return args


def abstract_args(s: LayerShape, mesh, axis="expert"):
    """`abstract_args_unsharded` placed as moe_ffn wants them: everything split over `axis`."""
    sharding = NamedSharding(mesh, P(axis))
    return tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        for a in abstract_args_unsharded(s)
    )


def layer_fns(s: LayerShape, mesh, variant: str, axis="expert", extra=None):
    """(forward, forward+backward) callables over (x, ids, wts, w_gate, w_up, w_down), then the
    three biases when `s.biases` (their gradients taken too).

    `extra`: more `moe_ffn` keyword arguments on top of the variant's (e.g. gmm_impl,
    activation)."""
    kw = dict(VARIANTS[variant], mesh=mesh, expert_axis=axis, **(extra or {}))
    if variant.startswith("ring"):
        kw.setdefault("chunk_size", s.chunk)

    def fwd(x, ids, wts, wg, wu, wd, *b):
        return moe_ffn(x, ids, wts, wg, wu, wd, **kw, **dict(zip(("b_gate", "b_up", "b_down"), b)))

    def loss(x, wts, wg, wu, wd, *b_ids):
        *b, ids = b_ids
        y = fwd(x, ids, wts, wg, wu, wd, *b).astype(jnp.float32)
        return 0.5 * jnp.sum(y * y)  # dy = y: a real [T, H] cotangent buffer

    grad = jax.value_and_grad(loss, argnums=tuple(range(5 + 3 * s.biases)))
    return fwd, lambda x, ids, wts, wg, wu, wd, *b: grad(x, wts, wg, wu, wd, *b, ids)


def measure_layer(s: LayerShape, mesh, variant: str, axis="expert", extra=None):
    """One variant, compile-only for `mesh`'s devices (emulated CPUs, or abstract GPUs from
    `relaymoe_jax.gpu_mesh`: then XLA:GPU's buffer assignment, with gmm_impl "auto" the Pallas
    kernel): {"fwd", "fwdbwd"} temp bytes per device, and the bytes one
    ring hop sends, read from the compiled HLO's collective permutes: "hop_fwd" (the forward
    loop body) and "hop_bwd" (the fwd+bwd program's loop bodies minus the forward's). 0 for the
    all-to-all, which has no ring. `extra`: as `layer_fns`."""
    fwd, fwdbwd = layer_fns(s, mesh, variant, axis, extra)
    args = abstract_args(s, mesh, axis)
    with jax.set_mesh(mesh):  # an abstract GPU mesh (`gpu_mesh`): Pallas needs the context
        c_fwd, c_all = (
            jax.jit(f).trace(*args).lower().compile(compiler_options=XLA_OPTIONS)
            for f in (fwd, fwdbwd)
        )
    return read_compiled(c_fwd, c_all)


def read_compiled(c_fwd, c_all):
    """`measure_layer`'s figures from the compiled forward and forward+backward."""
    hop_fwd = sum(hlo.loop_permute_bytes(c_fwd.as_text()))
    return {
        "fwd": c_fwd.memory_analysis().temp_size_in_bytes,
        "fwdbwd": c_all.memory_analysis().temp_size_in_bytes,
        "hop_fwd": hop_fwd,
        "hop_bwd": sum(hlo.loop_permute_bytes(c_all.as_text())) - hop_fwd,
    }


def mib(nbytes):
    return nbytes / 2**20


def ratio(a, b):
    return a / b if b else math.inf
