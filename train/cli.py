"""Command line: `python -m train --config configs/tiny.yaml --steps N --out DIR [key=value ...]`.

`key=value` items set trainer fields (`train.loop.TrainConfig`: batch_size, seq_len, lr, ...) or,
for any other key, `ModelConfig` fields of the YAML config (dispatcher, routing, num_experts...);
the trainer fields also have `--flag` forms. The mesh comes from `mesh=` (`train.mesh`; default
"expert=-1": EP over all devices), e.g. `mesh=data=2,expert=4`.

Steps are numbered from 1: the metrics line with `"step": s` is the s-th optimizer update, and the
checkpoint of step s holds the state after it. A rerun with the same `--out` resumes from the
latest checkpoint, first dropping metrics lines past it, and appends only the new steps.
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import jax
from jax.sharding import NamedSharding

from relaymoe_jax.devices import use_cpu_devices
from relaymoe_jax.models.configs import load_config, parse_overrides

TRAIN_EXTRA = ("optax", "orbax.checkpoint", "matplotlib")    # pyproject's `train` extra
try:        # without the extra, main() and entry() say what is missing (MissingExtraError)
    from . import checkpoint as ckpt
    from . import data as data_mod
    from . import distributed, loop, plot, progress, report
    from . import mesh as train_mesh
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in {m.split(".")[0] for m in TRAIN_EXTRA}:
        raise
    _MISSING: str | None = e.name
else:
    _MISSING = None

CPU_DEVICES = 8     # the emulated CPU devices of `entry` (XLA_FLAGS's device count wins)


class MissingExtraError(ImportError):
    """A package of the `train` extra is not installed."""


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:         # its parent package is missing
        return False


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="configs/<name>.yaml, a path or a name")
    p.add_argument("--steps", type=int, required=True, help="train until this step (total)")
    p.add_argument("--out", required=True, type=Path, help="run directory (metrics, checkpoints)")
    p.add_argument("--data", action="append", default=None,
                   help="text file(s) to train on (default: the shipped train/data/*.txt)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a local Hugging Face tokenizer.json (default: byte-level)")
    p.add_argument("--quiet", action="store_true", help="no per-step line")
    p.add_argument("--memory-table", action="store_true",
                   help="at the end, print the train step's per-device memory with ring and "
                        "all-to-all (the ones not trained are compiled, not run)")
    distributed.add_arguments(p)
    for f in dataclasses.fields(loop.TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            p.add_argument(flag, dest=f.name, action="store_true", default=None)
        else:
            typ = {"int": int, "float": float}.get(f.type, f.type)
            p.add_argument(flag, dest=f.name, type=typ, default=None)
    p.add_argument("overrides", nargs="*", help="key=value (trainer or model config fields)")
    return p


def parse(argv):
    args = build_parser().parse_intermixed_args(argv)
    over = parse_overrides(args.overrides)
    train_kw = {k: over.pop(k) for k in list(over) if k in loop.TRAIN_FIELDS}
    for f in dataclasses.fields(loop.TrainConfig):
        if getattr(args, f.name) is not None:
            train_kw[f.name] = getattr(args, f.name)
    tc = loop.TrainConfig(**train_kw)
    for f in dataclasses.fields(tc):
        want = {"int": int, "float": float, "bool": bool}.get(f.type, f.type)
        v = getattr(tc, f.name)
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
        raise ValueError(f"compute_dtype={tc.compute_dtype!r}: expected one of "
                         f"{loop.COMPUTE_DTYPES}")
    cfg = load_config(args.config, expert_size=train_mesh.expert_size(sizes), **over)
    train_mesh.check(sizes, cfg, tc.batch_size, tc.seq_len, tc.mesh)
    if tc.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={tc.seq_len} exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings} of {args.config}")
    return args, tc, cfg


def _log(msg: str) -> None:
    if distributed.is_main():
        print(msg, flush=True)


def require_train_extra() -> None:
    """MissingExtraError naming `pip install "relaymoe-jax[train]"` if the extra is missing."""
    missing = _MISSING or next((m for m in TRAIN_EXTRA if not _installed(m)), None)
    if missing is not None:
        raise MissingExtraError(f"the trainer needs the train extra ({missing} is not "
                                f'installed): pip install "relaymoe-jax[train]"')


def main(argv=None) -> int:
    require_train_extra()
    argv = sys.argv[1:] if argv is None else argv
    distributed.initialize(build_parser().parse_intermixed_args(argv))    # before any jax call
    args, tc, cfg = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = data_mod.make_data(args.data, synthetic=tc.synthetic, seq_len=tc.seq_len,
                              batch_size=tc.batch_size, seed=tc.seed, vocab_size=cfg.vocab_size,
                              tokenizer=args.tokenizer)
    mesh = train_mesh.make_mesh(tc.mesh)
    graphdef, state, tx, rules = loop.init_state(cfg, tc, mesh)

    mngr = ckpt.manager(out)
    metrics_path = out / "metrics.jsonl"
    shape = (tc.batch_size, tc.seq_len)
    ids_sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
    try:
        start = 0
        restored = ckpt.restore(mngr, state)
        if restored is not None:
            start, state, meta = restored
            if meta.get("train_config") != dataclasses.asdict(tc):
                _log(f"warning: trainer settings differ from the checkpoint's "
                     f"({meta.get('train_config')})")
            _log(f"resumed from {mngr.directory} step {start}")
        if distributed.is_main():
            ckpt.truncate_metrics(metrics_path, start)
        compiled = None
        if start >= args.steps:
            _log(f"already at step {start} >= --steps {args.steps}; nothing to do")
        else:
            t0 = time.perf_counter()
            step = loop.make_step(graphdef, tx, cfg, tc.compute_dtype, tc.loss_chunk)
            compiled = loop.compile_step(step,
                                         state, ids_sharding, shape,
                                         key=loop.step_key(cfg, tc, shape, mesh))
            _log(f"train step ready in {time.perf_counter() - t0:.1f} s on "
                 f"{jax.device_count()} {jax.default_backend()} devices "
                 f"(dispatcher={cfg.dispatcher}, mesh {dict(mesh.shape)})")
            _log(loop.memory_summary(compiled))
            meta = {"train_config": dataclasses.asdict(tc), "config": args.config,
                    "seed": tc.seed}
            state = _train(args, tc, cfg, graphdef, state, compiled, data, ids_sharding, mngr,
                           metrics_path, start, meta)
            _log(f"done: step {args.steps}; metrics in {metrics_path}; checkpoints in "
                 f"{mngr.directory} (latest {mngr.latest_step()})")
        _finish(args, tc, cfg, mesh, compiled, metrics_path)
        return 0
    finally:
        mngr.wait_until_finished()
        mngr.close()


def _train(args, tc, cfg, graphdef, state, compiled, data, ids_sharding, mngr, metrics_path,
           start, meta):
    """Steps start+1 .. args.steps: run, log (metrics.jsonl and the progress line), stop on a
    non-finite loss, checkpoint every save_every and at the last step. Returns the state."""
    bar = progress.Progress(start, args.steps)
    with distributed.open_on_main(metrics_path, "a") as mf:
        for s in range(start + 1, args.steps + 1):
            ids = loop.put_batch(data.batch(s - 1), ids_sharding)
            t = time.perf_counter()
            state, m = compiled(state, ids)
            if cfg.expert_bias:
                state = loop.update_expert_bias(graphdef, state, m["expert_load"])
            m = jax.device_get(m)
            m.pop("expert_load")
            dt = time.perf_counter() - t
            rec = {"step": s, **{k: float(v) if k != "dropped_pairs" else int(v)
                                 for k, v in m.items()},
                   "tokens_per_s": tc.batch_size * tc.seq_len / dt, "step_time": dt}
            if not math.isfinite(rec["loss"]):
                mngr.wait_until_finished()
                raise NonFiniteLossError(
                    f"loss is {rec['loss']} at step {s} (lm_loss={rec['lm_loss']}, "
                    f"aux_loss={rec['aux_loss']}); stopping. The last good checkpoint is "
                    f"step {mngr.latest_step()} in {mngr.directory}")
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            if not args.quiet:
                _log(bar.line(rec))
            if s % tc.save_every == 0 or s == args.steps:
                ckpt.save(mngr, s, state, {**meta, "data_position": s * tc.batch_size})
    return state


def _finish(args, tc, cfg, mesh, compiled, metrics_path):
    """With --memory-table the train step's memory per dispatcher, then the loss-curve PNG
    (process 0), whose path is the last line."""
    if args.memory_table:
        rows = report.memory_rows(cfg, tc, mesh, compiled, log=_log)
        _log(f"\nper-device memory of the train step ({jax.device_count()} devices, mesh "
             f"{dict(mesh.shape)}, batch {tc.batch_size} x seq {tc.seq_len}, "
             f"{tc.compute_dtype}; XLA memory_analysis of the compiled step):\n"
             + report.memory_table(rows))
    if distributed.is_main() and metrics_path.exists() and metrics_path.stat().st_size:
        png = plot.plot_losses({cfg.dispatcher: metrics_path}, args.out / "loss.png",
                               title=f"{args.config}: training loss")
        _log(f"loss curve: {png}")


def entry() -> None:
    """Console entry point (`relaymoe-train`, `python -m train`): `CPU_DEVICES` emulated CPU
    devices (`relaymoe_jax.devices.use_cpu_devices`: unless XLA_FLAGS sets a count; a GPU is still
    used if jax has one), then `main`; clear one-line errors for bad input, a missing `train`
    extra and a diverged loss, exit status 1."""
    try:
        require_train_extra()
        use_cpu_devices(CPU_DEVICES)
        sys.exit(main())
    except (NonFiniteLossError, MissingExtraError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
