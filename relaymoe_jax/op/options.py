"""`MoEOptions`: the op's execution options, one frozen typed record, validated in one place.

Every option has one tuple of allowed names (`DISPATCHERS`, `ROUTINGS`, `RINGS`, `GMM_IMPLS`),
defined here and nowhere else, and one validator. `moe_ffn`'s keyword arguments build the record;
the model's config (`ModelConfig.moe_options`), `MoEConfig` and the trainer hold it and reuse the
same checks. A bad value raises a ValueError that names the field and what it accepts:

    MoEOptions(dispatcher="rign")
    ValueError: dispatcher='rign': expected one of ('ring', 'alltoall', 'reference')

Fields are checked one by one at construction. Whether they fit together (routing, ring and
chunk_size are the ring's; capacity_factor the all-to-all's) is `check_combination`, which the
op runs on what it is called with. A config may hold every field at once (the trainer compares
dispatchers with one config), and `applicable()` gives the record the op is called with.
"""

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Literal

import numpy as np

from relaymoe_jax.kernels.gmm import MOE_IMPLS

Dispatcher = Literal["ring", "alltoall", "reference"]
Routing = Literal["expert", "token", "auto"]
RingKind = Literal["auto", "flat", "hierarchical"]
GmmImpl = Literal["auto", "xla", "ragged_dot", "pallas", "pallas-interpret"]

DISPATCHERS: tuple[str, ...] = typing.get_args(Dispatcher)
ROUTINGS: tuple[str, ...] = typing.get_args(Routing)
RINGS: tuple[str, ...] = typing.get_args(RingKind)
GMM_IMPLS: tuple[str, ...] = typing.get_args(GmmImpl)
assert GMM_IMPLS == MOE_IMPLS, (GMM_IMPLS, MOE_IMPLS)  # one list, the kernels' own

INT32_MAX = 2**31 - 1


def _one_of(name: str, allowed: tuple[str, ...]):
    def check(value):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {allowed}")

    return check


def _capacity_factor(value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(
            f"capacity_factor={value!r}: expected > 0, a number (or None for dropless), "
            f"got a {type(value).__name__}"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"capacity_factor={value!r}: expected > 0 and finite (or None)")


def _chunk_size(value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"chunk_size={value!r}: expected an int >= 1 (or None)")
    if value > INT32_MAX:
        raise ValueError(
            f"chunk_size={value}: expected at most {INT32_MAX} (int32 indices); "
            "a chunk never holds more than the pairs of one device anyway"
        )


VALIDATORS = {
    "dispatcher": _one_of("dispatcher", DISPATCHERS),
    "routing": _one_of("routing", ROUTINGS),
    "ring": _one_of("ring", RINGS),
    "capacity_factor": _capacity_factor,
    "chunk_size": _chunk_size,
    "gmm_impl": _one_of("gmm_impl", GMM_IMPLS),
}


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How `moe_ffn` runs (never what it computes: every choice gives the same numbers, except
    a capacity factor, which drops pairs).

    dispatcher: "ring" (RelayMoE), "alltoall" (the Megatron-style baseline) or "reference" (dense).
    routing: the ring's mode, "expert" (weights travel), "token" (tokens travel) or "auto".
    ring: "flat", "hierarchical" (rounds of an inner ring) or "auto" (`op.topology`).
    capacity_factor: the all-to-all's; None is dropless.
    chunk_size: the ring's pairs per chunk; None is `dispatch.chunking.default_chunk`.
    gmm_impl: the grouped matmul (`kernels.gmm`).
    """

    dispatcher: Dispatcher = "ring"
    routing: Routing = "auto"
    ring: RingKind = "auto"
    capacity_factor: float | None = None
    chunk_size: int | None = None
    gmm_impl: GmmImpl = "auto"

    def __post_init__(self):
        for name, check in VALIDATORS.items():
            check(getattr(self, name))

    @classmethod
    def from_mapping(cls, values: Mapping, *, where: str = "") -> "MoEOptions":
        """The record from the option keys of `values` (other keys are ignored); an error names
        the key, prefixed by `where` (e.g. "MoEConfig.")."""
        picked = {k: values[k] for k in FIELDS if k in values}
        try:
            return cls(**picked)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None

    def replace(self, **changes) -> "MoEOptions":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}

    def check_combination(self) -> "MoEOptions":
        """Refuse options that the chosen dispatcher does not use (a value the op would ignore
        is a mistake the caller should hear about). Returns self."""
        d = self.dispatcher
        for name, default in (("routing", "auto"), ("ring", "auto")):
            value = getattr(self, name)
            if value != default and d != "ring":
                raise ValueError(
                    f"{name}={value!r} applies to dispatcher='ring' only (got {d!r}); "
                    f"leave it at {default!r}"
                )
        if self.capacity_factor is not None and d != "alltoall":
            raise ValueError(
                f"capacity_factor={self.capacity_factor!r} applies to dispatcher='alltoall' "
                f"only (got {d!r}): the ring is dropless by construction"
            )
        return self

    def applicable(self) -> "MoEOptions":
        """The options the dispatcher uses, the others at their defaults (a config may hold the
        ring's and the all-to-all's options at once)."""
        ring, a2a = self.dispatcher == "ring", self.dispatcher == "alltoall"
        return self.replace(
            routing=self.routing if ring else "auto",
            ring=self.ring if ring else "auto",
            chunk_size=self.chunk_size if ring else None,
            capacity_factor=self.capacity_factor if a2a else None,
        )


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MoEOptions))
