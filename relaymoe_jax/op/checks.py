"""Static checks of the op's arguments, before tracing: every bad input names itself.

Shared by `moe_ffn` (global arrays), `moe_ffn_local` (one device's shards) and `routing_plan`:
the mesh, the mesh axes, the arrays' ranks, shapes and dtypes, and the sizes that must divide.
The options are `op.options`' job. Each check returns what it found as a named record.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.dispatch.experts import BIAS_NAMES, Experts, check_experts_divide
from relaymoe_jax.quant import fp8


class Sizes(NamedTuple):
    """The sizes of one call's arrays (experts and ffn as passed: global, or one device's)."""

    lead: tuple[int, ...]  # x's leading (token) shape
    tokens: int  # their product
    hidden: int  # H
    top_k: int  # k
    experts: int  # E
    ffn: int  # F


class Dtypes(NamedTuple):
    x: jnp.dtype  # activations
    weights: jnp.dtype  # the expert weights (w_gate's)
    router: jnp.dtype  # expert_weights


def check_mesh(mesh) -> None:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")


def check_axes(names, expert_axis, expert_tensor_axis, *, dispatcher, gmm_impl) -> tuple:
    """The expert axes as a tuple; the expert-tensor axis checked against them."""
    ea = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
    if not ea or len(set(ea)) != len(ea) or any(a not in names for a in ea):
        raise ValueError(
            f"expert_axis={expert_axis!r}: expected an axis of the mesh, or a tuple "
            f"of distinct axes (mesh axes: {names})"
        )
    etp = expert_tensor_axis
    if etp is not None and (etp not in names or etp in ea):
        raise ValueError(
            f"expert_tensor_axis={etp!r}: expected None or a mesh axis other than "
            f"the expert axes {ea} (mesh axes: {names})"
        )
    if etp is not None and gmm_impl == "pallas-interpret" and dispatcher != "reference":
        raise ValueError(
            f"expert_tensor_axis={etp!r} with gmm_impl='pallas-interpret': the "
            "interpreter needs shard_map(check_vma=False) in jax 0.12, and the ETP "
            "reductions need check_vma=True; use gmm_impl='pallas' or 'xla'"
        )
    return ea


def check_interpret_vma(gmm_impl: str, typed: bool, *, who: str) -> None:
    """The Pallas interpreter under `shard_map(check_vma=True)`: refused (jax 0.12's interpreter
    fails there with a dynamic_slice type error)."""
    if gmm_impl == "pallas-interpret" and typed:
        raise ValueError(
            f"{who}(gmm_impl='pallas-interpret') under shard_map(check_vma=True): jax 0.12's "
            "Pallas interpreter needs check_vma=False; pass it to your shard_map, or use "
            "gmm_impl='xla' (the compiled gmm_impl='pallas' takes check_vma=True on GPUs)"
        )


def check_gmm_platform(gmm_impl: str, platform: str) -> None:
    """gmm_impl='mosaic' or 'pallas' (a compiled GPU kernel) where the call does not compile for
    a GPU."""
    if gmm_impl in ("mosaic", "pallas") and platform != "gpu":
        raise ValueError(
            f"gmm_impl={gmm_impl!r} compiles a GPU kernel, but this call compiles for "
            f"{platform!r}: use gmm_impl='{gmm_impl}-interpret' (the same kernel in its "
            "interpreter, slow: for tests), 'xla' or 'auto'"
        )


def check_interpret_devices(gmm_impl: str, devices: int) -> None:
    """gmm_impl='mosaic-interpret' on a mesh of several devices: refused (jax 0.12's Mosaic GPU
    interpreter runs one device only; several wait forever in a rendezvous)."""
    if gmm_impl == "mosaic-interpret" and devices > 1:
        raise ValueError(
            f"gmm_impl='mosaic-interpret' on a mesh of {devices} devices: jax 0.12's Mosaic GPU "
            "interpreter runs one device only (it would wait forever in a rendezvous); run it on "
            "a mesh of one device, or use 'pallas-interpret' or 'xla'"
        )


def check_token_axes(names, token_axes) -> tuple | None:
    """`token_axes` as a tuple of mesh axes (None stays None)."""
    if token_axes is None:
        return None
    token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
    for a in token_axes:
        if a not in names:
            raise ValueError(f"token_axes: {a!r} is not an axis of the mesh {names}")
    return token_axes


def _rank(a, name, want) -> tuple:
    s = getattr(a, "shape", None)
    if s is None or len(s) != want:
        raise ValueError(f"{name}: expected a rank-{want} array, got shape {s}")
    return tuple(s)


def _floating(**arrays) -> None:
    for name, a in arrays.items():
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {a.dtype}")


def _token_shape(x) -> tuple:
    xs = getattr(x, "shape", None)
    if xs is None or len(xs) < 2:
        raise ValueError(
            f"x: expected an array [..., hidden] with at least one token dimension "
            f"(e.g. [tokens, hidden] or [batch, seq, hidden]), got shape {xs}"
        )
    return tuple(xs)


def _check_router(xs, ids, wts) -> int:
    """expert_ids and expert_weights [..., k] against x's leading shape; returns k."""
    lead = xs[:-1]
    ids_shape = getattr(ids, "shape", None)
    if ids_shape is None or len(ids_shape) != len(xs):
        raise ValueError(
            f"expert_ids: shape {ids_shape}, expected [..., top_k] with x's leading "
            f"shape {lead} (x {xs})"
        )
    *lead_i, k = ids_shape
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids: expected an integer dtype, got {ids.dtype}")
    if tuple(lead_i) != lead:
        what = (
            f"{lead_i[0]} tokens, but x has {lead[0]}"
            if len(lead) == 1
            else f"leading shape {tuple(lead_i)}, but x has {lead}"
        )
        raise ValueError(f"expert_ids: {what} (x {xs}, ids {ids.shape})")
    if tuple(wts.shape) != (*lead, k):
        raise ValueError(
            f"expert_weights: shape {wts.shape}, expected {(*lead, k)} like expert_ids"
        )
    return k


def _check_weights(h, w_gate, w_up, w_down) -> tuple[int, int]:
    """w_gate, w_up [E, H, F] and w_down [E, F, H]; returns (E, F)."""
    e, hg, f = _rank(w_gate, "w_gate", 3)
    if hg != h:
        raise ValueError(f"w_gate: hidden size {hg} does not match x's {h} (w_gate {w_gate.shape})")
    if tuple(w_up.shape) != (e, h, f):
        raise ValueError(f"w_up: shape {w_up.shape}, expected {(e, h, f)} like w_gate")
    if tuple(w_down.shape) != (e, f, h):
        raise ValueError(f"w_down: shape {w_down.shape}, expected {(e, f, h)}")
    return e, f


def check_arrays(x, ids, wts, experts: Experts) -> Sizes:
    """Ranks, shapes and dtypes: x [..., H], ids and weights [..., k], w_gate and w_up [E, H, F],
    w_down [E, F, H] (E and F as passed: global or one device's shard; the biases are
    `check_biases`')."""
    w_gate, w_up, w_down = experts.weights
    xs = _token_shape(x)
    _rank(w_gate, "w_gate", 3)
    _floating(x=x, expert_weights=wts, w_gate=w_gate, w_up=w_up, w_down=w_down)
    k = _check_router(xs, ids, wts)
    e, f = _check_weights(xs[-1], w_gate, w_up, w_down)
    t = math.prod(xs[:-1])
    if t == 0:
        raise ValueError(f"x: shape {xs} has no tokens")
    return Sizes(xs[:-1], t, xs[-1], k, e, f)


def check_biases(sizes: Sizes, experts: Experts) -> None:
    """The given biases: b_gate, b_up [E, F] and b_down [E, H] (E and F as the weights are passed:
    global, or one device's)."""
    e, f, h = sizes.experts, sizes.ffn, sizes.hidden
    wants = (((e, f), "[num_experts, ffn]"),) * 2 + (((e, h), "[num_experts, hidden]"),)
    for name, b, (want, what) in zip(BIAS_NAMES, experts.biases, wants):
        if b is None:
            continue
        if tuple(getattr(b, "shape", None) or ()) != want:
            raise ValueError(
                f"{name}: shape {getattr(b, 'shape', None)}, expected {want} = {what} "
                f"(w_gate {tuple(experts.w_gate.shape)})"
            )
        _floating(**{name: b})


def dtypes(x, wts, w_gate) -> Dtypes:
    return Dtypes(jnp.dtype(x.dtype), jnp.dtype(w_gate.dtype), jnp.dtype(wts.dtype))


def check_sizes(sizes: Sizes, *, ep, expert_axis, etp, etp_size, local=False) -> None:
    """E over the expert axes, F over the expert-tensor axis, k against E (global sizes; with
    `local`, experts and ffn are one device's share: E is checked times `ep`, F not at all)."""
    num_experts = sizes.experts * (ep if local else 1)
    if sizes.top_k > num_experts:
        raise ValueError(
            f"top_k={sizes.top_k} (expert_ids.shape[-1]) exceeds num_experts={num_experts}"
        )
    check_experts_divide(num_experts, ep, axis=f"expert_axis {expert_axis!r}")
    if not local and sizes.ffn % etp_size:
        raise ValueError(
            f"w_gate: ffn size {sizes.ffn} is not divisible by the size {etp_size} of "
            f"expert_tensor_axis {etp!r}"
        )


def check_fp8_blocks(sizes: Sizes, *, expert_fp8: bool, etp, etp_size, local=False) -> None:
    """With `expert_fp8` and an expert-tensor axis, each device's ffn slice must be whole
    128-column blocks, so that the blocks it quantises are the whole matrix's (every dispatcher,
    and the reference, then round the same values). `local`: `sizes.ffn` is the slice."""
    if not expert_fp8 or etp_size == 1:
        return
    block = fp8.BLOCK
    ffn_slice = sizes.ffn if local else sizes.ffn // etp_size
    if ffn_slice % block:
        raise ValueError(
            f"expert_fp8=True with expert_tensor_axis {etp!r}: each device's ffn slice "
            f"({ffn_slice} = ffn / {etp_size}) must be a multiple of the {block}-column "
            f"quantisation block, so that its blocks are the whole matrix's; use an ffn size "
            f"that divides so, or no expert_tensor_axis"
        )
