"""Static checks of `moe_ffn`'s arguments, before tracing: every bad input names itself."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.dispatch.mode import routing_volumes
from relaymoe_jax.kernels.gmm import MOE_IMPLS

DISPATCHERS = ("ring", "alltoall", "reference")
ROUTINGS = ("expert", "token", "auto")


def validate(x, ids, wts, w_gate, w_up, w_down, *, mesh, expert_axis, expert_tensor_axis,
              dispatcher, routing, capacity_factor, chunk_size, token_axes, gmm_impl="auto"):
    """Check everything static before tracing; resolve axes, chunk size and routing mode."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}: expected one of {DISPATCHERS}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    if routing != "auto" and dispatcher != "ring":
        raise ValueError(f"routing={routing!r} applies to dispatcher='ring' only (got "
                         f"{dispatcher!r}); leave it at 'auto'")
    if gmm_impl not in MOE_IMPLS:
        raise ValueError(f"gmm_impl={gmm_impl!r}: expected one of {MOE_IMPLS}")
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    ea = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
    if not ea or len(set(ea)) != len(ea) or any(a not in names for a in ea):
        raise ValueError(f"expert_axis={expert_axis!r}: expected an axis of the mesh, or a tuple "
                         f"of distinct axes (mesh axes: {names})")
    etp = expert_tensor_axis
    if etp is not None and (etp not in names or etp in ea):
        raise ValueError(f"expert_tensor_axis={etp!r}: expected None or a mesh axis other than "
                         f"the expert axes {ea} (mesh axes: {names})")
    if etp is not None and gmm_impl == "pallas-interpret" and dispatcher != "reference":
        raise ValueError(f"expert_tensor_axis={etp!r} with gmm_impl='pallas-interpret': the "
                         "interpreter needs shard_map(check_vma=False) in jax 0.12, and the ETP "
                         "reductions need check_vma=True; use gmm_impl='pallas' or 'xla'")
    token_axes = names if token_axes is None else tuple(token_axes)
    for a in token_axes:
        if a not in names:
            raise ValueError(f"token_axes: {a!r} is not an axis of the mesh {names}")
    if any(a not in token_axes for a in ea):
        raise ValueError(f"token_axes={token_axes} must include every expert axis {ea}: the "
                         "ring (and the all-to-all) reach the experts through them")

    def shape(a, name, rank):
        s = getattr(a, "shape", None)
        if s is None or len(s) != rank:
            raise ValueError(f"{name}: expected a rank-{rank} array, got shape {s}")
        return s

    def floating(a, name):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {a.dtype}")

    t, h = shape(x, "x", 2)
    ti, k = shape(ids, "expert_ids", 2)
    tw, kw = shape(wts, "expert_weights", 2)
    e, hg, f = shape(w_gate, "w_gate", 3)
    floating(x, "x")
    floating(wts, "expert_weights")
    for a, name in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")):
        floating(a, name)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids: expected an integer dtype, got {ids.dtype}")
    if ti != t:
        raise ValueError(f"expert_ids: {ti} tokens, but x has {t} (x {x.shape}, ids {ids.shape})")
    if (tw, kw) != (t, k):
        raise ValueError(f"expert_weights: shape {wts.shape}, expected {(t, k)} like expert_ids")
    if hg != h:
        raise ValueError(f"w_gate: hidden size {hg} does not match x's {h} (w_gate {w_gate.shape})")
    if tuple(w_up.shape) != (e, h, f):
        raise ValueError(f"w_up: shape {w_up.shape}, expected {(e, h, f)} like w_gate")
    if tuple(w_down.shape) != (e, f, h):
        raise ValueError(f"w_down: shape {w_down.shape}, expected {(e, f, h)}")
    if k > e:
        raise ValueError(f"top_k={k} (expert_ids.shape[1]) exceeds num_experts={e}")
    n = math.prod(mesh.shape[a] for a in ea)
    if e % n:
        raise ValueError(f"num_experts={e} is not divisible by the size {n} of expert_axis "
                         f"{expert_axis!r}")
    etp_size = 1 if etp is None else mesh.shape[etp]
    if f % etp_size:
        raise ValueError(f"w_gate: ffn size {f} is not divisible by the size {etp_size} of "
                         f"expert_tensor_axis {etp!r}")
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if t % shards:
        raise ValueError(f"x: {t} tokens are not divisible by the {shards} token shards over "
                         f"{token_axes}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, (int, np.integer)) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected an int >= 1 (or None)")
    if capacity_factor is not None:
        if dispatcher != "alltoall":
            raise ValueError(f"capacity_factor={capacity_factor!r} applies to "
                             f"dispatcher='alltoall' only (got {dispatcher!r}): the ring is "
                             "dropless by construction")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor!r}: expected > 0 or None")
    # Tokens one ring member works on: its shard, gathered over the ETP axis if sharded there.
    t_ring = t // shards * (etp_size if etp in token_axes else 1)
    chunk = int(chunk_size) if chunk_size is not None else max(1, -(-t_ring * k // n))
    vol = routing_volumes(experts=e, top_k=k, hidden=h, ffn=f, ep=n, etp=etp_size,
                          tokens_per_device=t_ring, act_dtype=x.dtype, weight_dtype=w_gate.dtype,
                          router_dtype=wts.dtype)
    return {"token_axes": token_axes, "expert_axes": ea, "chunk": chunk, "volumes": vol,
            "routing": vol.choice if routing == "auto" else routing}
