"""Loss curves of trainer runs: `python -m train.run.plot OUT.png RUN [RUN ...] [--key K]
[--title T]` (`python -m train.plot` too).

Each RUN is a run directory (its `metrics.jsonl`), a metrics .jsonl file, or `LABEL=PATH`; without
a label a run is named after its directory (or after the file's stem if it is not called
metrics.jsonl). One line per run: x = "step", y = the key (default "loss"). Lines of a metrics
file that are not valid JSON, or lack "step" or the key, are skipped. Where a run resumed with
changed settings (a record with "resume_changes", `state.identity`), a dashed vertical line just
before that step is labelled with the changes. A run that evaluated on held-out data
(`--eval-data`, `train.step.evaluate`) also has its "eval_loss" points drawn beside its loss (key
"loss" or "lm_loss"), markers in the run's colour, a dotted line joining the points of one
evaluation set (a resume that changed the held-out data or `eval_batches` starts another; a
resume that changed only the evaluation's settings is not marked: training is the same). Drawn
with matplotlib's Agg canvas (no pyplot, no display, the global backend is left alone).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def metrics_file(src) -> Path:
    """The metrics.jsonl of a run directory, or `src` itself if it is a file."""
    p = Path(src)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"metrics file not found: {p}")
    return p


def read_records(src) -> list[dict]:
    """The records of a run: `src` as is if it is a list of dicts, else the JSON objects of the
    lines of its metrics file (lines that fail to parse are skipped)."""
    if isinstance(src, list):
        return src
    recs = []
    for line in metrics_file(src).read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            recs.append(r)
    return recs


def curves(runs: dict, key: str = "loss") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """label -> (steps, values) float64 arrays, sorted by step, of the records of each run that
    have both "step" and `key`. Raises ValueError naming a run that has none."""
    out = {}
    for label, src in runs.items():
        recs = [r for r in read_records(src) if "step" in r and key in r]
        pts = sorted(((r["step"], r[key]) for r in recs), key=lambda t: t[0])
        if not pts:
            raise ValueError(
                f"run {label!r} ({src if not isinstance(src, list) else 'records'}) "
                f"has no records with 'step' and {key!r}"
            )
        steps, vals = zip(*pts)
        out[label] = (np.asarray(steps, dtype=np.float64), np.asarray(vals, dtype=np.float64))
    return out


EVAL_KEY = "eval_loss"  # the held-out loss (train.step.evaluate), drawn beside these keys:
EVAL_BESIDE = ("loss", "lm_loss")
EVAL_CHANGES = ("eval_every", "eval_batches", "eval_data")  # not marked: training is the same
EVAL_SETS = ("eval_batches", "eval_data")  # a resume that changes one evaluates another set


def eval_curves(src, key: str = EVAL_KEY) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(steps, values) float64] of the records of a run that have `key` (the steps that
    evaluated), sorted by step, one curve per evaluation set: a resume that changed the held-out
    data or how many of its batches are evaluated (`EVAL_SETS`) starts a new curve, so points
    of different sets are not joined by a line. [] when it has none."""
    recs = [r for r in read_records(src) if "step" in r]
    cuts = sorted(
        r["step"]
        for r in recs
        if any(c.get("key") in EVAL_SETS for c in r.get("resume_changes") or [])
    )
    pieces: dict[int, list] = {}
    for step, value in sorted((r["step"], r[key]) for r in recs if key in r):
        pieces.setdefault(sum(c <= step for c in cuts), []).append((step, value))
    return [
        tuple(np.asarray(v, dtype=np.float64) for v in zip(*pts))
        for _, pts in sorted(pieces.items())
    ]


def changes(src) -> list[tuple[int, list[dict]]]:
    """(step, changes) of each resume with changed settings in a run, by step: the records'
    "resume_changes" lists of {"key", "old", "new", "same_math"}."""
    out = [
        (r["step"], r["resume_changes"])
        for r in read_records(src)
        if "step" in r and isinstance(r.get("resume_changes"), list)
    ]
    return sorted(out, key=lambda t: t[0])


def _short(v, limit: int = 32) -> str:
    """A value for a label, cut to `limit` characters (a rotated label longer than the axes
    collapses matplotlib's constrained layout): the data's file names and hashes are long."""
    text = v if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def change_text(step: int, chs: list[dict]) -> str:
    """`step 4: dispatcher ring -> alltoall, ...` (the label of a resume's vertical line)."""
    return f"step {step}: " + ", ".join(
        f"{c.get('key')} {_short(c.get('old'))} -> {_short(c.get('new'))}" for c in chs
    )


def dispatcher_label(src, current: str) -> str:
    """The curve's label: the dispatcher, or its history if a resume changed it, e.g.
    `ring -> alltoall (from step 4)`. `current` is used when the run records no change."""
    hist = [(s, c) for s, chs in changes(src) for c in chs if c.get("key") == "dispatcher"]
    if not hist:
        return current
    return " -> ".join(
        [str(hist[0][1].get("old"))] + [f"{c.get('new')} (from step {s})" for s, c in hist]
    )


def make_figure(runs: dict, *, key: str = "loss", title: str | None = None):
    """A matplotlib Figure (on an Agg canvas) with one line per run of `curves(runs, key)`,
    labelled by the run's name, and a labelled vertical line where a run resumed with changed
    settings (`changes`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, (steps, vals) in curves(runs, key).items():
        (line,) = ax.plot(steps, vals, label=label)
        for i, held in enumerate(eval_curves(runs[label]) if key in EVAL_BESIDE else []):
            name = f"{label}: held-out" if i == 0 else None  # one legend entry for its sets
            ax.plot(*held, marker="o", ls=":", color=line.get_color(), label=name)
        for step, chs in changes(runs[label]):
            chs = [c for c in chs if c.get("key") not in EVAL_CHANGES]  # training's curve only
            if not chs:
                continue
            ax.axvline(step - 0.5, color=line.get_color(), ls="--", lw=0.8)
            ax.text(
                step - 0.5,
                0.98,
                change_text(step, chs),
                rotation=90,
                ha="right",
                va="top",
                fontsize=7,
                color=line.get_color(),
                bbox=dict(facecolor="white", alpha=0.8, lw=0, pad=1),
                transform=ax.get_xaxis_transform(),
            )
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return fig


def plot_losses(runs: dict, out_png, *, key: str = "loss", title: str | None = None) -> Path:
    """Draws `key` against step for each run of `runs` (label -> run dir, metrics file or list of
    records) into the PNG `out_png` (parent folders are created); returns its Path."""
    out_png = Path(out_png)
    fig = make_figure(runs, key=key, title=title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png", dpi=120)
    return out_png


def load_matrix(src, key: str = "expert_overload") -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, [layers, steps] values) of the per-layer list `key` of a run's records (those
    that have it, by step; a resume's repeated steps keep the last record), or None if none has
    it (a dense model, a metrics file from before the load statistics)."""
    by_step = {r["step"]: r[key] for r in read_records(src) if "step" in r and r.get(key)}
    if not by_step:
        return None
    steps = np.array(sorted(by_step))
    layers = max(len(v) for v in by_step.values())
    m = np.full((layers, len(steps)), np.nan)
    for j, s in enumerate(steps):
        m[: len(by_step[s]), j] = by_step[s]
    return steps, m


def plot_expert_load(src, out_png, *, title: str | None = None) -> Path | None:
    """A heatmap of the overload factor (max / mean expert load) per MoE layer (rows) and step
    (columns) of one run into the PNG `out_png`; None (nothing written) without load lists."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    found = load_matrix(src)
    if found is None:
        return None
    steps, m = found
    fig = Figure(figsize=(7, 1.5 + 0.35 * m.shape[0]), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    extent = (steps[0] - 0.5, steps[-1] + 0.5, m.shape[0] - 0.5, -0.5)
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma", extent=extent)
    fig.colorbar(im, ax=ax, label="max / mean expert load")
    ax.set_xlabel("step")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(m.shape[0]))
    ax.set_title(title or "expert overload per layer")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png", dpi=120)
    return out_png


def parse_run(spec: str) -> tuple[str, Path]:
    """(label, path) of a command-line run `LABEL=PATH` or `PATH`."""
    label, eq, path = spec.partition("=")
    if eq and label and "/" not in label:
        return label, Path(path)
    p = Path(spec)
    if p.suffix == ".jsonl" and p.name != "metrics.jsonl":
        return p.stem, p
    return (p.parent if p.suffix == ".jsonl" else p).resolve().name, p


def main(argv=None) -> int:
    """Command line (see the module docstring); errors are one line on stderr, exit status 1."""
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}.plot", description=__doc__.splitlines()[0]
    )
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("runs", nargs="+", help="run directory, metrics .jsonl, or LABEL=PATH")
    p.add_argument("--key", default="loss", help="metric to plot (default: loss)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        runs = {}
        for spec in args.runs:
            label, path = parse_run(spec)
            if label in runs:
                raise ValueError(f"two runs are labelled {label!r}; name them with LABEL=PATH")
            runs[label] = path
        print(plot_losses(runs, args.out, key=args.key, title=args.title))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
