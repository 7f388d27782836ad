"""What a run keeps between its processes and resumes: `checkpoint` (orbax save and restore,
checksums, the metrics log) and `identity` (what a checkpoint was trained with, which resumes it
refuses, the learning rate's horizon). It sits above `step` (the optimizer's schedule); importing
the package imports none of its modules."""
