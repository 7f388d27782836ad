"""The `## Grouped matmul kernels` section of benchmarks/gpu.py: the shapes and group patterns,
the inputs and float64 references of a case, and one row per kernel with its three passes' time,
TFLOP/s and error."""

import dataclasses
import math

from gpu_common import FP8_TOL, TOL, error_text, num, print_head, print_row, relerr
from gpu_kernels import kernels, timed_call

# (name, M, K, N, G) per device
SHAPES = [
    ("qwen3-30b-a3b gate/up", 65536, 2048, 768, 16),
    ("qwen3-30b-a3b down", 65536, 768, 2048, 16),
    ("e384 gate/up = down", 65536, 2048, 2048, 48),
]
TINY_SHAPES = [
    ("qwen-like gate/up", 256, 64, 32, 4),
    ("qwen-like down", 256, 32, 64, 4),
    ("e384-like", 256, 64, 64, 8),
]
PATTERNS = ("balanced", "skewed")
PASSES = ("fwd", "dx", "dW")


def group_sizes(pattern: str, m: int, g: int):
    """Holds int32 [G] sizes summing to m: balanced, or skewed (see gpu.py's module doc)."""
    import numpy as np

    sizes = np.zeros(g, np.int64)
    if pattern == "balanced":
        sizes[:] = m // g
        sizes[: m - sizes.sum()] += 1
        return sizes.astype(np.int32)
    live = [i for i in range(1, g) if i % 4 != 3]  # every 4th group (3, 7, ...) stays empty
    sizes[0] = m // 2 if live else m
    if live:
        rest = m - sizes[0]
        zipf = 1.0 / np.arange(1, len(live) + 1)
        alloc = np.floor(rest * zipf / zipf.sum()).astype(np.int64)
        alloc[0] += rest - alloc.sum()
        sizes[live] = alloc
    return sizes.astype(np.int32)


def _pattern_label(pattern, sizes):
    if pattern == "balanced":
        return "balanced"
    return f"skewed (max {int(sizes.max())}, {int((sizes == 0).sum())} empty)"


def _sample(m, n_check, sizes):
    """Holds sorted unique rows to check: evenly spaced plus each group's first and last row."""
    import numpy as np

    if m <= n_check:
        return np.arange(m)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    edges = np.concatenate([starts[sizes > 0], ends[sizes > 0] - 1])
    return np.unique(np.concatenate([np.linspace(0, m - 1, n_check).astype(np.int64), edges]))


class Case:
    """One shape's device arrays; `check(pattern)` data: sampled rows and float64 references."""

    def __init__(self, m, k, n, g, check_rows, seed=0):
        import jax
        import jax.numpy as jnp

        kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
        self.m, self.k, self.n, self.g = m, k, n, g
        self.x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        self.w = (jax.random.normal(kw, (g, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
        self.dout = jax.random.normal(kd, (m, n), jnp.bfloat16)
        self.check_rows = check_rows

    def reference(self, sizes):
        """Holds (rows, cols, out[rows], dlhs[rows], drhs[:, :, cols]) in float64."""
        import numpy as np

        from relaymoe_jax.kernels.gmm import reference

        rows = _sample(self.m, self.check_rows, sizes)
        cols = np.unique(np.linspace(0, self.n - 1, min(self.n, 64)).astype(np.int64))
        ends = np.cumsum(sizes)
        sizes_r = np.bincount(np.searchsorted(ends, rows, side="right"), minlength=self.g)
        f64 = lambda a: np.asarray(a, np.float64)
        x_r, d_r, w = f64(self.x[rows]), f64(self.dout[rows]), f64(self.w)
        out = reference.gmm(x_r, w, sizes_r[: self.g])
        dlhs = reference.gmm(d_r, w, sizes_r[: self.g], transpose_rhs=True)
        drhs = reference.tgmm(f64(self.x), f64(self.dout[:, cols]), sizes, self.g)
        return rows, cols, out, dlhs, drhs


@dataclasses.dataclass(frozen=True)
class KernelTiming:
    """One pass of one kernel on one case (a JSON row); ms/tflops/err None when it failed."""

    shape: str
    m: int
    k: int
    n: int
    g: int
    groups: str
    kernel: str
    config: str
    op: str  # a PASSES entry
    ms: float | None
    tflops: float | None
    err: float | None
    error: str | None = None


def _pass_error(op, got, ref):
    """Holds the pass's err against the float64 reference (see gpu.py's module doc)."""
    rows, cols, ref_out, ref_dx, ref_dw = ref
    if op == "dW":
        return relerr(got[:, :, cols], ref_dw)
    return relerr(got[rows], ref_out if op == "fwd" else ref_dx)


def time_pass(kernel, op, case, gs, ref, flops, opts):
    """Holds (ms, TFLOP/s, err) of one pass; raises what the kernel raised."""
    got, secs = timed_call(
        kernel.fns[op], (case.x, case.w, gs, case.dout), opts, kernel.mgpu_interpret
    )
    err = _pass_error(op, got, ref)
    return secs * 1e3, flops / secs / 1e12, err


KERNEL_COLS = (
    "shape",
    "M",
    "K",
    "N",
    "G",
    "groups",
    "kernel",
    "config",
    *(f"{p} {c}" for p in PASSES for c in ("ms", "TFLOP/s")),
    "% peak fwd / dx / dW",
    *(f"err {p}" for p in PASSES),
    "check",
)


def kernel_rows(kernel, name, case, sizes, pattern, ref, opts, peak):
    """Times the kernel's passes on one case: prints its row, holds its KernelTiming records."""
    import jax.numpy as jnp

    gs = jnp.asarray(sizes)
    flops = 2.0 * float(sizes.sum()) * case.k * case.n
    groups = _pattern_label(pattern, sizes)
    timings, cells, pct = [], [], []
    for op in PASSES:
        rec = dict(
            shape=name,
            m=case.m,
            k=case.k,
            n=case.n,
            g=case.g,
            groups=pattern,
            kernel=kernel.name,
            config=kernel.config,
            op=op,
        )
        if op not in kernel.fns:
            timings.append(KernelTiming(**rec, ms=None, tflops=None, err=None, error=kernel.fail))
            cells += [kernel.fail, ""]
            pct.append("-")
            continue
        try:
            ms, tf, err = time_pass(kernel, op, case, gs, ref, flops, opts)
            timings.append(KernelTiming(**rec, ms=ms, tflops=tf, err=err))
            cells += [num(ms), num(tf)]
            pct.append(f"{100 * tf / (peak * kernel.peak_factor):.1f}" if peak else "n/a")
        except Exception as e:
            why = f"{kernel.fail}: {error_text(e)}"
            timings.append(KernelTiming(**rec, ms=None, tflops=None, err=None, error=why))
            cells += [why, ""]
            pct.append("-")
    errs = [t.err for t in timings if t.err is not None]
    check = "-" if not errs else ("ok" if all(e <= kernel.tol for e in errs) else "ERR > tol")
    print_row(
        [
            name,
            case.m,
            case.k,
            case.n,
            case.g,
            groups,
            kernel.name,
            kernel.label,
            *cells,
            " / ".join(pct),
            *("-" if t.err is None else num(t.err, 3) for t in timings),
            check,
        ]
    )
    return timings


def _case_kernels(name, m, k, n, g, opts):
    """Holds (case, kernels) of one shape, or None after printing why it failed."""
    try:
        case = Case(m, k, n, g, opts.check_rows)
        return case, kernels(case, opts)
    except Exception as e:
        print(f"# {name}: error: {error_text(e)}", flush=True)
        return None


def kernel_section(opts, peak, budget, results):
    print("\n## Grouped matmul kernels (bf16 in, f32 accumulation, bf16 out)\n")
    print(
        f"# fwd = x @ W_g, dx = dout @ W_g^T, dW = x_g^T @ dout_g, each 2*M*K*N FLOPs; err: "
        f"max|out - ref| / max|ref| vs float64 numpy; tolerance {TOL} ({FP8_TOL} for e4m3 "
        "against the unrounded operands); % peak: of "
        + (f"{peak} TFLOP/s" if peak else "n/a (peak unknown)")
        + " (bf16; e4m3 rows: of twice it)",
        flush=True,
    )
    print_head(KERNEL_COLS)
    for name, m, k, n, g in TINY_SHAPES if opts.tiny else SHAPES:
        if budget.over():
            print(f"# skipped {name} and the rest: time budget of {budget.minutes} min reached")
            return
        built = _case_kernels(name, m, k, n, g, opts)
        if built is None:
            continue
        case, kerns = built
        for pattern in PATTERNS:
            if budget.over():
                print(
                    f"# skipped {name} {pattern} and the rest: time budget of "
                    f"{budget.minutes} min reached"
                )
                return
            sizes = group_sizes(pattern, m, g)
            try:
                ref = case.reference(sizes)
            except Exception as e:
                print(f"# {name} {pattern}: reference failed: {error_text(e)}", flush=True)
                continue
            for kernel in kerns:
                results.kernels += kernel_rows(kernel, name, case, sizes, pattern, ref, opts, peak)
