"""One prepared GPU run: grouped-matmul kernel TFLOP/s and the MoE layer's fwd+bwd time and memory.

Run on one H100/H200: `python benchmarks/gpu.py` (about 5 minutes). The first output line is the
command that reproduces the output, the second the jax version, device kind and date. Sections:

1. `## MoE layer` -- `moe_ffn` fwd+bwd on one device (mesh of 1, expert axis of size 1): ring
   (expert and token routing) vs all-to-all (dropless, and capacity factor 1.0), gmm_impl="pallas".
   Shape: E=16 experts (Qwen3-30B-A3B's 128 experts over EP=8 leave 16 per device), k=8, H=2048,
   F=768, T=8192 tokens, bf16: T*k = 65536 routed rows, the M of the kernel shapes below; the
   layer's arrays and temporaries take a few GB, far below 80 GB. Columns: compiled temp bytes
   (`compiled.memory_analysis().temp_size_in_bytes`, compile-only) for fwd and fwd+bwd; the run
   peak from `jax.devices()[0].memory_stats()`; fwd+bwd time; expert TFLOP/s (18*T*k*H*F per
   fwd+bwd: three matmuls, forward + two gradients each); pairs the capacity dropped; the largest
   |y - y_ring_expert| / max|y_ring_expert|. This section runs first, before the kernels allocate
   anything, because the allocator's peak cannot be reset (see `layer_section`).
2. `## Grouped matmul kernels` -- bf16 inputs, f32 accumulation, bf16 outputs (and gradients):
   our Pallas `gmm` (impl="pallas": the default config, plus a few block configs), XLA's
   `lax.ragged_dot` (impl="ragged_dot"), and JAX's Mosaic-GPU `ragged_dot_mgpu.ragged_dot` (its
   fwd+bwd is that kernel for dlhs with transpose_rhs=True, and `transposed_ragged_dot_mgpu` for
   drhs). Shapes are per device, M = tokens*k = 65536 routed rows: Qwen3-30B-A3B gate/up (K=H=2048,
   N=F=768, G=16 local experts) and down (K=768, N=2048), and E384 (H=F=2048, G=48; gate/up and
   down have the same shape). Group patterns, both summing to M: balanced (equal sizes) and skewed
   (half the rows in group 0, the rest Zipf 1/r over the other groups, every 4th group empty).
   TFLOP/s = 2*M*K*N / time for the forward, 3 * 2*M*K*N (forward, dlhs, drhs) for fwd+bwd.
   `% peak` is against the dense bf16 peak of the device kind (printed; `--peak-tflops` sets it).
   err = max|out - ref| / max|ref| against the float64 numpy reference (`kernels/gmm/reference.py`)
   on sampled rows (`--check-rows`; all rows when M is no larger) and, for drhs, up to 64 sampled
   columns; err bwd is the larger of dlhs's and drhs's. `check` is "ok" when both are within the
   bf16 tolerance TOL, else "ERR > tol".

Time = median over `--runs` runs, after `--warmup` calls, of the wall time of `--inner` back-to-back
calls ended by `jax.block_until_ready`, divided by `--inner` (a call slower than 10 ms is timed
alone, and one slower than 0.2 s is run 3 times at most). Every section, kernel and cell is guarded:
a failure prints `error: ...` (`n/a: ...` for the Mosaic-GPU kernel, e.g. on a non-Hopper GPU) and
the run goes on. Once `--budget-min` minutes have passed, the remaining cases are skipped (said so).

`--tiny` shrinks every shape so it runs anywhere (M=256, K, N in {32, 64}, G in {4, 8}; the layer at
E=4, k=2, H=F=32, T=64). `--interpret` (needs `--tiny`) runs the Pallas kernel with interpret=True,
the Mosaic-GPU kernels under `plgpu.force_gpu_interpret_mode` and the layer with
gmm_impl="pallas-interpret": this is how tests/test_gpu_script.py runs the script on CPU. Its
times only show that the code runs. Without `--interpret` the script needs a GPU.
"""

import argparse
import contextlib
import datetime
import math
import os
import shlex
import sys
import time

from relaymoe_jax.argtypes import non_negative_int, positive_float, positive_int

SCRIPT = "benchmarks/gpu.py"
TOL = 2e-2   # bf16 tolerance of err (relative to max|reference|), as in tests/test_gmm_pallas.py
# (name, M, K, N, G) per device
SHAPES = [("qwen3-30b-a3b gate/up", 65536, 2048, 768, 16),
          ("qwen3-30b-a3b down", 65536, 768, 2048, 16),
          ("e384 gate/up = down", 65536, 2048, 2048, 48)]
TINY_SHAPES = [("qwen-like gate/up", 256, 64, 32, 4),
               ("qwen-like down", 256, 32, 64, 4),
               ("e384-like", 256, 64, 64, 8)]
PATTERNS = ("balanced", "skewed")
# Pallas configs: "default" (api.gmm(impl="pallas")) or "block_m,block_n,block_k[,warps[,stages]]"
PALLAS_CONFIGS = ["default", "128,128,64,8,3", "128,256,64,8", "64,256,64,4,3"]
# (128x256x64 with its stages fitted to shared memory: 3 stages of its tgmm need 245,760 bytes)
TINY_PALLAS_CONFIGS = ["default", "16,32,32"]
# Mosaic-GPU configs: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n); blocks are
# shrunk to divide the dimension they tile (see `_mgpu_cfg`).
MGPU_CONFIGS = [(128, 128, 64, 4, 2), (64, 128, 64, 4, 2)]
TINY_MGPU_CONFIGS = [(64, 64, 32, 2, 1)]
LAYER = dict(experts=16, top_k=8, hidden=2048, ffn=768, tokens=8192)
TINY_LAYER = dict(experts=4, top_k=2, hidden=32, ffn=32, tokens=64)
LAYER_VARIANTS = ("ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0")  # memory.VARIANTS
# Dense bf16 tensor-core peak (TFLOP/s, no sparsity), NVIDIA spec sheets.
PEAKS = (("nvl", None), ("h100 pcie", 756.0), ("h100", 989.4), ("h200", 989.4), ("a100", 312.0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes: runs anywhere")
    p.add_argument("--interpret", action="store_true",
                   help="kernels in their CPU interpreters (needs --tiny); runs=1 by default")
    p.add_argument("--sections", nargs="+", choices=("layer", "kernels"),
                   default=["layer", "kernels"])
    p.add_argument("--runs", type=positive_int, default=None,
                   help="timed runs (default 10; 1 interpret)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="warm-up calls (default 2; 1 interp.)")
    p.add_argument("--inner", type=positive_int, default=None,
                   help="back-to-back calls per timed run (default 5; 1 interpret)")
    p.add_argument("--pallas-configs", nargs="+", default=None,
                   help="Pallas block configs: 'default' or 'bm,bn,bk[,warps[,stages]]' (default: "
                        + " ".join(PALLAS_CONFIGS) + ")")
    p.add_argument("--check-rows", type=positive_int, default=2048,
                   help="rows sampled for the error check (all rows when M is no larger)")
    p.add_argument("--layer-tokens", type=positive_int, default=None,
                   help=f"tokens of the layer section (default {LAYER['tokens']}; tiny "
                        f"{TINY_LAYER['tokens']})")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="dense bf16 peak for '%% peak' (default: from the device kind)")
    p.add_argument("--budget-min", type=positive_float, default=4.5,
                   help="skip the remaining cases after this many minutes")
    a = p.parse_args(argv)
    if a.interpret and not a.tiny:
        p.error("--interpret runs the kernels in their CPU interpreters, which only handle tiny "
                "shapes: add --tiny")
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
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
            out = None   # drop the previous output before the next call allocates its own
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
    live = [i for i in range(1, g) if i % 4 != 3]   # every 4th group (3, 7, ...) stays empty
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
        self.w = (jax.random.normal(kw, (g, k, n), jnp.float32) / math.sqrt(k)).astype(
            jnp.bfloat16)
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
    return (f"bm{kw['block_m']} bn{kw['block_n']} bk{kw['block_k']} "
            f"steps{kw['max_concurrent_steps']} gbn{kw['grid_block_n']}")


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

    class _Dev:   # CPU devices have no core_count; transposed_ragged_dot reads it
        core_count = 8

        def __init__(self, dev):
            self._dev = dev

        def __getattr__(self, name):
            return getattr(self._dev, name)

    patch = (mock.patch.object(jax, "devices", lambda *a: [_Dev(d) for d in real(*a)])
             if not hasattr(real()[0], "core_count") else contextlib.nullcontext())
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()), patch:
        yield


def _reset_interpreter():
    try:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
            reset_gpu_interpret_mode_state,
        )
        reset_gpu_interpret_mode_state()
    except Exception:   # a private API: best effort only
        pass


def kernels(case, opts):
    """Holds [(kernel, config label, fwd fn, fwdbwd fn, failure prefix, interpret-mgpu)]."""
    import jax
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import gmm as api_gmm
    from relaymoe_jax.kernels.gmm import pallas as gp
    bf16 = jnp.bfloat16

    def with_vjp(f):
        def fb(x, w, gs, dout):
            out, vjp = jax.vjp(lambda a, b: f(a, b, gs), x, w)
            return (out, *vjp(dout))
        return fb

    out = []
    for spec in opts.pallas_configs:
        cfg = _pallas_cfg(spec)
        if cfg is None:
            f = lambda x, w, gs: api_gmm(x, w, gs, impl="pallas", interpret=opts.interpret,
                                         preferred_element_type=bf16)
            label = "default (api.gmm impl='pallas')"
        else:
            f = (lambda c: lambda x, w, gs: gp.gmm(x, w, gs, preferred_element_type=bf16,
                                                   interpret=opts.interpret, **c))(cfg)
            label = " ".join(f"{k.replace('block_', 'b').replace('num_', '')}{v}"
                             for k, v in cfg.items())
        out.append(("pallas", label, jax.jit(f), jax.jit(with_vjp(f)), "error", False))
    f = lambda x, w, gs: api_gmm(x, w, gs, impl="ragged_dot", preferred_element_type=bf16)
    out.append(("ragged_dot", "lax.ragged_dot (impl='ragged_dot')", jax.jit(f),
                jax.jit(with_vjp(f)), "error", False))
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except Exception as e:
        out.append(("mgpu", "ragged_dot_mgpu", None, None, f"n/a: {_why(e)}", False))
        return out
    for cfg in (TINY_MGPU_CONFIGS if opts.tiny else MGPU_CONFIGS):
        kw_fwd = _mgpu_cfg(cfg, case.m, case.k, case.n)
        kw_dlhs = _mgpu_cfg(cfg, case.m, case.n, case.k)   # [M,N] @ [G,K,N]^T: N contracted
        bm, bn = kw_fwd["block_m"], kw_fwd["block_n"]
        while bm > 8 and case.k % bm:
            bm //= 2
        # block_k is the row chunk; its swizzle tiles the (rows, K) and (rows, N) blocks in
        # block_k columns, so block_k must divide block_m and block_n.
        kw_drhs = dict(block_m=bm, block_n=bn, block_k=min(64, bm, bn),
                       max_concurrent_steps=cfg[3], grid_block_n=1)
        fwd, fwdbwd = _mgpu_fns(ragged_dot_mgpu, transposed_ragged_dot_mgpu, kw_fwd, kw_dlhs,
                                kw_drhs)
        out.append(("mgpu", _mgpu_label(kw_fwd), jax.jit(fwd), jax.jit(fwdbwd), "n/a",
                    opts.interpret))
    return out


def _mgpu_fns(rd, trd, kw_fwd, kw_dlhs, kw_drhs):
    """Holds (fwd, fwdbwd) of the Mosaic-GPU kernels: fwdbwd gives (out, dlhs, drhs)."""
    fwd = lambda x, w, gs: rd.ragged_dot(x, w, group_sizes=gs, **kw_fwd)

    def fwdbwd(x, w, gs, dout):
        dx = rd.ragged_dot(dout, w, group_sizes=gs, transpose_rhs=True, **kw_dlhs)
        dw = trd.transposed_ragged_dot(x, dout, group_sizes=gs, **kw_drhs)
        return fwd(x, w, gs), dx, dw

    return fwd, fwdbwd


def _call(fn, args, opts, mgpu_interpret):
    """Holds timed(fn, args) run inside the Mosaic-GPU interpreter when asked."""
    with _mgpu_context(mgpu_interpret):
        try:
            return timed(fn, args, opts)
        except Exception:
            if mgpu_interpret:
                _reset_interpreter()
            raise


def kernel_section(opts, peak, budget):
    import jax.numpy as jnp
    print("\n## Grouped matmul kernels (bf16 in, f32 accumulation, bf16 out)\n")
    print(f"# err: max|out - ref| / max|ref| vs float64 numpy; tolerance {TOL}; % peak: of "
          + (f"{peak} TFLOP/s" if peak else "n/a (peak unknown)"), flush=True)
    _head(("shape", "M", "K", "N", "G", "groups", "kernel", "config", "fwd ms", "fwd TFLOP/s",
           "fwd % peak", "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd % peak", "err fwd",
           "err bwd", "check"))
    pct = lambda tf: f"{100 * tf / peak:.1f}" if peak else "n/a"
    for name, m, k, n, g in (TINY_SHAPES if opts.tiny else SHAPES):
        if budget.over():
            print(f"# skipped {name} and the rest: time budget of {budget.minutes} min reached")
            return
        try:
            case = Case(m, k, n, g, opts.check_rows)
            kerns = kernels(case, opts)
        except Exception as e:
            print(f"# {name}: error: {_why(e)}", flush=True)
            continue
        for pattern in PATTERNS:
            if budget.over():
                print(f"# skipped {name} {pattern} and the rest: time budget of "
                      f"{budget.minutes} min reached")
                return
            sizes = group_sizes(pattern, m, g)
            try:
                rows, cols, ref_out, ref_dx, ref_dw = case.reference(sizes)
            except Exception as e:
                print(f"# {name} {pattern}: reference failed: {_why(e)}", flush=True)
                continue
            gs = jnp.asarray(sizes)
            flops = 2.0 * float(sizes.sum()) * k * n
            for kernel, label, fwd, fwdbwd, fail, mgpu_interp in kerns:
                cells = [name, m, k, n, g, _pattern_label(pattern, sizes), kernel, label]
                errs, res = {}, []
                for key, fn, args, mult in (("fwd", fwd, (case.x, case.w, gs), 1),
                                            ("bwd", fwdbwd, (case.x, case.w, gs, case.dout), 3)):
                    if fn is None:
                        res += [fail, "", ""]
                        continue
                    try:
                        got, secs = _call(fn, args, opts, mgpu_interp)
                        if key == "fwd":
                            errs[key] = _relerr(got[rows], ref_out)
                        else:
                            errs[key] = max(_relerr(got[1][rows], ref_dx),
                                            _relerr(got[2][:, :, cols], ref_dw))
                        del got
                        tf = mult * flops / secs / 1e12
                        res += [_num(secs * 1e3), _num(tf), pct(tf)]
                    except Exception as e:
                        res += [f"{fail}: {_why(e)}", "", ""]
                errs_txt = [_num(errs[x], 3) if x in errs else "-" for x in ("fwd", "bwd")]
                ok = "-" if not errs else (
                    "ok" if all(v <= TOL for v in errs.values()) else "ERR > tol")
                _row([*cells, *res, *errs_txt, ok])


# ---------------------------------------------------------------- layer


def layer_section(opts, budget):
    """moe_ffn fwd+bwd on a 1-device mesh: ring (expert, token) vs alltoall (dropless, cap 1.0).

    Peak memory: `memory_stats()["peak_bytes_in_use"]` is a process-wide high-water mark that
    cannot be reset. So every variant is compiled first (its temp size measured), then the
    variants run in ascending order of fwd+bwd temp size, each on the same resident inputs: a
    variant that raises the high-water mark gets `peak - bytes in use before it ran` (its
    transient peak over the inputs); one that does not gets "<= " the previous mark's value,
    an upper bound only.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from relaymoe_jax import XLA_OPTIONS, memory, moe_ffn
    from relaymoe_jax.kernels.gmm import MOE_IMPLS
    shp = dict(TINY_LAYER if opts.tiny else LAYER)
    shp["tokens"] = opts.layer_tokens or shp["tokens"]
    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    impl = "pallas-interpret" if opts.interpret else "pallas"
    print(f"\n## MoE layer fwd+bwd on one device: E={e} k={k} H={h} F={f} T={t} bf16, "
          f"gmm_impl={impl!r}\n")
    if impl not in MOE_IMPLS:
        print(f"# gmm_impl={impl!r} is not in MOE_IMPLS {MOE_IMPLS}: using 'xla' instead")
        impl = "xla"
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("expert",))
    sharding = NamedSharding(mesh, P("expert"))
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    keys = jax.random.split(jax.random.key(1), 5)
    wts = rng.uniform(0.1, 1.0, (t, k))
    host = [jax.random.normal(keys[0], (t, h)), ids, wts / wts.sum(1, keepdims=True),
            jax.random.normal(keys[1], (e, h, f)) / math.sqrt(h),
            jax.random.normal(keys[2], (e, h, f)) / math.sqrt(h),
            jax.random.normal(keys[3], (e, f, h)) / math.sqrt(f)]
    args = [jax.device_put(jnp.asarray(a, jnp.int32 if i == 1 else jnp.bfloat16), sharding)
            for i, a in enumerate(host)]
    del host

    def fns(variant):
        kw = dict(memory.VARIANTS[variant], mesh=mesh, expert_axis="expert", gmm_impl=impl)
        fwd = lambda x, ids, wts, wg, wu, wd: moe_ffn(x, ids, wts, wg, wu, wd, return_stats=True,
                                                      **kw)

        def loss(x, wts, wg, wu, wd, ids):
            y = moe_ffn(x, ids, wts, wg, wu, wd, **kw).astype(jnp.float32)
            return 0.5 * jnp.sum(y * y)   # dy = y: a real [T, H] cotangent

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
        return fwd, lambda x, ids, wts, wg, wu, wd: grad(x, wts, wg, wu, wd, ids)

    stats = lambda: dev.memory_stats() or {}
    print("# temp MiB: compiled.memory_analysis().temp_size_in_bytes (compile-only); run peak "
          "MiB: memory_stats() peak_bytes_in_use during the variant's runs minus bytes in use "
          "before (variants run in ascending temp order; '<= x': no new high-water mark, an "
          "upper bound; n/a: no memory_stats on this backend); MiB = 2^20 bytes; expert "
          "TFLOP/s = 18*T*k*H*F / time, every routed pair counted (a2a-cap1.0 computes fewer: "
          "its dropped pairs)", flush=True)
    compiled, errors = {}, {}
    for v in LAYER_VARIANTS:
        try:
            fwd, fwdbwd = fns(v)
            c_fwd = jax.jit(fwd).lower(*args).compile(compiler_options=XLA_OPTIONS)
            c_all = jax.jit(fwdbwd).lower(*args).compile(compiler_options=XLA_OPTIONS)
            compiled[v] = (c_fwd, c_all, c_fwd.memory_analysis(), c_all.memory_analysis())
        except Exception as ex:
            errors[v] = f"error: {_why(ex)}"
    temp = lambda ma: ma.temp_size_in_bytes if ma is not None else None
    order = sorted(compiled, key=lambda v: temp(compiled[v][3]) or 0)
    _head(("variant", "fwd temp MiB", "fwd+bwd temp MiB", "run peak MiB", "fwd+bwd ms",
           "expert TFLOP/s", "dropped pairs", "y rel. diff vs ring-expert"))
    flops, rows, ys = 18.0 * t * k * h * f, {}, {}
    for v in order:
        c_fwd, c_all, ma_fwd, ma_all = compiled[v]
        cells = [v, _mib(temp(ma_fwd)) if ma_fwd else "n/a",
                 _mib(temp(ma_all)) if ma_all else "n/a"]
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
                peak_txt = (_mib(after["peak_bytes_in_use"] - before["bytes_in_use"]) if new_mark
                            else f"<= {_mib(before['peak_bytes_in_use'] - before['bytes_in_use'])}")
            else:
                peak_txt = "n/a"
            rows[v] = [*cells, peak_txt, _num(secs * 1e3), _num(flops / secs / 1e12), dropped]
        except Exception as ex:
            rows[v] = [*cells, f"error: {_why(ex)}", "", "", ""]
    for v in LAYER_VARIANTS:   # printed together: the last column needs ring-expert's output
        if v in errors:
            _row([v, errors[v], "", "", "", "", "", ""])
            continue
        ref = ys.get("ring-expert")
        diff = (_num(_relerr(ys[v], ref), 3) if v in ys and ref is not None
                else "n/a" if v in ys else "")
        _row([*rows[v], diff])


# ---------------------------------------------------------------- main


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    import jax
    if jax.default_backend() != "gpu" and not opts.interpret:
        raise SystemExit(f"{SCRIPT} needs a GPU (JAX's default backend here is "
                         f"{jax.default_backend()!r}). On CPU, `python {SCRIPT} --tiny "
                         "--interpret` runs it with the kernels in their interpreters.")
    import logging
    logging.getLogger("relaymoe_jax").setLevel(logging.ERROR)   # capacity warnings: counted
    dev = jax.devices()[0]
    print("# reproduce: " + " ".join(shlex.quote(a) for a in ["python", SCRIPT, *argv]))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# jax {jax.__version__}; device: {dev.device_kind} ({dev.platform}, "
          f"{jax.device_count()} visible, 1 used); {now}; host {os.cpu_count()} CPUs")
    peak = opts.peak_tflops or assumed_peak(dev.device_kind)
    src = "--peak-tflops" if opts.peak_tflops else f"spec sheet for {dev.device_kind!r}"
    print(f"# assumed dense bf16 peak: {peak} TFLOP/s ({src})" if peak else
          f"# assumed dense bf16 peak: unknown for {dev.device_kind!r} (pass --peak-tflops); "
          "'% peak' is n/a")
    print(f"# time: median of {opts.runs} runs x {opts.inner} calls after {opts.warmup} "
          "warm-up(s), block_until_ready (calls > 10 ms: 1 per run; > 0.2 s: <= 3 runs)")
    if opts.interpret:
        print("# --interpret: Pallas interpret=True, Mosaic GPU under force_gpu_interpret_mode, "
              "layer gmm_impl='pallas-interpret'; times only show that the code runs")
    budget = Budget(opts.budget_min)
    sections = {"layer": lambda: layer_section(opts, budget),
                "kernels": lambda: kernel_section(opts, peak, budget)}
    for name in ("layer", "kernels"):   # layer first: see layer_section's doc
        if name not in opts.sections:
            continue
        try:
            sections[name]()
        except Exception as e:
            print(f"# {name} section failed: {_why(e)}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
