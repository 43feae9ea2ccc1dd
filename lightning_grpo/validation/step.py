"""`GRPOModule`'s validation hooks, delegated: one batch of held-out prompts through the training rollouts'
conversations, scored into the epoch's `ValidationTally`, and the tally added over ranks and logged as `val/*`."""

from __future__ import annotations

from typing import Any

import torch

from ..data.tooling import ConversationSpec
from ..models.loading import eos_token_ids
from ..training.sharding import is_sharded
from .metrics import ValidationTally
from .rollouts import Sampling, reward_columns, validation_rollouts


def start_tally(module: Any) -> ValidationTally:
    """An empty tally for this epoch, with the contract's reward columns and weights."""
    contract, hp = module.contract, module.hparams
    return ValidationTally(
        contract.reward_names, contract.reward_weights, hp.num_generations_eval, hp.val_pass_threshold
    )


def conversation_of(module: Any) -> ConversationSpec:
    """The conversations of training (tools, environments, prompt format), or plain chat."""
    return module.contract.conversation or ConversationSpec(tokenizer=module.contract.tokenizer)


def validate_batch(module: Any, batch: list[dict[str, Any]], tally: ValidationTally, attention: str | None) -> None:
    """Every rank: conversations on this rank's held-out prompts, scored into `tally`.

    Under a sharded policy every rank runs the same number of forward passes (`fixed_length`, and the number of
    conversations still active agreed over ranks), since each forward is a collective.
    """
    contract, hp = module.contract, module.hparams
    sharded = is_sharded(module.policy, module.trainer.model)
    sampling = Sampling(
        max_tokens=hp.val_max_tokens or contract.max_completion_length,
        temperature=hp.val_temperature,
        top_p=contract.top_p,
        top_k=contract.top_k,
        attention=attention,
        fixed_length=sharded,
        stop=contract.stop,
    )
    rollouts = validation_rollouts(
        module.policy,
        batch,
        conversation_of(module),
        sampling,
        num_generations=hp.num_generations_eval,
        eos_token_ids=eos_token_ids(contract.tokenizer, module.policy),
        sync_active=(lambda active: _most_over_ranks(active, module.device)) if sharded else None,
    )
    scored = module.trainer.datamodule.score_completions(rollouts.completions, rollouts.rows)
    columns = reward_columns(rollouts, scored, list(contract.reward_names))
    k = hp.num_generations_eval
    for start in range(0, columns.shape[1], k):
        tally.add_prompt(columns[:, start : start + k])
    for conversation in rollouts.conversations:
        tally.add_conversation(
            conversation.tool_calls, conversation.tool_failures, conversation.loop_exhausted, len(conversation.turns)
        )


def log_tally(module: Any, tally: ValidationTally) -> None:
    """Every rank: add the ranks' tallies (one all-reduce) and log `val/*`, NaN where nothing was scored."""
    totals = tally.tensor().to(module.device)
    if module.trainer.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
    metrics = tally.metrics(totals.cpu(), tools=conversation_of(module).uses_tools)
    reward = metrics.pop("val/reward")
    # Every rank holds the same exact values already; "max" over ranks keeps them bit for bit.
    module.log("val/reward", reward, on_epoch=True, prog_bar=True, sync_dist=True, reduce_fx="max")
    module.log_dict(metrics, on_epoch=True, sync_dist=True, reduce_fx="max")


def _most_over_ranks(active: int, device: torch.device) -> int:
    """The most conversations still running on any rank (every rank calls it once per validation turn)."""
    value = torch.tensor([active], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())
