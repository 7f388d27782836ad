"""What `moe_ffn_local` reads from the caller's `jax.shard_map`, and the contradictions it refuses.

Under `check_vma=True` the varying-manual-axes types (`jax.typeof(a).manual_axis_type.varying`)
say over which manual axes each array differs between devices. The op reads from them which axes
hold other tokens (summed over for the weight gradients and the stats), whether the tokens are
sharded over the expert-tensor axis, and refuses, before tracing the ring, a sharding that
contradicts its arguments: experts that do not vary over `expert_axis` (replicated, or sharded
over other axes), experts that vary over an axis other than the expert and expert-tensor ones
(whatever x varies over), an ffn that does not vary over `expert_tensor_axis`, a
`tokens_sharded_over_etp` that x's type contradicts. Under `check_vma=False` nothing is typed:
the caller's arguments are taken as they are (`debug_checks=True` checks them at run time).
"""

from typing import NamedTuple

import jax
from jax import lax

from relaymoe_jax.dispatch.experts import BIAS_NAMES, Experts


def vma(a) -> frozenset:
    """The manual axes over which `a` varies (empty under `check_vma=False`)."""
    return frozenset(jax.typeof(a).manual_axis_type.varying)


def checks_vma(axis: str) -> bool:
    """Whether the enclosing shard_map types varying manual axes (`check_vma=True`): an axis
    index varies over its axis only then. Trace-time only: the index is never used."""
    return bool(vma(lax.axis_index(axis)))


class LocalAxes(NamedTuple):
    """What the caller's shard_map says about one call's tokens."""

    gather_etp: bool  # tokens sharded over the expert-tensor axis
    reduce_axes: tuple[str, ...]  # other axes whose devices hold other tokens, same weights
    typed: bool  # check_vma=True


def _names(axes) -> tuple:
    return tuple(sorted(axes))


def _check_tokens(vx, ea) -> None:
    missing = [a for a in ea if a not in vx]
    if missing:
        raise ValueError(
            f"moe_ffn_local: x does not vary over the expert axes {missing}: each "
            "device must hold its own tokens there (tokens replicated over an expert "
            "axis would have their weight gradients counted once per copy)"
        )


def _check_alike(weights: dict) -> frozenset:
    (first, v0), *rest = ((n, vma(w)) for n, w in weights.items())
    for name, v in rest:
        if v != v0:
            raise ValueError(
                f"moe_ffn_local: {name} varies over {_names(v)}, but {first} over "
                f"{_names(v0)}: the three expert weights must be sharded alike"
            )
    return v0


def _check_experts(vw, expert_axis, ea, etp) -> None:
    """The experts vary over every expert axis, and over no other axis but the expert-tensor
    one (whatever x varies over: weights that differ along a token axis are experts the op
    does not count)."""
    missing = [a for a in ea if a not in vw]
    if missing:
        sharded = tuple(a for a in _names(vw) if a != etp)
        order = (
            f"={sharded[0]!r}"
            if len(sharded) == 1
            else " as the tuple of those axes in the order of the experts' PartitionSpec"
        )
        hint = (
            f"the experts vary over {sharded}: pass expert_axis{order}"
            if sharded
            else "every device holds all experts: shard them over the expert axes, or call "
            "relaymoe_jax.moe_ffn (replicated experts would travel the ring for nothing)"
        )
        raise ValueError(
            f"moe_ffn_local: w_gate does not vary over the expert axes {missing} "
            f"(expert_axis={expert_axis!r}; w_gate varies over {_names(vw)}): each device along "
            f"the expert axes must hold its own E / EP experts; {hint}"
        )
    extra = vw - set(ea) - {etp}
    if extra:
        raise ValueError(
            f"moe_ffn_local: w_gate varies over {_names(extra)}, which is neither an expert "
            f"axis (expert_axis={expert_axis!r}) nor expert_tensor_axis={etp!r}: the experts "
            f"look sharded over {_names((*ea, *extra))}, and the op would see only the "
            "experts along expert_axis (ids beyond them ignored); pass expert_axis as the "
            "tuple of those axes in the order of the experts' PartitionSpec (e.g. ('data', "
            "'expert') for P(('data', 'expert'))), or gather the experts there first with "
            "jax.lax.all_gather(..., to='invarying') (FSDP: the same weights on every device)"
        )


def _check_etp(vw, vx, etp, tokens_sharded_over_etp) -> bool:
    """Whether the tokens are sharded over the ETP axis (typed), checked against the flag."""
    if etp not in vw:
        raise ValueError(
            f"moe_ffn_local: w_gate does not vary over expert_tensor_axis={etp!r} (it varies "
            f"over {_names(vw)}): each expert-tensor rank must hold its own ffn slice "
            "[E / EP, H, F / ETP]; pass expert_tensor_axis=None if the ffn is not split"
        )
    sharded = etp in vx
    if tokens_sharded_over_etp is not None and bool(tokens_sharded_over_etp) != sharded:
        what = "varies" if sharded else "does not vary"
        means = "holds other tokens" if sharded else "holds the same tokens"
        raise ValueError(
            f"moe_ffn_local: tokens_sharded_over_etp={tokens_sharded_over_etp!r}, but x "
            f"{what} over expert_tensor_axis={etp!r} (each expert-tensor rank {means}): "
            f"pass {sharded}, or leave it None to read it from x"
        )
    return sharded


def _untyped_gather(etp, tokens_sharded_over_etp) -> bool:
    if etp is None:
        return False
    if tokens_sharded_over_etp is None:
        raise ValueError(
            f"moe_ffn_local(expert_tensor_axis={etp!r}) under "
            "shard_map(check_vma=False): pass tokens_sharded_over_etp=True or False "
            "(whether each expert-tensor rank holds other tokens)"
        )
    return bool(tokens_sharded_over_etp)


def _check_biases(experts: Experts, vw, etp) -> None:
    """Each given bias varies like w_gate (b_down: but over the expert-tensor axis)."""
    for name, b in zip(BIAS_NAMES, experts.biases):
        if b is None:
            continue
        want = vw - {etp} if name == "b_down" else vw
        if vma(b) != want:
            also = (
                f" ({name} is added once: the same on every rank of expert_tensor_axis={etp!r})"
                if name == "b_down" and etp is not None
                else ""
            )
            raise ValueError(
                f"moe_ffn_local: {name} varies over {_names(vma(b))}, expected {_names(want)} "
                f"like its weights{also}: shard it over the expert axes as w_gate is"
            )


def read_axes(x, experts: Experts, expert_axis, ea, etp, manual, tokens_sharded_over_etp):
    """The call's `LocalAxes`, from the types of x and the experts (their biases as given, None
    where not) under check_vma (refusing contradictions), else from the arguments: under
    check_vma=False every manual axis other than the expert and expert-tensor ones is taken to
    hold other tokens (for the stats)."""
    if tokens_sharded_over_etp and etp is None:
        raise ValueError(
            "moe_ffn_local: tokens_sharded_over_etp=True needs expert_tensor_axis (the axis "
            "the tokens are sharded over besides the expert axes)"
        )
    others = tuple(a for a in manual if a not in (*ea, etp))
    if not checks_vma(ea[0]):
        return LocalAxes(_untyped_gather(etp, tokens_sharded_over_etp), others, False)
    vx = vma(x)
    _check_tokens(vx, ea)
    vw = _check_alike(dict(zip(Experts._fields, experts.weights)))
    _check_experts(vw, expert_axis, ea, etp)
    _check_biases(experts, vw, etp)
    gather = etp is not None and _check_etp(vw, vx, etp, tokens_sharded_over_etp)
    reduce_axes = tuple(a for a in others if a in vx)
    return LocalAxes(gather, reduce_axes, True)
