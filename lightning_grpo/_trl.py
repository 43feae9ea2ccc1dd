"""The one place lightning_grpo imports TRL, so that a TRL upgrade breaks only this module (and its pinned-names test).

`trl>=1.16,<1.17` is pinned because `trl.experimental.async_grpo` is private API that changes between releases.
`tests/test_trl_names.py` lists every private name, method and attribute of TRL's that the rollout loop and the
weight transfers rely on, so a release that moves one fails that test with the list.

Light names are imported here at once (the rollout child needs them); names from TRL's trainer module, which imports
the HF `Trainer` and accelerate, and from its vLLM client are imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.chat_template_utils import (  # noqa: E402
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)
from trl.chat_template_utils import qwen3_template as hermes_response_template  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import (  # noqa: E402
    RolloutGroup,
    TrainingSequence,
    TurnRecord,
    _AsyncRolloutLoop,
    _chain_to_sequences,
    _child_main,
)
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from trl.trainer.utils import get_callable_name, is_async_callable  # noqa: E402

__all__ = [
    "RolloutGroup",
    "TrainingSequence",
    "TreeRow",
    "TurnRecord",
    "_AsyncRolloutLoop",
    "_chain_to_sequences",
    "_child_main",
    "add_response_schema",
    "flash_attention_kernel",
    "flash_tree_attention",
    "get_callable_name",
    "get_training_chat_template",
    "hermes_response_template",
    "is_async_callable",
    "is_chat_template_prefix_preserving",
    "iter_vllm_named_params",
    "nccl_weight_transfer_client",
    "round_lora_rank",
    "select_adapter_sync",
    "validate_lora_for_vllm_sync",
    "parse_response",
    "supports_tool_calling",
]


def iter_vllm_named_params(model: Any) -> Iterator[tuple[str, Any]]:
    """TRL's `_iter_vllm_named_params`: the `(name, parameter)` stream a vLLM server fed over NCCL expects."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    return _iter_vllm_named_params(model)


def validate_lora_for_vllm_sync(model: Any) -> Any:
    """TRL's `validate_lora_for_vllm_sync`: the active adapter's `LoraConfig`, refusing what vLLM's LoRA cannot serve."""
    from trl.experimental.async_grpo.async_grpo_trainer import validate_lora_for_vllm_sync as validate

    return validate(model)


def select_adapter_sync(server_info: dict, model: Any, max_staleness: int) -> bool:
    """TRL's `select_adapter_sync`: whether a server (its `/server_info` `vllm_config`) can take adapter-only syncs
    of `model` with `max_staleness` versions in flight (False, with a warning, when it was started without LoRA;
    raises ValueError when its `--max-lora-rank` or `--max-loras` is too low)."""
    from types import SimpleNamespace

    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync as select

    return select(server_info, model, SimpleNamespace(max_staleness=max_staleness))


def round_lora_rank(rank: int) -> int:
    """TRL's `round_lora_rank`: the smallest `--max-lora-rank` vLLM accepts that serves an adapter of `rank`."""
    from trl.experimental.async_grpo.async_grpo_trainer import round_lora_rank as round_rank

    return round_rank(rank)


def nccl_weight_transfer_client(server_url: str, server_timeout: float, update_info: dict, sync_timeout: int) -> Any:
    """TRL's `WeightTransferClient` over its `VLLMClient` (needs vllm installed, and a GPU to run)."""
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    return WeightTransferClient(VLLMClient(server_url, server_timeout), update_info, weight_sync_timeout=sync_timeout)


def flash_tree_attention(*args: Any, **kwargs: Any) -> Any:
    """TRL's FA3 varlen tree attention (`packing.tree_attention`), for CUDA."""
    from trl.experimental.async_grpo.packing import tree_attention

    return tree_attention(*args, **kwargs)


def flash_attention_kernel() -> Any:
    """Load TRL's FA3 kernel (`packing._flash_attn`); raises when it cannot (no CUDA, no `kernels`, no hub)."""
    from trl.experimental.async_grpo.packing import _flash_attn

    return _flash_attn()
