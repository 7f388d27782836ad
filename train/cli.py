"""Command line: `python -m train --config configs/tiny.yaml --steps N --out DIR [key=value ...]`.

`key=value` items set trainer fields (`train.loop.TrainConfig`: batch_size, seq_len, lr, ...) or,
for any other key, `ModelConfig` fields of the YAML config (dispatcher, routing, num_experts...);
the trainer fields also have `--flag` forms. The mesh is ("expert",) over all devices.

Steps are numbered from 1: the metrics line with `"step": s` is the s-th optimizer update, and the
checkpoint of step s holds the state after it. A rerun with the same `--out` resumes from the
latest checkpoint, first dropping metrics lines past it, and appends only the new steps.
"""

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
from jax.sharding import NamedSharding

from relaymoe_jax.models.configs import load_config, parse_overrides
from train import checkpoint as ckpt
from train import data as data_mod
from train import loop


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="configs/<name>.yaml, a path or a name")
    p.add_argument("--steps", type=int, required=True, help="train until this step (total)")
    p.add_argument("--out", required=True, type=Path, help="run directory (metrics, checkpoints)")
    p.add_argument("--data", action="append", default=None,
                   help="text file(s) to train on (default: the shipped train/data/*.txt)")
    p.add_argument("--quiet", action="store_true", help="no per-step line")
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
    n_dev = jax.device_count()
    cfg = load_config(args.config, expert_size=n_dev, **over)
    if tc.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={tc.seq_len} exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings} of {args.config}")
    return args, tc, cfg


def _log(msg: str) -> None:
    print(msg, flush=True)


def main(argv=None) -> int:
    args, tc, cfg = parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = data_mod.make_data(args.data, synthetic=tc.synthetic, seq_len=tc.seq_len,
                              batch_size=tc.batch_size, seed=tc.seed, vocab_size=cfg.vocab_size)
    mesh = jax.make_mesh((jax.device_count(),), ("expert",))
    graphdef, state, tx, rules = loop.init_state(cfg, tc, mesh)

    mngr = ckpt.manager(out)
    metrics_path = out / "metrics.jsonl"
    try:
        start = 0
        restored = ckpt.restore(mngr, state)
        if restored is not None:
            start, state, meta = restored
            if meta.get("train_config") != dataclasses.asdict(tc):
                _log(f"warning: trainer settings differ from the checkpoint's "
                     f"({meta.get('train_config')})")
            _log(f"resumed from {mngr.directory} step {start}")
        ckpt.truncate_metrics(metrics_path, start)
        if start >= args.steps:
            _log(f"already at step {start} >= --steps {args.steps}; nothing to do")
            return 0

        shape = (tc.batch_size, tc.seq_len)
        ids_sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
        t0 = time.perf_counter()
        compiled = loop.compile_step(loop.make_step(graphdef, tx, cfg), state, ids_sharding,
                                     shape, key=loop.step_key(cfg, tc, shape, mesh))
        _log(f"train step ready in {time.perf_counter() - t0:.1f} s on "
             f"{jax.device_count()} {jax.default_backend()} devices "
             f"(dispatcher={cfg.dispatcher})")
        _log(loop.memory_summary(compiled))
        meta = {"train_config": dataclasses.asdict(tc), "config": args.config,
                "seed": tc.seed}
        with metrics_path.open("a") as mf:
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
                    last = mngr.latest_step()
                    raise NonFiniteLossError(
                        f"loss is {rec['loss']} at step {s} (lm_loss={rec['lm_loss']}, "
                        f"aux_loss={rec['aux_loss']}); stopping. The last good checkpoint is "
                        f"step {last} in {mngr.directory}")
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                if not args.quiet:
                    _log(f"step {s:6d}/{args.steps} loss {rec['loss']:.4f} "
                         f"lm {rec['lm_loss']:.4f} aux {rec['aux_loss']:.4f} "
                         f"z {rec['z_loss']:.4f} gnorm {rec['grad_norm']:.3f} "
                         f"{rec['tokens_per_s']:,.0f} tok/s {dt * 1e3:.1f} ms")
                if s % tc.save_every == 0 or s == args.steps:
                    ckpt.save(mngr, s, state, {**meta, "data_position": s * tc.batch_size})
        _log(f"done: step {args.steps}; metrics in {metrics_path}; checkpoints in "
             f"{mngr.directory} (latest {mngr.latest_step()})")
        return 0
    finally:
        mngr.wait_until_finished()
        mngr.close()


def entry() -> None:
    """Console entry point (`relaymoe-train`, `python -m train`): clear one-line errors for bad
    input and a diverged loss, exit status 1."""
    try:
        sys.exit(main())
    except (NonFiniteLossError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
