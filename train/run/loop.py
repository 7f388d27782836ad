"""One training run, from its `RunSettings` (`train.cli.parse`): build the train state or resume
it from the newest checkpoint, compile the step, train, checkpoint, and report.

Steps are numbered from 1: the metrics line with `"step": s` is the s-th optimizer update, and the
checkpoint of step s holds the state after it. A rerun with the same `--out` resumes from the
latest checkpoint, first dropping metrics lines past it, and appends only the new steps.
Checkpoints hold the train state as the tree `TrainState.as_saved` gives (the one every version
of the trainer has written), so older runs keep resuming.

A signal (`train.run.interrupt.Stop`) stops the run after the step in progress, checkpointed; a
second one stops it at once, unless a checkpoint is being written (`Stop.saving`, `io.saves`). A
failed checkpoint save or metrics write is a `train.errors.WriteError` naming the path.
"""

import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import data as data_mod
from ..data import loader
from ..hf import init as hf_init
from ..planner import fit, memory
from ..settings import RunSettings
from ..state import checkpoint as ckpt
from ..state import identity
from ..step import accumulate, evaluate, train_step
from ..step import flops as flops_mod
from ..step import mesh as train_mesh
from . import board, distributed, guards, interrupt, plot, profile, progress
from . import io as run_io

log = distributed.print_on_main


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the steps of a run need besides the state: the compiled step and its inputs, where
    the run writes, its identity (`train.state.identity`) and the signal record."""

    settings: RunSettings
    graphdef: object  # nnx.GraphDef of the model
    compiled: object  # the compiled step (`train_step.compile_step`)
    data: data_mod.Source  # an iterator of `data_mod.Batch` with state()
    rows: list[int] | None  # the global batch's rows this process reads (None: all)
    ids_sharding: NamedSharding
    mngr: object  # orbax CheckpointManager
    metrics_path: Path
    run_identity: identity.RunIdentity
    stop: interrupt.Stop
    evaluator: evaluate.Evaluator | None = None  # --eval-data (train.step.evaluate)
    flops: flops_mod.StepFlops | None = None  # model FLOPs for the TFLOP/s and MFU


def execute(run: RunSettings, stop: interrupt.Stop) -> int:
    """The run `run`; 0 when done. While it trains, SIGINT and SIGTERM (`stop`, installed by the
    caller) checkpoint the last completed step and raise `interrupt.Interrupted`; a second signal
    ends the process at once, unless a checkpoint is being written (`interrupt.Stop`)."""
    out = guards.prepare_run_dir(run.out)  # a writable directory, or one line now
    stop.watch(run_io.saves(out))  # what a second signal names, from now on
    run, source = hf_init.of_run(run, log=log)  # --init-from-hf: its tokenizer for --data files
    tc = run.train
    data = data_mod.make_source(
        run.data,
        synthetic=tc.synthetic,
        seq_len=tc.seq_len,
        batch_size=tc.batch_size * tc.grad_accum,  # a step's rows, its micro-batches' too
        seed=tc.seed,
        vocab_size=run.model.vocab_size,
        tokenizer=run.tokenizer,
        log=log,
    )
    if (summary := data.summary()) is not None:
        log(summary)  # the dataset's documents, tokens and rows
    eval_src = evaluate.open_eval_data(run, data) if run.eval_data is not None else None
    init = hf_init.check_data(source, run, data.identity())  # the source's identity, or None
    run, ident = identity.of_run(run, data.identity(), log=log, init=init)  # schedule, identity
    ident.add_eval_data(None if eval_src is None else evaluate.identity(eval_src))
    tc, cfg = run.train, run.model
    mesh = train_mesh.make_mesh(tc.mesh)
    est = fit.check_fits(cfg, tc, mesh, force=run.force)  # before anything is allocated
    log(
        f"building {run.config}: {est.params:,} parameters, train state and gradients "
        f"{fit.fmt_bytes(est.per_device)} per device"
        + (f" (+ {fit.fmt_bytes(est.host)} in host memory)" if est.host else "")
        + f", {jax.device_count()} {jax.default_backend()} devices"
    )
    fresh = source is not None and not run_io.committed_steps(out.resolve() / "checkpoints")
    model = hf_init.load_model(source, cfg, mesh, log=log) if fresh else None  # else: resumes
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh, model)

    mngr = ckpt.manager(out)
    stop.watch(run_io.saves(out, mngr))  # and waits for, while the manager writes one
    metrics_path = out / "metrics.jsonl"
    shape = (tc.batch_size, tc.seq_len)
    ids_sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
    rows = _select_rows(data, *accumulate.step_batch(ids_sharding, *shape, tc.grad_accum))
    try:
        start = 0
        restored = ckpt.restore(mngr, state.as_saved(), check_meta=ident.check)
        if restored is not None:
            start, saved, meta = restored
            state = train_step.TrainState.from_saved(saved)
            ident.report(log)  # changed settings that keep the math, or an old checkpoint
            log(f"resumed from {mngr.directory} step {start}")
            _resume_data(data, meta, start)
        if distributed.is_main():
            ckpt.truncate_metrics(metrics_path, start)
        compiled = None
        if start >= run.steps:
            log(f"already at step {start} >= --steps {run.steps}; nothing to do")
        else:
            run_io.stop_before_training(stop, mngr)
            compiled = _compile(run, graphdef, tx, state, mesh, ids_sharding, stop, data.packed)
            run_io.stop_before_training(stop, mngr)  # a signal during the compile
            evaluator = _evaluator(run, graphdef, state, ids_sharding, eval_src)
            ctx = StepContext(
                run,
                graphdef,
                compiled,
                data,
                rows,
                ids_sharding,
                mngr,
                metrics_path,
                ident,
                stop,
                evaluator,
                flops_mod.StepFlops.of(run.model, state.params, jax.devices()[0].device_kind),
            )
            meta = {"config": run.config, "seed": tc.seed, **ident.meta}
            state = train(ctx, state, start, meta)
            run_io.wait(mngr)  # the last checkpoint written before the handlers go
            log(
                f"done: step {run.steps}; metrics in {metrics_path}; checkpoints in "
                f"{mngr.directory} (latest {mngr.latest_step()})"
            )
        stop.release()  # trained and saved: Ctrl-C now just stops (the plot, the table)
        _finish(run, mesh, compiled, metrics_path, data.packed)
        return 0
    finally:
        run_io.close(mngr, failing=sys.exc_info()[1] is not None)


def _select_rows(data, ids_sharding, shape) -> list[int] | None:
    """The rows of the global batch this process's devices hold, which a dataset source then
    reads alone (logged on every process, at INFO); None (all) for the synthetic stream."""
    if not isinstance(data, data_mod.PreparedSource):
        return None
    rows = accumulate.rows_of_process(ids_sharding, shape)  # [N, B, S]: of N * B rows
    data.select_rows(rows)
    logging.getLogger(__name__).info(
        f"data: process {jax.process_index()} of {jax.process_count()} reads "
        f"{len(rows)} of the {math.prod(shape[:-1])} rows of each batch: "
        f"{loader.row_ranges(rows)}"
    )
    return rows


def _resume_data(data, meta: dict, start: int) -> None:
    """Continue the data source at batch `start`: from the loader state saved with the
    checkpoint (the trainer's earlier checkpoints hold none, and a resume allowed to switch
    between synthetic and text data holds the other source's: then by position)."""
    saved = meta.get("data_state")
    if saved is None or set(saved) != set(data.state()):  # none, or another kind of source's
        data.seek(start)  # (--allow-changes synthetic): both count batches from 0
        return
    data.restore(saved)
    if data.position() != start:
        raise ckpt.StateMismatchError(
            f"checkpoint step {start} holds the data loader at batch {data.position()} "
            f"({saved}); expected batch {start}"
        )


def _evaluator(run: RunSettings, graphdef, state, ids_sharding, eval_src):
    """The held-out evaluation of --eval-data (its rows read, its forward compiled), or None."""
    if eval_src is None:
        return None
    tc = run.train
    every = f"every {tc.eval_every} steps and " if tc.eval_every else ""
    log(
        f"evaluation on {run.eval_data} {every}at step {run.steps}: {tc.eval_batches} "
        f"batch(es) of {tc.batch_size} x {tc.seq_len} ({eval_src.summary().removeprefix('data: ')})"
    )
    return evaluate.Evaluator(run, graphdef, state, ids_sharding, eval_src)


def _compile(run: RunSettings, graphdef, tx, state, mesh, ids_sharding, stop, packed):
    """The step compiled for `state` (memoised in-process), with its start-up lines; None if a
    signal came first (`interrupt.unless_stopped`: the compile runs in a helper thread, so the
    signal is seen at once)."""
    tc, cfg = run.train, run.model
    sharding, shape = accumulate.step_batch(ids_sharding, tc.batch_size, tc.seq_len, tc.grad_accum)
    log(
        f"compiling the train step (dispatcher={cfg.moe.options.dispatcher}, mesh "
        f"{dict(mesh.shape)}, {accumulate.describe(tc)}) ..."
    )
    t0 = time.perf_counter()
    offload = tc if tc.offload_optimizer else None
    step = train_step.make_step(
        graphdef, tx, tc.compute_dtype, tc.loss_chunk, packed, offload, tc.grad_accum
    )
    compiled = train_step.compile_step(
        step,
        state,
        sharding,
        shape,
        key=train_step.step_key(cfg, tc, shape, mesh, packed),
        runner=lambda build: interrupt.unless_stopped(build, stop),
        packed=packed,
    )
    if compiled is None:
        return None
    log(
        f"train step ready in {time.perf_counter() - t0:.1f} s on "
        f"{jax.device_count()} {jax.default_backend()} devices "
        f"(dispatcher={cfg.moe.options.dispatcher}, mesh {dict(mesh.shape)})"
    )
    log(train_step.memory_summary(compiled))
    return compiled


def train(t: StepContext, state, start: int, meta: dict):
    """Steps start+1 .. --steps: run, log (metrics.jsonl and the progress line), stop on a
    non-finite loss, checkpoint every save_every and at the last step; after a signal
    (`t.stop`, told the step in progress and each save), checkpoint the step just completed and
    raise `interrupt.Interrupted`. Returns the state."""
    run, tc = t.settings, t.settings.train
    bar = progress.StepProgress(start, run.steps, tc.batch_size * tc.grad_accum * tc.seq_len)
    prof = profile.Profiler(run.out, run.profile_steps, log)
    with run_io.metrics_file(t.metrics_path) as mf, board.Board(run.out, start) as tb, prof:
        for s in range(start + 1, run.steps + 1):
            t.stop.step = s  # a second signal from now on names it
            prof.before(s)
            state, rec = _step(t, state, s)
            prof.after(s)
            if not math.isfinite(rec["loss"]):
                run_io.wait(t.mngr)
                raise guards.NonFiniteLossError(
                    f"loss is {rec['loss']} at step {s} (lm_loss={rec['lm_loss']}, "
                    f"aux_loss={rec['aux_loss']}); stopping. The last good checkpoint is "
                    f"step {t.mngr.latest_step()} in {t.mngr.directory}"
                )
            if t.evaluator is not None and (
                s % (tc.eval_every or run.steps) == 0 or s == run.steps
            ):
                rec.update(t.evaluator(state).record())  # the held-out loss (train.step.evaluate)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            tb.write(rec)
            if not run.quiet:
                log(bar.line(rec))
            sig = t.stop.requested()  # every step (several processes: agreed among them)
            if s % tc.save_every == 0 or s == run.steps or sig is not None:
                data_meta = {
                    "data_position": s * tc.batch_size * tc.grad_accum,  # rows read
                    "data_state": t.data.state(),
                }
                with t.stop.saving(s):  # a second signal meanwhile waits for it
                    run_io.save(t.mngr, s, state, {**meta, **data_meta})
                    if sig is not None:
                        raise run_io.interrupted(sig, t.mngr, s)  # once it is written
    return state


def _step(t: StepContext, state, s: int):
    """(state, metrics record) after step `s` (the expert bias updated, if the model has one)."""
    tc = t.settings.train
    t0 = time.perf_counter()
    local = next(t.data)
    t1 = time.perf_counter()
    sharding, shape = accumulate.step_batch(
        t.ids_sharding, tc.batch_size, tc.seq_len, tc.grad_accum
    )
    state, m = t.compiled(state, accumulate.put_batch(local, sharding, shape, t.rows))
    if t.settings.model.moe.expert_bias:
        state = train_step.update_expert_bias(t.graphdef, state, m.expert_load)
    m = jax.device_get(m)
    dt = time.perf_counter() - t1
    tokens = tc.batch_size * tc.grad_accum * tc.seq_len  # every micro-batch
    rec = {
        "step": s,
        **m.record(),
        **t.run_identity.extra(s),
        "tokens_per_s": tokens / dt,
        "step_time": dt,
        "data_time": t1 - t0,  # waiting for the batch (the loader reads ahead meanwhile)
    }
    if t.flops is not None:  # this process's rows stand for the others' documents
        seg = None if local.segment_ids is None else np.reshape(local.segment_ids, (-1, tc.seq_len))
        ids = np.reshape(local.tokens, (-1, tc.seq_len))
        rows = ids.shape[0]
        pairs = flops_mod.visible_pairs(ids, seg)
        pairs = pairs * (tc.batch_size * tc.grad_accum) // max(rows, 1)
        rec.update(t.flops.record(tokens, pairs, dt, jax.device_count()))
    return state, rec


def _finish(run: RunSettings, mesh, compiled, metrics_path: Path, packed: bool) -> None:
    """With --memory-table the train step's memory per dispatcher, then (process 0) the expert
    load heatmap (a model with MoE layers) and the loss-curve PNG, whose path is the last line."""
    tc, cfg = run.train, run.model
    if run.memory_table:
        rows = memory.memory_rows(cfg, tc, mesh, compiled, log=log, packed=packed)
        log(
            f"\nper-device memory of the train step ({jax.device_count()} devices, mesh "
            f"{dict(mesh.shape)}, {accumulate.describe(tc)}, "
            f"{tc.compute_dtype}; XLA memory_analysis of the compiled step):\n"
            + memory.memory_table(rows)
        )
    if distributed.is_main() and metrics_path.exists() and metrics_path.stat().st_size:
        heat = plot.plot_expert_load(
            metrics_path, run.out / "expert_load.png", title=f"{run.config}: expert overload"
        )
        if heat is not None:
            log(f"expert load: {heat}")
        label = plot.dispatcher_label(metrics_path, cfg.moe.options.dispatcher)
        png = plot.plot_losses(
            {label: metrics_path},
            run.out / "loss.png",
            title=f"{run.config}: training loss" + (" and held-out" if run.eval_data else ""),
        )
        log(f"loss curve: {png}")
