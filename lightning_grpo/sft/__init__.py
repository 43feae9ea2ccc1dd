"""The supervised warm start (`lightning-grpo sft`): tool-use demonstrations rendered through the rollout path."""
