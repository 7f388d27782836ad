"""What the sections of benchmarks/gpu.py share: the bf16 tolerance, the timing method, the time
budget and the Markdown table cells."""

import time

TOL = 2e-2  # bf16 tolerance of err (relative to max|reference|), as in tests/test_gmm_pallas.py
# The e4m3 kernel's err against the unrounded operands' reference: each product's relative error
# is at most (1 + 2^-4)^2 - 1 < 0.13 (two roundings to e4m3); random data sits far below it, a
# wrong block scale (a factor of 2 or more) far above.
FP8_TOL = 0.13


def error_text(e: BaseException, limit: int = 160) -> str:
    """Holds a one-line, table-safe description of an exception."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_row(cells):
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def print_head(cols):
    print_row(cols)
    print("|" + "---|" * len(cols), flush=True)


def num(v, digits=4):
    return f"{v:.{digits}g}"


def mib(nbytes):
    return f"{nbytes / 2**20:,.1f}"


def relerr(got, want):
    import numpy as np

    got = np.asarray(got, np.float64)
    scale = float(np.abs(want).max()) or 1.0
    return float(np.max(np.abs(got - want))) / scale


def timed(fn, args, opts, keep=True):
    """Holds (first output or None, median seconds per call); the method: see gpu.py's module doc.
    With `opts.warmup` 0 the first call (a compile included, where fn compiles) is the first run.

    Only one output is alive at a time while timing (with keep=False; else also the first).
    """
    import jax

    t0 = time.perf_counter()
    first = jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    for _ in range(max(opts.warmup - 1, 0)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = time.perf_counter() - t0
    first = first if keep else None
    inner = opts.inner if once < 0.01 else 1
    runs = opts.runs if once < 0.2 else min(opts.runs, 3)
    times = [] if opts.warmup else [once]  # no warm-up: the first call is the first run
    for _ in range(runs - len(times)):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = None  # drop the previous output before the next call allocates its own
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
        del out
    times.sort()
    mid = len(times) // 2
    return first, (times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid]))


class Budget:
    def __init__(self, minutes):
        self.end = time.monotonic() + 60 * minutes
        self.minutes = minutes

    def over(self):
        return time.monotonic() > self.end
