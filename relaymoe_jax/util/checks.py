"""The value checks every record shares: "one of", "an int >= n", "a finite number".

Each returns None when the value is accepted and raises `ValueError("{name}={value!r}: expected
...")` otherwise, so every record's error reads the same way. `name` is what the user wrote (a
field, a key, `MoEConfig.router`); the predicates (`is_int`, `is_number`) are for records that
check several rules on one value.
"""

import math
from collections.abc import Sequence

import numpy as np


def fail(name: str, value, want: str):
    """Raise the one error every check gives."""
    raise ValueError(f"{name}={value!r}: expected {want}")


def is_int(v) -> bool:
    """A Python or numpy int, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_number(v) -> bool:
    """A Python or numpy int or float, not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_)
    )


def one_of(name: str, value, allowed: Sequence[str]) -> None:
    """`value` is one of the names `allowed`."""
    if not isinstance(value, str) or value not in allowed:
        fail(name, value, f"one of {tuple(allowed)}")


def is_bool(name: str, value) -> None:
    """A Python bool (YAML's true/false)."""
    if not isinstance(value, bool):
        fail(name, value, "true or false")


def int_at_least(name: str, value, low: int, *, none_ok: bool = False) -> None:
    """An int >= `low` (or None when `none_ok`)."""
    if none_ok and value is None:
        return
    if not (is_int(value) and value >= low):
        fail(name, value, f"an int >= {low}" + (" (or None)" if none_ok else ""))


def finite_number(name: str, value, *, low: float | None = None, strict: bool = False) -> None:
    """A finite int or float; with `low`, >= low (> low when `strict`)."""
    ok = is_number(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if not ok:
        bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
        fail(name, value, f"a finite number{bound}")
