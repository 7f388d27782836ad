"""Compile-only planning of attention recomputation (paper §3.4), per dispatcher.

    python -m train.planner --config configs/tiny.yaml --memory H100 --batch 8 --seq 256 \
        [--max-batch LIMIT] [--max-seq LIMIT] [k=v ...]
    python -m train.planner --config configs/qwen3-30b-a3b.yaml --target h100 --batch 8 \
        --seq 4096 compute_dtype=bfloat16 [k=v ...]

For a model config, a mesh (`mesh=`, as in `python -m train`), a micro-batch and sequence length,
a device memory (`--memory`: H100, H200, or a size such as 80GiB / 12.5MB / 1e9) and a host
memory per device (`--host-memory`, below), for each dispatcher:

1. compile (never run) the train step with every attention block fully recomputed and read its
   per-device peak from XLA's buffer assignment (`memory_analysis()`: arguments + temporaries +
   outputs not aliased to donated arguments); the budget is the usable memory minus that peak.
   Its host bytes (pinned host memory: `offload_optimizer`'s train state, `offload_layer_inputs`'
   residuals; `memory.host_footprint`) must fit the usable `--host-memory` as well;
2. choose one option per layer with the greedy c/m solver (`relaymoe_jax.remat`);
3. compile the planned step and check its peak fits (else plan again within less: `plan_remat`);
   report the FLOPs it no longer recomputes, from `cost_analysis()` (full minus planned);
4. with `--max-batch` / `--max-seq`, find the largest micro-batch at `--seq` / sequence length at
   `--batch` (never past the model's `max_position_embeddings`, nor is `--seq`) whose fully
   recomputed step fits, device and host (`search`: doubling then bisection, one compile
   per probe), and plan the remat at that size.

A step fits when its device bytes fit `--usable` x `--memory` and its host bytes fit `--usable` x
`--host-memory` (default: the per-GPU share of an 8-GPU `--target` node's RAM, 2 TiB / 8 =
256 GiB for H100 and H200, the H100 node's without `--target`; `args.host_memory`); a row
that does not says which memory it overflows. With `offload_layer_inputs` every layer stays
`full` (the config requires it), so the plan is all `full` whatever the budget.

The dispatchers: `--dispatchers` (default ring,alltoall) or `dispatcher=X` alone
(`args.planned_dispatchers`); each table row names its options (`memory.options_label`:
"alltoall (capacity 1.0)"), and an op option on the command line that none of them uses is
refused before compiling, as the trainer refuses it (`settings.check_options_used`).

The header says, per dispatcher, over which mesh axes the experts are spread and, for the ring,
which ring runs (`ring=`: flat or hierarchical, with the reason when `ring=auto` picks flat;
`relaymoe_jax.op.topology`). Without `--target` every emulated device is process 0, so `auto` is
flat there.

Exit status 0 when something fits (device and host), 1 when nothing does (no dispatcher at
--batch x --seq and no searched size; said on stderr after the tables) or on an error, 2 for bad
arguments.

Without `--target` the budget is measured on XLA:CPU with the emulated mesh. GPU buffer
assignment differs (other fusions, cuDNN attention without [S, S] scores, allocator
fragmentation, the CUDA context and XLA's preallocation: jax takes 75% of the GPU unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise, hence `--usable`, default 0.9); treat the CPU
figures as a model, not a promise.

With `--target h100|h200` every step is compiled by the XLA:GPU compiler for abstract GPUs
(`relaymoe_jax.gpu_mesh`, the `gpu-compile` extra; no GPU needed): `--hosts` hosts of 8 GPUs,
`mesh=` over all of them, laid out host-major (`--hosts 2 mesh=node=2,expert=8`: experts over
both hosts, `node` across them and `expert` within each), `--memory` defaulting to the target's,
and the grouped matmul `gmm_impl="auto"`'s (our Mosaic GPU kernel at bf16, the Triton one at
float32; a `gmm_impl=` setting names another). That is the GPU compiler's own buffer assignment;
still no timing, and the GPU compiler gives no `cost_analysis()`, so the FLOPs saved come from
the solver's formula only.
"""

import dataclasses
import math
import sys

import jax

from relaymoe_jax import remat
from relaymoe_jax.analysis import gpu_mesh
from relaymoe_jax.cli.argtypes import positive_int as positive_int  # benchmarks/capacity.py
from relaymoe_jax.cli.devices import use_cpu_devices
from relaymoe_jax.models.config_files import load_config, parse_overrides

from ..settings import TRAIN_FIELDS, TrainConfig, sized_train_config
from ..step import flops, train_step
from ..step import mesh as train_mesh
from . import args as planner_args
from . import predict, search
from .args import SEQ_STEP as SEQ_STEP
from .args import parse_memory as parse_memory
from .args import planned_dispatchers
from .memory import footprint, host_footprint, options_label
from .report import (
    Findings,
    LargestSize,
    Misfit,
    config_notes,
    expert_parallelism,
    host_pool_note,
    replan_notes,
    summary,
)


@dataclasses.dataclass(frozen=True)
class StepCost:
    peak: int  # device bytes per device (memory.footprint)
    flops: float | None  # cost_analysis()["flops"] of the whole step, per device; None when the
    # compiler gives none (XLA:GPU without a device)
    state: int | None = None  # device bytes of the step's arguments: the train state on the device
    host: int = 0  # host bytes per device (memory.host_footprint): offloaded state and residuals
    host_state: int | None = None  # host bytes of the step's arguments: the offloaded train state

    @classmethod
    def of(cls, compiled) -> "StepCost":
        """The cost of a compiled program: its `memory_analysis()` and `cost_analysis()`."""
        cost, m = compiled.cost_analysis(), compiled.memory_analysis()
        flops = cost["flops"] if cost else None
        args, host_args = m.argument_size_in_bytes, m.host_argument_size_in_bytes
        return cls(footprint(m), flops, args, host_footprint(m), host_args)


def step_cost(cfg, tc: TrainConfig, mesh, memo: bool = True) -> StepCost:
    """Compile (not run) the train step of `cfg` and `tc` on `mesh`
    (`train_step.compile_abstract`), under `mesh` as the context mesh (an abstract GPU mesh needs
    it for the GPU kernels)."""
    with jax.set_mesh(mesh):
        return StepCost.of(train_step.compile_abstract(cfg, tc, mesh, memo))


class DoesNotFit(ValueError):
    """The fully recomputed step (`cost`) overflows `over` ("device memory", "host memory" or
    both: `search.overflow`)."""

    def __init__(self, message: str, cost: StepCost, over: str):
        super().__init__(message)
        self.cost, self.over = cost, over


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
    host_capacity: int | None = None,
):
    """(largest batch_size or seq_len (`field`), a multiple of `step` up to `limit`, whose fully
    recomputed step fits `capacity` device bytes and `host_capacity` host bytes (None: the host
    is not checked), or None; the `search.Search` record). A sequence never goes past the
    model's `max_position_embeddings` (the record's `limit` is then that bound): a longer one is
    not one the model takes."""
    full = dataclasses.replace(cfg, attention_remat="full")
    if field == "seq_len":
        limit = min(limit, cfg.max_position_embeddings)

    def peak(n: int) -> tuple[int, int]:
        c = step_cost(full, dataclasses.replace(tc, **{field: n}), mesh, memo=False)
        return c.peak, c.host

    return search.largest(peak, capacity, step, limit, log, host_capacity=host_capacity)


@dataclasses.dataclass(frozen=True)
class RematReport:
    dispatcher: str  # as the tables name it: memory.options_label ("alltoall (dropless)")
    capacity: int
    full: StepCost
    plan: remat.Plan
    planned: StepCost
    misses: tuple = ()  # (plan, compiled peak, its host bytes) of the plans that did not fit
    host_capacity: int | None = None  # host bytes the steps had to fit (None: not checked)

    @property
    def over(self) -> str:
        """The memory the planned step overflows (`search.overflow`): "" when it fits."""
        p = self.planned
        return search.overflow(p.peak, p.host, self.capacity, self.host_capacity)

    @property
    def fits(self) -> bool:
        return not self.over

    @property
    def flops_saved(self) -> float | None:
        if self.full.flops is None or self.planned.flops is None:
            return None
        return self.full.flops - self.planned.flops


REPLANS = 2  # plans tried again within less when the compiled one does not fit


def _does_not_fit(cfg, tc, full: StepCost, capacity: int, host_capacity: int | None) -> str:
    """Why the fully recomputed step `full` does not fit, or "" if it does."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    parts = []  # (what it needs, what there is)
    if full.peak > capacity:
        parts.append((f"{mib(full.peak)} MiB per device", f"{mib(capacity)} MiB available"))
    if host_capacity is not None and full.host > host_capacity:
        room = f"{mib(host_capacity)} MiB of host memory available (--host-memory)"
        parts.append((f"{mib(full.host)} MiB of host memory per device", room))
    if not parts:
        return ""
    need, room = zip(*parts)
    return (
        f"the train step needs {' and '.join(need)} with full attention recomputation, more "
        f"than the {' and the '.join(room)} (dispatcher={cfg.moe.options.dispatcher}, batch "
        f"{tc.batch_size}, seq {tc.seq_len}): nothing to plan"
    )


def plan_remat(
    cfg, tc: TrainConfig, mesh, capacity: int, host_capacity: int | None = None
) -> RematReport:
    """Steps 1-3 of the module docstring for `cfg` as given (its dispatcher). `DoesNotFit` (a
    ValueError) if the fully recomputed step does not fit `capacity` device bytes or
    `host_capacity` host bytes (None: not checked). XLA's buffer assignment is not exactly the
    fully recomputed peak plus the bytes the plan keeps: a planned step whose compiled peak is
    over `capacity` is planned again within its kept bytes less the overshoot (at most `REPLANS`
    times, then every layer `full`, which fits), each miss kept in `misses`; one over
    `host_capacity` is planned again with every layer `full`. With `offload_layer_inputs` every
    layer is `full` (the config requires it)."""
    full = step_cost(dataclasses.replace(cfg, attention_remat="full"), tc, mesh)
    why = _does_not_fit(cfg, tc, full, capacity, host_capacity)
    if why:
        raise DoesNotFit(why, full, search.overflow(full.peak, full.host, capacity, host_capacity))
    misses, budget = [], 0 if cfg.offload_layer_inputs else capacity - full.peak
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
        over = search.overflow(planned.peak, planned.host, capacity, host_capacity)
        if not over:
            d = options_label(cfg.moe.options.applicable())
            return RematReport(d, capacity, full, plan, planned, tuple(misses), host_capacity)
        misses.append((plan, planned.peak, planned.host))
        budget = 0 if "host" in over else max(0, plan.bytes - (planned.peak - capacity))


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


def _plan_dispatcher(d: str, cfg, tc, mesh, args, batch_step, found: Findings, kind: str):
    """Plan dispatcher `d` (`cfg`) at --batch x --seq (and predict its step time on a GPU of
    `kind`: `predict`) and, if asked, at the largest sizes."""
    print(f"# {d}: compiling the fully recomputed and the planned step ...", flush=True)
    room = (args.capacity, args.host_capacity)
    try:
        found.reports.append(plan_remat(cfg, tc, mesh, *room))
    except DoesNotFit as e:  # does not fit at this size: a row and a note say so, still search
        print(f"# {d}: {e}", flush=True)
        found.reports.append(Misfit(d, e.cost, e.over))
        found.notes.append(f"{d}: {e}")
    else:
        found.notes.extend(
            replan_notes(found.reports[-1], f"batch {tc.batch_size} x seq {tc.seq_len}")
        )
        if found.rates is not None:
            params = train_step.abstract_state(cfg, tc, mesh)[1].params
            options, shape = found.reports[-1].plan.options, dict(mesh.shape)
            found.predictions.append(
                (d, predict.predict(cfg, tc, shape, options, params, kind, found.rates))
            )
    for limit, field, step, out in (
        (args.max_batch, "batch_size", batch_step, found.by_batch),
        (args.max_seq, "seq_len", args.seq_step, found.by_seq),
    ):
        if limit is None:
            continue
        print(f"# {d}: searching the largest {field} <= {limit} ...", flush=True)
        size, rec = largest_size(
            cfg,
            tc,
            mesh,
            room[0],
            field=field,
            step=step,
            limit=limit,
            log=print,
            host_capacity=room[1],
        )
        rep = None
        if size is not None:
            at = dataclasses.replace(tc, **{field: size})
            rep = plan_remat(cfg, at, mesh, *room)
            found.notes.extend(replan_notes(rep, f"batch {at.batch_size} x seq {at.seq_len}"))
        out.append(LargestSize(d, size, rec, rep))


def main(argv=None) -> int:
    """Print the plans; 0 if something fits, 1 (with a line on stderr) if nothing does: no
    dispatcher's step fits (device and host memory) at --batch x --seq and no searched size
    fits either."""
    args = planner_args.parse(argv, __doc__.splitlines()[0])
    over = parse_overrides(args.overrides)
    planner_args.refuse_run_only(over)  # seed, save_every, ...: the step never reads them
    sizes = {"batch_size": ("--batch", args.batch), "seq_len": ("--seq", args.seq)}
    tc = sized_train_config(over, sizes)  # takes the trainer keys out of `over`
    dispatchers = planned_dispatchers(args.dispatchers, over)
    sizes, mesh, where = _mesh(args, tc)
    batch_step = math.prod(n for a, n in sizes.items() if a in remat.costs.BATCH_AXES)
    found = Findings()
    kind = gpu_mesh.device_kind(args.target) if args.target else jax.devices()[0].device_kind
    if flops.peak_tflops(kind) is not None:  # a GPU: its step time can be predicted
        found.rates = predict.Rates.load()
    for i, d in enumerate(dispatchers):
        cfg = load_config(
            args.config,
            expert_size=train_mesh.expert_size(sizes),
            dispatcher=d,
            other_keys={"trainer": TRAIN_FIELDS},
            **over,
        )
        compiles_for = "gpu" if args.target else jax.devices()[0].platform
        train_mesh.check(sizes, cfg, tc.batch_size, tc.seq_len, tc.mesh, compiles_for)
        if i == 0:  # the same model for every dispatcher
            args.max_seq = _check_lengths(args, cfg, found)
        found.rings.append(expert_parallelism(cfg, mesh))
        for marker, note in config_notes(cfg, tc, target=args.target is not None):
            found.note_once(marker, note)
        label = options_label(cfg.moe.options.applicable())
        _plan_dispatcher(label, cfg, tc, mesh, args, batch_step, found, kind)
    if found.host_used():
        found.notes.append(host_pool_note(args.target is not None))
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    room = f"{mib(args.capacity)} per device ({args.usable:g} x {args.memory})"
    host = f"{mib(args.host_capacity)} of host memory per device ({args.usable:g} x "
    host += f"{args.host_from})"
    head = f"{args.config}, mesh {dict(mesh.shape)}, {tc.compute_dtype}, usable memory {room}, "
    head += f"{host}; {where}"
    print(summary(head, tc, found))
    if not found.anything_fits():
        print(
            f"error: nothing fits in {room} at batch {tc.batch_size} x seq {tc.seq_len}"
            + (" nor at any size searched" if found.by_batch or found.by_seq else "")
            + f", with {host}",
            file=sys.stderr,
        )
        return 1
    return 0


def entry() -> None:
    """`python -m train.planner` (`train/planner/__main__.py`): 8 emulated CPU devices (unless
    XLA_FLAGS sets a device count), then `main`; an error is one line on stderr, exit status 1."""
    use_cpu_devices(8)  # the emulated mesh, unless XLA_FLAGS sets a device count
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, gpu_mesh.PluginMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
