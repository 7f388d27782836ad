"""`offload_optimizer=true`: the float32 master weights and the AdamW moments in pinned host memory.

Between steps the parameters (float32) and the optimizer's moments live in `pinned_host` memory
(their shardings are the stored ones, `storage.stored_sharding`, with that memory kind; the
optimizer's counts, the expert bias and the key stay on the device). Inside the step:

1. `fetch_params`: the parameters come to the device in the compute dtype, one stacked layer per
   iteration of a `lax.scan` (a scanned model's decoder layers) or one tensor at a time (the
   embedding, the final norm, the LM head): at most one layer's float32 weights are on the device
   at once, and what stays is the compute copy (bf16 under `compute_dtype=bfloat16`: half the
   float32 weights);
2. the forward and backward differentiate with respect to that copy: the gradients are in the
   compute dtype (float32 compute: the program's arithmetic is the one without offload, so the
   losses are bitwise equal; bfloat16: the gradients are rounded to bf16 before the reduce-scatter
   over the storage axes sums them, where without offload they are summed in float32);
3. `streamed_update`: the global gradient norm (in float32) and the clipping, then AdamW one layer
   at a time: that layer's weights and moments come from the host, are updated on the device and
   go back. The XLA:GPU program copies them asynchronously (copy-start / copy-done); how much of
   a layer's transfer hides behind compute is the scheduler's choice and not measured here.

So the device's peak holds the compute copy and the gradients, not the float32 weights and the
two moments (12 bytes per parameter, less the copy). What a step moves over PCIe, per device:
host -> device the float32 weights twice (fetch and update) and the two moments once; device ->
host the weights and the moments once: 16 bytes per stored parameter down and 12 up. The
compiled step writes the updated layers into new host buffers and then into the donated ones, so
the host holds the weights and moments twice during the update (`memory_analysis().host_temp_*`).

The update is optax's own AdamW applied to each layer's slice (`streamed_update`), with the
clipping's formula applied with the global norm, so each element is updated exactly as by
`optimizer.make_optimizer`'s chain.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from relaymoe_jax.models.sharding import LAYERS

from ..settings import TrainConfig
from .optimizer import make_schedule, weight_decayed

HOST = "pinned_host"
DEVICE, HOST_SPACE = jax.memory.Space.Device, jax.memory.Space.Host


def on_host(sharding):
    """`sharding` in pinned host memory."""
    return sharding.with_memory_kind(HOST)


def is_stacked(v) -> bool:
    """A scanned model's decoder-layer parameter: [L, ...] with the stacked layer axis first."""
    return isinstance(v, nnx.Variable) and v.get_metadata().get("logical_axes", ())[:1] == (LAYERS,)


def _variables(params):
    return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _fetch(x, dtype):
    x = jax.device_put(x, DEVICE)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


def fetch_params(params, dtype):
    """The host-resident `params` on the device in `dtype` (floats only), a stacked layer at a
    time (`lax.scan`) or a tensor at a time; same tree, same shardings (device memory)."""
    leaves, treedef = jax.tree.flatten(params)
    stacked = [is_stacked(v) for v in _variables(params)]
    out = [None if s else _fetch(x, dtype) for x, s in zip(leaves, stacked)]
    xs = [x for x, s in zip(leaves, stacked) if s]
    if xs:
        _, ys = jax.lax.scan(lambda _, layer: (None, [_fetch(x, dtype) for x in layer]), None, xs)
        it = iter(ys)
        out = [next(it) if s else o for o, s in zip(out, stacked)]
    return jax.tree.unflatten(treedef, out)


def _clip(g, g_norm, max_norm):
    """optax.clip_by_global_norm's formula for one tensor, with the global norm given."""
    g = g.astype(jnp.float32)
    return jax.lax.select(jnp.squeeze(g_norm < max_norm), g, (g / g_norm) * max_norm)


def _replace(tree, like, lists, as_tree):
    """`tree` with each subtree `like` selects replaced, in order, by `as_tree(lists[k])`."""
    it = iter(lists)
    return jax.tree.map(lambda t: as_tree(next(it)) if like(t) else t, tree, is_leaf=like)


def _subtrees(tree, like) -> list[list]:
    """The leaves of each subtree of `tree` that `like` selects, in order."""
    return [jax.tree.leaves(t) for t in jax.tree.leaves(tree, is_leaf=like) if like(t)]


def _like(structure):
    return lambda t: jax.tree.structure(t) == structure


def streamed_update(tc: TrainConfig, params, opt_state, grads):
    """(new params, new opt_state, the gradients' global norm in float32): the update of
    `optimizer.make_optimizer(tc)` (clipping, then AdamW: `opt_state` is its state) with the
    host-resident weights and moments streamed through the device, a stacked layer per iteration
    of a `lax.scan` and the other tensors one group; new weights and moments back on the host."""
    leaves, treedef = jax.tree.flatten(params)
    g_leaves = jax.tree.leaves(grads)
    stacked = [is_stacked(v) for v in _variables(params)]
    decayed = [weight_decayed(v) for v in _variables(params)]
    clip_state, adam_state = opt_state
    is_moment = _like(jax.tree.structure(params))
    moments = _subtrees(adam_state, is_moment)  # [mu leaves, nu leaves]
    g_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in g_leaves))
    on_device = lambda xs: [jax.device_put(x, DEVICE) for x in xs]
    to_host = lambda xs: [jax.device_put(x, HOST_SPACE) for x in xs]

    def update(which, p, ms, g):
        """AdamW on the leaves `which` selects (p, g, and each moment's ms[k] lists of them):
        (new p, new moment lists) on the host, and AdamW's new state (list-shaped)."""
        adam = optax.adamw(
            make_schedule(tc),
            b1=tc.b1,
            b2=tc.b2,
            weight_decay=tc.weight_decay,
            mask=[d for d, w in zip(decayed, which) if w],
        )
        p = on_device(p)
        state = _replace(adam_state, is_moment, [on_device(m) for m in ms], list)
        u, state = adam.update([_clip(x, g_norm, tc.clip_norm) for x in g], state, p)
        p = optax.apply_updates(p, u)
        new_ms = _subtrees(state, _like(jax.tree.structure(p)))
        return to_host(p), [to_host(m) for m in new_ms], state

    pick = lambda xs, which: [x for x, w in zip(xs, which) if w]
    flat = [not s for s in stacked]
    if not any(flat):
        raise ValueError("streamed_update: every parameter is stacked (no embedding?)")
    new = {"p": list(leaves), "m": [list(m) for m in moments]}

    def put(which, p, ms):
        idx = [i for i, w in enumerate(which) if w]
        for i, x in zip(idx, p):
            new["p"][i] = x
        for k, m in enumerate(ms):
            for i, x in zip(idx, m):
                new["m"][k][i] = x

    p, ms, flat_state = update(
        flat, pick(leaves, flat), [pick(m, flat) for m in moments], pick(g_leaves, flat)
    )
    put(flat, p, ms)
    if any(stacked):

        def body(_, layer):
            p, ms, g = layer
            p, ms, _ = update(stacked, p, ms, g)
            return None, (p, ms)

        xs = (pick(leaves, stacked), [pick(m, stacked) for m in moments], pick(g_leaves, stacked))
        _, (p, ms) = jax.lax.scan(body, None, xs)
        put(stacked, p, ms)
    # the counts from the flat group's update (every group counts the same step)
    as_params = lambda xs: jax.tree.unflatten(jax.tree.structure(params), xs)
    flat_def = jax.tree.structure(pick(leaves, flat))
    new_adam = _replace(flat_state, _like(flat_def), new["m"], as_params)
    return jax.tree.unflatten(treedef, new["p"]), (clip_state, new_adam), g_norm
