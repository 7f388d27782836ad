"""Run identity: what a run's checkpoints were trained with, checked when the run resumes.

Every checkpoint's JSON metadata records

* `model_config`: every `ModelConfig` key in the flat form (`ModelConfig.as_dict`: the YAML
  keys) as resolved (the YAML file plus the key=value overrides);
* `train_config`: the trainer settings (`TrainConfig`), `schedule_steps` resolved to the cosine
  horizon the run uses (see "Schedule");
* `data`: what the data source records (`train.data.Source.identity`): a prepared dataset's
  directory and the sha256 of its manifest.json (which holds every shard's sha256 and the
  tokenizer's), or each text file's path and sha256 (in order: the order changes the packing)
  and the tokenizer (the tokenizer.json's path and sha256, or null for the byte-level one),
  either with `"loader"`, how rows are packed (`train.data.loader.PACKING`: checkpoints of the
  trainer's earlier text packing, without it, read other rows), or `{"synthetic": true}`.
* `init`: the weights the run started from: null (random, seeded), or a Hugging Face checkpoint
  (`--init-from-hf`: its path and a sha256 of its content, `train.hf.init.source_identity`).

A rerun on the same --out compares them, key by key, with its own (the checkpoint it restores;
nothing is checked when it has nothing left to train):

* **math changes are refused**, in one line naming each key old -> new and the flag that
  overrides it (`--allow-changes key1,key2`): any other model field (sizes, top-k, router losses,
  rope_theta, initializer_range ...), any other trainer field (batch, grad_accum, sequence,
  optimizer, schedule, seed, synthetic, compute_dtype), the data (by content: a moved file with
  the same bytes is the same data), the tokenizer and `init` (another checkpoint, by content);
* **same-math changes are allowed**: logged in one line, recorded on the first metrics line
  after the resume (`"resume_changes"`), marked on loss.png. They change how the step is
  computed, not what it computes (the same math up to float rounding: summation order):
  `routing`, `ring` (flat or hierarchical: the same pairs, another transfer order),
  `chunk_size`, `gmm_impl`, `attention_impl` and `attention_block_k` (the chunked attention is
  the same softmax, online), `context_layout` (the same tokens in another order over the
  devices), `attention_remat`, `moe_remat` (recomputation is exact),
  `offload_layer_inputs` and `offload_optimizer` (values moved to host memory, not changed),
  `max_position_embeddings` (a bound on seq_len), `loss_chunk`, `save_every`, and the held-out
  evaluation's `eval_every`, `eval_batches` and `--eval-data` (recorded as `eval_data`: the
  dataset's path and manifest sha256; evaluation never changes training); the `dispatcher`
  and `capacity_factor` as long as nothing is dropped on either side (ring, reference and the
  all-to-all with capacity_factor null are all dropless; the all-to-all with a capacity factor
  drops (token, expert) pairs, so a change into, out of or between capacities is a math
  change), and the `mesh` likewise (an all-to-all capacity is per device);
* **`scan_layers` is refused, override or not**: it changes the parameter layout (the layers
  stacked on one axis), so the checkpoint cannot be restored across it.

Changes allowed with --allow-changes are logged, recorded and marked like the same-math ones.
A checkpoint written before identities were recorded (no `model_config`) resumes with a one-line
warning; its trainer settings (always saved) are still checked. A model key added since a
checkpoint was written (the router, activation and bias keys of the MoE block) is compared as its
default: the checkpoint was trained with it.

Schedule: the cosine horizon is `schedule_steps` if set, else the run's --steps (never shorter
than warmup_steps + 1). It is recorded, so a resume with another --steps and no schedule_steps
is a math change (`schedule_steps` old -> new): add `schedule_steps=<old>` to keep the
checkpoint's schedule, or `--allow-changes schedule_steps` to switch (the lr moves onto the new
cosine from the next step on). A horizon shorter than --steps is allowed with a warning naming
the step from which the lr stays at its floor `lr * min_lr_ratio`. The warmup starts at lr 0
(step 1), so `--steps 1` with a warmup would train nothing: a warning says so and names
`warmup_steps=0`.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from relaymoe_jax.models.config import KEYS, ModelConfig

from ..settings import RunSettings, TrainConfig
from ..step.optimizer import make_schedule, schedule_horizon
from . import checkpoint as ckpt
from . import shapes

ALLOW_FLAG = "--allow-changes"
DATA_KEYS = ("data", "tokenizer", "init")
# same math up to float rounding (see the module docstring)
SAME_MATH = frozenset(
    {
        "routing",
        "ring",
        "chunk_size",
        "gmm_impl",
        "attention_impl",
        "attention_block_k",
        "context_layout",
        "attention_remat",
        "moe_remat",
        "offload_layer_inputs",
        "offload_optimizer",
        "max_position_embeddings",
        "loss_chunk",
        "save_every",
        "eval_every",  # the held-out evaluation (train.step.evaluate) never changes training
        "eval_batches",
    }
)
DROP_KEYS = frozenset({"dispatcher", "capacity_factor", "mesh"})  # same math while dropless
LAYOUT_KEYS = frozenset({"scan_layers"})
MODEL_FIELDS = KEYS  # the flat form: the op's options are keys like the others
TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


class ResumeRefusedError(ckpt.StateMismatchError):
    """Resuming would change what the run computes, or cannot restore the checkpoint's layout."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        ALLOW_FLAG,
        action="append",
        default=[],
        metavar="KEY[,KEY...]",
        help="resume even though these settings differ from the checkpoint's "
        "(model config or trainer keys, 'data', 'tokenizer', 'init'). Without it a "
        "resume that changes the math (top-k, lr, data, the schedule's horizon, "
        "...) is refused; same-math changes (ring <-> dropless alltoall, "
        "routing, remat, chunk sizes) are always allowed and logged. The cosine "
        "horizon is schedule_steps if set, else --steps, and is recorded: a "
        "resume with another --steps needs schedule_steps=<old> (keep) or "
        f"{ALLOW_FLAG} schedule_steps (switch)",
    )


def allowed_keys(items) -> frozenset:
    """The keys of the repeatable, comma-separated `--allow-changes` values (checked)."""
    keys = {k.strip() for item in items or () for k in item.split(",") if k.strip()}
    unknown = sorted(keys - set(MODEL_FIELDS) - set(TRAIN_FIELDS) - set(DATA_KEYS))
    if unknown:
        raise ValueError(
            f"{ALLOW_FLAG}: unknown key(s) {unknown}; expected model config or "
            f"trainer keys, 'data', 'tokenizer' or 'init'"
        )
    return frozenset(keys)


def json_value(x):
    """`x` as it reads back from JSON (tuples become lists): how the metadata holds it."""
    return json.loads(json.dumps(x))


def _fmt(v) -> str:
    """A value as written on the command line (key=value, YAML)."""
    if isinstance(v, str):
        return v
    return json.dumps(v, separators=(",", ":"))


def _drops(model: dict) -> float | None:
    """The all-to-all's capacity factor (pairs are dropped), None when dropless."""
    return model.get("capacity_factor") if model.get("dispatcher") == "alltoall" else None


def _files(d: dict) -> str:
    """The data of a data identity (`Source.identity`), in a few words."""
    if "dataset" in d:
        text = f"{d['dataset']['path']} (manifest sha256 {d['dataset']['manifest_sha256'][:12]})"
    else:
        text = " + ".join(f"{Path(f['path']).name} (sha256 {f['sha256'][:12]})" for f in d["files"])
    return text if d.get("loader") else f"{text} (the earlier text packing)"


def _content(d: dict):
    """What decides the rows a data identity (`Source.identity`) reads."""
    if "dataset" in d:
        return ("dataset", d["dataset"]["manifest_sha256"], d.get("loader"))
    return ("files", [f["sha256"] for f in d["files"]], d.get("loader"))


def _tokenizer(d: dict) -> str:
    t = d.get("tokenizer")
    return "byte-level" if t is None else f"{Path(t['path']).name} (sha256 {t['sha256'][:12]})"


@dataclasses.dataclass
class Change:
    key: str
    old: object
    new: object
    same_math: bool
    layout: bool = False

    def text(self) -> str:
        return f"{self.key} {_fmt(self.old)} -> {_fmt(self.new)}"

    def record(self) -> dict:
        return {"key": self.key, "old": self.old, "new": self.new, "same_math": self.same_math}


def compare(meta: dict, model: dict, train: dict, data: dict) -> list[Change]:
    """The changes from the checkpoint metadata `meta` to this run's identity, classified (see
    the module docstring). A model key the checkpoint did not record (one added since it was
    written, e.g. `router`) had its default; the trainer keys it did not record are not
    compared."""
    changes = []
    old_m = meta.get("model_config")
    defaults = json_value(ModelConfig().as_dict())
    old_drops = _drops(old_m) if old_m is not None else _drops(model)
    dropless = old_drops is None and _drops(model) is None
    if old_m is not None:
        for k in MODEL_FIELDS:
            o, n = old_m.get(k, defaults[k]), model[k]
            if o != n:
                same = k in SAME_MATH or (k in DROP_KEYS and old_drops == _drops(model))
                changes.append(Change(k, o, n, same, layout=k in LAYOUT_KEYS))
    old_t = meta.get("train_config") or {}
    for k in TRAIN_FIELDS:
        if k in old_t and old_t[k] != train[k]:
            same = k in SAME_MATH or (k in DROP_KEYS and dropless)
            changes.append(Change(k, old_t[k], train[k], same))
    old_d = meta.get("data")
    if old_d is not None and "synthetic" not in old_d and "synthetic" not in data:
        if _content(old_d) != _content(data):
            changes.append(Change("data", _files(old_d), _files(data), False))
        if (old_d.get("tokenizer") or {}).get("sha256") != (data.get("tokenizer") or {}).get(
            "sha256"
        ):
            changes.append(Change("tokenizer", _tokenizer(old_d), _tokenizer(data), False))
    return changes


def _init_change(old: dict | None, new: dict | None) -> list[Change]:
    """The `init` change (the weights the run started from: random, or a Hugging Face
    checkpoint, compared by content) between a checkpoint's and this run's, as a list."""
    sha = lambda d: None if d is None else d.get("sha256")
    if sha(old) == sha(new):
        return []
    name = lambda d: "random" if d is None else f"{d['path']} (sha256 {d['sha256'][:12]})"
    return [Change("init", name(old), name(new), False)]


def _eval_change(meta: dict, new: dict | None) -> list[Change]:
    """The held-out evaluation data's change (`--eval-data`, `step.evaluate`: by its manifest's
    sha256), same math: it never changes training. Checkpoints that did not record it: none."""
    if "eval_data" not in meta:
        return []
    old, sha = meta["eval_data"], lambda d: None if d is None else d.get("manifest_sha256")
    if sha(old) == sha(new):
        return []
    name = lambda d: "none" if d is None else f"{d['path']} (manifest sha256 {sha(d)[:12]})"
    return [Change("eval_data", name(old), name(new), True)]


class RunIdentity:
    """This run's identity (`meta`, saved with every checkpoint) and the resume check
    (`check`, the `check_meta` hook of `train.state.checkpoint.restore`). `data`: what the data
    source records (`train.data.Source.identity`)."""

    def __init__(
        self,
        cfg,
        tc: TrainConfig,
        *,
        steps: int,
        data: dict,
        allow=frozenset(),
        explicit_schedule: bool = True,
        out=None,
        init: dict | None = None,
    ):
        self.model = json_value(cfg.as_dict())
        self.train = json_value(dataclasses.asdict(tc))
        self.data = data
        self.meta = {"model_config": self.model, "train_config": self.train, "data": self.data}
        self.meta["init"] = init  # --init-from-hf: the checkpoint's path and sha256 (train.hf.init)
        self.steps, self.allow, self.explicit_schedule = steps, frozenset(allow), explicit_schedule
        self.out = out
        self._lr = np.asarray(make_schedule(tc)(np.arange(steps)), np.float64)
        self.resumed_at: int | None = None
        self.changes: list[Change] = []
        self.notes: list[str] = []

    def check(self, meta: dict) -> None:
        """Refuses (`ResumeRefusedError`, one line) to resume from the checkpoint of `meta` if
        the math would change; else keeps the accepted changes and notes for `report`."""
        step = meta.get("step")
        self.resumed_at, self.changes, self.notes = step, [], []
        if step is not None and step >= self.steps:
            return  # nothing left to train
        where = f"{self.out} at step {step}" if self.out is not None else f"step {step}"
        changes = compare(meta, self.model, self.train, self.data) + _init_change(
            meta.get("init"), self.meta["init"]
        )
        changes += _eval_change(meta, self.meta.get("eval_data"))
        layout = [c for c in changes if c.layout]
        if layout:
            raise ResumeRefusedError(
                f"cannot resume {where}: {', '.join(c.text() for c in layout)} changes the "
                f"parameter layout (the layers stacked on one axis), so the checkpoint cannot be "
                f"restored with it; keep {layout[0].key}={_fmt(layout[0].old)} or use a new --out"
            )
        math_keys = [c for c in changes if c.key in MODEL_FIELDS and not c.same_math]
        shaped = shapes.shape_changes(self.model, math_keys)
        if shaped:
            raise ResumeRefusedError(
                f"cannot resume {where}: {', '.join(c.text() for c in shaped)} changes the "
                f"parameters' shapes, so the checkpoint cannot be restored with it (no "
                f"{ALLOW_FLAG} can); keep {shaped[0].key}={_fmt(shaped[0].old)} or use a new "
                f"--out"
            )
        refused = [c for c in changes if not c.same_math and c.key not in self.allow]
        if refused:
            keys = ",".join(c.key for c in refused)
            hint = ""
            sched = next((c for c in refused if c.key == "schedule_steps"), None)
            if sched is not None and not self.explicit_schedule:
                hint = (
                    f" (the cosine horizon follows --steps unless schedule_steps is set: add "
                    f"schedule_steps={_fmt(sched.old)} to keep the checkpoint's schedule)"
                )
            raise ResumeRefusedError(
                f"cannot resume {where}: {', '.join(c.text() for c in refused)} would change "
                f"the math{hint}; rerun with {ALLOW_FLAG} {keys} to resume anyway, or use a new "
                f"--out"
            )
        self.changes = changes
        if "model_config" not in meta:
            what = "its trainer settings are" if meta.get("train_config") else "nothing is"
            self.notes.append(
                f"warning: checkpoint step {step} was written by an older trainer "
                f"that did not record its model config and data: those cannot be "
                f"checked ({what})"
            )
        if changes:
            self.notes.append(
                f"resuming from step {step} with changed settings: "
                + "; ".join(
                    c.text() + (" (same math)" if c.same_math else f" (allowed by {ALLOW_FLAG})")
                    for c in changes
                )
            )

    def add_eval_data(self, eval_data: dict | None) -> None:
        """Record the held-out evaluation data (`train.step.evaluate.identity`) in the metadata."""
        self.meta["eval_data"] = eval_data

    def report(self, log) -> None:
        """Logs the notes of the last `check` (a warning and/or the accepted changes)."""
        for line in self.notes:
            log(line)

    def extra(self, step: int) -> dict:
        """The metrics fields this module adds to step `step`'s line: "lr" (the learning rate
        that step's update used) and, on the first step after a resume with changes,
        "resume_changes" (a list of {"key", "old", "new", "same_math"})."""
        rec = {"lr": float(self._lr[step - 1])}
        if self.changes and step == (self.resumed_at or 0) + 1:
            rec["resume_changes"] = [c.record() for c in self.changes]
        return rec


def of_run(
    run: RunSettings, data: dict, log=print, init: dict | None = None
) -> tuple[RunSettings, RunIdentity]:
    """(settings, RunIdentity) for `run` training on `data` (the data source's identity,
    `train.data.Source.identity`): its `train.schedule_steps` resolved to the horizon
    (`optimizer.schedule_horizon`), with a warning if the lr will sit at its floor before the
    end; its `--allow-changes` keys read (checked)."""
    tc = run.train
    explicit = tc.schedule_steps is not None
    if explicit and tc.schedule_steps < 1:
        raise ValueError(
            f"schedule_steps={tc.schedule_steps}: expected an int >= 1 (or unset: follow --steps)"
        )
    allow = allowed_keys(run.allow_changes)
    tc = dataclasses.replace(tc, schedule_steps=schedule_horizon(tc, run.steps))
    if tc.schedule_steps < run.steps:
        log(
            f"warning: schedule_steps={tc.schedule_steps} < --steps {run.steps}: the lr "
            f"reaches its floor {tc.lr * tc.min_lr_ratio:.3g} (lr * min_lr_ratio) at step "
            f"{tc.schedule_steps + 1} and stays there for the last "
            f"{run.steps - tc.schedule_steps} steps"
        )
    if run.steps == 1 and tc.lr > 0 and float(make_schedule(tc)(0)) == 0:
        log(
            f"warning: --steps 1 with warmup_steps={tc.warmup_steps}: the warmup starts at lr 0, "
            f"so the only step's optimizer update is zero and the weights stay as initialised; "
            f"add warmup_steps=0 to train it at lr={tc.lr:g}"
        )
    identity = RunIdentity(
        run.model,
        tc,
        steps=run.steps,
        data=data,
        allow=allow,
        explicit_schedule=explicit,
        out=run.out,
        init=init,
    )
    return run.replace(train=tc), identity
