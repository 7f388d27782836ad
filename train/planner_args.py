"""The planner's arguments that are more than argparse's types: `--memory`'s size
(`parse_memory`: a device name or a number with a unit) and the dispatchers it plans
(`planned_dispatchers`: `--dispatchers`, or `dispatcher=` like any other key, and the op options
on the command line that those dispatchers use, by `MoEOptions`' one table)."""

import re

from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.op.options import DISPATCHERS
from relaymoe_jax.util.checks import one_of

from .settings import check_options_used

# device memory of each target, from its shipped XLA GPU target config (relaymoe_jax.gpu_mesh)
DEVICES = {t.upper(): gpu_mesh.device_memory(t) for t in gpu_mesh.TARGETS}
_UNITS = {"": 1, "B": 1} | {
    f"{p}{i}B": (2**10 if i else 10**3) ** n for n, p in enumerate("KMGT", 1) for i in ("", "I")
}


def parse_memory(text: str) -> int:
    """Bytes of `--memory`: a device name (DEVICES) or a number with an optional unit."""
    if text.upper() in DEVICES:
        return DEVICES[text.upper()]
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].upper() not in _UNITS:
        raise ValueError(
            f"--memory {text!r}: expected one of {sorted(DEVICES)} or a size like "
            "80GiB, 12.5MB, 1e9"
        )
    value = float(m[1]) * _UNITS[m[2].upper()]
    if value <= 0:
        raise ValueError(f"--memory {text!r}: must be > 0")
    return int(value)


def planned_dispatchers(flag: str | None, over: dict) -> tuple[str, ...]:
    """The dispatchers to plan: --dispatchers (`flag`), or `dispatcher=` (taken out of `over`)
    alone, else ring and all-to-all; ValueError for both given and different, a name that is
    not a dispatcher, or an op option on the command line that none of them uses."""
    given = (over.pop("dispatcher"),) if "dispatcher" in over else None
    listed = None if flag is None else tuple(flag.split(","))
    if given is not None and listed is not None and listed != given:
        raise ValueError(
            f"dispatcher={given[0]!r} and --dispatchers {flag}: give the dispatchers once "
            "(dispatcher=X plans X alone, --dispatchers X,Y several)"
        )
    dispatchers = listed or given or ("ring", "alltoall")
    for d in dispatchers:
        one_of("dispatcher" if given else "--dispatchers", d, DISPATCHERS)
    check_options_used(
        over,
        {d: () for d in dispatchers},
        f"the planner plans {' and '.join(dispatchers)} only",
        "plan {0} too (--dispatchers " + ",".join(dispatchers) + ",{0})",
    )
    return dispatchers
