"""Small JAX helpers the op, its kernels and the model share (nothing here imports the rest).

- `late`: `late_zero`, a loop accumulator's scalar made once the loop's input exists.
- `checks`: the value checks every record shares (`one_of`, `int_at_least`, `finite_number`).
- `first_order`: `first_order`, an identity whose JVP raises (the op is first-order only).
- `platform`: `platform()`, the platform traced code compiles for (mesh, context, backend).
- `sorted_search`: `count_at_most`, `count_at_most_bisect`: searchsorted that traces in a
  partial-manual shard_map.
- `typed`: `sharded_like`, a value given another's sharding type (custom VJPs' cotangents);
  `varying_like`, a value made varying over another's shard_map axes.
- `tracing`: what jax is tracing now, the mesh of `jax.set_mesh`, whether jax's backends started
  and jax's CUDA path (the one `jax._src` reader of the library and the trainer).
"""
