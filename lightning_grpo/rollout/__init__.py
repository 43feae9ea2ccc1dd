"""Everything the CUDA-free rollout process imports: the loop, the worker handle, the embedded generator, the reward
pool, the group schedule, advantages, the records that cross the process boundary, and the generator's side of the
shared-memory weight transfer.

Nothing here imports Lightning or the trainer side (`tests/rollout/test_child_imports.py` checks it), so the spawned
child starts in a fraction of a second. The public names are re-exported from `lightning_grpo`.
"""
