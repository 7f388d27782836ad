"""One training run, from its `RunSettings` (`train.cli.parse`): build the train state or resume
it from the newest checkpoint, compile the step, train, checkpoint, and report.

Steps are numbered from 1: the metrics line with `"step": s` is the s-th optimizer update, and the
checkpoint of step s holds the state after it. A rerun with the same `--out` resumes from the
latest checkpoint, first dropping metrics lines past it, and appends only the new steps.
Checkpoints hold the train state as the tree `TrainState.as_saved` gives (the one every version
of the trainer has written), so older runs keep resuming.

A signal (`train.interrupt.Stop`) stops the run after the step in progress, checkpointed; a
failed checkpoint save or metrics write is a `guards.WriteError` naming the path.
"""

import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

import jax
from jax.sharding import NamedSharding

from . import checkpoint as ckpt
from . import data as data_mod
from . import distributed, guards, identity, interrupt, plot, progress, report, train_step
from . import mesh as train_mesh
from .data import loader
from .settings import RunSettings

log = distributed.print_on_main


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the steps of a run need besides the state: the compiled step and its inputs, where
    the run writes, its identity (`train.identity`) and the signal record."""

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


def execute(run: RunSettings, stop: interrupt.Stop) -> int:
    """The run `run`; 0 when done. While it trains, SIGINT and SIGTERM (`stop`, installed by the
    caller) checkpoint the last completed step and raise `interrupt.Interrupted`."""
    out = guards.prepare_run_dir(run.out)  # a writable directory, or one line now
    tc = run.train
    data = data_mod.make_source(
        run.data,
        synthetic=tc.synthetic,
        seq_len=tc.seq_len,
        batch_size=tc.batch_size,
        seed=tc.seed,
        vocab_size=run.model.vocab_size,
        tokenizer=run.tokenizer,
        log=log,
    )
    if (summary := data.summary()) is not None:
        log(summary)  # the dataset's documents, tokens and rows
    run, ident = identity.of_run(run, data.identity(), log=log)  # schedule horizon, identity
    tc, cfg = run.train, run.model
    mesh = train_mesh.make_mesh(tc.mesh)
    est = guards.check_fits(cfg, tc, mesh, force=run.force)  # before anything is allocated
    log(
        f"building {run.config}: {est.params:,} parameters, train state and gradients "
        f"{guards.fmt_bytes(est.per_device)} per device"
        + (f" (+ {guards.fmt_bytes(est.host)} in host memory)" if est.host else "")
        + f", {jax.device_count()} {jax.default_backend()} devices"
    )
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh)

    mngr = ckpt.manager(out)
    metrics_path = out / "metrics.jsonl"
    shape = (tc.batch_size, tc.seq_len)
    ids_sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
    rows = _select_rows(data, ids_sharding, shape)
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
            _stop_before_training(stop, mngr)
            compiled = _compile(run, graphdef, tx, state, mesh, ids_sharding, stop, data.packed)
            _stop_before_training(stop, mngr)  # a signal during the compile
            stop.training = True  # from now on a signal lets the step and its save finish
            ctx = StepContext(
                run, graphdef, compiled, data, rows, ids_sharding, mngr, metrics_path, ident, stop
            )
            meta = {"config": run.config, "seed": tc.seed, **ident.meta}
            state = train(ctx, state, start, meta)
            log(
                f"done: step {run.steps}; metrics in {metrics_path}; checkpoints in "
                f"{mngr.directory} (latest {mngr.latest_step()})"
            )
        stop.release()  # trained and saved: Ctrl-C now just stops (the plot, the table)
        _finish(run, mesh, compiled, metrics_path, data.packed)
        return 0
    finally:
        _close(mngr, failing=sys.exc_info()[1] is not None)


def _select_rows(data, ids_sharding, shape) -> list[int] | None:
    """The rows of the global batch this process's devices hold, which a dataset source then
    reads alone (logged on every process, at INFO); None (all) for the synthetic stream."""
    if not isinstance(data, data_mod.PreparedSource):
        return None
    rows = loader.rows_of_process(ids_sharding, shape)
    data.select_rows(rows)
    logging.getLogger(__name__).info(
        f"data: process {jax.process_index()} of {jax.process_count()} reads "
        f"{len(rows)} of the {shape[0]} rows of each batch: {loader.row_ranges(rows)}"
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


def _compile(run: RunSettings, graphdef, tx, state, mesh, ids_sharding, stop, packed):
    """The step compiled for `state` (memoised in-process), with its start-up lines; None if a
    signal came first (`interrupt.unless_stopped`: the compile runs in a helper thread, so the
    signal is seen at once)."""
    tc, cfg = run.train, run.model
    shape = (tc.batch_size, tc.seq_len)
    log(
        f"compiling the train step (dispatcher={cfg.moe.options.dispatcher}, mesh "
        f"{dict(mesh.shape)}, batch {tc.batch_size} x seq {tc.seq_len}) ..."
    )
    t0 = time.perf_counter()
    offload = tc if tc.offload_optimizer else None
    step = train_step.make_step(graphdef, tx, tc.compute_dtype, tc.loss_chunk, packed, offload)
    compiled = train_step.compile_step(
        step,
        state,
        ids_sharding,
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
    (`t.stop`), checkpoint the step just completed and raise `interrupt.Interrupted`. Returns the
    state."""
    run, tc = t.settings, t.settings.train
    bar = progress.StepProgress(start, run.steps)
    with _metrics_file(t.metrics_path) as mf:
        for s in range(start + 1, run.steps + 1):
            state, rec = _step(t, state, s)
            if not math.isfinite(rec["loss"]):
                _wait(t.mngr)
                raise guards.NonFiniteLossError(
                    f"loss is {rec['loss']} at step {s} (lm_loss={rec['lm_loss']}, "
                    f"aux_loss={rec['aux_loss']}); stopping. The last good checkpoint is "
                    f"step {t.mngr.latest_step()} in {t.mngr.directory}"
                )
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            if not run.quiet:
                log(bar.line(rec))
            sig = t.stop.requested()  # every step (several processes: agreed among them)
            if s % tc.save_every == 0 or s == run.steps or sig is not None:
                data_meta = {"data_position": s * tc.batch_size, "data_state": t.data.state()}
                _save(t.mngr, s, state, {**meta, **data_meta})
            if sig is not None:
                raise _interrupted(sig, t.mngr, s)
    return state


def _step(t: StepContext, state, s: int):
    """(state, metrics record) after step `s` (the expert bias updated, if the model has one)."""
    tc = t.settings.train
    t0 = time.perf_counter()
    local = next(t.data)
    t1 = time.perf_counter()
    state, m = t.compiled(state, train_step.put_batch(local, t.ids_sharding, tc.batch_size, t.rows))
    if t.settings.model.moe.expert_bias:
        state = train_step.update_expert_bias(t.graphdef, state, m.expert_load)
    m = jax.device_get(m)
    dt = time.perf_counter() - t1
    rec = {
        "step": s,
        **m.record(),
        **t.run_identity.extra(s),
        "tokens_per_s": tc.batch_size * tc.seq_len / dt,
        "step_time": dt,
        "data_time": t1 - t0,  # waiting for the batch (the loader reads ahead meanwhile)
    }
    return state, rec


def _finish(run: RunSettings, mesh, compiled, metrics_path: Path, packed: bool) -> None:
    """With --memory-table the train step's memory per dispatcher, then the loss-curve PNG
    (process 0), whose path is the last line."""
    tc, cfg = run.train, run.model
    if run.memory_table:
        rows = report.memory_rows(cfg, tc, mesh, compiled, log=log, packed=packed)
        log(
            f"\nper-device memory of the train step ({jax.device_count()} devices, mesh "
            f"{dict(mesh.shape)}, batch {tc.batch_size} x seq {tc.seq_len}, "
            f"{tc.compute_dtype}; XLA memory_analysis of the compiled step):\n"
            + report.memory_table(rows)
        )
    if distributed.is_main() and metrics_path.exists() and metrics_path.stat().st_size:
        label = plot.dispatcher_label(metrics_path, cfg.moe.options.dispatcher)
        png = plot.plot_losses(
            {label: metrics_path}, run.out / "loss.png", title=f"{run.config}: training loss"
        )
        log(f"loss curve: {png}")


# --------------------------------------------------------------------------- checkpoints


def _committed_steps(directory) -> list[int]:
    """The checkpoint steps on disk (finalized step directories), sorted."""
    try:
        return sorted(int(p.name) for p in Path(str(directory)).iterdir() if p.name.isdigit())
    except OSError:
        return []


def _write_error(e: BaseException, mngr) -> guards.WriteError | None:
    """A WriteError for an operating-system failure of a checkpoint save (disk full, read-only
    directory; orbax reports a failed asynchronous save at the next save or wait), else None."""
    why = guards.os_error_text(e)
    if why is None:
        return None
    steps = _committed_steps(mngr.directory)
    last = f"step {steps[-1]}" if steps else "none"
    return guards.WriteError(
        f"saving a checkpoint in {mngr.directory} failed: {why} (the newest "
        f"complete checkpoint: {last})"
    )


def _save(mngr, step: int, state: train_step.TrainState, meta: dict) -> None:
    try:
        ckpt.save(mngr, step, state.as_saved(), meta)
    except Exception as e:
        err = _write_error(e, mngr)
        if err is None:
            raise
        raise err from e


def _wait(mngr) -> None:
    try:
        mngr.wait_until_finished()
    except Exception as e:
        err = _write_error(e, mngr)
        if err is None:
            raise
        raise err from e


def _close(mngr, failing: bool) -> None:
    """Wait for the last save and close the manager; while another error is on its way out,
    one of these (the same failed save, reported again) is not raised over it."""
    try:
        _wait(mngr)
        mngr.close()
    except Exception:
        if not failing:
            raise


@contextlib.contextmanager
def _metrics_file(path: Path):
    """metrics.jsonl opened for appending (process 0); an OSError while it is open (a write, the
    flush, the close: disk full, ...) is a WriteError naming it. Checkpoint failures arrive as
    WriteErrors already."""
    try:
        with distributed.open_on_main(path, "a") as f:
            yield f
    except OSError as e:
        raise guards.WriteError(f"writing {path} failed: {guards.describe_write_error(e)}") from e


# --------------------------------------------------------------------------- signals


def _stop_before_training(stop: interrupt.Stop, mngr) -> None:
    """`interrupt.Interrupted` if a signal came before the first step (nothing new to save)."""
    sig = stop.requested()
    if sig is not None:
        steps = _committed_steps(mngr.directory)
        where = (
            f"the newest checkpoint is step {steps[-1]} in {mngr.directory}"
            if steps
            else "no checkpoint yet"
        )
        raise interrupt.Interrupted(
            sig,
            f"interrupted by {interrupt.signal_name(sig)} before "
            f"the first step; nothing new to save ({where})",
        )


def _interrupted(sig: int, mngr, step: int) -> interrupt.Interrupted:
    """After step `step`'s checkpoint was started: wait for it to be written."""
    _wait(mngr)
    return interrupt.Interrupted(
        sig,
        f"interrupted by {interrupt.signal_name(sig)} after step "
        f"{step}: checkpoint step {step} saved in {mngr.directory}; "
        f"rerun the same command to resume",
    )
