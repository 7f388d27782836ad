"""Static checks of the op's arguments, before tracing: every bad input names itself.

Shared by `moe_ffn` (global arrays) and `moe_ffn_local` (one device's shards): the options, the
mesh axes, the arrays' ranks, shapes and dtypes, the sizes that must divide, and the ring's chunk
and routing mode for the tokens one ring member works on.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.dispatch.chunking import default_chunk
from relaymoe_jax.dispatch.mode import routing_volumes
from relaymoe_jax.kernels.gmm import MOE_IMPLS

DISPATCHERS = ("ring", "alltoall", "reference")
ROUTINGS = ("expert", "token", "auto")
INT32_MAX = 2**31 - 1


def check_options(*, dispatcher, routing, capacity_factor, chunk_size, gmm_impl):
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}: expected one of {DISPATCHERS}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    if routing != "auto" and dispatcher != "ring":
        raise ValueError(
            f"routing={routing!r} applies to dispatcher='ring' only (got "
            f"{dispatcher!r}); leave it at 'auto'"
        )
    if gmm_impl not in MOE_IMPLS:
        raise ValueError(f"gmm_impl={gmm_impl!r}: expected one of {MOE_IMPLS}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, (int, np.integer))
        or chunk_size < 1
    ):
        raise ValueError(f"chunk_size={chunk_size!r}: expected an int >= 1 (or None)")
    if chunk_size is not None and chunk_size > INT32_MAX:
        raise ValueError(
            f"chunk_size={chunk_size}: expected at most {INT32_MAX} (int32 indices); "
            "a chunk never holds more than the pairs of one device anyway"
        )
    if capacity_factor is not None:
        if dispatcher != "alltoall":
            raise ValueError(
                f"capacity_factor={capacity_factor!r} applies to "
                f"dispatcher='alltoall' only (got {dispatcher!r}): the ring is "
                "dropless by construction"
            )
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor!r}: expected > 0 or None")


def check_mesh(mesh):
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")


def check_axes(names, expert_axis, expert_tensor_axis, *, dispatcher, gmm_impl):
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


def check_arrays(x, ids, wts, w_gate, w_up, w_down):
    """Ranks, shapes and dtypes: x [..., H], ids and weights [..., k], w_gate and w_up [E, H, F],
    w_down [E, F, H] (E and F as passed: global or one device's shard). Returns
    (leading shape, tokens, H, k, E, F)."""

    def shape(a, name, want):
        s = getattr(a, "shape", None)
        if s is None or len(s) != want:
            raise ValueError(f"{name}: expected a rank-{want} array, got shape {s}")
        return tuple(s)

    def floating(a, name):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {a.dtype}")

    xs = getattr(x, "shape", None)
    if xs is None or len(xs) < 2:
        raise ValueError(
            f"x: expected an array [..., hidden] with at least one token dimension "
            f"(e.g. [tokens, hidden] or [batch, seq, hidden]), got shape {xs}"
        )
    *lead, h = xs
    lead = tuple(lead)
    ids_shape = getattr(ids, "shape", None)
    if ids_shape is None or len(ids_shape) != len(xs):
        raise ValueError(
            f"expert_ids: shape {ids_shape}, expected [..., top_k] with x's leading "
            f"shape {lead} (x {tuple(xs)})"
        )
    *lead_i, k = ids_shape
    e, hg, f = shape(w_gate, "w_gate", 3)
    floating(x, "x")
    floating(wts, "expert_weights")
    for a, name in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")):
        floating(a, name)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids: expected an integer dtype, got {ids.dtype}")
    if tuple(lead_i) != lead:
        what = (
            f"{lead_i[0]} tokens, but x has {lead[0]}"
            if len(lead) == 1
            else (f"leading shape {tuple(lead_i)}, but x has {lead}")
        )
        raise ValueError(f"expert_ids: {what} (x {xs}, ids {ids.shape})")
    if tuple(wts.shape) != (*lead, k):
        raise ValueError(
            f"expert_weights: shape {wts.shape}, expected {(*lead, k)} like expert_ids"
        )
    if hg != h:
        raise ValueError(f"w_gate: hidden size {hg} does not match x's {h} (w_gate {w_gate.shape})")
    if tuple(w_up.shape) != (e, h, f):
        raise ValueError(f"w_up: shape {w_up.shape}, expected {(e, h, f)} like w_gate")
    if tuple(w_down.shape) != (e, f, h):
        raise ValueError(f"w_down: shape {w_down.shape}, expected {(e, f, h)}")
    t = math.prod(lead)
    if t == 0:
        raise ValueError(f"x: shape {xs} has no tokens")
    return lead, t, h, k, e, f


def check_sizes(*, num_experts, top_k, ep, expert_axis, ffn, etp, etp_size, local=False):
    """E over the expert axes, F over the expert-tensor axis, k against E (global sizes; with
    `local`, ffn is one device's share and needs no check)."""
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} (expert_ids.shape[-1]) exceeds num_experts={num_experts}")
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the size {ep} of "
            f"expert_axis {expert_axis!r}"
        )
    if not local and ffn % etp_size:
        raise ValueError(
            f"w_gate: ffn size {ffn} is not divisible by the size {etp_size} of "
            f"expert_tensor_axis {etp!r}"
        )


def check_global(
    x,
    ids,
    wts,
    w_gate,
    w_up,
    w_down,
    *,
    mesh,
    expert_axis,
    expert_tensor_axis,
    token_axes,
    dispatcher,
    gmm_impl,
):
    """Everything static about `moe_ffn`'s global arrays and mesh (the options aside). Returns
    (expert axes, token axes or None, expert-axis size, ETP size, (H, k, E, F))."""
    check_mesh(mesh)
    names = tuple(mesh.axis_names)
    ea = check_axes(
        names, expert_axis, expert_tensor_axis, dispatcher=dispatcher, gmm_impl=gmm_impl
    )
    if token_axes is not None:
        token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
        for a in token_axes:
            if a not in names:
                raise ValueError(f"token_axes: {a!r} is not an axis of the mesh {names}")
    _, _, h, k, e, f = check_arrays(x, ids, wts, w_gate, w_up, w_down)
    etp = expert_tensor_axis
    etp_size = mesh.shape[etp] if etp is not None else 1
    ep = math.prod(mesh.shape[a] for a in ea)
    check_sizes(
        num_experts=e, top_k=k, ep=ep, expert_axis=expert_axis, ffn=f, etp=etp, etp_size=etp_size
    )
    return ea, token_axes, ep, etp_size, (h, k, e, f)


def ring_plan(
    *,
    routing,
    chunk_size,
    ring_tokens,
    num_experts,
    top_k,
    hidden,
    ffn,
    ep,
    etp_size,
    x_dtype,
    w_dtype,
    wts_dtype,
    hosts=1,
    hierarchical=False,
):
    """(chunk, RoutingVolumes, routing mode) for `ring_tokens` tokens per ring member.

    The default chunk is `dispatch.chunking.default_chunk` (at most the balanced share
    ceil(T * k / EP)); a given one is capped at the pairs a hop can hold (T * k), so no buffer is
    sized past what can exist."""
    pairs = ring_tokens * top_k
    chunk = (
        default_chunk(ring_tokens, top_k, ep, num_experts)
        if chunk_size is None
        else min(int(chunk_size), pairs)
    )
    vol = routing_volumes(
        experts=num_experts,
        top_k=top_k,
        hidden=hidden,
        ffn=ffn,
        ep=ep,
        etp=etp_size,
        tokens_per_device=ring_tokens,
        act_dtype=x_dtype,
        weight_dtype=w_dtype,
        router_dtype=wts_dtype,
        hosts=hosts,
        hierarchical=hierarchical,
    )
    return chunk, vol, vol.choice if routing == "auto" else routing
