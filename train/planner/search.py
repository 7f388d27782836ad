"""The largest micro-batch or sequence length whose fully recomputed train step fits a device,
found by compiling (never running) candidate steps: no trial can run out of memory here.

`largest(fits, step, limit)`: the largest multiple of `step` in [step, limit] for which `fits`
holds, assuming `fits` is monotone (a bigger batch or sequence never needs less memory): doubling
from `step`, then bisection between the last size that fit and the first that did not. Every
probe is one compile; `Search.probes` keeps what each measured, in order.

A size fits when its device bytes fit `capacity` and, when `peak_of` measures host memory too
(returns a `(device bytes, host bytes)` pair) and a `host_capacity` is given, its host bytes fit
that: both at once (`overflow` names the memory that does not). Host bytes are the pinned host
memory of offloaded state and residuals (`memory.host_footprint`).

`largest_listed(sizes, ...)`: the largest of a given list of sizes that fits (the paper's tested
sequence lengths), with as few compiles as a peak that is close to affine in the size allows: the
smallest first (if it does not fit, nothing does), then the largest, then the size the line
through the two probes nearest the boundary predicts, narrowing as bisection would if the
prediction is wrong. The answer is exact for any monotone peak; only the number of probes depends
on how affine it is (three or four at full size, instead of one per listed size).
"""

import dataclasses
from collections.abc import Callable

# peak_of(size): device bytes, or (device bytes, host bytes)
PeakOf = Callable[[int], "int | tuple[int, int]"]


def overflow(peak: int, host: int, capacity: int | None, host_capacity: int | None) -> str:
    """Which memory `peak` device bytes and `host` host bytes overflow: "" when both fit,
    "device memory", "host memory" or "device and host memory" (a capacity None is not
    checked)."""
    over = [
        name
        for name, used, room in (("device", peak, capacity), ("host", host, host_capacity))
        if room is not None and used > room
    ]
    return f"{' and '.join(over)} memory" if over else ""


@dataclasses.dataclass
class Search:
    step: int
    limit: int
    probes: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (size, peak)
    hosts: dict[int, int] = dataclasses.field(default_factory=dict)  # size: host bytes, if measured
    capacity: int | None = None  # the device bytes a size had to fit
    host_capacity: int | None = None  # the host bytes it had to fit (None: not checked)

    def over(self, size: int) -> str:
        """`overflow` of the probe at `size`: "" if it fit."""
        peak = dict(self.probes)[size]
        return overflow(peak, self.hosts.get(size, 0), self.capacity, self.host_capacity)

    def fill(self, size: int) -> float:
        """The fuller memory's share of its capacity at the probe at `size` (> 1: over)."""
        used = [dict(self.probes)[size] / self.capacity]
        if self.host_capacity is not None and size in self.hosts:
            used.append(self.hosts[size] / self.host_capacity)
        return max(used)

    def _measure(self, peak_of: PeakOf, size: int, log) -> bool:
        """Probe `size`: record it, log it, and whether it fits."""
        got = peak_of(size)
        peak, host = got if isinstance(got, tuple) else (got, None)
        self.probes.append((size, peak))
        if host is not None:
            self.hosts[size] = host
        over = self.over(size)
        host_text = "" if host is None else f", host {host / 2**20:,.1f} MiB"
        verdict = f"does not fit ({over})" if over and host is not None else "does not fit"
        log(f"  size {size}: {peak / 2**20:,.1f} MiB{host_text} {verdict if over else 'fits'}")
        return not over


def largest(
    peak_of: PeakOf,
    capacity: int,
    step: int,
    limit: int,
    log=lambda msg: None,
    *,
    host_capacity: int | None = None,
) -> tuple[int | None, Search]:
    """(largest multiple of `step` <= `limit` that fits or None, record): its device bytes
    <= capacity and, if `peak_of` gives host bytes too, those <= host_capacity."""
    if step < 1 or limit < step:
        raise ValueError(f"search: need 1 <= step <= limit, got step={step}, limit={limit}")
    rec = Search(step, limit, capacity=capacity, host_capacity=host_capacity)

    def fits(n: int) -> bool:
        return rec._measure(peak_of, n * step, log)

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
    peak_of: PeakOf,
    capacity: int,
    sizes,
    log=lambda msg: None,
    *,
    host_capacity: int | None = None,
) -> tuple[int | None, Search]:
    """(largest of `sizes` that fits, as in `largest`, or None, record); `peak_of` must not
    decrease with the size. The record's `step` is the smallest size and `limit` the largest.
    The boundary is interpolated on the fuller of the two memories (bytes over capacity)."""
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"search: need positive sizes, got {sizes}")
    rec = Search(sizes[0], sizes[-1], capacity=capacity, host_capacity=host_capacity)
    fills: dict[int, float] = {}  # size: `Search.fill`
    lo, hi = -1, len(sizes)  # sizes[lo] fits (-1: none known); sizes[hi] does not

    def next_index() -> int:
        if lo == -1 and not fills:
            return 0
        if hi == len(sizes):
            return len(sizes) - 1
        known = [i for i in (lo, hi) if 0 <= i < len(sizes) and sizes[i] in fills]
        if len(known) == 2:  # interpolate the boundary between the two bounds
            (s0, p0), (s1, p1) = ((sizes[i], fills[sizes[i]]) for i in known)
            if p1 > p0:
                guess = s0 + (1 - p0) * (s1 - s0) / (p1 - p0)
                i = max((k for k in range(lo + 1, hi) if sizes[k] <= guess), default=lo + 1)
                return i
        return (lo + hi) // 2

    while hi - lo > 1:
        i = next_index()
        fits = rec._measure(peak_of, sizes[i], log)
        fills[sizes[i]] = rec.fill(sizes[i])
        if fits:
            lo = i
        else:
            hi = i
        if lo == -1 and hi == 0:
            break
    skipped = [s for s in sizes if s not in fills]
    if skipped:
        log(
            f"  (not probed: {', '.join(f'{s:,}' for s in skipped)}; the peak does not decrease "
            "with the size, so the answer does not depend on them)"
        )
    return (sizes[lo] if lo >= 0 else None), rec
