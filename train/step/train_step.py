"""The train state and the compiled train step: model, optimizer state, one AdamW update.

The train state is one record, `TrainState(opt_state, params, rest, rng)`: `params` the model's
`nnx.Param` state, `rest` every other model variable (the aux-loss-free expert bias), `opt_state`
optax's state (`optimizer`) and `rng` a raw uint32 key. The step is compiled once, ahead of
time, with the state's own shardings as both input and output shardings and the state donated;
the first call then reuses exactly that executable. (The plain `nnx.jit` reference step
recompiled at step 2: `jax_explain_cache_misses` shows the optimizer's scalars, the i32[] step
count and a u32[] scalar, arriving unsharded at step 1 and replicated over the Explicit mesh from
step 2.) Compiled steps are memoised per process by (model config, optimizer settings, batch
shape, mesh), so repeated in-process runs (tests) compile once.

The step takes a `train.data.Batch` (tokens, and for packed documents segment ids and positions,
each on the batch's sharding: `put_batch`) and returns `StepMetrics`, one record.
"""

import dataclasses
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.models import QwenMoe
from relaymoe_jax.models.loss import DEFAULT_CHUNK
from relaymoe_jax.xla_options import XLA_OPTIONS

from ..data.source import Batch
from ..settings import RUN_ONLY_FIELDS, TrainConfig, check_offload
from . import accumulate, expert_load, objective
from .accumulate import accumulated_value_and_grad, step_batch
from .objective import next_token_targets as next_token_targets  # (callers read it here)
from .offload import fetch_params, on_host, streamed_update
from .optimizer import make_optimizer
from .storage import STORAGE_AXES, stored_sharding
from .storage import gather_stored as gather_stored  # (tests read them from here)
from .storage import is_variable as is_variable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What the step updates, one pytree. The fields are in the order of the dict
    `{"opt_state", "params", "rest", "rng"}` the state was before (jax sorts a dict's keys), so
    the compiled step sees the same leaves in the same order; checkpoints hold that dict
    (`as_saved`, `from_saved`: the saved tree keeps its structure and names)."""

    opt_state: typing.Any  # optax's state
    params: typing.Any  # nnx.State of the model's nnx.Param variables
    rest: typing.Any  # nnx.State of every other model variable (the expert bias)
    rng: typing.Any  # a raw uint32 key (jax.random.key_data)

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)

    def as_saved(self) -> dict:
        """The tree a checkpoint holds: `{"params", "opt_state", "rest", "rng"}`."""
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "rest": self.rest,
            "rng": self.rng,
        }

    @classmethod
    def from_saved(cls, tree: dict) -> "TrainState":
        """The state of a checkpoint's tree (`as_saved`)."""
        return cls(**{f.name: tree[f.name] for f in dataclasses.fields(cls)})


def abstract_state(cfg, tc: TrainConfig, mesh):
    """(graphdef, state, tx, rules) like `init_state`, with `jax.ShapeDtypeStruct` leaves (shape,
    dtype, sharding) and nothing allocated: for compile-only measurements of any model size."""
    model = nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    check_offload(cfg, tc, mesh.devices.flat[0])
    params = jax.tree.map(lambda x: sds(x, stored_sharding(x, mesh)), params)
    rest = jax.tree.map(lambda x: sds(x, x.sharding), rest)
    tx = make_optimizer(tc)
    opt_shardings = _opt_shardings(tx, params, mesh, tc.offload_optimizer)
    opt_state = jax.tree.map(sds, jax.eval_shape(tx.init, params), opt_shardings)
    if tc.offload_optimizer:
        params = jax.tree.map(lambda x: sds(x, on_host(x.sharding)), params)
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    state = TrainState(opt_state, params, rest, sds(key, NamedSharding(mesh, P())))
    return graphdef, state, tx, model.rules


def _replicated_if_needed(x, mesh):
    if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh:
        return x
    return jax.device_put(x, NamedSharding(mesh, P()))


def _opt_shardings(tx, params, mesh, offload: bool = False):
    """Shardings for `tx.init(params)`: every subtree shaped like `params` (Adam's moments) takes
    the parameters' shardings (in pinned host memory with `offload`), the rest (counts) is
    replicated on the device. (Left to itself, `jit(tx.init)` returns the moments replicated: a
    full copy of every expert's moments on every device.)"""
    pdef = jax.tree.structure(params)
    like_params = lambda t: jax.tree.structure(t) == pdef
    own = jax.tree.map(lambda p: on_host(p.sharding) if offload else p.sharding, params)
    rep = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda t: own if like_params(t) else rep,
        jax.eval_shape(tx.init, params),
        is_leaf=like_params,
    )


def init_state(cfg, tc: TrainConfig, mesh, model=None):
    """(graphdef, state, tx, rules) for a freshly initialised model (seeded by `tc.seed`), or for
    `model` (a `QwenMoe` of `cfg` on `mesh` with its weights: `train.hf.init`) and a fresh
    optimizer; with an `fsdp` or `context` mesh axis the parameters (hence the optimizer moments)
    are stored per `stored_sharding`."""
    check_offload(cfg, tc, mesh.devices.flat[0])
    model = QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(tc.seed)) if model is None else model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if any(a in mesh.axis_names for a in STORAGE_AXES):
        params = jax.tree.map(lambda p: jax.device_put(p, stored_sharding(p, mesh)), params)
    tx = make_optimizer(tc)
    opt_shardings = _opt_shardings(tx, params, mesh, tc.offload_optimizer)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    if tc.offload_optimizer:  # one tensor at a time: the device never holds them all twice
        params = jax.tree.map(lambda p: jax.device_put(p, on_host(p.sharding)), params)
    rng = jax.random.key_data(jax.random.key(tc.seed))
    state = TrainState(opt_state, params, rest, rng)
    state = jax.tree.map(lambda x: _replicated_if_needed(x, mesh), state)
    return graphdef, state, tx, model.rules


class StepMetrics(NamedTuple):
    """What a step returns besides the state (scalars, replicated): the losses, the gradient
    norm, the pairs the all-to-all dropped, and the expert load (the bias update reads it, the
    metrics line gets its per-layer statistics, `expert_load.load_stats`)."""

    loss: jax.Array  # lm_loss + router_loss: what the update minimises
    lm_loss: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    router_loss: jax.Array
    grad_norm: jax.Array
    dropped_pairs: jax.Array  # int32
    expert_load: jax.Array  # [L_moe, E] int32 (`update_expert_bias`; logged as its statistics)

    def record(self) -> dict:
        """The fields of the metrics.jsonl line (host values), in the order the line always had
        them (by name), then the per-layer load statistics of a model with MoE layers
        (`expert_load.LOAD_KEYS`; the counts themselves are not logged)."""
        rec = {k: float(v) for k, v in sorted(self._asdict().items()) if k != "expert_load"}
        rec["dropped_pairs"] = int(self.dropped_pairs)
        if np.ndim(self.expert_load) == 2 and np.shape(self.expert_load)[0]:
            rec.update(expert_load.load_stats(self.expert_load))
        return rec


def make_step(
    graphdef,
    tx,
    compute_dtype: str = "float32",
    loss_chunk: int = DEFAULT_CHUNK,
    packed: bool = False,
    offload: TrainConfig | None = None,
    grad_accum: int = 1,
):
    """step(state, batch) -> (state, StepMetrics): one AdamW update on next-token cross-entropy
    plus the router losses. `batch` is a `Batch` of [B, S] int32 arrays: its tokens, with
    `packed` also its segment ids and positions (packed documents, `train.data.loader`):
    attention stays within a document, and the loss is the mean over the targets
    `next_token_targets` keeps. The parameters are gathered from their storage (`stored_sharding`)
    and, with `compute_dtype="bfloat16"` (`TrainConfig` checks it), cast to bf16 for the forward
    and backward: a scanned model's layers one at a time inside the layer scan, within each
    block's checkpoint (`QwenMoe.hidden`'s `layer_weights`), everything else before the model
    runs (the stored master weights, the optimizer and the update stay float32; the
    router and the losses compute in float32 anyway). The LM head and cross-entropy run in chunks
    of `loss_chunk` tokens per device (`relaymoe_jax.models.loss.lm_loss`): no [tokens, vocab]
    logits are ever built (`train.step.objective`). The expert bias is not touched here:
    `update_expert_bias` (eager, as `QwenMoe.update_expert_bias` needs concrete shardings)
    applies `metrics.expert_load`.

    `offload`: the trainer settings of a state whose weights and moments are in pinned host
    memory (`offload_optimizer`): the step then fetches the weights in the compute dtype, layer by
    layer, and streams the update (`train.step.offload`; `tx` is then not called).

    `grad_accum` N > 1: `batch` is a `Batch` of [N, B, S] arrays, N micro-batches whose gradients
    a `lax.scan` sums in float32 before the one update (`train.step.accumulate`, which says how each
    loss is averaged)."""
    dtype = jnp.dtype(compute_dtype)
    if grad_accum == 1:
        loss_fn = objective.make_loss(graphdef, dtype, loss_chunk, packed)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    else:  # N micro-batches, one lax.scan, the gradients summed in float32
        grad_fn = accumulated_value_and_grad(graphdef, dtype, loss_chunk, packed, grad_accum)

    def step(state, batch: Batch):
        if offload is not None:
            with jax.named_scope("fetch_params"):
                compute = fetch_params(state.params, dtype)
            (loss, (lm, aux)), grads = grad_fn(compute, state.rest, batch)
            with jax.named_scope("streamed_update"):
                params, opt_state, grad_norm = streamed_update(
                    offload, state.params, state.opt_state, grads
                )
        else:
            (loss, (lm, aux)), grads = grad_fn(state.params, state.rest, batch)
            with jax.named_scope("optimizer"):
                updates, opt_state = tx.update(grads, state.opt_state, state.params)
                params = optax.apply_updates(state.params, updates)
                grad_norm = optax.tree.norm(grads)
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
        metrics = StepMetrics(
            loss=loss,
            lm_loss=lm,
            aux_loss=aux.aux_loss,
            z_loss=aux.z_loss,
            router_loss=aux.router_loss,
            grad_norm=grad_norm,
            dropped_pairs=aux.dropped_pairs,
            expert_load=aux.expert_load,
        )
        return TrainState(opt_state, params, state.rest, rng), metrics

    return step


_COMPILED: dict = {}  # the memoised programs (`compile_step`, `memoised`) by their key


def step_key(cfg, tc: TrainConfig, batch_shape, mesh, packed: bool = False):
    """What the compiled step depends on: not the trainer fields it never reads
    (`settings.RUN_ONLY_FIELDS`: the seed, save interval, evaluation settings, data source),
    except whether its batches carry segment ids."""
    plain = TrainConfig()
    opt = dataclasses.replace(tc, **{f: getattr(plain, f) for f in RUN_ONLY_FIELDS})
    return (cfg, repr(opt), tuple(batch_shape), mesh, packed)


def memoised(key, build):
    """The program memoised under `key`, else `build()` memoised under it (a None it returns is
    returned and not memoised)."""
    if key not in _COMPILED:
        compiled = build()
        if compiled is None:
            return None
        _COMPILED[key] = compiled
    return _COMPILED[key]


def clear_compiled() -> None:
    """Forget every memoised program (the tests release them after each file)."""
    _COMPILED.clear()


def update_expert_bias(graphdef, state, expert_load):
    """The aux-loss-free bias update after a step, outside the optimizer (and outside jit), via
    `QwenMoe.update_expert_bias`; keeps the bias's sharding so the compiled step still fits."""
    model = nnx.merge(graphdef, state.params, state.rest)
    model.update_expert_bias(expert_load)
    _, _, rest = nnx.split(model, nnx.Param, ...)
    return state.replace(rest=rest)


def compile_step(
    step, state, ids_sharding, batch_shape, key=None, runner=None, packed: bool = False
):
    """The step compiled once for `state`'s shardings (in = out, state donated) and a `Batch` on
    `ids_sharding` (with segment ids and positions if `packed`); memoised by `key` (see
    `step_key`) when given.
    `runner(fn)` runs the lowering and compile `fn` (default:
    calls it); a None it returns (`train.run.interrupt.unless_stopped`: a signal came first) is
    returned as is and not memoised."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    # without these XLA:GPU waits for most of a ring hop's transfer before its compute
    # (relaymoe_jax/xla_options.py); XLA:CPU ignores them
    jitted = jax.jit(
        step,
        in_shardings=(shardings, ids_sharding),  # every array of the batch
        out_shardings=(shardings, NamedSharding(ids_sharding.mesh, P())),
        donate_argnums=0,
        compiler_options=XLA_OPTIONS,
    )
    ids = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=ids_sharding)
    batch = Batch(ids, ids, ids) if packed else Batch(ids)
    build = lambda: jitted.lower(state, batch).compile()
    run = build if runner is None else (lambda: runner(build))
    return run() if key is None else memoised(key, run)


def compile_abstract(cfg, tc: TrainConfig, mesh, memo: bool = True, packed: bool = False):
    """The train step of `cfg` and `tc` on `mesh` (batches with segment ids if `packed`),
    compiled against `abstract_state` (nothing allocated, nothing run): for memory and cost
    analysis. `memo=False` keeps no executable (searches compile many sizes once each)."""
    graphdef, state, tx, rules = abstract_state(cfg, tc, mesh)
    shape = (tc.batch_size, tc.seq_len)
    ids_sharding = NamedSharding(mesh, rules.fit(shape, "batch", "seq"))
    sharding, shape = step_batch(ids_sharding, *shape, tc.grad_accum)  # [N, B, S] if N > 1
    offload = tc if tc.offload_optimizer else None
    step = make_step(graphdef, tx, tc.compute_dtype, tc.loss_chunk, packed, offload, tc.grad_accum)
    key = step_key(cfg, tc, shape, mesh, packed) if memo else None
    return compile_step(step, state, sharding, shape, key=key, packed=packed)


def footprint(m) -> int:
    """Bytes live at once per device: arguments + temporaries + outputs not aliased to a donated
    argument."""
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def host_footprint(m) -> int:
    """Host bytes live at once per device, `footprint`'s count over XLA's host memory space
    (pinned host memory: offloaded train state and residuals): host arguments + host temporaries
    + host outputs not aliased to a donated host argument. 0 when nothing is offloaded."""
    return (
        m.host_argument_size_in_bytes
        + m.host_temp_size_in_bytes
        + m.host_output_size_in_bytes
        - m.host_alias_size_in_bytes
    )


def memory_summary(compiled) -> str:
    """Per-device memory of the compiled step, from `memory_analysis()`: its parts and the peak as
    the planner counts it (arguments + temporaries + outputs not aliased to a donated argument;
    XLA's own `peak_memory_in_bytes` estimate, below the temporaries alone on XLA:CPU, is not
    shown)."""
    m = compiled.memory_analysis()
    if m is None:
        return "memory_analysis() unavailable on this backend"
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    fields = [
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
    ]
    host = [f"host_{f}" for f in fields if getattr(m, f"host_{f}", 0)]
    return (
        "per-device memory of the train step: "
        + ", ".join(
            f"{f.removesuffix('_size_in_bytes')}={mib(getattr(m, f, 0))}" for f in fields + host
        )
        + f", peak={mib(footprint(m))} (arguments + temp + outputs not aliased)"
    )


def put_batch(batch: Batch, sharding, global_batch: int, rows=None) -> Batch:
    """The global batch of `global_batch` rows as a `Batch` of arrays on `sharding`: `batch` is
    this process's rows `rows` of it (default: all; `train.data.loader.rows_of_process` says
    which each process reads). Each process fills only its own devices' shards, so this also
    works when the mesh spans several processes (`accumulate.put_batch` with one micro-batch)."""
    shape = (global_batch, np.shape(batch.tokens)[-1])
    return accumulate.put_batch(batch, sharding, shape, rows)
