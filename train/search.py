"""The largest micro-batch or sequence length whose fully recomputed train step fits a device,
found by compiling (never running) candidate steps: no trial can run out of memory here.

`largest(fits, step, limit)`: the largest multiple of `step` in [step, limit] for which `fits`
holds, assuming `fits` is monotone (a bigger batch or sequence never needs less memory): doubling
from `step`, then bisection between the last size that fit and the first that did not. Every
probe is one compile; `Search.probes` keeps what each measured, in order.
"""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class Search:
    step: int
    limit: int
    probes: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (size, peak)


def largest(peak_of: Callable[[int], int], capacity: int, step: int, limit: int,
            log=lambda msg: None) -> tuple[int | None, Search]:
    """(largest multiple of `step` <= `limit` with peak_of(size) <= capacity or None, record)."""
    if step < 1 or limit < step:
        raise ValueError(f"search: need 1 <= step <= limit, got step={step}, limit={limit}")
    rec = Search(step, limit)

    def fits(n: int) -> bool:
        peak = peak_of(n * step)
        rec.probes.append((n * step, peak))
        log(f"  size {n * step}: {peak / 2**20:,.1f} MiB "
            f"{'fits' if peak <= capacity else 'does not fit'}")
        return peak <= capacity

    top = limit // step
    if not fits(1):
        return None, rec
    good, bad = 1, None
    while bad is None and good < top:           # doubling
        n = min(2 * good, top)
        if fits(n):
            good = n
        else:
            bad = n
    while bad is not None and bad - good > 1:   # bisection
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good * step, rec
