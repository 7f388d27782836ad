"""The grouped matmul kernels benchmarks/gpu.py times: our Pallas gmm/tgmm at each block config,
XLA's lax.ragged_dot and JAX's Mosaic-GPU kernels, each as one jitted function per pass (fwd, dx,
dW), and how a pass is timed (inside the Mosaic-GPU interpreter with --interpret)."""

import contextlib
import dataclasses

from gpu_common import FP8_TOL, TOL, error_text, timed

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


def pallas_cfg(spec: str):
    """Holds None for "default", else the block/launch keyword arguments of pallas.gmm."""
    if spec == "default":
        return None
    parts = spec.split(",")
    if not 3 <= len(parts) <= 5 or not all(p.strip().isdigit() for p in parts):
        raise ValueError("expected 'default' or 'block_m,block_n,block_k[,warps[,stages]]'")
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    return {n: int(p) for n, p in zip(names, parts)}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel under test: a jitted fn(x, w, gs, dout) per pass, or none and why not."""

    name: str  # "mosaic", "pallas", "ragged_dot" or "mgpu"
    config: str  # as given: a PALLAS_CONFIGS entry, or the Mosaic-GPU label
    label: str  # as printed
    fns: dict  # pass -> jitted fn; {} when the kernel is unavailable
    fail: str  # what a failed cell starts with: "error", "n/a" or "n/a: why"
    mgpu_interpret: bool = False
    tol: float = TOL  # of err against float64 of the (unrounded) bf16 operands
    peak_factor: float = 1.0  # the device's peak for this kernel's operands / its bf16 peak


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
    cfg = pallas_cfg(spec)
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


def mosaic_kernel(interpret: bool) -> Kernel:
    """Our Mosaic GPU gmm (fwd, dx) and tgmm (dW) at their default config (impl="mosaic"); in
    the GPU interpreter with `interpret` (their own `interpret=True`)."""
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import gmm as api_gmm
    from relaymoe_jax.kernels.gmm import tgmm as api_tgmm

    kw = dict(impl="mosaic", interpret=interpret, preferred_element_type=jnp.bfloat16)
    fns = _jit_all(_passes(api_gmm, api_tgmm, **kw))
    return Kernel("mosaic", "mosaic", "ours, Mosaic GPU (impl='mosaic')", fns, "error")


def fp8_kernel(case, interpret: bool) -> Kernel:
    """Our e4m3 Mosaic GPU gmm (`kernels/gmm/mosaic_fp8.py`, what expert_fp8 runs on Hopper):
    fwd and dx on operands quantised once here, outside the timing (x and dout per 1 x 128
    tile, W per 128 x 128 block, W for fwd already K-major as the ring keeps it: the kernel
    alone). dW stays the 16-bit tgmm (the mosaic row's). % peak: of the e4m3 peak (2x bf16)."""
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import mosaic, mosaic_fp8
    from relaymoe_jax.quant import fp8

    cfg = mosaic.make_config(interpret)
    x_q, d_q = fp8.quantize(case.x, fp8.TILE), fp8.quantize(case.dout, fp8.TILE)
    w_nk, w_kn = fp8.quantize(jnp.swapaxes(case.w, 1, 2)), fp8.quantize(case.w)
    call = lambda a, w, gs: mosaic_fp8.gmm_fp8_call(a, w, gs, True, jnp.bfloat16, cfg)
    fns = {
        "fwd": lambda x, w, gs, dout: call(x_q, w_nk, gs),
        "dx": lambda x, w, gs, dout: call(d_q, w_kn, gs),  # dout @ W^T: W is [G, K, N] = K-major
    }
    label = "ours, e4m3 (gmm_fp8, operands pre-quantised)"
    why = "n/a: 16-bit tgmm (the mosaic row)"
    return Kernel("mosaic-fp8", "e4m3", label, _jit_all(fns), why, tol=FP8_TOL, peak_factor=2.0)


def ragged_dot_kernel() -> Kernel:
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import gmm as api_gmm
    from relaymoe_jax.kernels.gmm import tgmm as api_tgmm

    fns = _passes(api_gmm, api_tgmm, impl="ragged_dot", preferred_element_type=jnp.bfloat16)
    return Kernel(
        "ragged_dot", "ragged_dot", "lax.ragged_dot (impl='ragged_dot')", _jit_all(fns), "error"
    )


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


def mgpu_kernels(case, opts) -> list[Kernel]:
    """JAX's Mosaic-GPU kernels at MGPU_CONFIGS (one 'n/a: why' entry if they do not import)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except Exception as e:
        return [Kernel("mgpu", "ragged_dot_mgpu", "ragged_dot_mgpu", {}, f"n/a: {error_text(e)}")]
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
    """Every kernel timed on `case`: ours on Mosaic GPU (bf16, then e4m3), the Pallas Triton
    configs, lax.ragged_dot, jax's Mosaic-GPU ones."""
    return [
        mosaic_kernel(opts.interpret),
        fp8_kernel(case, opts.interpret),
        *(pallas_kernel(s, opts.interpret) for s in opts.pallas_configs),
        ragged_dot_kernel(),
        *mgpu_kernels(case, opts),
    ]


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
    """Clears the Mosaic-GPU interpreter's state after a failed kernel, best effort."""
    try:  # jax._src: jax exports no public function that resets the GPU interpreter's state
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
            reset_gpu_interpret_mode_state,
        )

        reset_gpu_interpret_mode_state()
    except Exception:  # a private API: best effort only
        pass


def timed_call(fn, args, opts, mgpu_interpret):
    """Holds timed(fn, args) run inside the Mosaic-GPU interpreter when asked."""
    with _mgpu_context(mgpu_interpret):
        try:
            return timed(fn, args, opts)
        except Exception:
            if mgpu_interpret:
                _reset_interpreter()
            raise
