"""Parity testing for MoE layers on emulated multi-device CPU, built on chex.

For users who swap `relaymoe_jax.moe_ffn` into their own JAX MoE model and want to prove that
their expert block and ours compute the same thing, values and gradients:

    from relaymoe_jax import testing
    testing.use_cpu_devices(8)                # first, before jax's first operation
    ids_tk = testing.routing_cases(64, 4, 16, num_partitions=8)["ragged"]
    inp = testing.moe_inputs(ids_tk, num_experts=16)
    testing.assert_moe_parity(theirs, ours, *inp.args)      # values and all 5 gradients
    testing.assert_parity_detects(theirs, ours, *inp.args)  # ...and the check can fail

`theirs` and `ours` take `moe_ffn`'s positional arguments (x, expert_ids, expert_weights,
w_gate, w_up, w_down) and return y [tokens, hidden]; bind the rest with functools.partial, e.g.
`ours = functools.partial(relaymoe_jax.moe_ffn, mesh=mesh)`. Place the arguments on the mesh
first (`jax.device_put`) to test sharded inputs.

Modules: `routing` (the adversarial routing cases and random inputs), `grads` (values and
gradients of one function), `parity` (the parity assertion), `controls` (its negative control).
"""

from relaymoe_jax.cli.devices import use_cpu_devices
from relaymoe_jax.testing.controls import assert_parity_detects
from relaymoe_jax.testing.grads import MoeRun, moe_value_and_grads
from relaymoe_jax.testing.parity import DEFAULT_RTOL, assert_moe_parity
from relaymoe_jax.testing.routing import CASES, MoeInputs, moe_inputs, routing_case, routing_cases

__all__ = [
    "CASES",
    "DEFAULT_RTOL",
    "MoeInputs",
    "MoeRun",
    "assert_moe_parity",
    "assert_parity_detects",
    "moe_inputs",
    "moe_value_and_grads",
    "routing_case",
    "routing_cases",
    "use_cpu_devices",
]
