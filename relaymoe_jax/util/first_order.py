"""`first_order`: the op is first-order reverse-mode only; differentiating a backward says so.

The ring's backward and the grouped matmuls' backwards are `jax.custom_vjp` rules built from
while loops with traced trip counts, which JAX cannot differentiate again. Each rule passes its
inputs through `first_order` (an identity), whose JVP raises: grad-of-grad, or forward mode over
a backward, then fails with one clear NotImplementedError instead of an error from deep inside a
loop. First-order `jax.grad` / `jax.vjp` never differentiate a backward, so they are unaffected.
"""

import jax
import jax.numpy as jnp

MESSAGE = (
    "relaymoe_jax's MoE op (and its grouped matmul) is differentiable once, in reverse "
    "mode (jax.grad, jax.vjp, jax.value_and_grad): its backward pass cannot be "
    "differentiated again (grad-of-grad, hessian, jvp of a gradient)"
)


@jax.custom_jvp
def _mark(x):
    return x


@_mark.defjvp
def _mark_jvp(primals, tangents):
    raise NotImplementedError(MESSAGE)


def first_order(tree):
    """`tree` unchanged; differentiating through it raises NotImplementedError(MESSAGE)."""
    return jax.tree.map(
        lambda a: _mark(a) if jnp.issubdtype(jnp.result_type(a), jnp.inexact) else a, tree
    )
