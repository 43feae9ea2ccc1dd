"""Helpers of the test suite, importable from every test folder (`tests/` is on `sys.path` through its conftest).

`tiny` (the tiny model's fits, packed rows and their unpacked references), `fit_rewards` (reward functions that
import only the standard library), `processes` (process trees, sessions, fresh rank processes), `fit_script` (the
`scripts/fit_tiny.py` runner), `rollouts` (rollout samples and groups, reading a worker's queue), `transfers` (a
strict recording weight transfer, pushes), `lora` (LoRA policies), `replay`, `loss_ranks`, `learning_rates`,
`optimizer_probe` (micro-batches and gradient norms per step), `trl_grpo` (TRL's own GRPO code on given inputs),
`tool_policy` (a tiny policy that calls a tool) and `layout` (the layers docs/concepts/layout.md declares). Keep this
file empty of imports: a spawned reward worker imports `helpers.fit_rewards` and nothing else.
"""
