"""Helpers of the test suite, importable from every test folder (`tests/` is on `sys.path` through its conftest).

`tiny` (the tiny model's fits, `tiny_prompts`, packed rows and their unpacked references), `fit_rewards` (reward
functions that import only the standard library, `char_sum_reward` among them), `processes` (the one way to run a
fit's processes: each command in its own process session, a hang or a process left behind fails the test),
`fit_probe` (the step recorder every fit test records with), `fit_script` (the `scripts/fit_tiny.py` runner),
`rollouts` (rollout samples and groups, reading a worker's queue), `transfers` (a
strict recording weight transfer, pushes), `lora` (LoRA policies), `replay`, `loss_ranks`, `learning_rates`,
`optimizer_probe` (micro-batches and gradient norms per step), `trl_grpo` (TRL's GRPOTrainer built by its own
`__init__`: trained and recorded, or its code on given inputs), `tool_policy` (a tiny policy that calls a tool) and
`layout` (the layers docs/concepts/layout.md declares). Keep this file empty of imports: a spawned reward worker
imports `helpers.fit_rewards` and nothing else.
"""
