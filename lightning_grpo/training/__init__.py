"""The trainer's side of a step: the GRPO family's loss (`loss`), its options (`loss_options`) and statistics
(`loss_stats`), the chunked log-probabilities (`selected_logprobs`), tree attention over packed rows (`attention`),
the reference model of the KL term (`reference`), the policy's adapters and checkpointing (`policy`, `checkpoint`),
`GRPOModule`'s model set-up (`model_setup`) and training step (`step`), data-parallel sharding (`sharding`), the
per-step metrics (`step_metrics`) and completions table (`completions`), the CPU split between trainer and generator
(`threads`), the Lightning precision plugin that picks bf16-mixed or fp32 for the machine (`precision_plugin`), and
`StepReplay` (`replay`), a rollout source with no rollout child."""
