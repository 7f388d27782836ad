"""One prepared GPU run: what the cost model assumes, measured on one H100/H200.

Run on one H100/H200 (the whole run within about 8.5 minutes; `--budget-min` skips what is left
after 8): `python benchmarks/gpu.py --json benchmarks/results/gpu.json`. The first output line
is the command that reproduces the output, the second the jax version, device kind and date.
`--json PATH` also writes every figure (below) to PATH, which
`relaymoe_jax.analysis.costmodel.load_rates` reads (benchmarks/cost_model.py then uses the measured
compute rates instead of its assumed one); nothing is written without it. Sections, in this order:

1. `## MoE layer` -- `moe_ffn` fwd+bwd on one device (mesh of 1, expert axis of size 1): ring
   (expert and token routing) vs all-to-all (dropless, and capacity factor 1.0), gmm_impl="auto"
   (what a user gets: our Mosaic GPU kernel on Hopper, the Triton one on other GPUs).
   Shape: E=16 experts (Qwen3-30B-A3B's 128 experts over EP=8 leave 16 per device), k=8, H=2048,
   F=768, T=8192 tokens, bf16: T*k = 65536 routed rows, the M of the kernel shapes below; the
   layer's arrays and temporaries take a few GB, far below 80 GB. Columns: compiled temp bytes
   (`compiled.memory_analysis().temp_size_in_bytes`, compile-only) for fwd and fwd+bwd; the run
   peak from `jax.devices()[0].memory_stats()`; fwd+bwd time; expert TFLOP/s (18*T*k*H*F per
   fwd+bwd: three matmuls, forward + two gradients each); pairs the capacity dropped; the largest
   |y - y_ring_expert| / max|y_ring_expert|. This section runs first, before the others allocate
   anything, because the allocator's peak cannot be reset (see `layer_section`).
2. `## One ring hop` -- the compute of one hop of the paper's ring (E=128 over EP=8: E_l=16 local
   experts, k=8, H=2048, F=768, bf16, T=61,440 tokens per device): a hop computes the balanced share
   T*k/EP = 61,440 pairs, so on one device `moe_ffn(dispatcher="ring", routing="expert",
   gmm_impl=...)` with 16 experts and 61,440/8 = 7,680 tokens (k=8: the same 61,440 pairs, all on
   the one device) is that hop. Timed at two chunk sizes, the default
   (`dispatch.chunking.default_chunk(61_440, 8, 8, 128)`) and the balanced share (one chunk, the old
   default), with each grouped matmul (`gpu_layer.hop_cases`): ours on Mosaic GPU ("mosaic", what
   gmm_impl="auto" takes on Hopper) and on Triton ("pallas") at both, `lax.ragged_dot`
   ("ragged_dot") at the default chunk. fwd ms; bwd ms = fwd+bwd - fwd; TFLOP/s = 6*pairs*H*F / fwd
   and 12*pairs*H*F / bwd (`costmodel.hop_flops`: the three matmuls and their six gradients; the
   ring's backward also recomputes gate and up, not counted). The default chunk's row with "auto"'s
   grouped matmul is the cost model's compute term. A last row times that hop with
   `expert_fp8=True` (docs/precision.md): on Hopper the ring's forward and dgrad GEMMs run on
   our e4m3 kernel (`gmm_fp8`; wgrad stays the 16-bit tgmm), so this row against the "mosaic"
   row is the FP8 hop's speed-up (the FP8 relay's bytes are not in a one-device hop; the cost
   model's FP8 lines predict them).
3. `## Grouped matmul kernels` -- bf16 inputs, f32 accumulation, bf16 outputs: the three passes of
   one grouped matmul timed apart: fwd out = x @ W_g, dx = dout @ W_g^T (gmm with
   transpose_rhs=True), dW = x_g^T @ dout_g (tgmm). Kernels: ours on Mosaic GPU (impl="mosaic",
   its default config: TMA, wgmma, warp specialisation), its e4m3 form ("mosaic-fp8": fwd and dx
   of `gmm_fp8` on operands quantised before the timing, its err against the unrounded operands
   within FP8_TOL, its % peak of twice the bf16 peak), our Pallas Triton gmm/tgmm (impl="pallas":
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

4. `## Train step` -- the trainer's own step (`train.step.train_step`, compiled with
   `relaymoe_jax.XLA_OPTIONS`) on one GPU's share of Qwen3-30B-A3B at EP=8 (16 experts, 2
   layers, bf16, moe_remat, attention and grouped matmul "auto") at 8,192, 32,768 and 131,072
   tokens: step ms, tokens/s, model TFLOP/s and MFU as the trainer's metrics line counts them,
   the compiled peak, and the planner's predicted step time (`train/planner/predict.py`, at the
   cost model's rates) with measured / predicted: benchmarks/gpu_train.py. A length is skipped
   (said so) when the budget left cannot hold its compile (the last length's) and timed steps at
   the predicted step time (scaled by the last length's measured / predicted).
5. `## Attention` -- causal grouped-query attention fwd and fwd+bwd (the loss sum(o * do), do a
   fixed bf16 normal) at Qwen3-30B-A3B's heads: N=32 query heads, K=4 kv heads, head_dim 128,
   bf16, batch 1, at 8,192, 32,768 and 131,072 tokens per device, each with packed documents of
   4,096 tokens (segment ids 0, .., 0, 1, ..) and plain causal (run in that order, so the costliest
   case comes last). Implementations: our Pallas Mosaic GPU kernel (`pallas`:
   `kernels.attention.flash_attention`) and the chunked XLA path (`chunked`:
   `models.attention.chunked_causal_attention`, block_k=512). Columns: tokens, documents (none /
   the document length), impl, fwd ms, bwd ms (= fwd+bwd - fwd), fwd and bwd TFLOP/s, `% peak fwd
   / bwd` (of the bf16 peak below), err o / dq / dk / dv (max|x - chunked| / max|chunked| on up
   to `--check-rows` sampled positions with each document's first and last token) and check
   ("ok" when all four are within TOL). FLOPs count the causal minimum: fwd = 4*B*N*D*(visible
   (query, key) pairs: S(S+1)/2 causal, the sum of L(L+1)/2 over the documents), bwd = 2.5 x fwd
   (FlashAttention's convention: five matmuls to the forward's two). Chunked cells over 2e13 fwd
   FLOPs (131,072 tokens causal) are timed with 1 warm-up and 1 run; a cell is skipped (said so)
   when the budget left cannot hold it at the pace of the impl's previous cell (the first: at
   `gpu_attention.SLOW_RATE`).

Time = median over `--runs` runs, after `--warmup` calls, of the wall time of `--inner` back-to-back
calls ended by `jax.block_until_ready`, divided by `--inner` (a call slower than 10 ms is timed
alone, and one slower than 0.2 s is run 3 times at most). With `--warmup 0` the first call (its
compile included, where it compiles) is the first run: `--interpret`'s default, where each call
runs a kernel in its interpreter and the times only show that the code runs. Every section,
kernel and cell is guarded: a failure prints `error: ...` (`n/a: ...` for the Mosaic-GPU kernel,
e.g. on a non-Hopper GPU) and the run goes on. Once `--budget-min` minutes have passed, the
remaining cases are skipped (said so).

`--tiny` shrinks every shape so it runs anywhere (M=256, K, N in {32, 64}, G in {4, 8}; the layer at
E=4, k=2, H=F=32, T=64; the hop at E_l=4, k=2, H=F=32, 128 pairs, chunks 32 and 128; the train
step on configs/tiny.yaml, one layer, 64 tokens; attention at N=4, K=2, D=64, 128 tokens,
documents of 64, chunked block_k=64). `--interpret`
(needs `--tiny`) runs the Pallas kernels (gmm and attention) with interpret=True, the Mosaic-GPU
kernels under `plgpu.force_gpu_interpret_mode` and the hop with "pallas-interpret"; the layer runs
with gmm_impl="xla". This is how tests/test_gpu_script.py runs the script on CPU. Its
times only show that the code runs. Without `--interpret` the script needs a GPU.
"""

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: gpu_train
if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling modules, when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from gpu_attention import ATTN, TINY_ATTN, attention_section
from gpu_common import FP8_TOL, TOL, Budget, error_text
from gpu_kernel_section import PASSES, PATTERNS, SHAPES, TINY_SHAPES, kernel_section
from gpu_kernels import PALLAS_CONFIGS, TINY_PALLAS_CONFIGS, pallas_cfg
from gpu_layer import HOP, LAYER, LAYER_VARIANTS, TINY_HOP, TINY_LAYER, hop_section, layer_section
from gpu_train import TINY_TRAIN, TRAIN, train_section

from relaymoe_jax.cli.argtypes import non_negative_int, positive_float, positive_int

# What tests/test_gpu_script.py and tests/test_gpu_compile.py read off this script; the sections
# live in gpu_layer.py (layer, hop), gpu_kernel_section.py and gpu_kernels.py, gpu_attention.py,
# and gpu_common.py.
__all__ = [
    "ATTN",
    "FP8_TOL",
    "HOP",
    "LAYER",
    "LAYER_VARIANTS",
    "PALLAS_CONFIGS",
    "PASSES",
    "PATTERNS",
    "SHAPES",
    "TINY_ATTN",
    "TINY_HOP",
    "TINY_LAYER",
    "TINY_PALLAS_CONFIGS",
    "TINY_SHAPES",
    "TINY_TRAIN",
    "TOL",
    "TRAIN",
    "main",
    "pallas_cfg",
    "parse_args",
]

SCRIPT = "benchmarks/gpu.py"
# run in this order: see gpu_layer.layer_section's doc (attention last: the longest; the train
# step before it, so that it runs within the budget)
SECTIONS = ("layer", "hop", "kernels", "train", "attention")
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
        "--warmup",
        type=non_negative_int,
        default=None,
        help="warm-up calls (default 2; 0 interpret: the first call is the first run)",
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
        default=8.0,
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
    a.warmup = a.warmup if a.warmup is not None else (0 if a.interpret else 2)
    a.inner = a.inner or (1 if a.interpret else 5)
    a.pallas_configs = a.pallas_configs or (TINY_PALLAS_CONFIGS if a.tiny else PALLAS_CONFIGS)
    for c in a.pallas_configs:
        try:
            pallas_cfg(c)
        except ValueError as e:
            p.error(f"--pallas-configs {c!r}: {e}")
    return a


def assumed_peak(kind: str):
    """Holds the dense bf16 peak TFLOP/s of a device kind, or None when unknown."""
    k = kind.lower()
    for key, peak in PEAKS:
        if key in k:
            return peak
    return None


# ---------------------------------------------------------------- results and main


@dataclasses.dataclass
class Results:
    """What the sections measured, for `--json`."""

    kernels: list = dataclasses.field(default_factory=list)  # KernelTiming
    hop: list = dataclasses.field(default_factory=list)  # HopTiming
    layer: list = dataclasses.field(default_factory=list)  # {LAYER_COLS column: cell text}
    attention: list = dataclasses.field(default_factory=list)  # AttnTiming
    train: list = dataclasses.field(default_factory=list)  # TrainTiming


def write_json(path, header: dict, results: Results):
    """Writes the header (command, device, jax, date, ...) and every section's rows to path."""
    doc = {
        **header,
        "kernels": [dataclasses.asdict(r) for r in results.kernels],
        "hop": [dataclasses.asdict(r) for r in results.hop],
        "layer": results.layer,
        "attention": [dataclasses.asdict(r) for r in results.attention],
        "train": [dataclasses.asdict(r) for r in results.train],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n# measurements written to {path}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    import jax

    if opts.interpret:  # XLA:CPU threads for the Mosaic GPU interpreter, before jax starts
        from relaymoe_jax.kernels.attention.interpret import reserve_threads

        reserve_threads()
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
            "# --interpret: Pallas (gmm, attention) interpret=True, Mosaic GPU under "
            "force_gpu_interpret_mode, hop gmm_impl 'pallas-interpret', layer 'xla'; times "
            "only show that the code runs"
        )
    budget, results = Budget(opts.budget_min), Results()
    sections = {
        "layer": lambda: layer_section(opts, budget, results),
        "hop": lambda: hop_section(opts, budget, results),
        "kernels": lambda: kernel_section(opts, peak, budget, results),
        "train": lambda: train_section(opts, peak, budget, results),
        "attention": lambda: attention_section(opts, peak, budget, results),
    }
    for name in SECTIONS:
        if name not in opts.sections:
            continue
        try:
            sections[name]()
        except Exception as e:
            print(f"# {name} section failed: {error_text(e)}", flush=True)
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
