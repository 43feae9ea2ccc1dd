"""Weight sync from the trainer to the generator: `WeightSync` (`sync`), the one owner of pushes and of the policy
version; the full parameters it streams (`parameters`); the backends (`shared_memory` for the embedded generator,
`vllm_http` for a vLLM server without NCCL, TRL's NCCL client) and the one factory (`factory`).

The trainer's side only: the generator's side of the shared-memory transfer runs in the rollout child and lives in
`lightning_grpo.rollout.weight_receiver`.
"""
