"""The op's public functions: `moe_ffn` on global arrays, `moe_ffn_local` inside your
shard_map, and `routing_plan`.

Each builds the options record (`op.options.MoEOptions`) from its keywords and hands over:
`moe_ffn` to `op.global_call` (it reads where x's tokens live, puts the weights where the op
wants them, and runs each device's step in a `shard_map` of its own), `moe_ffn_local` to
`op.local_call` (the same step, inside the caller's `shard_map`). Both reach the static
description of the call through one front door, `op.resolve`.
"""

from relaymoe_jax.dispatch.activation import as_activation
from relaymoe_jax.dispatch.experts import Experts
from relaymoe_jax.op import checks, global_call, local_call
from relaymoe_jax.op import layout as lay
from relaymoe_jax.op.options import MoEOptions
from relaymoe_jax.op.resolve import ring_choice


class _Unset:
    """The default of the op's option keywords (dispatcher, routing, ring, capacity_factor,
    chunk_size, gmm_impl): not given, so `MoEOptions`' default, or `options=`'s field."""

    def __repr__(self) -> str:
        return "UNSET"


_UNSET = _Unset()


def _options(options, **keywords) -> MoEOptions:
    """The call's options record: `options` when given (no option keyword may be passed with
    it, whatever its value), else built from the keywords passed; checked as a combination."""
    given = {k: v for k, v in keywords.items() if v is not _UNSET}
    if options is None:
        return MoEOptions(**given).check_combination()
    if not isinstance(options, MoEOptions):
        raise ValueError(
            f"options: expected a relaymoe_jax.MoEOptions, got {type(options).__name__}"
        )
    if given:
        passed = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"options= is given, and so are {list(given)} ({passed}): pass the options in one "
            "place (options.replace(...) changes a field)"
        )
    return options.check_combination()


def moe_ffn(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    mesh,
    expert_axis="expert",
    expert_tensor_axis=None,
    dispatcher=_UNSET,
    routing=_UNSET,
    ring=_UNSET,
    capacity_factor=_UNSET,
    chunk_size=_UNSET,
    token_axes=None,
    gmm_impl=_UNSET,
    expert_fp8=_UNSET,
    out_sharding=None,
    return_stats=False,
    options=None,
    activation="swiglu",
    b_gate=None,
    b_up=None,
    b_down=None,
):
    """Routed gated experts: y[t] = sum_j expert_weights[t, j] * expert_{expert_ids[t, j]}(x[t]),
    expert_e(x) = act(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]
    (SwiGLU, no biases by default).

    Takes global arrays (call it under `jax.jit`, or eagerly); inside a `jax.shard_map` use
    `moe_ffn_local`.

    Args:
      x: [..., hidden] float32 or bfloat16: [tokens, hidden], [batch, seq, hidden], ... Its
        leading dimensions keep their sharding (each device flattens its own block; nothing
        moves); see `relaymoe_jax.op.layout` for how the op reads it. Any token count works:
        when the shards hold fewer tokens than the expert axes have devices, or do not divide,
        the op splits and pads internally, exactly.
      expert_ids: [..., top_k] int, values in [0, num_experts). Ids outside that range are
        ignored: the pair contributes nothing and gets no gradient (counted in stats).
      expert_weights: [..., top_k] float, the router's (already normalised) weights.
      w_gate, w_up: [num_experts, hidden, ffn]; w_down: [num_experts, ffn, hidden]. The op uses
        them sharded over `expert_axis` on experts and over `expert_tensor_axis` on ffn, replicated
        otherwise; a weight sharded over another axis is all-gathered, with one warning on the
        "relaymoe_jax" logger that says over which axes and how many bytes.
      mesh: a `jax.sharding.Mesh` that has `expert_axis`.
      expert_axis: the mesh axis the ring runs over, or a tuple of axes used together (parallel
        folding: e.g. ("data", "context") lets the MoE see an attention mesh as one expert axis).
      expert_tensor_axis: optional mesh axis splitting each expert's ffn dimension (ETP). Tokens
        sharded over it are all-gathered before the experts and the down projection's partial
        sums are reduce-scattered back; tokens replicated over it get a psum instead.
      dispatcher, routing, ring, capacity_factor, chunk_size, gmm_impl: the execution options
        (`relaymoe_jax.MoEOptions`). Each defaults to UNSET, "not given": the record's default,
        given below. An option the chosen dispatcher does not use, given away from its default,
        is refused (`MoEOptions.check_combination`), never ignored.
      dispatcher: "ring" (RelayMoE, default), "alltoall" (Megatron-style baseline) or
        "reference" (dense: every device computes every token; no routing options, no grouped
        matmul).
      routing: ring only. "expert" (weights travel), "token" (tokens travel) or "auto"
        (default): the mode that sends fewer bytes per hop (paper Table 2 plus the accumulators
        that travel; see `routing_plan`), logged at INFO on the "relaymoe_jax" logger.
      ring: ring only. "flat" (one ring over all expert axes), "hierarchical" (expert_axis a
        tuple (outer..., inner): an inner ring over the last axis, e.g. a host's GPUs, once per
        round, and one transfer per round over the outer axes, overlapped with the round), or
        "auto" (default): hierarchical when the last expert axis stays on one host and the
        others reach other hosts (the devices' process_index; `relaymoe_jax.op.topology`), else
        flat.
      capacity_factor: alltoall only. None (default) = dropless; c > 0 = at most ceil(c*T*k/E)
        pairs per expert from each device; the rest are dropped and counted in
        stats["dropped_pairs"].
      chunk_size: ring only: pairs per chunk (default: the balanced share ceil(T_local*k / EP);
        capped at the T_local*k pairs a hop can hold).
      token_axes: the mesh axes to shard the tokens over, laid over x's leading dimensions in
        order. Default: x's own sharding when it is known (an Explicit mesh, or an array placed
        on the mesh), else every axis of the mesh.
      gmm_impl: ring and alltoall only: the grouped matmul, see `relaymoe_jax.kernels.gmm`:
        "auto" (default: on GPUs, abstract ones included, our Mosaic GPU kernel on Hopper with
        16-bit operands and the Pallas Triton kernel otherwise; the blocked XLA one elsewhere),
        "xla", "ragged_dot", "mosaic", "pallas" (deprecated with jax's Triton backend), or
        "mosaic-interpret" / "pallas-interpret" (a kernel in its CPU interpreter: slow, for
        tests).
      expert_fp8: True runs the expert GEMMs with DeepSeek-V3's FP8 tiling and power-of-two
        scales (`relaymoe_jax.quant.fp8`, docs/precision.md): the three matrices rounded to e4m3
        per 128 x 128 block; x, the activation, y's gradient and the projections' gradients per
        1 x 128 tile; every rounding's gradient passed straight through (to x, w_gate, w_up,
        w_down). The ring relays its weights (expert routing) or its x and dy (token routing)
        as e4m3 and scales, the all-to-all dispatches e4m3 rows (half the bytes of bf16). The
        ring's grouped matmuls with gmm_impl "mosaic" ("auto" on Hopper) run the forward and
        the dgrads on the e4m3 tensor cores (`kernels.gmm.gmm_fp8`); every other grouped
        matmul multiplies the rounded values in 16 bits (exact). Default False.
      out_sharding: where to put y (a NamedSharding, or a PartitionSpec on `mesh`). Default: x's
        own sharding when known, else the layout the op computed in.
      return_stats: also return {"dropped_pairs", "ignored_pairs"} (int32 scalars).
      options: a `relaymoe_jax.MoEOptions` record instead of the keywords dispatcher, routing,
        ring, capacity_factor, chunk_size, gmm_impl and expert_fp8 (none of which may then be
        passed, even at its default value).
      activation: the experts' gated activation act(g, u) (`relaymoe_jax.ACTIVATIONS`):
        "swiglu" silu(g) * u (default), "geglu" gelu(g) * u with GELU's tanh approximation,
        "geglu_exact" with the exact (erf) GELU, "gpt_oss" GPT-OSS's clamped SwiGLU
        (clip(u, -L, L) + 1) * min(g, L) * sigmoid(1.702 * min(g, L)), L = 7; or a
        `relaymoe_jax.Activation` record (e.g. `Activation("gpt_oss", limit=...)`). It is what
        the op computes, not how: not part of `options`.
      b_gate, b_up: optional [num_experts, ffn] biases of the gate and up projections; b_down:
        optional [num_experts, hidden], added to each expert's output before its router weight
        scales it (GPT-OSS). Used sharded like their weights (b_down replicated over
        `expert_tensor_axis` and added once); a missing one is zero. Differentiable; in expert
        routing they travel with their weights and their gradients come home like dW.

    Returns y with x's shape and dtype, or (y, stats) with return_stats=True.
    Differentiable in x, expert_weights, w_gate, w_up and w_down; works under jax.jit.
    """
    manual = local_call.manual_axes()
    if manual:
        raise ValueError(
            f"moe_ffn takes global arrays, but it is called inside a jax.shard_map "
            f"(manual mesh axes {manual}); there, call "
            "relaymoe_jax.moe_ffn_local with each device's shards"
        )
    opts = _options(
        options,
        dispatcher=dispatcher,
        routing=routing,
        ring=ring,
        capacity_factor=capacity_factor,
        chunk_size=chunk_size,
        gmm_impl=gmm_impl,
        expert_fp8=expert_fp8,
    )
    act = as_activation(activation)
    tokens = (x, expert_ids, expert_weights)
    experts = Experts(w_gate, w_up, w_down, b_gate, b_up, b_down)
    call = global_call.check(
        tokens,
        experts,
        opts,
        mesh=mesh,
        expert_axis=expert_axis,
        expert_tensor_axis=expert_tensor_axis,
        token_axes=token_axes,
    )
    y, stats = global_call.run(
        call,
        tokens,
        experts,
        opts,
        out_sharding=out_sharding,
        return_stats=return_stats,
        activation=act,
    )
    return (y, stats) if return_stats else y


def moe_ffn_local(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    expert_axis,
    expert_tensor_axis=None,
    tokens_sharded_over_etp=None,
    dispatcher=_UNSET,
    routing=_UNSET,
    ring=_UNSET,
    capacity_factor=_UNSET,
    chunk_size=_UNSET,
    gmm_impl=_UNSET,
    expert_fp8=_UNSET,
    return_stats=False,
    options=None,
    debug_checks=False,
    activation="swiglu",
    b_gate=None,
    b_up=None,
    b_down=None,
):
    """`moe_ffn` for one device, inside the caller's `jax.shard_map`: the drop-in for a
    codebase that already shards its expert step by hand.

    Args (each device's shards):
      x: [..., hidden], this device's tokens. Each device must hold its own tokens along the
        expert axes (x varies over them): tokens replicated over an expert axis would have their
        weight gradients counted once per copy.
      expert_ids, expert_weights: [..., top_k], global expert ids in [0, num_experts).
      w_gate, w_up: [E / EP, hidden, ffn / ETP]; w_down: [E / EP, ffn / ETP, hidden]: this
        device's experts (partition `axis_index(expert_axis)`) and its ffn slice.
      expert_axis: the manual mesh axis (or tuple of axes) holding the experts; the ring runs
        over it. expert_tensor_axis: the manual axis splitting ffn, if any.
      tokens_sharded_over_etp: whether each expert-tensor rank holds other tokens (gathered, then
        reduce-scattered) or the same ones (psum). Default: read from x's varying axes; must be
        given under `shard_map(check_vma=False)`.
      dispatcher, routing, ring, capacity_factor, chunk_size, gmm_impl, return_stats: as
        `moe_ffn` ("reference" is not available per device; ring="auto" reads the devices of
        the `jax.set_mesh` mesh, and is flat without one). The stats are summed over the devices
        that hold other tokens: under check_vma the axes x varies over; under check_vma=False
        every manual axis but an expert-tensor axis the tokens are replicated over.

    options: a `MoEOptions` record instead of those six keywords (none of them passed then), as
      in `moe_ffn`.
    activation: the experts' gated activation, as in `moe_ffn`.
    b_gate, b_up: [E / EP, ffn / ETP]; b_down: [E / EP, hidden], the same on every expert-tensor
      rank: this device's experts' biases, as in `moe_ffn`, sharded like w_gate (b_down not over
      the expert-tensor axis).

    Contradictions between the shard_map and the arguments are refused before tracing where the
    types show them (check_vma=True): experts that do not vary over every expert axis
    (replicated, or `expert_axis` naming another axis), weights varying over an axis that is
    neither an expert axis nor `expert_tensor_axis` (whatever x varies over), an ffn that does
    not vary over `expert_tensor_axis`, a `tokens_sharded_over_etp` that x's type contradicts.
    debug_checks: also check at run time what the types cannot show (ids beyond the experts the
    call sees, replicated experts or biases, and the ETP tokens under check_vma=False); each is one
    logged warning (`relaymoe_jax.op.debug_checks`), for tests and first runs.

    The weight gradients are summed over the axes whose devices hold other tokens for the same
    weights (data-parallel axes), with nothing to pass: under check_vma the types say which (x
    varies there and w_gate does not) and the op sums over them; under `check_vma=False`
    shard_map's own transpose sums every input's gradient over the axes its in_spec leaves out.

    Returns y like x (this device's tokens), or (y, stats) with return_stats=True.
    """
    opts = _options(
        options,
        dispatcher=dispatcher,
        routing=routing,
        ring=ring,
        capacity_factor=capacity_factor,
        chunk_size=chunk_size,
        gmm_impl=gmm_impl,
        expert_fp8=expert_fp8,
    )
    return local_call.run(
        (x, expert_ids, expert_weights),
        Experts(w_gate, w_up, w_down, b_gate, b_up, b_down),
        opts,
        expert_axis=expert_axis,
        expert_tensor_axis=expert_tensor_axis,
        tokens_sharded_over_etp=tokens_sharded_over_etp,
        return_stats=return_stats,
        debug_checks=debug_checks,
        activation=as_activation(activation),
    )


def routing_plan(
    x,
    expert_ids,
    expert_weights,
    w_gate,
    w_up,
    w_down,
    *,
    mesh,
    expert_axis="expert",
    expert_tensor_axis=None,
    token_axes=None,
    ring="auto",
):
    """The per-hop volumes of both routing modes for this exact `moe_ffn` call, and the mode
    `routing="auto"` picks (a `RoutingVolumes`; see `relaymoe_jax.routing_volumes`).

    Tokens per device are those one ring member works on: its share of x's tokens (see
    `relaymoe_jax.op.layout`), times the expert-tensor axis size when tokens are sharded over it
    (they are gathered there). Only shapes, dtypes and known shardings are read: arrays,
    `jax.ShapeDtypeStruct`s or tracers all work. With `mesh`'s devices on several hosts it also
    gives the bytes per link class (`RoutingVolumes.link_bytes`) of the ring `ring` resolves to.
    """
    opts = MoEOptions(ring=ring)
    call = global_call.check(
        (x, expert_ids, expert_weights),
        Experts(w_gate, w_up, w_down),
        opts,
        mesh=mesh,
        expert_axis=expert_axis,
        expert_tensor_axis=expert_tensor_axis,
        token_axes=token_axes,
    )
    layout = lay.resolve(x, mesh, call.expert_axes, call.etp, call.token_axes)
    where = global_call.placement(call, layout, opts)
    return ring_choice(opts, call.sizes, checks.dtypes(x, expert_weights, w_gate), where).volumes


__all__ = ["moe_ffn", "moe_ffn_local", "routing_plan"]
