"""Which public names the Python API reference shows, on which page, and which it leaves out as internals.

Every name of `lightning_grpo.__all__` and `lightning_grpo.callbacks.__all__` is either on a page or in `INTERNAL`
(`tests/docs/test_api_reference.py` fails on one that is neither), so a new public name needs a decision here.
Internals keep their docstrings in the code; docs/concepts/layout.md says where each stage lives.
"""

from __future__ import annotations

#: page (docs/reference/<page>.md) -> (its title in the index, its sections: (heading, dotted paths)); a single
#: section's heading is not shown.
PAGES: dict[str, tuple[str, list[tuple[str, list[str]]]]] = {
    "module": (
        "GRPOModule",
        [
            ("The module", ["lightning_grpo.GRPOModule"]),
            ("The precision plugin", ["lightning_grpo.AutoPrecision"]),
        ],
    ),
    "datamodule": ("GRPODataModule", [("The data module", ["lightning_grpo.GRPODataModule"])]),
    "callbacks": (
        "Callbacks",
        [
            (
                "Callbacks",
                [
                    "lightning_grpo.callbacks.WeightSyncCallback",
                    "lightning_grpo.callbacks.RolloutStopCallback",
                    "lightning_grpo.callbacks.RolloutMetricsCallback",
                    "lightning_grpo.callbacks.CompletionsTableCallback",
                    "lightning_grpo.callbacks.GRPOProgressBar",
                    "lightning_grpo.callbacks.PreemptionCallback",
                    "lightning_grpo.callbacks.PREEMPTED_EXIT_CODE",
                    "lightning_grpo.callbacks.RolloutStreamError",
                    "lightning_grpo.callbacks.RolloutStallError",
                ],
            )
        ],
    ),
    "rewards": (
        "Rewards and scorers",
        [
            (
                "Builtin rewards",
                [
                    "lightning_grpo.rewards.accuracy",
                    "lightning_grpo.rewards.boxed_format",
                    "lightning_grpo.rewards.format_reward",
                    "lightning_grpo.rewards.numeric_closeness",
                    "lightning_grpo.rewards.reasoning_gym",
                    "lightning_grpo.rewards.completion_text",
                ],
            ),
            (
                "Trainer scoring",
                [
                    "lightning_grpo.TrainerScorer",
                    "lightning_grpo.RewardModelScorer",
                    "lightning_grpo.FeatureMatchingScorer",
                ],
            ),
            ("From rewards to advantages", ["lightning_grpo.compute_group_advantages"]),
        ],
    ),
    "generator": (
        "Generation and weight sync",
        [
            (
                "The embedded generator",
                ["lightning_grpo.EmbeddedGenerator", "lightning_grpo.GeneratorSpec", "lightning_grpo.PolicySpec"],
            ),
            ("vLLM servers", ["lightning_grpo.VLLMServer"]),
            (
                "Weight transfers",
                [
                    "lightning_grpo.make_weight_transfer",
                    "lightning_grpo.SharedMemoryWeightTransfer",
                    "lightning_grpo.VLLMHTTPWeightTransfer",
                    "lightning_grpo.VLLMLoRAWeightTransfer",
                ],
            ),
        ],
    ),
    "loss": (
        "The loss",
        [("The loss", ["lightning_grpo.grpo_loss", "lightning_grpo.policy_loss", "lightning_grpo.LossOptions"])],
    ),
    "export": ("Export", [("Export", ["lightning_grpo.export_policy"])]),
    "contract": (
        "The module/data contract",
        [("The contract", ["lightning_grpo.RolloutContract", "lightning_grpo.RolloutSource"])],
    ),
}

#: Public for the package's own layers and tests, not for users: the pipeline's stages, packing, records.
INTERNAL = frozenset(
    {
        "ProgressCollator",
        "GRPORolloutLoop",
        "GRPORolloutWorker",
        "GroupSchedule",
        "GroupedQueue",
        "ReferenceModel",
        "ReferencePolicy",
        "RewardProcessPool",
        "RolloutProgress",
        "RolloutSample",
        "RolloutStop",
        "SCORE_PAYLOAD",
        "SampleFilterQueue",
        "ScoredRow",
        "ScoringCollator",
        "StepBatch",
        "StepMetrics",
        "StepPlan",
        "StepPlanner",
        "StepReplay",
        "StopAwareDataset",
        "WeightSync",
        "check_step_capacity",
        "chunk_inputs",
        "chunk_sequences",
        "pack_sequences",
        "register_tree_attention",
        "score_step",
        "unpack_sequences",
    }
)


def documented() -> dict[str, str]:
    """Every dotted path on a page -> its page."""
    return {path: page for page, (_, sections) in PAGES.items() for _, paths in sections for path in paths}
