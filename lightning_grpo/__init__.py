"""Asynchronous GRPO for language models as a PyTorch Lightning module, data module and callbacks.

Public names are imported lazily, so that a spawned worker importing one submodule (the reward pool, the rollout
child) does not pay for importing torch and Lightning.
"""

from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING

from ._imports import lazy_exports

# TRL marks `trl.experimental` unstable on every import; we pin the TRL minor release instead.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# public name -> submodule that defines it
_EXPORTS = {
    # the rollout process
    "compute_group_advantages": "rollout.advantages",
    "RolloutSample": "rollout.records",
    "SCORE_PAYLOAD": "rollout.records",
    "GroupSchedule": "rollout.schedule",
    "RewardProcessPool": "rollout.reward_pool",
    "GRPORolloutLoop": "rollout.loop",
    "GRPORolloutWorker": "rollout.worker",
    "EmbeddedGenerator": "rollout.generator",
    "GeneratorSpec": "rollout.generator",
    "PolicySpec": "rollout.generator",
    # rank 0's pipeline
    "GroupedQueue": "pipeline.grouping",
    "SampleFilterQueue": "pipeline.filtering",
    "ScoredRow": "pipeline.planner",
    "StepPlan": "pipeline.planner",
    "StepPlanner": "pipeline.planner",
    "check_step_capacity": "pipeline.planner",
    "ProgressCollator": "pipeline.collating",
    "StopAwareDataset": "pipeline.stopping",
    "RolloutProgress": "pipeline.ledger",
    "RolloutStop": "pipeline.ledger",
    "StepBatch": "pipeline.batch",
    # trainer scoring
    "TrainerScorer": "scoring.trainer_scorer",
    "ScoringCollator": "scoring.collator",
    "score_step": "scoring.step",
    "chunk_inputs": "scoring.packing",
    "chunk_sequences": "scoring.packing",
    "pack_sequences": "scoring.packing",
    "unpack_sequences": "scoring.packing",
    "RewardModelScorer": "scoring.builtin_scorers",
    "FeatureMatchingScorer": "scoring.builtin_scorers",
    # weight sync and serving
    "WeightSync": "weights.sync",
    "SharedMemoryWeightTransfer": "weights.shared_memory",
    "VLLMHTTPWeightTransfer": "weights.vllm_http",
    "VLLMLoRAWeightTransfer": "weights.vllm_lora",
    "make_weight_transfer": "weights.factory",
    "VLLMServer": "serving.vllm_launcher",
    # the trainer
    "RolloutContract": "contract",
    "RolloutSource": "contract",
    "register_tree_attention": "training.attention",
    "grpo_loss": "training.loss",
    "policy_loss": "training.loss",
    "LossOptions": "training.loss_options",
    "ReferenceModel": "training.reference",
    "ReferencePolicy": "training.reference",
    "StepReplay": "training.replay",
    "GRPOModule": "module",
    "StepMetrics": "training.step_metrics",
    "AutoPrecision": "training.precision_plugin",
    "GRPODataModule": "datamodule",
    "export_policy": "cli.export",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .cli.export import export_policy
    from .contract import RolloutContract, RolloutSource
    from .datamodule import GRPODataModule
    from .module import GRPOModule
    from .pipeline.batch import StepBatch
    from .pipeline.collating import ProgressCollator
    from .pipeline.filtering import SampleFilterQueue
    from .pipeline.grouping import GroupedQueue
    from .pipeline.ledger import RolloutProgress, RolloutStop
    from .pipeline.planner import ScoredRow, StepPlan, StepPlanner, check_step_capacity
    from .pipeline.stopping import StopAwareDataset
    from .rollout.advantages import compute_group_advantages
    from .rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
    from .rollout.loop import GRPORolloutLoop
    from .rollout.records import SCORE_PAYLOAD, RolloutSample
    from .rollout.reward_pool import RewardProcessPool
    from .rollout.schedule import GroupSchedule
    from .rollout.worker import GRPORolloutWorker
    from .scoring.builtin_scorers import FeatureMatchingScorer, RewardModelScorer
    from .scoring.collator import ScoringCollator
    from .scoring.packing import chunk_inputs, chunk_sequences, pack_sequences, unpack_sequences
    from .scoring.step import score_step
    from .scoring.trainer_scorer import TrainerScorer
    from .serving.vllm_launcher import VLLMServer
    from .training.attention import register_tree_attention
    from .training.loss import grpo_loss, policy_loss
    from .training.loss_options import LossOptions
    from .training.precision_plugin import AutoPrecision
    from .training.reference import ReferenceModel, ReferencePolicy
    from .training.replay import StepReplay
    from .training.step_metrics import StepMetrics
    from .weights.factory import make_weight_transfer
    from .weights.shared_memory import SharedMemoryWeightTransfer
    from .weights.sync import WeightSync
    from .weights.vllm_http import VLLMHTTPWeightTransfer
    from .weights.vllm_lora import VLLMLoRAWeightTransfer
