"""The optimizer: AdamW with global-norm clipping, linear warmup and cosine decay.

The cosine horizon (`schedule_horizon`) is the trainer's `schedule_steps` if set, else the run's
--steps (`train.state.identity` records it, so that a resume keeps it).
"""

import jax
import optax
from flax import nnx

from relaymoe_jax.models.sharding import LAYERS

from ..settings import TrainConfig

# The cosine horizon of `make_optimizer` when `schedule_steps` is None and no run length is
# given (compile-only uses: the planner, the benchmarks); the trainer always passes --steps.
DEFAULT_SCHEDULE_STEPS = 300


def schedule_horizon(tc: TrainConfig, steps: int | None = None) -> int:
    """The cosine horizon: `schedule_steps` if set, else the run's `steps`, else
    `DEFAULT_SCHEDULE_STEPS`; never shorter than the warmup (warmup_steps + 1)."""
    h = tc.schedule_steps if tc.schedule_steps is not None else steps
    h = DEFAULT_SCHEDULE_STEPS if h is None else h
    return max(h, tc.warmup_steps + 1)


def make_schedule(tc: TrainConfig, steps: int | None = None):
    """optax schedule: lr at optimizer count c (step s uses c = s - 1): linear warmup from 0 over
    `warmup_steps`, then cosine to `lr * min_lr_ratio` at c = `schedule_horizon`, flat after."""
    return optax.warmup_cosine_decay_schedule(
        0.0,
        tc.lr,
        max(tc.warmup_steps, 0),
        schedule_horizon(tc, steps),
        end_value=tc.lr * tc.min_lr_ratio,
    )


def _weight_ndim(x) -> int:
    """A parameter's own number of dimensions: a `scan_layers` model's stacked layer axis
    (logical name "layers", from the Variable's metadata) is not one of them."""
    if isinstance(x, nnx.Variable):
        names = x.get_metadata().get("logical_axes", ())
        return x.get_value().ndim - (1 if names[:1] == (LAYERS,) else 0)
    return x.ndim


def weight_decayed(p) -> bool:
    """Whether AdamW decays this parameter: one with at least 2 dimensions of its own (never a
    norm or a bias; a scanned model's stacked layer axis does not count)."""
    return _weight_ndim(p) >= 2


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay (`make_schedule`), global-norm clipping, and
    weight decay only on parameters with at least 2 dimensions (never on norms or biases; a
    stacked layer axis does not count, so a scanned model's [L, H] norms are not decayed
    either)."""
    sched = make_schedule(tc)
    mask = lambda params: jax.tree.map(
        weight_decayed, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(sched, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=mask),
    )
