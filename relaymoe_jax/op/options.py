"""`MoEOptions`: the op's execution options, one frozen typed record, validated in one place.

Every option has one tuple of allowed names (`DISPATCHERS`, `ROUTINGS`, `RINGS`, `GMM_IMPLS`),
defined here and nowhere else, and one validator. `moe_ffn`'s keyword arguments build the record;
the model's MoE block (`ModelConfig.moe.options`, a `MoEConfig` field) and the trainer hold it
and reuse the same checks. A bad value raises a ValueError that names the field and what it accepts:

    MoEOptions(dispatcher="rign")
    ValueError: dispatcher='rign': expected one of ('ring', 'alltoall', 'reference')

Fields are checked one by one at construction. Which dispatcher uses which option is one table,
`USED_BY` (routing, ring and chunk_size are the ring's; capacity_factor the all-to-all's;
gmm_impl the ring's and the all-to-all's, the dense reference has no grouped matmul), and
everything that checks or strips options reads it: `check_combination` (what the op, `MoELayer`,
the trainer's command line and the planner refuse: an option away from its default that the
dispatcher would ignore) and `applicable()` (the record the op is called with). A config may
hold every field at once (one file for several dispatchers: the trainer's --memory-table, the
planner), so the record itself refuses nothing of the kind.
"""

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from typing import Literal

from relaymoe_jax.kernels.gmm import MOE_IMPLS
from relaymoe_jax.util.checks import fail, int_at_least, is_bool, is_number, one_of

Dispatcher = Literal["ring", "alltoall", "reference"]
Routing = Literal["expert", "token", "auto"]
RingKind = Literal["auto", "flat", "hierarchical"]
GmmImpl = Literal[
    "auto", "xla", "ragged_dot", "mosaic", "pallas", "mosaic-interpret", "pallas-interpret"
]

DISPATCHERS: tuple[str, ...] = typing.get_args(Dispatcher)
ROUTINGS: tuple[str, ...] = typing.get_args(Routing)
RINGS: tuple[str, ...] = typing.get_args(RingKind)
GMM_IMPLS: tuple[str, ...] = typing.get_args(GmmImpl)
assert GMM_IMPLS == MOE_IMPLS, (GMM_IMPLS, MOE_IMPLS)  # one list, the kernels' own

INT32_MAX = 2**31 - 1

# option -> the dispatchers that use it (the one table of "used or refused"; `dispatcher` itself
# is every dispatcher's)
USED_BY: dict[str, tuple[str, ...]] = {
    "dispatcher": DISPATCHERS,
    "routing": ("ring",),
    "ring": ("ring",),
    "capacity_factor": ("alltoall",),
    "chunk_size": ("ring",),
    "gmm_impl": ("ring", "alltoall"),
    "expert_fp8": DISPATCHERS,
}


def unused_error(name: str, value, setting: str, users, chosen, default) -> ValueError:
    """The one sentence for a field set away from its default that the chosen `setting` ignores:
    `routing='token' applies to dispatcher='ring' only (got dispatcher='alltoall'): it would be
    ignored; leave it at 'auto'`. `users`: the values of `setting` that use the field."""
    who = " or ".join(f"{setting}={u!r}" for u in users)
    return ValueError(
        f"{name}={value!r} applies to {who} only (got {setting}={chosen!r}): it would be "
        f"ignored; leave it at {default!r}"
    )


def _capacity_factor(value):
    if value is None:
        return
    if not is_number(value):
        want = f"> 0, a number (or None for dropless), got a {type(value).__name__}"
        fail("capacity_factor", value, want)
    if not (value > 0 and math.isfinite(value)):
        fail("capacity_factor", value, "> 0 and finite (or None)")


def _chunk_size(value):
    int_at_least("chunk_size", value, 1, none_ok=True)
    if value is not None and value > INT32_MAX:
        fail(
            "chunk_size",
            int(value),
            f"at most {INT32_MAX} (int32 indices); a chunk never holds more than the pairs of "
            "one device anyway",
        )


VALIDATORS = {
    "dispatcher": functools.partial(one_of, "dispatcher", allowed=DISPATCHERS),
    "routing": functools.partial(one_of, "routing", allowed=ROUTINGS),
    "ring": functools.partial(one_of, "ring", allowed=RINGS),
    "capacity_factor": _capacity_factor,
    "chunk_size": _chunk_size,
    "gmm_impl": functools.partial(one_of, "gmm_impl", allowed=GMM_IMPLS),
    "expert_fp8": functools.partial(is_bool, "expert_fp8"),
}


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How `moe_ffn` runs (never what it computes: every choice gives the same numbers, except
    a capacity factor, which drops pairs, and expert_fp8, which rounds the experts' GEMM inputs).

    dispatcher: "ring" (RelayMoE), "alltoall" (the Megatron-style baseline) or "reference" (dense).
    routing: the ring's mode, "expert" (weights travel), "token" (tokens travel) or "auto".
    ring: "flat", "hierarchical" (rounds of an inner ring) or "auto" (`op.topology`).
    capacity_factor: the all-to-all's; None is dropless.
    chunk_size: the ring's pairs per chunk; None is `dispatch.chunking.default_chunk`.
    gmm_impl: the grouped matmul (`kernels.gmm`).
    expert_fp8: the FP8 recipe for the expert GEMMs (docs/precision.md): the matrices in e4m3
    with 128 x 128 block scales, x, the activation and the output and projection gradients per
    1 x 128 tile (`quant.fp8`), gradients straight through to the full-precision weights; what
    travels (the ring's weights or tokens, the all-to-all's dispatch) travels as e4m3 (half the
    bytes of bf16). Changes the numbers (by e4m3's rounding), unlike the other options.
    """

    dispatcher: Dispatcher = "ring"
    routing: Routing = "auto"
    ring: RingKind = "auto"
    capacity_factor: float | None = None
    chunk_size: int | None = None
    gmm_impl: GmmImpl = "auto"
    expert_fp8: bool = False

    def __post_init__(self):
        for name, check in VALIDATORS.items():
            check(getattr(self, name))

    @classmethod
    def from_mapping(cls, values: Mapping) -> "MoEOptions":
        """The record from the option keys of `values` (other keys are ignored); an error names
        the key (`dispatcher='rign': expected ...`)."""
        return cls(**{k: values[k] for k in FIELDS if k in values})

    def replace(self, **changes) -> "MoEOptions":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}

    def unused_fields(self) -> tuple[str, ...]:
        """The fields away from their defaults that the chosen dispatcher does not use
        (`USED_BY`), in field order."""
        return tuple(
            name
            for name, users in USED_BY.items()
            if self.dispatcher not in users and getattr(self, name) != DEFAULTS[name]
        )

    def check_combination(self) -> "MoEOptions":
        """Refuse an option that the chosen dispatcher does not use (`USED_BY`; a value the op
        would ignore is a mistake the caller should hear about). Returns self."""
        unused = self.unused_fields()
        if unused:
            name = unused[0]
            value, users = getattr(self, name), USED_BY[name]
            raise unused_error(name, value, "dispatcher", users, self.dispatcher, DEFAULTS[name])
        return self

    def applicable(self) -> "MoEOptions":
        """The options the dispatcher uses, the others at their defaults (`USED_BY`; a config
        may hold the ring's and the all-to-all's options at once)."""
        return self.replace(**{name: DEFAULTS[name] for name in self.unused_fields()})


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MoEOptions))
DEFAULTS: dict = {f.name: f.default for f in dataclasses.fields(MoEOptions)}
assert set(USED_BY) == set(FIELDS) == set(VALIDATORS), (USED_BY, FIELDS)
