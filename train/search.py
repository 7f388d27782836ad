"""The largest micro-batch or sequence length whose fully recomputed train step fits a device,
found by compiling (never running) candidate steps: no trial can run out of memory here.

`largest(fits, step, limit)`: the largest multiple of `step` in [step, limit] for which `fits`
holds, assuming `fits` is monotone (a bigger batch or sequence never needs less memory): doubling
from `step`, then bisection between the last size that fit and the first that did not. Every
probe is one compile; `Search.probes` keeps what each measured, in order.

`largest_listed(sizes, ...)`: the largest of a given list of sizes that fits (the paper's tested
sequence lengths), with as few compiles as a peak that is close to affine in the size allows: the
smallest first (if it does not fit, nothing does), then the largest, then the size the line
through the two probes nearest the boundary predicts, narrowing as bisection would if the
prediction is wrong. The answer is exact for any monotone peak; only the number of probes depends
on how affine it is (three or four at full size, instead of one per listed size).
"""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class Search:
    step: int
    limit: int
    probes: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (size, peak)


def largest(
    peak_of: Callable[[int], int], capacity: int, step: int, limit: int, log=lambda msg: None
) -> tuple[int | None, Search]:
    """(largest multiple of `step` <= `limit` with peak_of(size) <= capacity or None, record)."""
    if step < 1 or limit < step:
        raise ValueError(f"search: need 1 <= step <= limit, got step={step}, limit={limit}")
    rec = Search(step, limit)

    def fits(n: int) -> bool:
        peak = peak_of(n * step)
        rec.probes.append((n * step, peak))
        log(
            f"  size {n * step}: {peak / 2**20:,.1f} MiB "
            f"{'fits' if peak <= capacity else 'does not fit'}"
        )
        return peak <= capacity

    top = limit // step
    if not fits(1):
        return None, rec
    good, bad = 1, None
    while bad is None and good < top:  # doubling
        n = min(2 * good, top)
        if fits(n):
            good = n
        else:
            bad = n
    while bad is not None and bad - good > 1:  # bisection
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good * step, rec


def largest_listed(
    peak_of: Callable[[int], int], capacity: int, sizes, log=lambda msg: None
) -> tuple[int | None, Search]:
    """(largest of `sizes` with peak_of(size) <= capacity or None, record); `peak_of` must not
    decrease with the size. The record's `step` is the smallest size and `limit` the largest."""
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"search: need positive sizes, got {sizes}")
    rec = Search(sizes[0], sizes[-1])
    peaks: dict[int, int] = {}
    lo, hi = -1, len(sizes)  # sizes[lo] fits (-1: none known); sizes[hi] does not

    def next_index() -> int:
        if lo == -1 and not peaks:
            return 0
        if hi == len(sizes):
            return len(sizes) - 1
        known = [i for i in (lo, hi) if 0 <= i < len(sizes) and sizes[i] in peaks]
        if len(known) == 2:  # interpolate the boundary between the two bounds
            (s0, p0), (s1, p1) = ((sizes[i], peaks[sizes[i]]) for i in known)
            if p1 > p0:
                guess = s0 + (capacity - p0) * (s1 - s0) / (p1 - p0)
                i = max((k for k in range(lo + 1, hi) if sizes[k] <= guess), default=lo + 1)
                return i
        return (lo + hi) // 2

    while hi - lo > 1:
        i = next_index()
        peak = peak_of(sizes[i])
        peaks[sizes[i]] = peak
        rec.probes.append((sizes[i], peak))
        fits = peak <= capacity
        log(f"  size {sizes[i]}: {peak / 2**20:,.1f} MiB {'fits' if fits else 'does not fit'}")
        if fits:
            lo = i
        else:
            hi = i
        if lo == -1 and hi == 0:
            break
    skipped = [s for s in sizes if s not in peaks]
    if skipped:
        log(
            f"  (not probed: {', '.join(f'{s:,}' for s in skipped)}; the peak does not decrease "
            "with the size, so the answer does not depend on them)"
        )
    return (sizes[lo] if lo >= 0 else None), rec
