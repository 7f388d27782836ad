"""The trainer's settings, typed: `TrainConfig` (the trainer fields, set by `key=value` or
`--flag`) and `RunSettings` (one run of `python -m train` as its command line asks, what
`train.cli.parse` returns and `train.run.loop` executes).

The model's settings are the `ModelConfig` of the YAML file (`relaymoe_jax.models`), which
validates its own fields (the op's options through `relaymoe_jax.op.MoEOptions`).
"""

import dataclasses
import math
import typing
from collections.abc import Mapping
from pathlib import Path

import jax

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.loss import DEFAULT_CHUNK
from relaymoe_jax.op.options import DEFAULTS as OPTION_DEFAULTS
from relaymoe_jax.op.options import USED_BY
from relaymoe_jax.util.checks import one_of

ComputeDtype = typing.Literal["float32", "bfloat16"]
COMPUTE_DTYPES: tuple[str, ...] = typing.get_args(ComputeDtype)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Trainer settings (model settings are the `ModelConfig` of the YAML file)."""

    batch_size: int = 8
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step (train.step.accumulate)
    seq_len: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    schedule_steps: int | None = None  # cosine horizon; None: the run's --steps (state.identity)
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    seed: int = 0
    save_every: int = 100
    synthetic: bool = False
    mesh: str = "expert=-1"  # train.step.mesh: e.g. "data=2,expert=4", "fsdp=2,expert=4"
    compute_dtype: ComputeDtype = "float32"  # "bfloat16": bf16 compute, float32 master weights
    loss_chunk: int = DEFAULT_CHUNK  # tokens per device per LM-head chunk (models/loss.py)
    # the float32 master weights and the AdamW moments in pinned host memory between steps,
    # streamed to the device layer by layer for the update (train.step.train_step, docs/planning.md)
    offload_optimizer: bool = False
    # held-out evaluation on --eval-data (train.step.evaluate): every N steps and at the last step
    # (unset: the last step only), over eval_batches batches of batch_size rows
    eval_every: int | None = None
    eval_batches: int = 4


TRAIN_FIELDS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}

# The trainer fields the compiled train step never reads: what a run does around the step (the
# initial weights' seed, when to checkpoint, the data source, the held-out evaluation, which is
# a program of its own), so that no value of them changes the step's program or its memory. The
# one table of them: the memoised step's key leaves them out (`train_step.step_key`) and the
# planner, which measures the step's memory, refuses them (`train.planner.args`). The optimizer's
# values (lr, its schedule, b1, b2, weight_decay, clip_norm) are not here: they are constants of
# the step's program, and some values change it (optax skips a weight decay of 0).
RUN_ONLY_FIELDS = frozenset({"seed", "save_every", "synthetic", "eval_every", "eval_batches"})

_finite = math.isfinite
# what each numeric trainer field must satisfy (a value outside is refused, never clamped)
RANGES = {
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "grad_accum": (lambda v: v >= 1, ">= 1 (micro-batches per optimizer step)"),
    "seq_len": (lambda v: v >= 2, ">= 2"),
    "lr": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "warmup_steps": (lambda v: v >= 0, ">= 0"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "clip_norm": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "seed": (lambda v: v >= 0, ">= 0"),
    "save_every": (lambda v: v >= 1, ">= 1"),
    "loss_chunk": (lambda v: v >= 1, ">= 1 (tokens per device per chunk)"),
    "eval_every": (lambda v: v is None or v >= 1, ">= 1 (steps between evaluations)"),
    "eval_batches": (lambda v: v >= 1, ">= 1 (batches per evaluation)"),
}


def field_type(f: dataclasses.Field) -> type:
    """The value type of a TrainConfig field: `int` for `int | None` (None then means "unset"),
    `str` for a Literal of names."""
    t = {"int": int, "float": float, "bool": bool, "str": str}.get(f.type, f.type)
    if typing.get_origin(t) is typing.Literal:  # names: a str
        return type(typing.get_args(t)[0])
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if len(args) == 1 else t


def checked_train_config(values: Mapping) -> TrainConfig:
    """The TrainConfig of `values` (trainer fields only), each value checked against its
    field's type (an int is taken for a float, None only where the default is None: unset) and
    range (`RANGES`); ValueError naming the field otherwise."""
    kw = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in values:
            continue
        v, want = values[f.name], field_type(f)
        if v is None and f.default is None:  # unset (schedule_steps: follow --steps)
            pass
        elif want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ValueError(f"trainer option {f.name}={v!r}: expected {want.__name__}")
        ok, expected = RANGES.get(f.name, (None, None))
        if ok is not None and not ok(v):
            raise ValueError(f"trainer option {f.name}={v!r}: expected {expected}")
        kw[f.name] = v
    tc = TrainConfig(**kw)
    one_of("compute_dtype", tc.compute_dtype, COMPUTE_DTYPES)  # the one check of it
    return tc


def sized_train_config(over: dict, sizes: Mapping[str, tuple[str, int]]) -> TrainConfig:
    """The trainer fields of the key=value items `over` (taken out of it), checked as
    `checked_train_config` does, with the fields `sizes` ({field: (its flag, value)}, e.g. the
    planner's --batch and --seq) set by their flags; ValueError for a size given as key=value
    too."""
    values = {k: over.pop(k) for k in list(over) if k in TRAIN_FIELDS}
    for field, (flag, value) in sizes.items():
        if field in values:
            raise ValueError(f"{field}={values[field]!r}: set it with {flag} (here {value})")
        values[field] = value
    return checked_train_config(values)


def check_options_used(over: Mapping, steps: Mapping[str, tuple], runs: str, fix: str) -> None:
    """ValueError for an op option given on the command line (a key of `over`, away from its
    default) that no step the command compiles uses. `steps`: {dispatcher: the option keys that
    step sets itself} of each step compiled (the trained one, the --memory-table's rows, the
    planner's dispatchers); an option is used by a dispatcher by `MoEOptions`' one table
    (`USED_BY`). `runs` says what the command compiles, `fix` how to add a dispatcher that uses
    it. A config file may still hold every option (one file for several dispatchers)."""
    for key, value in over.items():
        if key not in USED_BY or value == OPTION_DEFAULTS[key]:
            continue
        if any(d in USED_BY[key] and key not in own for d, own in steps.items()):
            continue
        users = USED_BY[key]
        who = " or ".join(f"dispatcher={u!r}" for u in users)
        raise ValueError(
            f"{key}={value!r} applies to {who} only, and {runs}: it would be ignored; drop it "
            f"or {fix.format(users[0])}"
        )


def check_offload(cfg, tc: TrainConfig, device) -> None:
    """ValueError, one line, for an offload setting (`offload_optimizer`, the model's
    `offload_layer_inputs`) this model or `device`'s backend cannot honour. An abstract device of
    a deviceless compile lists no memories: XLA's compile decides there."""
    if tc.offload_optimizer and not cfg.scan_layers:
        raise ValueError(
            "offload_optimizer=true streams the update one decoder layer at a time over the "
            "stacked layers: it needs scan_layers=true"
        )
    asked = [
        k
        for k, on in [
            ("offload_optimizer", tc.offload_optimizer),
            ("offload_layer_inputs", cfg.offload_layer_inputs),
        ]
        if on
    ]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        kinds = set()
    if asked and kinds and "pinned_host" not in kinds:
        raise ValueError(
            f"{asked[0]}=true needs 'pinned_host' memory, which these {device.platform} devices "
            f"do not have (their memories: {sorted(kinds)}); drop {' and '.join(asked)}"
        )


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One run of the trainer, as parsed and checked from its command line."""

    config: str  # --config as given: a path or a shipped config's name
    steps: int  # --steps: train until this step
    out: Path  # --out: the run directory
    train: TrainConfig
    model: ModelConfig  # the YAML file with its key=value overrides
    data: tuple[str, ...] | None = None  # --data files; None: the shipped text
    tokenizer: Path | None = None  # --tokenizer: a tokenizer.json; None: byte-level
    eval_data: Path | None = None  # --eval-data: a prepared dataset to evaluate on
    quiet: bool = False  # --quiet: no per-step line
    memory_table: bool = False  # --memory-table
    force: bool = False  # --force: skip the memory check
    allow_changes: tuple[str, ...] = ()  # --allow-changes items, as given (train.state.identity)
    init_from_hf: Path | None = None  # --init-from-hf: a Hugging Face checkpoint (train.hf.init)
    profile_steps: tuple[int, int] | None = None  # --profile-steps A:B (train.run.profile)

    def replace(self, **changes) -> "RunSettings":
        return dataclasses.replace(self, **changes)
