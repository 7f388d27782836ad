"""`python -m train.planner`: the planner's command (`plan.entry`; `plan`'s docstring says what it
prints). With `--target` jax is kept off a local GPU before it is imported (`JAX_PLATFORMS=cpu`
unless set: the deviceless GPU compile, `relaymoe_jax.analysis.gpu_mesh`)."""

import os
import sys

if __name__ == "__main__":
    if "--target" in sys.argv:  # before jax: see relaymoe_jax.analysis.gpu_mesh
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from .plan import entry

    entry()
