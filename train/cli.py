"""Command line: `python -m train --config configs/tiny.yaml --steps N --out DIR [key=value ...]`.

`key=value` items set trainer fields (`train.loop.TrainConfig`: batch_size, seq_len, lr, ...) or,
for any other key, `ModelConfig` fields of the YAML config (dispatcher, routing, num_experts...);
the trainer fields also have `--flag` forms. The mesh comes from `mesh=` (`train.mesh`; default
"expert=-1": EP over all devices), e.g. `mesh=data=2,expert=4`.

Steps are numbered from 1: the metrics line with `"step": s` is the s-th optimizer update, and the
checkpoint of step s holds the state after it. A rerun with the same `--out` resumes from the
latest checkpoint, first dropping metrics lines past it, and appends only the new steps.

SIGINT / SIGTERM stop the run after the step in progress, checkpointed (`train.interrupt`; exit
status 130 / 143). Expected failures are one line on stderr and exit status 1, before the model is
built where they can be (`train.guards`: `--out`, the memory check, failed writes); every case
and its test: docs/robustness.md.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import jax
from jax.sharding import NamedSharding

from relaymoe_jax.devices import use_cpu_devices
from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.configs import load_config, parse_overrides, unknown_keys

from . import guards, interrupt  # these two need no package of the train extra

TRAIN_EXTRA = ("optax", "orbax.checkpoint", "matplotlib")  # pyproject's `train` extra
try:  # without the extra, main() and entry() say what is missing (MissingExtraError)
    from . import checkpoint as ckpt
    from . import data as data_mod
    from . import distributed, identity, loop, plot, progress, report
    from . import mesh as train_mesh
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in {m.split(".")[0] for m in TRAIN_EXTRA}:
        raise
    _MISSING: str | None = e.name
else:
    _MISSING = None

CPU_DEVICES = 8  # the emulated CPU devices of `entry` (XLA_FLAGS's device count wins)


class MissingExtraError(ImportError):
    """A package of the `train` extra is not installed."""


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


# --help's words for the trainer settings (`loop.TrainConfig`; the defaults come from it)
TRAIN_HELP = {
    "batch_size": "global batch, in sequences per step",
    "seq_len": "tokens per sequence",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine decays to lr * this",
    "warmup_steps": "steps of linear warmup from 0",
    "schedule_steps": "the cosine schedule's horizon in steps (unset: --steps)",
    "weight_decay": "AdamW weight decay (never on 1-D parameters)",
    "clip_norm": "global gradient-norm clipping",
    "b1": "AdamW beta1",
    "b2": "AdamW beta2",
    "seed": "initialisation and data-order seed",
    "save_every": "checkpoint every N steps (and at the last step)",
    "synthetic": "train on a learnable synthetic stream instead of text files",
    "mesh": "device mesh, e.g. data=2,expert=4 or node=2,expert=8 (axes data, fsdp, node, "
    "expert, context, expert_tensor; one size may be -1)",
    "compute_dtype": "float32 or bfloat16 (float32 master weights and optimizer either way)",
    "loss_chunk": "tokens per device per LM-head / cross-entropy chunk",
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written; each optional flag's default appended to its help
    (none, off for a switch, or the value) unless the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or "default" in text
            or action.default is argparse.SUPPRESS
        ):
            return text
        if action.default is None or action.default == []:
            return text + " (default: none)"
        if action.default is False:
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def _trainer_settings_help() -> str:
    rows = []
    for f in dataclasses.fields(loop.TrainConfig):
        default = "unset" if f.default is None else f.default
        rows.append(
            textwrap.fill(
                TRAIN_HELP.get(f.name, ""),
                96,
                initial_indent=f"  {f.name}={default}".ljust(26) + " ",
                subsequent_indent=" " * 27,
            )
        )
    notes = (
        "Any other key=value sets a field of the model config (the YAML keys of "
        "configs/*.yaml, e.g. dispatcher=alltoall routing=token capacity_factor=1.0). "
        "Exit status: 0 done; 1 an error, said in one line on stderr; 2 bad arguments; "
        "130 / 143 stopped by SIGINT / SIGTERM (after checkpointing the last completed "
        "step: rerun the same command to resume)."
    )
    return (
        "trainer settings, as key=value or --key VALUE (shown with their defaults):\n"
        + "\n".join(rows)
        + "\n\n"
        + textwrap.fill(notes, 98)
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}",
        description="Train a model config with the RelayMoE trainer "
        "(metrics, checkpoints, resume).",
        epilog=_trainer_settings_help(),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--config",
        required=True,
        help="model config: configs/<name>.yaml, a path or a shipped config's name (required)",
    )
    p.add_argument(
        "--steps",
        type=int,
        required=True,
        help="train until this step, counted from the start of the run (required)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="run directory: metrics.jsonl, checkpoints/, loss.png; a rerun with the "
        "same --out resumes (required)",
    )
    p.add_argument(
        "--data",
        action="append",
        default=None,
        help="text file to train on, repeatable (default: the shipped train/data/*.txt)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a local Hugging Face tokenizer.json (default: byte-level)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step line")
    p.add_argument(
        "--memory-table",
        action="store_true",
        help="at the end, print the train step's per-device memory with ring and "
        "all-to-all (the ones not trained are compiled, not run)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="skip the check that the train state fits this machine's memory "
        "(without it a config whose parameters, AdamW moments and gradients "
        "alone exceed the memory is refused before anything is built)",
    )
    distributed.add_arguments(p)
    identity.add_arguments(p)
    for f in dataclasses.fields(loop.TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text = (
            f"{TRAIN_HELP.get(f.name, 'trainer setting')} (also {f.name}=VALUE; "
            f"default: {'unset' if f.default is None else f.default})"
        )
        if f.type is bool or f.type == "bool":
            p.add_argument(flag, dest=f.name, action="store_true", default=None, help=text)
        else:
            typ = loop.field_type(f)
            p.add_argument(flag, dest=f.name, type=typ, default=None, help=text)
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="trainer settings (listed below) or model config fields",
    )
    return p


MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def _check_keys(over: dict) -> None:
    """ValueError for key=value items that are neither trainer settings nor model config keys,
    with the close matches and both lists."""
    unknown = [k for k in over if k not in loop.TRAIN_FIELDS and k not in MODEL_FIELDS]
    if unknown:
        items = " ".join(f"{k}={over[k]!r}" for k in unknown)
        raise ValueError(
            f"command line {items}: "
            + unknown_keys(unknown, {"trainer": loop.TRAIN_FIELDS, "model config": MODEL_FIELDS})
        )


def parse(argv):
    args = build_parser().parse_intermixed_args(argv)
    over = parse_overrides(args.overrides)
    _check_keys(over)
    train_kw = {k: over.pop(k) for k in list(over) if k in loop.TRAIN_FIELDS}
    for f in dataclasses.fields(loop.TrainConfig):
        if getattr(args, f.name) is not None:
            train_kw[f.name] = getattr(args, f.name)
    tc = loop.TrainConfig(**train_kw)
    for f in dataclasses.fields(tc):
        want = loop.field_type(f)
        v = getattr(tc, f.name)
        if v is None and f.default is None:  # unset (schedule_steps: follow --steps)
            continue
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            setattr(tc, f.name, float(v))
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ValueError(f"trainer option {f.name}={v!r}: expected {want.__name__}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if tc.batch_size < 1 or tc.seq_len < 2 or tc.save_every < 1:
        raise ValueError("batch_size >= 1, seq_len >= 2 and save_every >= 1 are required")
    sizes = train_mesh.parse_mesh(tc.mesh, jax.device_count())
    if tc.compute_dtype not in loop.COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype={tc.compute_dtype!r}: expected one of {loop.COMPUTE_DTYPES}"
        )
    cfg = load_config(
        args.config,
        expert_size=train_mesh.expert_size(sizes),
        other_keys={"trainer": loop.TRAIN_FIELDS},
        **over,
    )
    train_mesh.check(sizes, cfg, tc.batch_size, tc.seq_len, tc.mesh)
    if tc.seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={tc.seq_len} exceeds max_position_embeddings="
            f"{cfg.max_position_embeddings} of {args.config}"
        )
    return args, tc, cfg


def _log(msg: str) -> None:
    if distributed.is_main():
        print(msg, flush=True)


def require_train_extra() -> None:
    """MissingExtraError naming `pip install "relaymoe-jax[train]"` if the extra is missing."""
    missing = _MISSING or next((m for m in TRAIN_EXTRA if not _installed(m)), None)
    if missing is not None:
        raise MissingExtraError(
            f"the trainer needs the train extra ({missing} is not "
            f'installed): pip install "relaymoe-jax[train]"'
        )


def main(argv=None) -> int:
    """The run of `argv` (default sys.argv[1:]); 0 when done. SIGINT and SIGTERM are caught
    while it trains (`train.interrupt`): it checkpoints the last completed step and raises
    `interrupt.Interrupted` (exit status 128 + the signal's number from `entry`)."""
    stop = interrupt.Stop()
    try:
        return _main(argv, stop)
    finally:
        stop.release()


def _main(argv, stop: interrupt.Stop) -> int:
    require_train_extra()
    argv = sys.argv[1:] if argv is None else argv
    distributed.initialize(build_parser().parse_intermixed_args(argv))  # before any jax call
    stop.install()  # after jax.distributed's own SIGTERM handler (train.interrupt)
    args, tc, cfg = parse(argv)
    out = guards.prepare_run_dir(args.out)  # a writable directory, or one line now
    data = data_mod.make_data(
        args.data,
        synthetic=tc.synthetic,
        seq_len=tc.seq_len,
        batch_size=tc.batch_size,
        seed=tc.seed,
        vocab_size=cfg.vocab_size,
        tokenizer=args.tokenizer,
    )
    tc, run = identity.prepare(args, tc, cfg, log=_log)  # schedule horizon, run identity
    mesh = train_mesh.make_mesh(tc.mesh)
    est = guards.check_fits(cfg, tc, mesh, force=args.force)  # before anything is allocated
    _log(
        f"building {args.config}: {est.params:,} parameters, train state and gradients "
        f"{guards.fmt_bytes(est.per_device)} per device, {jax.device_count()} "
        f"{jax.default_backend()} devices"
    )
    graphdef, state, tx, rules = loop.init_state(cfg, tc, mesh)

    mngr = ckpt.manager(out)
    metrics_path = out / "metrics.jsonl"
    shape = (tc.batch_size, tc.seq_len)
    ids_sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
    try:
        start = 0
        restored = ckpt.restore(mngr, state, check_meta=run.check)
        if restored is not None:
            start, state, meta = restored
            run.report(_log)  # changed settings that keep the math, or an old checkpoint
            _log(f"resumed from {mngr.directory} step {start}")
        if distributed.is_main():
            ckpt.truncate_metrics(metrics_path, start)
        compiled = None
        if start >= args.steps:
            _log(f"already at step {start} >= --steps {args.steps}; nothing to do")
        else:
            _stop_before_training(stop, mngr)
            _log(
                f"compiling the train step (dispatcher={cfg.dispatcher}, mesh "
                f"{dict(mesh.shape)}, batch {tc.batch_size} x seq {tc.seq_len}) ..."
            )
            t0 = time.perf_counter()
            step = loop.make_step(graphdef, tx, cfg, tc.compute_dtype, tc.loss_chunk)
            compiled = loop.compile_step(
                step, state, ids_sharding, shape, key=loop.step_key(cfg, tc, shape, mesh)
            )
            _log(
                f"train step ready in {time.perf_counter() - t0:.1f} s on "
                f"{jax.device_count()} {jax.default_backend()} devices "
                f"(dispatcher={cfg.dispatcher}, mesh {dict(mesh.shape)})"
            )
            _log(loop.memory_summary(compiled))
            _stop_before_training(stop, mngr)  # a signal during the compile
            meta = {"config": args.config, "seed": tc.seed, **run.meta}
            state = _train(
                args,
                tc,
                cfg,
                graphdef,
                state,
                compiled,
                data,
                ids_sharding,
                mngr,
                metrics_path,
                start,
                meta,
                run,
                stop,
            )
            _log(
                f"done: step {args.steps}; metrics in {metrics_path}; checkpoints in "
                f"{mngr.directory} (latest {mngr.latest_step()})"
            )
        stop.release()  # trained and saved: Ctrl-C now just stops (the plot, the table)
        _finish(args, tc, cfg, mesh, compiled, metrics_path)
        return 0
    finally:
        _close(mngr, failing=sys.exc_info()[1] is not None)


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


def _save(mngr, step: int, state, meta: dict) -> None:
    try:
        ckpt.save(mngr, step, state, meta)
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


def _train(
    args,
    tc,
    cfg,
    graphdef,
    state,
    compiled,
    data,
    ids_sharding,
    mngr,
    metrics_path,
    start,
    meta,
    run,
    stop,
):
    """Steps start+1 .. args.steps: run, log (metrics.jsonl and the progress line), stop on a
    non-finite loss, checkpoint every save_every and at the last step; after a signal (`stop`),
    checkpoint the step just completed and raise `interrupt.Interrupted`. Returns the state."""
    bar = progress.Progress(start, args.steps)
    with _metrics_file(metrics_path) as mf:
        for s in range(start + 1, args.steps + 1):
            ids = loop.put_batch(data.batch(s - 1), ids_sharding)
            t = time.perf_counter()
            state, m = compiled(state, ids)
            if cfg.expert_bias:
                state = loop.update_expert_bias(graphdef, state, m["expert_load"])
            m = jax.device_get(m)
            m.pop("expert_load")
            dt = time.perf_counter() - t
            rec = {
                "step": s,
                **{k: float(v) if k != "dropped_pairs" else int(v) for k, v in m.items()},
                **run.extra(s),
                "tokens_per_s": tc.batch_size * tc.seq_len / dt,
                "step_time": dt,
            }
            if not math.isfinite(rec["loss"]):
                _wait(mngr)
                raise NonFiniteLossError(
                    f"loss is {rec['loss']} at step {s} (lm_loss={rec['lm_loss']}, "
                    f"aux_loss={rec['aux_loss']}); stopping. The last good checkpoint is "
                    f"step {mngr.latest_step()} in {mngr.directory}"
                )
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            if not args.quiet:
                _log(bar.line(rec))
            sig = stop.requested()  # every step (several processes: agreed among them)
            if s % tc.save_every == 0 or s == args.steps or sig is not None:
                _save(mngr, s, state, {**meta, "data_position": s * tc.batch_size})
            if sig is not None:
                raise _interrupted(sig, mngr, s)
    return state


def _finish(args, tc, cfg, mesh, compiled, metrics_path):
    """With --memory-table the train step's memory per dispatcher, then the loss-curve PNG
    (process 0), whose path is the last line."""
    if args.memory_table:
        rows = report.memory_rows(cfg, tc, mesh, compiled, log=_log)
        _log(
            f"\nper-device memory of the train step ({jax.device_count()} devices, mesh "
            f"{dict(mesh.shape)}, batch {tc.batch_size} x seq {tc.seq_len}, "
            f"{tc.compute_dtype}; XLA memory_analysis of the compiled step):\n"
            + report.memory_table(rows)
        )
    if distributed.is_main() and metrics_path.exists() and metrics_path.stat().st_size:
        label = plot.dispatcher_label(metrics_path, cfg.dispatcher)
        png = plot.plot_losses(
            {label: metrics_path}, args.out / "loss.png", title=f"{args.config}: training loss"
        )
        _log(f"loss curve: {png}")


def entry() -> None:
    """Console entry point (`relaymoe-train`, `python -m train`): `CPU_DEVICES` emulated CPU
    devices (`relaymoe_jax.devices.use_cpu_devices`: unless XLA_FLAGS sets a count; a GPU is still
    used if jax has one), then `main`; clear one-line errors for bad input, a missing `train`
    extra, a diverged loss, a failed write (disk full, read-only) and the like, exit status 1;
    stopped by SIGINT / SIGTERM (after checkpointing): one line, exit status 130 / 143."""
    try:
        require_train_extra()
        use_cpu_devices(CPU_DEVICES)
        with guards.quiet_background_errors(keep=True):
            code = main()
    except interrupt.Interrupted as e:
        _exit(str(e), e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside training (e.g. the plot): nothing to save
        _exit("interrupted (SIGINT)", 130)
    except (NonFiniteLossError, MissingExtraError, ValueError, guards.WriteError) as e:
        _exit(f"error: {e}", 1)
    except OSError as e:  # FileNotFoundError, a metrics or plot write ...
        _exit(f"error: {guards.describe_write_error(e)}", 1)
    sys.exit(code)


def _exit(line: str, code: int) -> None:
    """`line` on stderr and exit with `code`."""
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)
