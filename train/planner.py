"""Compile-only planning of attention recomputation (paper §3.4), per dispatcher.

    python -m train.planner --config configs/tiny.yaml --memory H100 --batch 8 --seq 256 \
        [--max-batch LIMIT] [--max-seq LIMIT] [k=v ...]
    python -m train.planner --config configs/qwen3-30b-a3b.yaml --target h100 --batch 8 \
        --seq 4096 compute_dtype=bfloat16 [k=v ...]

For a model config, a mesh (`mesh=`, as in `python -m train`), a micro-batch and sequence length,
and a device memory (`--memory`: H100, H200, or a size such as 80GiB / 12.5MB / 1e9), for each
dispatcher:

1. compile (never run) the train step with every attention block fully recomputed and read its
   per-device peak from XLA's buffer assignment (`memory_analysis()`: arguments + temporaries +
   outputs not aliased to donated arguments); the budget is the usable memory minus that peak;
2. choose one option per layer with the greedy c/m solver (`relaymoe_jax.remat`);
3. compile the planned step and check its peak fits (else plan again within less: `plan_remat`);
   report the FLOPs it no longer recomputes, from `cost_analysis()` (full minus planned);
4. with `--max-batch` / `--max-seq`, find the largest micro-batch at `--seq` / sequence length at
   `--batch` (never past the model's `max_position_embeddings`, nor is `--seq`) whose fully
   recomputed step fits (`train.search`: doubling then bisection, one compile per probe) and plan
   the remat at that size.

The dispatchers: `--dispatchers` (default ring,alltoall) or `dispatcher=X` alone
(`planner_args.planned_dispatchers`); each table row names its options (`report.options_label`:
"alltoall (capacity 1.0)"), and an op option on the command line that none of them uses is
refused before compiling, as the trainer refuses it (`settings.check_options_used`).

The header says, per dispatcher, over which mesh axes the experts are spread and, for the ring,
which ring runs (`ring=`: flat or hierarchical, with the reason when `ring=auto` picks flat;
`relaymoe_jax.op.topology`). Without `--target` every emulated device is process 0, so `auto` is
flat there.

Exit status 0 when something fits, 1 when nothing does (no dispatcher at --batch x --seq and no
searched size; said on stderr after the tables) or on an error, 2 for bad arguments.

Without `--target` the budget is measured on XLA:CPU with the emulated mesh. GPU buffer
assignment differs (other fusions, cuDNN attention without [S, S] scores, allocator
fragmentation, the CUDA context and XLA's preallocation: jax takes 75% of the GPU unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise, hence `--usable`, default 0.9); treat the CPU
figures as a model, not a promise.

With `--target h100|h200` every step is compiled by the XLA:GPU compiler for abstract GPUs
(`relaymoe_jax.gpu_mesh`, the `gpu-compile` extra; no GPU needed): `--hosts` hosts of 8 GPUs,
`mesh=` over all of them, laid out host-major (`--hosts 2 mesh=node=2,expert=8`: experts over
both hosts, `node` across them and `expert` within each), `--memory` defaulting to the target's,
and the grouped matmul the Pallas kernel. That is the GPU compiler's own buffer assignment;
still no timing, and the GPU compiler gives no `cost_analysis()`, so the FLOPs saved come from
the solver's formula only.
"""

import argparse
import dataclasses
import math
import os
import sys

if __name__ == "__main__" and "--target" in sys.argv:  # before jax: see relaymoe_jax.gpu_mesh
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from relaymoe_jax import remat
from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.cli.argtypes import positive_int
from relaymoe_jax.cli.devices import use_cpu_devices
from relaymoe_jax.models.config_files import load_config, parse_overrides

from . import mesh as train_mesh
from . import search, train_step
from .planner_args import parse_memory, planned_dispatchers
from .planner_report import Findings, LargestSize, expert_parallelism, replan_notes, summary
from .report import footprint, options_label
from .settings import TRAIN_FIELDS, TrainConfig, sized_train_config

SEQ_STEP = 128  # --seq-step's default


@dataclasses.dataclass(frozen=True)
class StepCost:
    peak: int  # bytes per device (report.footprint)
    flops: float | None  # cost_analysis()["flops"] of the whole step, per device; None when the
    # compiler gives none (XLA:GPU without a device)
    state: int | None = None  # bytes of the step's arguments per device: the train state


def step_cost(cfg, tc: TrainConfig, mesh, memo: bool = True) -> StepCost:
    """Compile (not run) the train step of `cfg` and `tc` on `mesh`
    (`train_step.compile_abstract`), under `mesh` as the context mesh (an abstract GPU mesh needs
    it for the Pallas kernel)."""
    with jax.set_mesh(mesh):
        compiled = train_step.compile_abstract(cfg, tc, mesh, memo)
    cost, m = compiled.cost_analysis(), compiled.memory_analysis()
    return StepCost(footprint(m), cost["flops"] if cost else None, m.argument_size_in_bytes)


def largest_size(
    cfg,
    tc: TrainConfig,
    mesh,
    capacity: int,
    *,
    field: str,
    step: int,
    limit: int,
    log=lambda msg: None,
):
    """(largest batch_size or seq_len (`field`), a multiple of `step` up to `limit`, whose fully
    recomputed step fits `capacity`, or None; the `search.Search` record). A sequence never goes
    past the model's `max_position_embeddings` (the record's `limit` is then that bound): a
    longer one is not one the model takes."""
    full = dataclasses.replace(cfg, attention_remat="full")
    if field == "seq_len":
        limit = min(limit, cfg.max_position_embeddings)
    peak = lambda n: step_cost(full, dataclasses.replace(tc, **{field: n}), mesh, memo=False).peak
    return search.largest(peak, capacity, step, limit, log)


@dataclasses.dataclass(frozen=True)
class RematReport:
    dispatcher: str  # as the tables name it: report.options_label ("alltoall (dropless)")
    capacity: int
    full: StepCost
    plan: remat.Plan
    planned: StepCost
    misses: tuple = ()  # (plan, compiled peak) of the plans that did not fit, re-planned

    @property
    def fits(self) -> bool:
        return self.planned.peak <= self.capacity

    @property
    def flops_saved(self) -> float | None:
        if self.full.flops is None or self.planned.flops is None:
            return None
        return self.full.flops - self.planned.flops


REPLANS = 2  # plans tried again within less when the compiled one does not fit


def plan_remat(cfg, tc: TrainConfig, mesh, capacity: int) -> RematReport:
    """Steps 1-3 of the module docstring for `cfg` as given (its dispatcher). ValueError if the
    fully recomputed step does not fit `capacity` bytes. XLA's buffer assignment is not exactly
    the fully recomputed peak plus the bytes the plan keeps: a planned step whose compiled peak
    is over `capacity` is planned again within its kept bytes less the overshoot (at most
    `REPLANS` times, then every layer `full`, which fits), each miss kept in `misses`."""
    full = step_cost(dataclasses.replace(cfg, attention_remat="full"), tc, mesh)
    if full.peak > capacity:
        raise ValueError(
            f"the train step needs {full.peak / 2**20:,.1f} MiB per device with "
            f"full attention recomputation, more than the {capacity / 2**20:,.1f} "
            f"MiB available (dispatcher={cfg.moe.options.dispatcher}, batch {tc.batch_size}, "
            f"seq {tc.seq_len}): nothing to plan"
        )
    misses, budget = [], capacity - full.peak
    while True:  # ends: all "full" is `full`, which fits
        plan = remat.plan_attention_remat(
            cfg,
            batch=tc.batch_size,
            seq=tc.seq_len,
            mesh_shape=dict(mesh.shape),
            dtype=tc.compute_dtype,
            budget=budget if len(misses) < REPLANS else 0,
        )
        planned = (
            full
            if set(plan.options) == {"full"}
            else step_cost(dataclasses.replace(cfg, attention_remat=plan.options), tc, mesh)
        )
        if planned.peak <= capacity:
            d = options_label(cfg.moe.options.applicable())
            return RematReport(d, capacity, full, plan, planned, tuple(misses))
        misses.append((plan, planned.peak))
        budget = max(0, plan.bytes - (planned.peak - capacity))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}.planner", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", required=True)
    p.add_argument(
        "--memory",
        default=None,
        help="H100, H200, or a size (80GiB, 1e9, ...); default: --target's",
    )
    p.add_argument(
        "--target",
        choices=[t for t in gpu_mesh.TARGETS],
        default=None,
        help="compile for abstract GPUs of this kind with XLA:GPU (no GPU needed; "
        "the gpu-compile extra) instead of the emulated CPU devices",
    )
    p.add_argument(
        "--hosts",
        type=positive_int,
        default=1,
        help=f"with --target: hosts of {gpu_mesh.GPUS_PER_HOST} GPUs (default 1)",
    )
    p.add_argument(
        "--usable",
        type=float,
        default=0.9,
        help="fraction of --memory the step may use (default 0.9)",
    )
    p.add_argument(
        "--batch", type=positive_int, required=True, help="global micro-batch (sequences)"
    )
    p.add_argument("--seq", type=positive_int, required=True, help="sequence length")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        metavar="LIMIT",
        help="also find the largest micro-batch <= LIMIT at --seq",
    )
    p.add_argument(
        "--max-seq",
        type=positive_int,
        default=None,
        metavar="LIMIT",
        help="also find the largest sequence length <= LIMIT at --batch",
    )
    p.add_argument(
        "--seq-step",
        type=positive_int,
        default=None,
        help=f"with --max-seq: the sequence lengths searched are multiples of this (default "
        f"{SEQ_STEP})",
    )
    p.add_argument(
        "--dispatchers",
        default=None,
        help="comma-separated, default ring,alltoall (dispatcher=X alone: X)",
    )
    p.add_argument("overrides", nargs="*", help="mesh=..., compute_dtype=..., model fields")
    return p


def _parse(argv) -> argparse.Namespace:
    """The checked arguments; `memory` defaults to the target's."""
    args = build_parser().parse_intermixed_args(argv)
    if not 0 < args.usable <= 1:
        raise ValueError(f"--usable {args.usable}: expected a fraction in (0, 1]")
    if args.memory is None and args.target is None:
        raise ValueError("--memory is required without --target (H100, H200 or a size)")
    if args.hosts < 1 or (args.hosts != 1 and args.target is None):
        raise ValueError(f"--hosts {args.hosts}: expected >= 1, and only with --target")
    if args.seq_step is not None and args.max_seq is None:
        raise ValueError(
            f"--seq-step {args.seq_step} only sets the lengths --max-seq searches: add "
            "--max-seq LIMIT, or drop --seq-step"
        )
    args.memory = args.memory or args.target.upper()
    args.seq_step = args.seq_step or SEQ_STEP
    return args


def _check_lengths(args, cfg, found: Findings) -> int | None:
    """The --max-seq to search (capped at the model's max_position_embeddings, with a note);
    ValueError if --seq is longer than the model takes, or the cap leaves no --seq-step."""
    most = cfg.max_position_embeddings
    if args.seq > most:
        raise ValueError(
            f"--seq {args.seq} exceeds max_position_embeddings={most} of {args.config}: the "
            f"model cannot take it (plan at most --seq {most}, or set "
            f"max_position_embeddings={args.seq} if the model can)"
        )
    if args.max_seq is None or args.max_seq <= most:
        return args.max_seq
    if args.seq_step > most:
        raise ValueError(
            f"--max-seq {args.max_seq} is capped at max_position_embeddings={most} of "
            f"{args.config}, below --seq-step {args.seq_step}: no length to search"
        )
    found.notes.append(
        f"--max-seq {args.max_seq} searched up to max_position_embeddings={most} of "
        f"{args.config} only: the model takes no longer sequence"
    )
    print(f"# {found.notes[-1]}", flush=True)
    return most


def _mesh(args, tc: TrainConfig):
    """(mesh sizes, mesh, where the sizes come from) for `--target` or the emulated devices."""
    if args.target:
        sizes = train_mesh.parse_mesh(tc.mesh, args.hosts * gpu_mesh.GPUS_PER_HOST)
        mesh = gpu_mesh.mesh(tuple(sizes.values()), tuple(sizes), target=args.target)
        where = (
            f"XLA:GPU buffer assignment for {math.prod(sizes.values())} abstract "
            f"{gpu_mesh.device_kind(args.target)}, compile only, no GPU: no timing, and "
            f"no cost_analysis (the FLOPs are the solver's formula)"
        )
    else:
        sizes = train_mesh.parse_mesh(tc.mesh, jax.device_count())
        mesh = train_mesh.make_mesh(tc.mesh)
        where = (
            "XLA:CPU buffer assignment, compile only. A GPU assigns buffers differently "
            "(other fusions, cuDNN attention without [S, S] scores, allocator "
            "fragmentation, the CUDA context): treat the sizes as a model, not a promise"
        )
    return sizes, mesh, where


def _plan_dispatcher(d: str, cfg, tc, mesh, capacity: int, args, batch_step, found: Findings):
    """Plan dispatcher `d` (`cfg`) at --batch x --seq and, if asked, at the largest sizes."""
    print(f"# {d}: compiling the fully recomputed and the planned step ...", flush=True)
    try:
        found.reports.append(plan_remat(cfg, tc, mesh, capacity))
    except ValueError as e:  # does not fit at this size: say so, still search
        print(f"# {d}: {e}", flush=True)
        found.notes.append(f"{d}: {e}")
    else:
        found.notes.extend(
            replan_notes(found.reports[-1], f"batch {tc.batch_size} x seq {tc.seq_len}")
        )
    for limit, field, step, out in (
        (args.max_batch, "batch_size", batch_step, found.by_batch),
        (args.max_seq, "seq_len", args.seq_step, found.by_seq),
    ):
        if limit is None:
            continue
        print(f"# {d}: searching the largest {field} <= {limit} ...", flush=True)
        size, rec = largest_size(
            cfg, tc, mesh, capacity, field=field, step=step, limit=limit, log=print
        )
        rep = None
        if size is not None:
            at = dataclasses.replace(tc, **{field: size})
            rep = plan_remat(cfg, at, mesh, capacity)
            found.notes.extend(replan_notes(rep, f"batch {at.batch_size} x seq {at.seq_len}"))
        out.append(LargestSize(d, size, rec, rep))


def main(argv=None) -> int:
    """Print the plans; 0 if something fits, 1 (with a line on stderr) if nothing does: no
    dispatcher's step fits at --batch x --seq and no searched size fits either."""
    args = _parse(argv)
    capacity = int(parse_memory(args.memory) * args.usable)
    over = parse_overrides(args.overrides)
    sizes = {"batch_size": ("--batch", args.batch), "seq_len": ("--seq", args.seq)}
    tc = sized_train_config(over, sizes)  # takes the trainer keys out of `over`
    dispatchers = planned_dispatchers(args.dispatchers, over)
    sizes, mesh, where = _mesh(args, tc)
    batch_step = math.prod(n for a, n in sizes.items() if a in remat.costs.BATCH_AXES)
    found = Findings()
    for i, d in enumerate(dispatchers):
        cfg = load_config(
            args.config,
            expert_size=train_mesh.expert_size(sizes),
            dispatcher=d,
            other_keys={"trainer": TRAIN_FIELDS},
            **over,
        )
        train_mesh.check(sizes, cfg, tc.batch_size, tc.seq_len, tc.mesh)
        if i == 0:  # the same model for every dispatcher
            args.max_seq = _check_lengths(args, cfg, found)
        found.rings.append(expert_parallelism(cfg, mesh))
        if cfg.attention_impl == "chunked":
            found.note_once(
                "while loop",
                "chunked attention: XLA's cost_analysis counts a while loop's body "
                "once, so its column sees one key block of the attention; the formula "
                "column counts them all",
            )
        label = options_label(cfg.moe.options.applicable())
        _plan_dispatcher(label, cfg, tc, mesh, capacity, args, batch_step, found)
    head = (
        f"{args.config}, mesh {dict(mesh.shape)}, {tc.compute_dtype}, usable memory "
        f"{capacity / 2**20:,.1f} MiB per device ({args.usable:g} x {args.memory}); {where}"
    )
    print(summary(head, tc, found))
    if not found.anything_fits():
        print(
            f"error: nothing fits in {capacity / 2**20:,.1f} MiB per device ({args.usable:g} x "
            f"{args.memory}) at batch {tc.batch_size} x seq {tc.seq_len}"
            + (" nor at any size searched" if found.by_batch or found.by_seq else ""),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    use_cpu_devices(8)  # the emulated mesh, unless XLA_FLAGS sets a device count
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, gpu_mesh.PluginMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
