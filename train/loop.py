"""Model, optimizer and the jitted train step.

The train state is one pytree `{"params", "opt_state", "rest", "rng"}`: `params` the model's
`nnx.Param` state, `rest` every other model variable (the aux-loss-free expert bias), `opt_state`
optax's state and `rng` a raw uint32 key. The step is compiled once, ahead of time, with the
state's own shardings as both input and output shardings and the state donated; the first call
then reuses exactly that executable. (The plain `nnx.jit` reference step recompiled at step 2:
`jax_explain_cache_misses` shows the optimizer's scalars, the i32[] step count and a u32[]
scalar, arriving unsharded at step 1 and replicated over the Explicit mesh from step 2.)
Compiled steps are memoised per process by (model config, optimizer settings, batch shape, mesh),
so repeated in-process runs (tests) compile once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models import QwenMoe


@dataclasses.dataclass
class TrainConfig:
    """Trainer settings (model settings are the `ModelConfig` of the YAML file)."""
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1          # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    schedule_steps: int = 300          # cosine horizon; NOT --steps, so resuming never changes it
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    seed: int = 0
    save_every: int = 100
    synthetic: bool = False


TRAIN_FIELDS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay, global-norm clipping, and weight decay only on
    parameters with at least 2 dimensions (never on norms or biases)."""
    sched = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(tc.warmup_steps, 0), max(tc.schedule_steps, tc.warmup_steps + 1),
        end_value=tc.lr * tc.min_lr_ratio)
    mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(sched, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                                   mask=mask))


def _replicated_if_needed(x, mesh):
    if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh:
        return x
    return jax.device_put(x, NamedSharding(mesh, P()))


def init_state(cfg, tc: TrainConfig, mesh):
    """(graphdef, state, tx) for a freshly initialised model (seeded by `tc.seed`)."""
    model = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(tc.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(tc)
    opt_state = jax.jit(tx.init)(params)
    rng = jax.random.key_data(jax.random.key(tc.seed))
    state = {"params": params, "opt_state": opt_state, "rest": rest, "rng": rng}
    state = jax.tree.map(lambda x: _replicated_if_needed(x, mesh), state)
    return graphdef, state, tx, model.rules


def make_step(graphdef, tx, cfg):
    """step(state, ids) -> (state, metrics): one AdamW update on next-token cross-entropy plus
    the router losses. The expert bias is not touched here: `update_expert_bias` (eager, as
    `QwenMoe.update_expert_bias` needs concrete shardings) applies `metrics["expert_load"]`."""

    def loss_fn(params, rest, ids):
        model = nnx.merge(graphdef, params, rest)
        logits, aux = model(ids)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        lm = -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()
        return lm + aux["router_loss"], (lm, aux)

    def step(state, ids):
        (loss, (lm, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["rest"], ids)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        rest = state["rest"]
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])
        metrics = {"loss": loss, "lm_loss": lm, "aux_loss": aux["aux_loss"],
                   "z_loss": aux["z_loss"], "router_loss": aux["router_loss"],
                   "grad_norm": optax.tree.norm(grads),
                   "dropped_pairs": aux["dropped_pairs"], "expert_load": aux["expert_load"]}
        return {"params": params, "opt_state": opt_state, "rest": rest, "rng": rng}, metrics

    return step


_COMPILED: dict = {}


def step_key(cfg, tc: TrainConfig, batch_shape, mesh):
    """What the compiled step depends on (not the seed, save interval or data source)."""
    opt = dataclasses.replace(tc, seed=0, save_every=1, synthetic=False)
    return (cfg, repr(opt), tuple(batch_shape), mesh)


def update_expert_bias(graphdef, state, expert_load):
    """The aux-loss-free bias update after a step, outside the optimizer (and outside jit), via
    `QwenMoe.update_expert_bias`; keeps the bias's sharding so the compiled step still fits."""
    model = nnx.merge(graphdef, state["params"], state["rest"])
    model.update_expert_bias(expert_load)
    _, _, rest = nnx.split(model, nnx.Param, ...)
    return {**state, "rest": rest}


def compile_step(step, state, ids_sharding, batch_shape, key=None):
    """The step compiled once for `state`'s shardings (in = out, state donated); memoised by
    `key` (see `step_key`) when given."""
    if key is not None and key in _COMPILED:
        return _COMPILED[key]
    shardings = jax.tree.map(lambda x: x.sharding, state)
    jitted = jax.jit(step, in_shardings=(shardings, ids_sharding),
                     out_shardings=(shardings, NamedSharding(ids_sharding.mesh, P())),
                     donate_argnums=0)
    abstract_ids = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=ids_sharding)
    compiled = jitted.lower(state, abstract_ids).compile()
    if key is not None:
        _COMPILED[key] = compiled
    return compiled


def memory_summary(compiled) -> str:
    """Per-device memory of the compiled step, from `memory_analysis()`."""
    m = compiled.memory_analysis()
    if m is None:
        return "memory_analysis() unavailable on this backend"
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    fields = ["argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "peak_memory_in_bytes"]
    return "per-device memory of the train step: " + ", ".join(
        f"{f.removesuffix('_size_in_bytes').removesuffix('_in_bytes')}={mib(getattr(m, f, 0))}"
        for f in fields)


def put_batch(batch: np.ndarray, sharding):
    return jax.device_put(jnp.asarray(batch, jnp.int32), sharding)
