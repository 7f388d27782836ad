"""Which model-config changes change the parameters' shapes (or which parameters there are): a
checkpoint cannot be restored across them, whatever a resume allows (`train.state.identity`).
Decided on the abstract model (`nnx.eval_shape`, one device, nothing allocated), one changed key
at a time."""

import jax
from flax import nnx

from relaymoe_jax.models import QwenMoe
from relaymoe_jax.models.config import ModelConfig


def param_shapes(model: dict):
    """The (tree, shapes and dtypes) of the parameters of the model config `model` (a dict),
    traced abstractly on one device; None if the config is not a valid one."""
    try:
        cfg = ModelConfig.from_dict(model)
    except (ValueError, TypeError):
        return None
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    params = nnx.state(nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0))), nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    return tree, [(x.shape, x.dtype) for x in leaves]


def shape_changes(model: dict, changes: list) -> list:
    """Of the model-config `changes`, those that alone change the parameters' shapes (or which
    parameters there are), from this run's config `model` with that key set back: a checkpoint
    cannot be restored across them, whatever is allowed."""
    if not changes:
        return []
    now = param_shapes(model)
    out = []
    for c in changes:
        then = param_shapes({**model, c.key: c.old})
        if now is not None and then is not None and then != now:
            out.append(c)
    return out
