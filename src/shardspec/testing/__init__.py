"""Tools for the tests and the benchmarks, never imported at run time: random-weight checkpoints
(random_checkpoint, from sizes, random_weights, fp8 and checkpoint_files), the bytes a decode step
moves (step_bytes), top-1 agreement (agreement)."""
