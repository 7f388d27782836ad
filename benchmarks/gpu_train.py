"""The `## Train step` section of benchmarks/gpu.py: the trainer's own step on one GPU, timed,
beside the planner's prediction of it (`train.planner.predict`).

One GPU's share of Qwen3-30B-A3B at EP=8: its config (`configs/qwen3-30b-a3b.yaml`) with the 16
experts one GPU holds (128 / 8; the ring over one device has nothing to relay, so the step is the
compute a GPU does between transfers), TRAIN["layers"] decoder layers, bf16 compute (float32
master weights and AdamW), every layer recomputed (`moe_remat=true`, attention "full"), attention
and grouped matmul "auto" (our Mosaic GPU kernels on Hopper), at TRAIN["tokens"] tokens (one row,
one document). Built, compiled and run as the trainer does (`train.step.train_step`: init_state,
make_step, compile_step with `relaymoe_jax.XLA_OPTIONS`), on random tokens.

Columns: tokens; step ms (gpu.py's timing: the step feeds its own state back, as training does);
tokens/s; model TFLOP/s (the metrics line's: 6 x active parameters x tokens + 12 x layers x heads x
head_dim x causal pairs, `train.step.flops`) and MFU (of the dense bf16 peak); compiled peak MiB
(`memory_analysis()`: the allocator's peak cannot be reset after the sections before); the
planner's predicted step ms at the cost model's rates (`predict`: measured ones where
benchmarks/results/gpu.json exists, else 0.35 x the H100 peak) and measured / predicted. A
cell whose compile or run fails says `error: ...` and the others go on.

Before each length is built, its cost is estimated against the budget left, and the length is
skipped (said so) when it cannot fit (`skip_reason`): a compile as long as the last length's
(COMPILE_S before the first) plus `--warmup` + `--runs` + 1 steps at the predicted step time,
scaled by the last length's measured / predicted (not with --interpret, whose times say nothing).

`--tiny`: the tiny config (configs/tiny.yaml, one layer, 8 experts) at TINY_TRAIN["tokens"]; with
`--interpret` the attention is "chunked" and the grouped matmul "xla" (no kernel interpreter in a
whole step), float32.
"""

import dataclasses
import math
import time
from pathlib import Path

from gpu_common import error_text, mib, num, print_head, print_row, timed

REPO = Path(__file__).resolve().parents[1]
TRAIN = dict(
    config="configs/qwen3-30b-a3b.yaml", experts=16, layers=2, tokens=(8192, 32768, 131072)
)
TINY_TRAIN = dict(config="configs/tiny.yaml", experts=8, layers=1, tokens=(64,))
COMPILE_S = 60.0  # the first length's compile, before one was measured (module doc)
TRAIN_COLS = (
    "tokens",
    "step ms",
    "tokens/s",
    "model TFLOP/s",
    "MFU",
    "compiled peak MiB",
    "predicted ms",
    "measured / predicted",
)


@dataclasses.dataclass
class TrainTiming:
    """One row of the section, for `--json`."""

    tokens: int
    layers: int
    experts: int
    step_ms: float | None
    model_tflops: float | None  # per device, per second
    mfu: float | None
    peak_bytes: int | None
    predicted_ms: float | None
    error: str | None = None


def section_config(shp, opts):
    """The section's ModelConfig (module doc)."""
    from relaymoe_jax.models.config_files import load_config

    interpret = opts.interpret
    return load_config(
        REPO / shp["config"],
        num_experts=shp["experts"],
        num_hidden_layers=shp["layers"],
        moe_remat=True,
        attention_impl="chunked" if interpret else "auto",
        gmm_impl="xla" if interpret else "auto",
        dispatcher="ring",
    )


def step_config(tokens: int, cfg, opts):
    from train.settings import TrainConfig

    dtype = "float32" if opts.interpret else "bfloat16"
    return TrainConfig(batch_size=1, seq_len=tokens, compute_dtype=dtype, warmup_steps=0)


@dataclasses.dataclass
class Pace:
    """What the last length measured, for the next length's estimate: its compile seconds and
    its measured / predicted step time."""

    compile_s: float = COMPILE_S
    ratio: float = 1.0


def skip_reason(predicted_s: float, pace: Pace, budget, opts) -> str | None:
    """Why a length whose step is predicted at `predicted_s` seconds is skipped (the budget is
    spent or cannot hold its compile and timed steps: module doc), or None."""
    if budget.over():
        return f"skipped: time budget of {budget.minutes} min reached"
    steps = opts.warmup + opts.runs + 1
    need = 0.0 if opts.interpret else pace.compile_s + steps * predicted_s * pace.ratio
    left = budget.end - time.monotonic()
    if left < need:
        return f"skipped: needs ~{need:.0f} s, {left:.0f} s of the budget left"
    return None


def abstract_params(cfg, tc):
    """The parameters' shapes and dtypes (nothing allocated), for the prediction."""
    import jax

    from train.step import train_step

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        params = train_step.abstract_state(cfg, tc, mesh)[1].params
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def time_step(cfg, tc, opts):
    """(seconds per step, the compiled step's peak bytes, compile seconds) of the trainer's
    step."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from train.data.source import Batch
    from train.planner.memory import footprint
    from train.step import train_step

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh)
        shape = (tc.batch_size, tc.seq_len)
        sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
        step = train_step.make_step(graphdef, tx, tc.compute_dtype, tc.loss_chunk)
        start = time.monotonic()
        compiled = train_step.compile_step(step, state, sharding, shape)
        compile_s = time.monotonic() - start
        peak = footprint(compiled.memory_analysis())
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, shape, dtype=np.int32)
        batch = jax.device_put(Batch(tokens), sharding)
        box = [state]

        def run():
            box[0], metrics = compiled(box[0], batch)
            return metrics.loss

        _, seconds = timed(run, (), opts, keep=False)
        loss = float(run())
    if not math.isfinite(loss):
        raise FloatingPointError(f"the step's loss is {loss}")
    return seconds, peak, compile_s


def train_section(opts, peak, budget, results):
    """Prints the section's table (module doc); appends a TrainTiming per row to results.train."""
    import jax

    from train.planner import predict
    from train.step import flops as flops_mod

    shp = TINY_TRAIN if opts.tiny else TRAIN
    cfg = section_config(shp, opts)
    rates = predict.Rates.load()
    kind = jax.devices()[0].device_kind
    print(
        f"\n## Train step\n\nthe trainer's step on one GPU: {shp['config']} with "
        f"{shp['experts']} experts (one GPU's share at EP=8) and {shp['layers']} layer(s), "
        f"moe_remat, attention {cfg.attention_impl}, gmm {cfg.moe.options.gmm_impl}; "
        "predicted: train/planner/predict.py at the rates below\n"
    )
    for line in rates.report():
        print(f"# {line}")
    print_head(TRAIN_COLS)
    params, pace = abstract_params(cfg, step_config(shp["tokens"][0], cfg, opts)), Pace()
    for tokens in shp["tokens"]:
        row = TrainTiming(tokens, shp["layers"], shp["experts"], *[None] * 5)
        tc = step_config(tokens, cfg, opts)
        want = predict.predict(cfg, tc, {"data": 1}, ("full",) * shp["layers"], params, kind, rates)
        why = skip_reason(want.seconds, pace, budget, opts)
        if why is None:
            try:
                seconds, peak_bytes, pace.compile_s = time_step(cfg, tc, opts)
            except Exception as e:
                why = f"error: {error_text(e)}"
        if why:
            row.error = why.removeprefix("error: ")
            print_row([f"{tokens:,}", why])
            results.train.append(row)
            continue
        pace.ratio = seconds / want.seconds
        flops = flops_mod.StepFlops.of(cfg, params, kind)
        model = flops.step(tokens, tokens * (tokens + 1) // 2)  # one row, one document
        tflops = model / seconds / 1e12
        mfu = tflops / peak if peak else None
        row.step_ms, row.model_tflops, row.mfu = seconds * 1e3, tflops, mfu
        row.peak_bytes, row.predicted_ms = peak_bytes, want.seconds * 1e3
        print_row(
            [
                f"{tokens:,}",
                num(seconds * 1e3),
                num(tokens / seconds),
                num(tflops),
                "n/a" if mfu is None else f"{mfu:.1%}",
                mib(peak_bytes),
                num(want.seconds * 1e3),
                num(seconds / want.seconds, 3),
            ]
        )
        results.train.append(row)
