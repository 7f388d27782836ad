"""Command line: `python -m train --config configs/tiny.yaml --steps N --out DIR [key=value ...]`.

`key=value` items set trainer fields (`train.settings.TrainConfig`: batch_size, seq_len, lr, ...)
or, for any other key, `ModelConfig` fields of the YAML config (dispatcher, routing,
num_experts...); the trainer fields also have `--flag` forms. The mesh comes from `mesh=`
(`train.step.mesh`; default "expert=-1": EP over all devices), e.g. `mesh=data=2,expert=4`. `parse`
checks it all into one `RunSettings`, which `train.run.loop` executes (steps, checkpoints, resume).

SIGINT / SIGTERM stop the run after the step in progress, checkpointed (`train.run.interrupt`; exit
status 130 / 143); a second signal stops it at once, unless a checkpoint is being written (one line
naming the checkpoint a rerun resumes from). Expected failures are one line on stderr and exit
status 1, before the model is built where they can be (`train.run.guards`: `--out`;
`train.planner.fit`: the memory check; `train.errors`: failed writes); every case and its test:
docs/robustness.md.
"""

import argparse
import atexit
import dataclasses
import difflib
import os
import signal
import sys
from pathlib import Path

import jax

from relaymoe_jax.cli.devices import use_cpu_devices
from relaymoe_jax.kernels.attention import interpret as interpreter
from relaymoe_jax.models.config import KEYS as MODEL_FIELDS
from relaymoe_jax.models.config_files import load_config, parse_overrides, unknown_keys

from .cli_help import TRAIN_HELP, HelpFormatter, trainer_settings_help
from .errors import (
    TRAIN_EXTRA,
    MissingExtraError,
    WriteError,
    describe_write_error,
    require_train_extra,
)
from .planner import memory
from .run import distributed, guards, interrupt, profile
from .settings import (
    TRAIN_FIELDS,
    RunSettings,
    TrainConfig,
    check_offload,
    check_options_used,
    checked_train_config,
    field_type,
)
from .step import mesh as train_mesh

# the modules above need no package of the train extra; without it, main() and entry() say
# what is missing (MissingExtraError)
try:
    from .hf import init as hf_init
    from .run import loop as training_run
    from .state import identity
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in {m.split(".")[0] for m in TRAIN_EXTRA}:
        raise
    _MISSING: str | None = e.name
else:
    _MISSING = None

CPU_DEVICES = 8  # the emulated CPU devices of `entry` (XLA_FLAGS's device count wins)


# the commands `entry` dispatches on the first argument, and what each takes
SUBCOMMANDS = {
    "prepare": "relaymoe-train prepare FILES --out DIR (tokenize a corpus: train/data/prepare.py)",
    "export": "relaymoe-train export RUN_DIR --out DIR (a Hugging Face checkpoint: train/hf/"
    "export.py)",
}


def subcommand_error(argv: list[str], parser: argparse.ArgumentParser) -> str | None:
    """A one-line error for a command word where a training run takes none: a subcommand that is
    not first, or a misspelt one (argparse would only ask for --steps and --out), naming the
    command it resembles; None when every word is an option, its value or a key=value."""
    takes_value = {
        s for a in parser._actions for s in a.option_strings if a.nargs != 0 and a.const is None
    }
    for i, word in enumerate(argv):
        if word.startswith("-") or "=" in word or (i and argv[i - 1] in takes_value):
            continue
        if word in SUBCOMMANDS:
            return f"{word!r} is a command and comes first: {SUBCOMMANDS[word]}"
        near = difflib.get_close_matches(word, SUBCOMMANDS, n=1, cutoff=0.6)
        if near:
            return f"unknown command {word!r}: did you mean {SUBCOMMANDS[near[0]]}?"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}",
        description="Train a model config with the RelayMoE trainer "
        "(metrics, checkpoints, resume). Other commands, given first: "
        + "; ".join(SUBCOMMANDS.values())
        + ".",
        epilog=trainer_settings_help(),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--config",
        default=None,
        help="model config: configs/<name>.yaml, a path or a shipped config's name (required "
        "unless --init-from-hf gives it)",
    )
    p.add_argument(
        "--init-from-hf",
        type=Path,
        default=None,
        metavar="DIR",
        help="start from a local Hugging Face Qwen3-MoE / Qwen2-MoE checkpoint: the model config "
        "is DIR/config.json (model key=value items still apply, unless they change a weight's "
        "shape), the weights are loaded into the sharded train state, the optimizer starts "
        "fresh; DIR/tokenizer.json, if there, tokenizes --data files (train.hf.init)",
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
        help="a prepared dataset directory (relaymoe-train prepare), or text/JSONL files to "
        "train on, repeatable, prepared once into a cache ($RELAYMOE_DATA_CACHE, default "
        "~/.cache/relaymoe-jax/datasets) (default: the shipped train/data/declaration.txt)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a local Hugging Face tokenizer.json (default: byte-level); with a prepared "
        "--data DIR it must be the one the dataset was prepared with",
    )
    p.add_argument(
        "--eval-data",
        type=Path,
        default=None,
        metavar="DIR",
        help="a prepared dataset (relaymoe-train prepare, the training data's tokenizer) to "
        "evaluate on every eval_every steps and at the last step: the mean next-token loss and "
        "perplexity over eval_batches batches of its rows, in metrics.jsonl and loss.png "
        "(train.step.evaluate)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step line")
    p.add_argument(
        "--profile-steps",
        type=profile.step_range,
        default=None,
        metavar="A:B",
        help="trace steps A to B (from 1) with jax.profiler into OUT/profile (XProf / "
        "TensorBoard's trace viewer: `tensorboard --logdir OUT/profile`)",
    )
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
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text = (
            f"{TRAIN_HELP.get(f.name, 'trainer setting')} (also {f.name}=VALUE; "
            f"default: {'unset' if f.default is None else f.default})"
        )
        if f.type is bool or f.type == "bool":
            p.add_argument(flag, dest=f.name, action="store_true", default=None, help=text)
        else:
            typ = field_type(f)
            p.add_argument(flag, dest=f.name, type=typ, default=None, help=text)
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="trainer settings (listed below) or model config fields",
    )
    return p


def _check_keys(over: dict) -> None:
    """ValueError for key=value items that are neither trainer settings nor model config keys,
    with the close matches and both lists."""
    unknown = [k for k in over if k not in TRAIN_FIELDS and k not in MODEL_FIELDS]
    if unknown:
        items = " ".join(f"{k}={over[k]!r}" for k in unknown)
        raise ValueError(
            f"command line {items}: "
            + unknown_keys(unknown, {"trainer": TRAIN_FIELDS, "model config": MODEL_FIELDS})
        )


def _train_config(args, over: dict) -> TrainConfig:
    """The trainer settings of the key=value items (taken out of `over`) and the flags (which
    win), checked."""
    train_kw = {k: over.pop(k) for k in list(over) if k in TRAIN_FIELDS}
    for f in dataclasses.fields(TrainConfig):
        flag = getattr(args, f.name)
        if flag is not None and f.name in train_kw:
            raise ValueError(
                f"{f.name} is given twice, as {f.name}={train_kw[f.name]!r} and as "
                f"--{f.name.replace('_', '-')}: give it once"
            )
        if flag is not None:
            train_kw[f.name] = flag
    tc = checked_train_config(train_kw)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    return tc


def _check_data_flags(args, tc: TrainConfig) -> None:
    """ValueError for data flags the run would ignore: --synthetic reads no file."""
    if tc.synthetic:
        given = " and ".join(
            f for f, v in (("--data", args.data), ("--tokenizer", args.tokenizer)) if v
        )
        if given:
            raise ValueError(
                f"{given} with --synthetic: the synthetic stream reads no text file and no "
                f"tokenizer; drop {given} or --synthetic"
            )


def _check_eval_flags(args, tc: TrainConfig, asked: set) -> None:
    """ValueError for evaluation settings without --eval-data (they would be ignored), and for
    --eval-data with --synthetic (no tokenizer to check the evaluation text against)."""
    given = [
        k for k in ("eval_every", "eval_batches") if k in asked or getattr(args, k) is not None
    ]
    if args.eval_data is None and given:
        raise ValueError(
            f"{given[0]}={getattr(tc, given[0])} without --eval-data: nothing to evaluate; add "
            f"--eval-data DIR (a prepared dataset) or drop {' and '.join(given)}"
        )
    if args.eval_data is not None and tc.synthetic:
        raise ValueError(
            "--eval-data with --synthetic: the synthetic stream has no tokenizer to evaluate "
            "text with; drop --eval-data or --synthetic"
        )


def _check_ignored_options(over: dict, cfg, memory_table: bool) -> None:
    """ValueError for an op option set on the command line that nothing of this run uses
    (`settings.check_options_used`): not the trained dispatcher, nor the --memory-table's rows
    (its ring row takes the ring's options; its all-to-all rows set their own
    capacity_factor)."""
    trained = cfg.moe.options.dispatcher
    steps = {trained: ()}
    if memory_table:
        for _, row in memory.MEMORY_TABLE_ROWS:
            steps.setdefault(row["dispatcher"], tuple(row))
    check_options_used(over, steps, f"this run trains dispatcher={trained!r}", "add dispatcher={}")


def parse(argv) -> RunSettings:
    """The checked `RunSettings` of the command line `argv` (ValueError naming what is wrong:
    keys, values, the mesh against the devices and the model, the sequence length)."""
    args = build_parser().parse_intermixed_args(argv)
    over = parse_overrides(args.overrides)
    _check_keys(over)
    asked = set(over)  # the key=value items (before _train_config takes the trainer's)
    tc = _train_config(args, over)
    _check_data_flags(args, tc)
    _check_eval_flags(args, tc, asked)
    sizes = train_mesh.parse_mesh(tc.mesh, jax.device_count())
    if (args.config is None) == (args.init_from_hf is None):
        raise ValueError(
            "give the model as --config FILE or --init-from-hf DIR (a Hugging Face checkpoint), "
            + ("not both" if args.config else "one of them")
        )
    if args.init_from_hf is not None:
        source = hf_init.open_source(args.init_from_hf)
        cfg = hf_init.model_config(source, over, train_mesh.expert_size(sizes))
    else:
        cfg = load_config(
            args.config,
            expert_size=train_mesh.expert_size(sizes),
            other_keys={"trainer": TRAIN_FIELDS},
            **over,
        )
    train_mesh.check(sizes, cfg, tc.batch_size, tc.seq_len, tc.mesh, jax.devices()[0].platform)
    check_offload(cfg, tc, jax.devices()[0])
    _check_ignored_options(over, cfg, args.memory_table)
    if tc.seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={tc.seq_len} exceeds max_position_embeddings="
            f"{cfg.max_position_embeddings} of {args.config or args.init_from_hf}"
        )
    return RunSettings(
        config=args.config or str(args.init_from_hf),
        steps=args.steps,
        out=args.out,
        train=tc,
        model=cfg,
        data=None if args.data is None else tuple(args.data),
        tokenizer=args.tokenizer,
        eval_data=args.eval_data,
        quiet=args.quiet,
        memory_table=args.memory_table,
        force=args.force,
        allow_changes=tuple(args.allow_changes),
        init_from_hf=args.init_from_hf,
        profile_steps=profile.check_range(args.profile_steps, args.steps),
    )


def main(argv=None) -> int:
    """The run of `argv` (default sys.argv[1:]); 0 when done. SIGINT and SIGTERM are caught
    while it trains (`train.run.interrupt`): it checkpoints the last completed step and raises
    `interrupt.Interrupted` (exit status 128 + the signal's number from `entry`); a second signal
    ends the process at once (the same status), unless a checkpoint is being written."""
    stop = interrupt.Stop()
    try:
        require_train_extra(_MISSING)
        argv = sys.argv[1:] if argv is None else argv
        parser = build_parser()
        if (wrong := subcommand_error(argv, parser)) is not None:
            raise ValueError(wrong)
        distributed.initialize(parser.parse_intermixed_args(argv))  # before any jax call
        stop.install()  # after jax.distributed's own SIGTERM handler (train.run.interrupt)
        return training_run.execute(parse(argv), stop)
    finally:
        stop.release()


def entry() -> None:
    """Console entry point (`relaymoe-train`, `python -m train`): `CPU_DEVICES` emulated CPU
    devices (`relaymoe_jax.cli.devices.use_cpu_devices`: unless XLA_FLAGS sets a count; a GPU is
    still used if jax has one) and XLA:CPU threads enough for the Mosaic GPU interpreter
    (`relaymoe_jax.kernels.attention.interpret.reserve_threads`: NPROC), then `main`; clear
    one-line errors for bad input, a missing `train` extra, a diverged loss, a failed write
    (disk full, read-only) and the like, exit status 1; stopped by SIGINT / SIGTERM (after
    checkpointing; a second signal: at once, unless a checkpoint is being written): one line,
    exit status 130 / 143."""
    if sys.argv[1:2] == ["prepare"]:  # `relaymoe-train prepare ...`: train/data/prepare.py
        from .data import prepare

        sys.exit(prepare.main(sys.argv[2:]))
    if sys.argv[1:2] == ["export"]:  # `relaymoe-train export RUN_DIR --out DIR`: train/hf/export.py
        from .hf import export

        with guards.quiet_background_errors(keep=True):  # orbax's reads cut short by a signal
            code = export.main(sys.argv[2:])
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)  # done: a Ctrl-C as jax exits
        sys.exit(code)
    try:
        require_train_extra(_MISSING)
        use_cpu_devices(CPU_DEVICES)
        interpreter.reserve_threads()  # XLA:CPU's threads for attention_impl=pallas-interpret
        with guards.quiet_background_errors(keep=True):
            code = main()
    except interrupt.Interrupted as e:
        _exit(str(e), e.exit_code, signalled=True)
    except KeyboardInterrupt:  # Ctrl-C outside training (e.g. the plot): nothing to save
        _exit("interrupted (SIGINT)", 130, signalled=True)
    except (guards.NonFiniteLossError, MissingExtraError, ValueError, WriteError) as e:
        _exit(f"error: {e}", 1)
    except OSError as e:  # FileNotFoundError, a metrics or plot write ...
        ours = isinstance(e, FileNotFoundError) and e.errno is None  # a missing config, data
        _exit(f"error: {e if ours else describe_write_error(e)}", 1)  # or tokenizer file
    sys.exit(code)


def _exit(line: str, code: int, signalled: bool = False) -> None:
    """`line` on stderr and exit with `code`; at once (`os._exit`, after flushing) while a
    compile a signal interrupted still runs in its helper thread (`interrupt.unless_stopped`):
    the interpreter's shutdown would otherwise run beside it. `signalled`: SIGINT is ignored
    from here on (a second Ctrl-C in this print, the handlers given back, aborted the process
    beside the compile: status -6, tests/test_train_kill.py, 2026-12-07)."""
    if signalled:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(line, file=sys.stderr, flush=True)
    if interrupt.left_running():
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)
