"""`moe_ffn_local(debug_checks=True)`: run-time checks of what the types cannot show.

Each finding is one WARNING on the `relaymoe_jax` logger per call, from the first device; the
call's result is unchanged. It cannot raise: an exception in one device's callback leaves the
other devices waiting in the ring's next collective, and XLA aborts the process. The checks cost a
few reductions and one transfer of w_gate and the given biases (and of x with an expert-tensor
axis): for tests and first runs, not for training.

- ids >= E, the experts the call sees (w_gate's E / EP per device times EP): the experts are
  sharded over more axes than `expert_axis`, or the router has more experts. Negative ids are
  padding and are not reported; both kinds are ignored and counted in `stats["ignored_pairs"]`.
- w_gate equal to the next ring member's on every ring member: the experts are replicated over
  the expert axes, or `expert_axis` names an axis they are not sharded over (under
  `check_vma=True` both are refused before tracing). The same for each given bias (b_gate, b_up,
  b_down) that is not all zeros: replicated rows would be added once per device (a zero bias
  looks the same sharded or replicated, so it is not reported).
- with an expert-tensor axis under `check_vma=False`: x equal on every pair of neighbouring ETP
  ranks while `tokens_sharded_over_etp=True`, or different while it is False.
"""

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.dispatch.experts import BIAS_NAMES, Experts
from relaymoe_jax.dispatch.local import LocalSpec

log = logging.getLogger("relaymoe_jax")


class Where(NamedTuple):
    """What the call was told, for the messages."""

    experts: int  # E, the experts the call sees
    per_device: int  # E / EP
    ep: int
    expert_axis: object
    etp: str | None
    gather: bool  # tokens_sharded_over_etp, as passed or read


def _same_as_next(a, axes: tuple, size: int):
    """1 where every device's `a` equals the next one's along `axes` (a ring of `size`)."""
    nxt = lax.ppermute(a, axes, [(i, (i + 1) % size) for i in range(size)])
    return lax.pmin(jnp.all(a == nxt).astype(jnp.int32), axes)


def _first_device(manual: tuple):
    first = jnp.bool_(True)
    for axis in manual:
        first = first & (lax.axis_index(axis) == 0)
    return first


def _replicated(spec: LocalSpec, ep: int, experts: Experts):
    """[w_gate, b_gate, b_up, b_down]: 1 where the array is the same on every ring member (a
    bias only if given and not all zeros), else 0."""
    out = []
    for name, a in zip(("w_gate", *BIAS_NAMES), (experts.w_gate, *experts.biases)):
        if a is None or ep == 1:
            out.append(jnp.int32(0))
            continue
        same = _same_as_next(a, spec.expert_axes, ep)
        if name != "w_gate":
            same = same * lax.pmax(jnp.any(a != 0).astype(jnp.int32), spec.expert_axes)
        out.append(same)
    return jnp.stack(out)


def run(spec: LocalSpec, *, ep: int, manual: tuple, typed: bool, expert_axis, x, ids, experts):
    """Schedule the checks of one call (inside its shard_map); `experts`: the weights and the
    biases as given (None where not)."""
    e = spec.num_experts
    beyond = lax.psum(jnp.sum(ids >= e, dtype=jnp.int32), spec.stat_axes)
    top = lax.pmax(jnp.max(ids).astype(jnp.int32), spec.stat_axes)
    replicated = _replicated(spec, ep, experts)
    etp_same = jnp.int32(-1)  # -1: not checked
    if spec.etp is not None and not typed and spec.etp_size > 1:
        etp_same = _same_as_next(x, spec.etp, spec.etp_size)
    where = Where(e, e // ep, ep, expert_axis, spec.etp, spec.gather_etp)

    def report(first, beyond, top, replicated, etp_same):
        if bool(first):
            names = tuple(n for n, r in zip(("w_gate", *BIAS_NAMES), replicated) if int(r) == 1)
            for message in findings(int(beyond), int(top), names, int(etp_same), where):
                log.warning("moe_ffn_local(debug_checks=True): %s", message)

    jax.debug.callback(report, _first_device(manual), beyond, top, replicated, etp_same)


def findings(beyond: int, top: int, replicated: tuple, etp_same: int, where: Where) -> list[str]:
    """The warnings for one call's measured values (plain Python: tested on its own too);
    `replicated`: the names of the arrays found the same on every ring member."""
    out = []
    if beyond:
        out.append(
            f"{beyond} (token, expert) pairs have ids >= {where.experts} (up to {top}), the "
            f"experts this call sees ({where.per_device} per device in w_gate x "
            f"{where.ep} over expert_axis={where.expert_axis!r}); they are ignored. If "
            "the experts are sharded over more mesh axes than expert_axis, pass them all"
        )
    if "w_gate" in replicated:
        out.append(
            f"w_gate is the same on every device along expert_axis={where.expert_axis!r}: "
            "the experts are replicated there, or sharded over another axis; each device "
            "along expert_axis must hold its own E / EP experts"
        )
    biases = [n for n in replicated if n != "w_gate"]
    if biases:
        out.append(
            f"{', '.join(biases)} {'is' if len(biases) == 1 else 'are'} the same on every "
            f"device along expert_axis={where.expert_axis!r}: the biases are replicated "
            "there, or sharded over another axis, and each device adds its rows to other "
            "experts; shard them over the expert axes as the weights are (E / EP rows each)"
        )
    if etp_same != -1 and bool(etp_same) == where.gather:
        said, seen, wrong = (
            ("True", "the same tokens on every", "the weight gradients are counted once per rank")
            if where.gather
            else ("False", "other tokens on some", "y and the gradients are wrong")
        )
        out.append(
            f"tokens_sharded_over_etp={said}, but x holds {seen} expert-tensor rank "
            f"(expert_tensor_axis={where.etp!r}): {wrong}; pass {not where.gather}"
        )
    return out


__all__ = ["findings", "run"]
