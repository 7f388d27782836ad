"""One prepared GPU run: what the cost model assumes, measured on one H100/H200.

Run on one H100/H200 (the whole run within about 7 minutes; `--budget-min` skips what is left
after 6.5): `python benchmarks/gpu.py --json benchmarks/results/gpu.json`. The first output line
is the command that reproduces the output, the second the jax version, device kind and date.
`--json PATH` also writes every figure (below) to PATH, which `relaymoe_jax.costmodel.load_rates`
reads (benchmarks/cost_model.py then uses the measured compute rates instead of its assumed one);
nothing is written without it. Sections, in this order:

1. `## MoE layer` -- `moe_ffn` fwd+bwd on one device (mesh of 1, expert axis of size 1): ring
   (expert and token routing) vs all-to-all (dropless, and capacity factor 1.0), gmm_impl="pallas".
   Shape: E=16 experts (Qwen3-30B-A3B's 128 experts over EP=8 leave 16 per device), k=8, H=2048,
   F=768, T=8192 tokens, bf16: T*k = 65536 routed rows, the M of the kernel shapes below; the
   layer's arrays and temporaries take a few GB, far below 80 GB. Columns: compiled temp bytes
   (`compiled.memory_analysis().temp_size_in_bytes`, compile-only) for fwd and fwd+bwd; the run
   peak from `jax.devices()[0].memory_stats()`; fwd+bwd time; expert TFLOP/s (18*T*k*H*F per
   fwd+bwd: three matmuls, forward + two gradients each); pairs the capacity dropped; the largest
   |y - y_ring_expert| / max|y_ring_expert|. This section runs first, before the others allocate
   anything, because the allocator's peak cannot be reset (see `layer_section`).
2. `## One ring hop` -- the compute of one hop of the paper's ring (E=128 over EP=8: E_l=16
   local experts, k=8, H=2048, F=768, bf16, T=61,440 tokens per device): a hop computes the
   balanced share T*k/EP = 61,440 pairs, so on one device `moe_ffn(dispatcher="ring",
   routing="expert", gmm_impl="pallas")` with 16 experts and 61,440/8 = 7,680 tokens (k=8: the
   same 61,440 pairs, all on the one device) is that hop. Timed at two chunk sizes: the default
   (`dispatch.chunking.default_chunk(61_440, 8, 8, 128)`) and the balanced share (one chunk, the
   old default). fwd ms; bwd ms = fwd+bwd - fwd; TFLOP/s = 6*pairs*H*F / fwd and 12*pairs*H*F /
   bwd (`costmodel.hop_flops`: the three matmuls and their six gradients; the ring's backward
   also recomputes gate and up, not counted). These are the cost model's compute term.
3. `## Grouped matmul kernels` -- bf16 inputs, f32 accumulation, bf16 outputs: the three passes of
   one grouped matmul timed apart: fwd out = x @ W_g, dx = dout @ W_g^T (gmm with
   transpose_rhs=True), dW = x_g^T @ dout_g (tgmm). Kernels: our Pallas gmm/tgmm (impl="pallas":
   the default config and the block configs of PALLAS_CONFIGS, from tokamax's H100 autotuning
   data), XLA's `lax.ragged_dot` (impl="ragged_dot"), and JAX's Mosaic-GPU
   `ragged_dot_mgpu.ragged_dot` (dx: the same kernel with transpose_rhs=True; dW:
   `transposed_ragged_dot_mgpu`). Shapes are per device, M = tokens*k = 65536 routed rows:
   Qwen3-30B-A3B gate/up (K=H=2048, N=F=768, G=16 local experts) and down (K=768, N=2048), and
   E384 (H=F=2048, G=48; gate/up and down have the same shape). Group patterns, both summing to
   M: balanced (equal sizes) and skewed (half the rows in group 0, the rest Zipf 1/r over the
   other groups, every 4th group empty). TFLOP/s = 2*M*K*N / time for each pass. `% peak` is
   against the dense bf16 peak of the device kind (printed; `--peak-tflops` sets it). err =
   max|out - ref| / max|ref| against the float64 numpy reference (`kernels/gmm/reference.py`) on
   sampled rows (`--check-rows`; all rows when M is no larger) and, for dW, up to 64 sampled
   columns. `check` is "ok" when all three are within the bf16 tolerance TOL, else "ERR > tol".

Time = median over `--runs` runs, after `--warmup` calls, of the wall time of `--inner` back-to-back
calls ended by `jax.block_until_ready`, divided by `--inner` (a call slower than 10 ms is timed
alone, and one slower than 0.2 s is run 3 times at most). Every section, kernel and cell is guarded:
a failure prints `error: ...` (`n/a: ...` for the Mosaic-GPU kernel, e.g. on a non-Hopper GPU) and
the run goes on. Once `--budget-min` minutes have passed, the remaining cases are skipped (said so).

`--tiny` shrinks every shape so it runs anywhere (M=256, K, N in {32, 64}, G in {4, 8}; the layer at
E=4, k=2, H=F=32, T=64; the hop at E_l=4, k=2, H=F=32, 128 pairs, chunks 32 and 128). `--interpret`
(needs `--tiny`) runs the Pallas kernel with interpret=True, the Mosaic-GPU kernels under
`plgpu.force_gpu_interpret_mode` and the layer and hop with gmm_impl="pallas-interpret": this is
how tests/test_gpu_script.py runs the script on CPU. Its times only show that the code runs.
Without `--interpret` the script needs a GPU.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from relaymoe_jax import costmodel
from relaymoe_jax.argtypes import non_negative_int, positive_float, positive_int

SCRIPT = "benchmarks/gpu.py"
TOL = 2e-2  # bf16 tolerance of err (relative to max|reference|), as in tests/test_gmm_pallas.py
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
SECTIONS = ("layer", "hop", "kernels")  # run in this order: see layer_section's doc
# Pallas configs: "default" (api.gmm / api.tgmm impl="pallas") or
# "block_m,block_n,block_k[,warps[,stages]]" in our kernel's terms; each is timed in every pass.
# The sweep starts from the block configs tokamax's autotuner found fastest for its Pallas-Triton
# ragged_dot on an H100 (openxla/tokamax 783ea95, tokamax/data/autotuning/nvidia_h100_80gb_hbm3/
# pallas_triton_ragged_dot.json, entry keys "lhs"/"rhs" shapes; TFLOP/s = 2*M*K*N / the median of
# its evaluation_times_ms). Its forward and dx dots tile (rows, output columns, contraction) with
# (block_m, block_n, block_k) as ours do; its ragged-contracting dot (dW) tiles lhs's output dim
# with block_m, rhs's with block_n and the rows with block_k, so its (m, n, k) is our tgmm's
# (block_k, block_n, block_m). It has no entry at our exact shapes (G=16/48); the nearest are:
#   128,128,32,4,4  fwd: fastest at 5 of its 8 G=256 forward shapes, e.g. bf16[131072,7168] @
#                   [256,7168,1024] (421 TFLOP/s); dx: fastest at 13 of its 15 dx shapes, among
#                   them [131072,768] @ [128,2048,768]^T (our gate/up dx at G=128, 164 TFLOP/s)
#                   and [65536,2048] @ [256,7168,2048]^T (144 TFLOP/s).
#   128,256,64,8    fwd: fastest at the few-group bf16[8192,4096] @ [8,4096,14336] (G=8, 649
#                   TFLOP/s) with 3 stages; stages fitted here (3 for gmm; tgmm would need
#                   245,760 bytes of shared memory at 3, so 2).
#   64,256,128,8    dW: its (128, 256, 64, 8 warps, 3 stages), fastest at [131072,2048]^T @
#                   [131072,768] (our gate/up dW at G=128, 551 TFLOP/s), [131072,4096]^T @
#                   [131072,1536] (580) and [262144,1536]^T @ [262144,4096] (595); stages fitted
#                   (3 for tgmm; gmm would need 245,760 bytes at 3, so 2).
#   32,128,128,4,4  dW: its (128, 128, 32, 4, 4), fastest at [131072,1536]^T @ [131072,4096]
#                   (down-like, K < N, G=128: 568 TFLOP/s) and [65536,7168]^T @ [65536,2048]
#                   (M=65,536, G=256: 393 TFLOP/s).
PALLAS_CONFIGS = ["default", "128,128,32,4,4", "128,256,64,8", "64,256,128,8", "32,128,128,4,4"]
TINY_PALLAS_CONFIGS = ["default", "16,32,32"]
# Mosaic-GPU configs: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n); blocks are
# shrunk to divide the dimension they tile (see `_mgpu_cfg`).
MGPU_CONFIGS = [(128, 128, 64, 4, 2), (64, 128, 64, 4, 2)]
TINY_MGPU_CONFIGS = [(64, 64, 32, 2, 1)]
LAYER = dict(experts=16, top_k=8, hidden=2048, ffn=768, tokens=8192)
TINY_LAYER = dict(experts=4, top_k=2, hidden=32, ffn=32, tokens=64)
LAYER_VARIANTS = ("ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0")  # memory.VARIANTS
# One hop of the paper's ring on one device: `experts` local experts (of experts * ep), `tokens`
# = the paper's tokens per device / ep, so tokens * top_k = the hop's balanced share of pairs.
# `chunk`: the smaller chunk timed (None: dispatch.chunking.default_chunk at the paper shape).
HOP = dict(experts=16, top_k=8, hidden=2048, ffn=768, tokens=7_680, ep=8, chunk=None)
TINY_HOP = dict(experts=4, top_k=2, hidden=32, ffn=32, tokens=64, ep=8, chunk=32)
# Dense bf16 tensor-core peak (TFLOP/s, no sparsity), NVIDIA spec sheets.
PEAKS = (("nvl", None), ("h100 pcie", 756.0), ("h100", 989.4), ("h200", 989.4), ("a100", 312.0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes: runs anywhere")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="kernels in their CPU interpreters (needs --tiny); runs=1 by default",
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument(
        "--runs", type=positive_int, default=None, help="timed runs (default 10; 1 interpret)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=None, help="warm-up calls (default 2; 1 interp.)"
    )
    p.add_argument(
        "--inner",
        type=positive_int,
        default=None,
        help="back-to-back calls per timed run (default 5; 1 interpret)",
    )
    p.add_argument(
        "--pallas-configs",
        nargs="+",
        default=None,
        help="Pallas block configs: 'default' or 'bm,bn,bk[,warps[,stages]]' (default: "
        + " ".join(PALLAS_CONFIGS)
        + ")",
    )
    p.add_argument(
        "--check-rows",
        type=positive_int,
        default=2048,
        help="rows sampled for the error check (all rows when M is no larger)",
    )
    p.add_argument(
        "--layer-tokens",
        type=positive_int,
        default=None,
        help=f"tokens of the layer section (default {LAYER['tokens']}; tiny "
        f"{TINY_LAYER['tokens']})",
    )
    p.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        help="dense bf16 peak for '%% peak' (default: from the device kind)",
    )
    p.add_argument(
        "--budget-min",
        type=positive_float,
        default=6.5,
        help="skip the remaining cases after this many minutes",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the measurements to PATH (for the cost model: "
        "benchmarks/results/gpu.json)",
    )
    a = p.parse_args(argv)
    if a.interpret and not a.tiny:
        p.error(
            "--interpret runs the kernels in their CPU interpreters, which only handle tiny "
            "shapes: add --tiny"
        )
    a.runs = a.runs or (1 if a.interpret else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.interpret else 2)
    a.inner = a.inner or (1 if a.interpret else 5)
    a.pallas_configs = a.pallas_configs or (TINY_PALLAS_CONFIGS if a.tiny else PALLAS_CONFIGS)
    for c in a.pallas_configs:
        try:
            _pallas_cfg(c)
        except ValueError as e:
            p.error(f"--pallas-configs {c!r}: {e}")
    return a


# ---------------------------------------------------------------- helpers


def _why(e: BaseException, limit: int = 160) -> str:
    """Holds a one-line, table-safe description of an exception."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _row(cells):
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def _head(cols):
    _row(cols)
    print("|" + "---|" * len(cols), flush=True)


def _num(v, digits=4):
    return f"{v:.{digits}g}"


def _mib(nbytes):
    return f"{nbytes / 2**20:,.1f}"


def assumed_peak(kind: str):
    """Holds the dense bf16 peak TFLOP/s of a device kind, or None when unknown."""
    k = kind.lower()
    for key, peak in PEAKS:
        if key in k:
            return peak
    return None


def _pallas_cfg(spec: str):
    """Holds None for "default", else the block/launch keyword arguments of pallas.gmm."""
    if spec == "default":
        return None
    parts = spec.split(",")
    if not 3 <= len(parts) <= 5 or not all(p.strip().isdigit() for p in parts):
        raise ValueError("expected 'default' or 'block_m,block_n,block_k[,warps[,stages]]'")
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    return {n: int(p) for n, p in zip(names, parts)}


def timed(fn, args, opts, keep=True):
    """Holds (first output or None, median seconds per call); the method: see the module doc.

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
    times = []
    for _ in range(runs):
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


# ---------------------------------------------------------------- kernels


def group_sizes(pattern: str, m: int, g: int):
    """Holds int32 [G] sizes summing to m: balanced, or skewed (see the module doc)."""
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


def _relerr(got, want):
    import numpy as np

    got = np.asarray(got, np.float64)
    scale = float(np.abs(want).max()) or 1.0
    return float(np.max(np.abs(got - want))) / scale


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


def _mgpu_cfg(cfg, m, k, n):
    """Holds the ragged_dot_mgpu keyword arguments for [M,K] @ [G,K,N], blocks fitted."""
    bm, bn, bk, steps, gbn = cfg

    def fit(block, dim):
        while block > 8 and (block > dim or dim % block):
            block //= 2
        return block

    bn, bk = fit(bn, n), fit(bk, k)
    if (-(-n // bn)) % gbn:
        gbn = 1
    return dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)


def _mgpu_label(kw):
    return (
        f"bm{kw['block_m']} bn{kw['block_n']} bk{kw['block_k']} "
        f"steps{kw['max_concurrent_steps']} gbn{kw['grid_block_n']}"
    )


@contextlib.contextmanager
def _mgpu_context(interpret):
    """GPU interpret mode on CPU, with a device `core_count` for transposed_ragged_dot."""
    if not interpret:
        yield
        return
    from unittest import mock

    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    real = jax.devices

    class _Dev:  # CPU devices have no core_count; transposed_ragged_dot reads it
        core_count = 8

        def __init__(self, dev):
            self._dev = dev

        def __getattr__(self, name):
            return getattr(self._dev, name)

    patch = (
        mock.patch.object(jax, "devices", lambda *a: [_Dev(d) for d in real(*a)])
        if not hasattr(real()[0], "core_count")
        else contextlib.nullcontext()
    )
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()), patch:
        yield


def _reset_interpreter():
    try:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
            reset_gpu_interpret_mode_state,
        )

        reset_gpu_interpret_mode_state()
    except Exception:  # a private API: best effort only
        pass


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel under test: a jitted fn(x, w, gs, dout) per pass, or none and why not."""

    name: str  # "pallas", "ragged_dot" or "mgpu"
    config: str  # as given: a PALLAS_CONFIGS entry, or the Mosaic-GPU label
    label: str  # as printed
    fns: dict  # pass -> jitted fn; {} when the kernel is unavailable
    fail: str  # what a failed cell starts with: "error", "n/a" or "n/a: why"
    mgpu_interpret: bool = False


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


def _passes(gmm, tgmm, **kw):
    """Holds {pass: fn(x, w, gs, dout)}: fwd x @ w[g], dx dout @ w[g]^T, dW x_g^T @ dout_g."""
    return {
        "fwd": lambda x, w, gs, dout: gmm(x, w, gs, **kw),
        "dx": lambda x, w, gs, dout: gmm(dout, w, gs, transpose_rhs=True, **kw),
        "dW": lambda x, w, gs, dout: tgmm(x, dout, gs, **kw),
    }


def _jit_all(fns):
    import jax

    return {p: jax.jit(f) for p, f in fns.items()}


def _cfg_label(cfg):
    return " ".join(f"{k.replace('block_', 'b').replace('num_', '')}{v}" for k, v in cfg.items())


def pallas_kernel(spec: str, interpret: bool) -> Kernel:
    """Our Pallas gmm (fwd, dx) and tgmm (dW), at config `spec` (see PALLAS_CONFIGS)."""
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import gmm as api_gmm
    from relaymoe_jax.kernels.gmm import pallas as gp
    from relaymoe_jax.kernels.gmm import tgmm as api_tgmm

    common = dict(preferred_element_type=jnp.bfloat16, interpret=interpret)
    cfg = _pallas_cfg(spec)
    if cfg is None:
        return Kernel(
            "pallas",
            spec,
            "default (api impl='pallas')",
            _jit_all(_passes(api_gmm, api_tgmm, impl="pallas", **common)),
            "error",
        )
    return Kernel(
        "pallas",
        spec,
        _cfg_label(cfg),
        _jit_all(_passes(gp.gmm, gp.tgmm, **common, **cfg)),
        "error",
    )


def ragged_dot_kernel() -> Kernel:
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import gmm as api_gmm
    from relaymoe_jax.kernels.gmm import tgmm as api_tgmm

    fns = _passes(api_gmm, api_tgmm, impl="ragged_dot", preferred_element_type=jnp.bfloat16)
    return Kernel(
        "ragged_dot", "ragged_dot", "lax.ragged_dot (impl='ragged_dot')", _jit_all(fns), "error"
    )


def mgpu_kernels(case, opts) -> list[Kernel]:
    """JAX's Mosaic-GPU kernels at MGPU_CONFIGS (one 'n/a: why' entry if they do not import)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except Exception as e:
        return [Kernel("mgpu", "ragged_dot_mgpu", "ragged_dot_mgpu", {}, f"n/a: {_why(e)}")]
    out = []
    for cfg in TINY_MGPU_CONFIGS if opts.tiny else MGPU_CONFIGS:
        kw_fwd = _mgpu_cfg(cfg, case.m, case.k, case.n)
        kw_dx = _mgpu_cfg(cfg, case.m, case.n, case.k)  # [M,N] @ [G,K,N]^T: N contracted
        bm, bn = kw_fwd["block_m"], kw_fwd["block_n"]
        while bm > 8 and case.k % bm:
            bm //= 2
        # block_k is the row chunk; its swizzle tiles the (rows, K) and (rows, N) blocks in
        # block_k columns, so block_k must divide block_m and block_n.
        kw_dw = dict(
            block_m=bm,
            block_n=bn,
            block_k=min(64, bm, bn),
            max_concurrent_steps=cfg[3],
            grid_block_n=1,
        )
        fns = _mgpu_passes(
            ragged_dot_mgpu.ragged_dot,
            transposed_ragged_dot_mgpu.transposed_ragged_dot,
            kw_fwd,
            kw_dx,
            kw_dw,
        )
        label = _mgpu_label(kw_fwd)
        out.append(Kernel("mgpu", label, label, _jit_all(fns), "n/a", opts.interpret))
    return out


def _mgpu_passes(rd, trd, kw_fwd, kw_dx, kw_dw):
    """Holds {pass: fn(x, w, gs, dout)} of the Mosaic-GPU kernels, each with its own blocks."""
    return {
        "fwd": lambda x, w, gs, dout: rd(x, w, group_sizes=gs, **kw_fwd),
        "dx": lambda x, w, gs, dout: rd(dout, w, group_sizes=gs, transpose_rhs=True, **kw_dx),
        "dW": lambda x, w, gs, dout: trd(x, dout, group_sizes=gs, **kw_dw),
    }


def kernels(case, opts) -> list[Kernel]:
    """Every kernel timed on `case`: the Pallas configs, lax.ragged_dot, the Mosaic-GPU ones."""
    return [
        *(pallas_kernel(s, opts.interpret) for s in opts.pallas_configs),
        ragged_dot_kernel(),
        *mgpu_kernels(case, opts),
    ]


def _call(fn, args, opts, mgpu_interpret):
    """Holds timed(fn, args) run inside the Mosaic-GPU interpreter when asked."""
    with _mgpu_context(mgpu_interpret):
        try:
            return timed(fn, args, opts)
        except Exception:
            if mgpu_interpret:
                _reset_interpreter()
            raise


def _pass_error(op, got, ref):
    """Holds the pass's err against the float64 reference (see the module doc)."""
    rows, cols, ref_out, ref_dx, ref_dw = ref
    if op == "dW":
        return _relerr(got[:, :, cols], ref_dw)
    return _relerr(got[rows], ref_out if op == "fwd" else ref_dx)


def time_pass(kernel, op, case, gs, ref, flops, opts):
    """Holds (ms, TFLOP/s, err) of one pass; raises what the kernel raised."""
    got, secs = _call(kernel.fns[op], (case.x, case.w, gs, case.dout), opts, kernel.mgpu_interpret)
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
            cells += [_num(ms), _num(tf)]
            pct.append(f"{100 * tf / peak:.1f}" if peak else "n/a")
        except Exception as e:
            why = f"{kernel.fail}: {_why(e)}"
            timings.append(KernelTiming(**rec, ms=None, tflops=None, err=None, error=why))
            cells += [why, ""]
            pct.append("-")
    errs = [t.err for t in timings if t.err is not None]
    check = "-" if not errs else ("ok" if all(e <= TOL for e in errs) else "ERR > tol")
    _row(
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
            *("-" if t.err is None else _num(t.err, 3) for t in timings),
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
        print(f"# {name}: error: {_why(e)}", flush=True)
        return None


def kernel_section(opts, peak, budget, results):
    print("\n## Grouped matmul kernels (bf16 in, f32 accumulation, bf16 out)\n")
    print(
        f"# fwd = x @ W_g, dx = dout @ W_g^T, dW = x_g^T @ dout_g, each 2*M*K*N FLOPs; err: "
        f"max|out - ref| / max|ref| vs float64 numpy; tolerance {TOL}; % peak: of "
        + (f"{peak} TFLOP/s" if peak else "n/a (peak unknown)"),
        flush=True,
    )
    _head(KERNEL_COLS)
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
                print(f"# {name} {pattern}: reference failed: {_why(e)}", flush=True)
                continue
            for kernel in kerns:
                results.kernels += kernel_rows(kernel, name, case, sizes, pattern, ref, opts, peak)


# ---------------------------------------------------------------- layer and hop


def _moe_impl(opts):
    """Holds the layer's gmm_impl: pallas (its interpreter with --interpret), else xla."""
    from relaymoe_jax.kernels.gmm import MOE_IMPLS

    impl = "pallas-interpret" if opts.interpret else "pallas"
    if impl not in MOE_IMPLS:
        print(f"# gmm_impl={impl!r} is not in MOE_IMPLS {MOE_IMPLS}: using 'xla' instead")
        impl = "xla"
    return impl


def _one_device():
    """Holds (device, its 1-device mesh over axis "expert", the sharding of that axis)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("expert",))
    return dev, mesh, NamedSharding(mesh, P("expert"))


def layer_inputs(shp, sharding):
    """Holds moe_ffn's bf16 inputs (x, ids, weights, w_gate, w_up, w_down) for shape `shp`:
    each token routed to `top_k` distinct random experts, router weights normalised."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    keys = jax.random.split(jax.random.key(1), 5)
    wts = rng.uniform(0.1, 1.0, (t, k))
    host = [
        jax.random.normal(keys[0], (t, h)),
        ids,
        wts / wts.sum(1, keepdims=True),
        jax.random.normal(keys[1], (e, h, f)) / math.sqrt(h),
        jax.random.normal(keys[2], (e, h, f)) / math.sqrt(h),
        jax.random.normal(keys[3], (e, f, h)) / math.sqrt(f),
    ]
    return [
        jax.device_put(jnp.asarray(a, jnp.int32 if i == 1 else jnp.bfloat16), sharding)
        for i, a in enumerate(host)
    ]


def layer_fns(kw, stats=True):
    """Holds (fwd, fwdbwd) of moe_ffn(**kw), both taking (x, ids, wts, wg, wu, wd): fwd gives
    (y, stats) (y alone with stats=False), fwdbwd the loss 0.5*|y|^2 and its gradients."""
    import jax
    import jax.numpy as jnp

    from relaymoe_jax import moe_ffn

    fwd = lambda x, ids, wts, wg, wu, wd: moe_ffn(x, ids, wts, wg, wu, wd, return_stats=stats, **kw)

    def loss(x, wts, wg, wu, wd, ids):
        y = moe_ffn(x, ids, wts, wg, wu, wd, **kw).astype(jnp.float32)
        return 0.5 * jnp.sum(y * y)  # dy = y: a real [T, H] cotangent

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    return fwd, lambda x, ids, wts, wg, wu, wd: grad(x, wts, wg, wu, wd, ids)


def _compile(fn, args):
    import jax

    from relaymoe_jax import XLA_OPTIONS

    return jax.jit(fn).lower(*args).compile(compiler_options=XLA_OPTIONS)


LAYER_COLS = (
    "variant",
    "fwd temp MiB",
    "fwd+bwd temp MiB",
    "run peak MiB",
    "fwd+bwd ms",
    "expert TFLOP/s",
    "dropped pairs",
    "y rel. diff vs ring-expert",
)


def layer_section(opts, budget, results):
    """moe_ffn fwd+bwd on a 1-device mesh: ring (expert, token) vs alltoall (dropless, cap 1.0).

    Peak memory: `memory_stats()["peak_bytes_in_use"]` is a process-wide high-water mark that
    cannot be reset. So every variant is compiled first (its temp size measured), then the
    variants run in ascending order of fwd+bwd temp size, each on the same resident inputs: a
    variant that raises the high-water mark gets `peak - bytes in use before it ran` (its
    transient peak over the inputs); one that does not gets "<= " the previous mark's value,
    an upper bound only.
    """
    import numpy as np

    from relaymoe_jax import memory

    shp = dict(TINY_LAYER if opts.tiny else LAYER)
    shp["tokens"] = opts.layer_tokens or shp["tokens"]
    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    impl = "pallas-interpret" if opts.interpret else "pallas"
    print(
        f"\n## MoE layer fwd+bwd on one device: E={e} k={k} H={h} F={f} T={t} bf16, "
        f"gmm_impl={impl!r}\n"
    )
    impl = _moe_impl(opts)
    dev, mesh, sharding = _one_device()
    args = layer_inputs(shp, sharding)
    stats = lambda: dev.memory_stats() or {}
    print(
        "# temp MiB: compiled.memory_analysis().temp_size_in_bytes (compile-only); run peak "
        "MiB: memory_stats() peak_bytes_in_use during the variant's runs minus bytes in use "
        "before (variants run in ascending temp order; '<= x': no new high-water mark, an "
        "upper bound; n/a: no memory_stats on this backend); MiB = 2^20 bytes; expert "
        "TFLOP/s = 18*T*k*H*F / time, every routed pair counted (a2a-cap1.0 computes fewer: "
        "its dropped pairs)",
        flush=True,
    )
    compiled, errors = {}, {}
    for v in LAYER_VARIANTS:
        try:
            fwd, fwdbwd = layer_fns(
                dict(memory.VARIANTS[v], mesh=mesh, expert_axis="expert", gmm_impl=impl)
            )
            c_fwd, c_all = _compile(fwd, args), _compile(fwdbwd, args)
            compiled[v] = (c_fwd, c_all, c_fwd.memory_analysis(), c_all.memory_analysis())
        except Exception as ex:
            errors[v] = f"error: {_why(ex)}"
    temp = lambda ma: ma.temp_size_in_bytes if ma is not None else None
    order = sorted(compiled, key=lambda v: temp(compiled[v][3]) or 0)
    _head(LAYER_COLS)
    flops, rows, ys = 18.0 * t * k * h * f, {}, {}
    for v in order:
        c_fwd, c_all, ma_fwd, ma_all = compiled[v]
        cells = [
            v,
            _mib(temp(ma_fwd)) if ma_fwd else "n/a",
            _mib(temp(ma_all)) if ma_all else "n/a",
        ]
        if budget.over():
            rows[v] = [*cells, f"skipped: time budget of {budget.minutes} min", "", "", ""]
            continue
        try:
            before = stats()
            y, st = c_fwd(*args)
            ys[v] = np.asarray(y, np.float64)
            dropped = int(st["dropped_pairs"])
            del y, st
            _, secs = timed(c_all, args, opts, keep=False)
            after = stats()
            if "peak_bytes_in_use" in after and "bytes_in_use" in before:
                new_mark = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]
                peak_txt = (
                    _mib(after["peak_bytes_in_use"] - before["bytes_in_use"])
                    if new_mark
                    else f"<= {_mib(before['peak_bytes_in_use'] - before['bytes_in_use'])}"
                )
            else:
                peak_txt = "n/a"
            rows[v] = [*cells, peak_txt, _num(secs * 1e3), _num(flops / secs / 1e12), dropped]
        except Exception as ex:
            rows[v] = [*cells, f"error: {_why(ex)}", "", "", ""]
    for v in LAYER_VARIANTS:  # printed together: the last column needs ring-expert's output
        if v in errors:
            cells = [v, errors[v], "", "", "", "", "", ""]
        else:
            ref = ys.get("ring-expert")
            diff = (
                _num(_relerr(ys[v], ref), 3)
                if v in ys and ref is not None
                else "n/a"
                if v in ys
                else ""
            )
            cells = [*rows[v], diff]
        _row(cells)
        results.layer.append(dict(zip(LAYER_COLS, (str(c) for c in cells))))


@dataclasses.dataclass(frozen=True)
class HopTiming:
    """One hop at one chunk size (a JSON row); the times None when it failed."""

    chunk: int
    default_chunk: bool  # the ring's default chunk at the paper shape
    pairs: int
    experts: int
    top_k: int
    hidden: int
    ffn: int
    fwd_ms: float | None
    bwd_ms: float | None
    fwd_tflops: float | None
    bwd_tflops: float | None
    error: str | None = None


def hop_chunks(shp):
    """Holds [(chunk, is the default)]: the default chunk at the paper shape, then the balanced
    share (one chunk; the old default)."""
    from relaymoe_jax.dispatch.chunking import balanced_share, default_chunk

    ring_tokens, ep = shp["tokens"] * shp["ep"], shp["ep"]
    share = balanced_share(ring_tokens, shp["top_k"], ep)
    small = shp["chunk"] or default_chunk(ring_tokens, shp["top_k"], ep, shp["experts"] * ep)
    return [(small, True), (share, False)]


def time_hop(shp, chunk, mesh, args, impl, opts):
    """Holds (fwd s, fwd+bwd s) of the ring's one hop at `chunk` pairs per chunk."""
    fwd, fwdbwd = layer_fns(
        dict(
            dispatcher="ring",
            routing="expert",
            mesh=mesh,
            expert_axis="expert",
            gmm_impl=impl,
            chunk_size=chunk,
        ),
        stats=False,
    )
    _, t_fwd = timed(_compile(fwd, args), args, opts, keep=False)
    _, t_all = timed(_compile(fwdbwd, args), args, opts, keep=False)
    return t_fwd, t_all


HOP_COLS = (
    "chunk (pairs)",
    "chunks per hop",
    "fwd ms",
    "bwd ms",
    "fwd+bwd ms",
    "fwd TFLOP/s",
    "bwd TFLOP/s",
)


def hop_section(opts, budget, results):
    """One hop of the paper's ring on one device, at the default chunk and at one chunk."""
    shp = TINY_HOP if opts.tiny else HOP
    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    pairs, impl = t * k, _moe_impl(opts)
    print(
        f"\n## One ring hop: E_l={e} local experts (E={e * shp['ep']} over EP={shp['ep']}), "
        f"k={k}, H={h}, F={f}, bf16, {pairs:,} pairs (T={t * shp['ep']:,} per device / EP; "
        f"{t:,} tokens on one device), gmm_impl={impl!r}\n"
    )
    flop_f, flop_b = costmodel.hop_flops(pairs, h, f)
    print(
        f"# moe_ffn(dispatcher='ring', routing='expert', chunk_size=chunk) under jit on a "
        f"1-device mesh; bwd = fwd+bwd - fwd; TFLOP/s: {costmodel.HOP_FWD_UNITS}*pairs*H*F / "
        f"fwd, {costmodel.HOP_BWD_UNITS}*pairs*H*F / bwd (the recompute not counted)",
        flush=True,
    )
    _, mesh, sharding = _one_device()
    args = layer_inputs(shp, sharding)
    _head(HOP_COLS)
    for chunk, is_default in hop_chunks(shp):
        rec = dict(
            chunk=chunk, default_chunk=is_default, pairs=pairs, experts=e, top_k=k, hidden=h, ffn=f
        )
        label = f"{chunk:,}" + (" (default)" if is_default else " (balanced share)")
        if budget.over():
            why = f"skipped: time budget of {budget.minutes} min"
            results.hop.append(
                HopTiming(
                    **rec, fwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None, error=why
                )
            )
            _row([label, "", why, "", "", "", ""])
            continue
        try:
            t_fwd, t_all = time_hop(shp, chunk, mesh, args, impl, opts)
        except Exception as ex:
            results.hop.append(
                HopTiming(
                    **rec,
                    fwd_ms=None,
                    bwd_ms=None,
                    fwd_tflops=None,
                    bwd_tflops=None,
                    error=_why(ex),
                )
            )
            _row([label, "", f"error: {_why(ex)}", "", "", "", ""])
            continue
        t_bwd = t_all - t_fwd
        tf_b = flop_b / t_bwd / 1e12 if t_bwd > 0 else None
        results.hop.append(
            HopTiming(
                **rec,
                fwd_ms=t_fwd * 1e3,
                bwd_ms=t_bwd * 1e3,
                fwd_tflops=flop_f / t_fwd / 1e12,
                bwd_tflops=tf_b,
            )
        )
        _row(
            [
                label,
                -(-pairs // chunk),
                _num(t_fwd * 1e3),
                _num(t_bwd * 1e3),
                _num(t_all * 1e3),
                _num(flop_f / t_fwd / 1e12),
                _num(tf_b) if tf_b is not None else "n/a (fwd+bwd <= fwd)",
            ]
        )


# ---------------------------------------------------------------- results and main


@dataclasses.dataclass
class Results:
    """What the sections measured, for `--json`."""

    kernels: list = dataclasses.field(default_factory=list)  # KernelTiming
    hop: list = dataclasses.field(default_factory=list)  # HopTiming
    layer: list = dataclasses.field(default_factory=list)  # {LAYER_COLS column: cell text}


def write_json(path, header: dict, results: Results):
    """Writes the header (command, device, jax, date, ...) and every section's rows to path."""
    doc = {
        **header,
        "kernels": [dataclasses.asdict(r) for r in results.kernels],
        "hop": [dataclasses.asdict(r) for r in results.hop],
        "layer": results.layer,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n# measurements written to {path}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    import jax

    if jax.default_backend() != "gpu" and not opts.interpret:
        raise SystemExit(
            f"{SCRIPT} needs a GPU (JAX's default backend here is "
            f"{jax.default_backend()!r}). On CPU, `python {SCRIPT} --tiny "
            "--interpret` runs it with the kernels in their interpreters."
        )
    import logging

    logging.getLogger("relaymoe_jax").setLevel(logging.ERROR)  # capacity warnings: counted
    dev = jax.devices()[0]
    command = " ".join(shlex.quote(a) for a in ["python", SCRIPT, *argv])
    print("# reproduce: " + command)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# jax {jax.__version__}; device: {dev.device_kind} ({dev.platform}, "
        f"{jax.device_count()} visible, 1 used); {now}; host {os.cpu_count()} CPUs"
    )
    peak = opts.peak_tflops or assumed_peak(dev.device_kind)
    src = "--peak-tflops" if opts.peak_tflops else f"spec sheet for {dev.device_kind!r}"
    print(
        f"# assumed dense bf16 peak: {peak} TFLOP/s ({src})"
        if peak
        else f"# assumed dense bf16 peak: unknown for {dev.device_kind!r} (pass --peak-tflops); "
        "'% peak' is n/a"
    )
    print(
        f"# time: median of {opts.runs} runs x {opts.inner} calls after {opts.warmup} "
        "warm-up(s), block_until_ready (calls > 10 ms: 1 per run; > 0.2 s: <= 3 runs)"
    )
    if opts.interpret:
        print(
            "# --interpret: Pallas interpret=True, Mosaic GPU under force_gpu_interpret_mode, "
            "layer and hop gmm_impl='pallas-interpret'; times only show that the code runs"
        )
    budget, results = Budget(opts.budget_min), Results()
    sections = {
        "layer": lambda: layer_section(opts, budget, results),
        "hop": lambda: hop_section(opts, budget, results),
        "kernels": lambda: kernel_section(opts, peak, budget, results),
    }
    for name in SECTIONS:
        if name not in opts.sections:
            continue
        try:
            sections[name]()
        except Exception as e:
            print(f"# {name} section failed: {_why(e)}", flush=True)
    if opts.json:
        write_json(
            opts.json,
            dict(
                command=command,
                device=dev.device_kind,
                platform=dev.platform,
                jax=jax.__version__,
                date=now,
                tiny=opts.tiny,
                interpret=opts.interpret,
                peak_tflops=peak,
            ),
            results,
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
