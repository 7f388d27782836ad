"""`late_zero`: the scalar a loop accumulator is broadcast from, made once the loop's input exists.

XLA merges identical zero broadcasts program-wide (CSE) and gives every while loop that carries
one its own copy, and XLA:CPU schedules all those copies early: the accumulators of every layer's
loops were alive at once (measured: 306 of a 534 MiB train-step peak, 8 layers of the scaled
Qwen3-30B at 4,096 tokens per device). Passing the scalar through an optimization barrier with
the loop's input ties each accumulator to its own loop; a barrier on the scalar, not on the
broadcast, so no full-size zeros exist before they are needed. Used by the ring's accumulators
(`dispatch.hop.zeros_f32`), the blocked grouped matmul and the chunked attention.
"""

import jax


def late_zero(scalar, anchor):
    """`scalar`, through an optimization barrier with `anchor` (an input of the loop)."""
    return jax.lax.optimization_barrier((scalar, anchor))[0]
