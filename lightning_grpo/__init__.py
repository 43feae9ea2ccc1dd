"""Asynchronous GRPO for language models as a PyTorch Lightning module, data module and callbacks.

Public names are imported lazily, so that a spawned worker importing one submodule (the reward pool, the rollout
child) does not pay for importing torch and Lightning.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import TYPE_CHECKING

# TRL marks `trl.experimental` unstable on every import; we pin the TRL minor release instead.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# public name -> submodule that defines it
_EXPORTS = {
    "compute_group_advantages": "advantages",
    "RolloutSample": "records",
    "SCORE_PAYLOAD": "records",
    "GroupSchedule": "schedule",
    "StepBatch": "batch",
    "RewardProcessPool": "reward_pool",
    "GRPORolloutLoop": "rollout",
    "GRPORolloutWorker": "rollout_worker",
    "RolloutStop": "progress",
    "RolloutProgress": "progress",
    "SampleFilterQueue": "progress",
    "StopAwareDataset": "progress",
    "ProgressCollator": "progress",
    "GroupedQueue": "planner",
    "ScoredRow": "planner",
    "StepPlan": "planner",
    "StepPlanner": "planner",
    "check_step_capacity": "planner",
    "TrainerScorer": "scoring",
    "ScoringCollator": "scoring",
    "score_step": "scoring",
    "chunk_inputs": "packing",
    "chunk_sequences": "packing",
    "pack_sequences": "packing",
    "unpack_sequences": "packing",
    "RewardModelScorer": "scorers",
    "FeatureMatchingScorer": "scorers",
    "EmbeddedGenerator": "generation",
    "GeneratorSpec": "generation",
    "PolicySpec": "generation",
    "SharedMemoryWeightTransfer": "weight_transfer",
    "VLLMServer": "vllm_server",
    "VLLMHTTPWeightTransfer": "vllm_transfer",
    "register_tree_attention": "attention",
    "grpo_loss": "loss",
    "GRPOModule": "module",
    "GRPODataModule": "datamodule",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .advantages import compute_group_advantages
    from .attention import register_tree_attention
    from .batch import StepBatch
    from .datamodule import GRPODataModule
    from .generation import EmbeddedGenerator, GeneratorSpec, PolicySpec
    from .loss import grpo_loss
    from .module import GRPOModule
    from .packing import chunk_inputs, chunk_sequences, pack_sequences, unpack_sequences
    from .planner import GroupedQueue, ScoredRow, StepPlan, StepPlanner, check_step_capacity
    from .progress import ProgressCollator, RolloutProgress, RolloutStop, SampleFilterQueue, StopAwareDataset
    from .records import SCORE_PAYLOAD, RolloutSample
    from .reward_pool import RewardProcessPool
    from .rollout import GRPORolloutLoop
    from .rollout_worker import GRPORolloutWorker
    from .schedule import GroupSchedule
    from .scorers import FeatureMatchingScorer, RewardModelScorer
    from .scoring import ScoringCollator, TrainerScorer, score_step
    from .vllm_server import VLLMServer
    from .vllm_transfer import VLLMHTTPWeightTransfer
    from .weight_transfer import SharedMemoryWeightTransfer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
