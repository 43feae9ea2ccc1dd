"""`GRPOModule`'s validation hooks, delegated: one batch of held-out prompts through the training rollouts'
conversations, scored into the epoch's `ValidationTally`, and the tally added over ranks and logged as `val/*`."""

from __future__ import annotations

from typing import Any

import torch

from ..data.tooling import ConversationSpec
from ..models.loading import eos_token_ids
from ..training.module_options import ValidationOptions
from ..training.sharding import is_sharded
from .metrics import ValidationTally
from .rollouts import Sampling, reward_table, validation_rollouts


def start_tally(module: Any, options: ValidationOptions) -> ValidationTally:
    """An empty tally for this epoch, with the module's contract's reward columns and weights."""
    contract = module.contract
    return ValidationTally(
        contract.reward_names, contract.reward_weights, options.num_generations_eval, options.val_pass_threshold
    )


def conversation_of(module: Any) -> ConversationSpec:
    """The conversations of training (tools, environments, prompt format), or plain chat."""
    return module.contract.conversation or ConversationSpec(tokenizer=module.contract.tokenizer)


def validate_batch(
    module: Any,
    batch: list[dict[str, Any]],
    tally: ValidationTally | None,
    options: ValidationOptions,
    attention: str | None,
) -> None:
    """Every rank: conversations on this rank's held-out prompts, scored into `tally`, sampled as `options` say, the
    padded batches with the `attention` implementation (None: `"sdpa"`).

    Under a sharded policy every rank runs the same number of forward passes (`fixed_length`, and the number of
    conversations still active agreed over ranks), since each forward is a collective.

    Raises:
        RuntimeError: no tally (`start_tally` runs when the validation epoch starts).
    """
    if tally is None:
        raise RuntimeError("`validate_batch` scores into the epoch's tally: `start_tally` runs when the epoch starts.")
    contract = module.contract
    sharded = is_sharded(module.policy, module.trainer.model)
    sampling = Sampling(
        max_tokens=options.val_max_tokens or contract.max_completion_length,
        temperature=options.val_temperature,
        top_p=contract.top_p,
        top_k=contract.top_k,
        attention=attention or "sdpa",
        fixed_length=sharded,
        stop=contract.stop,
    )
    rollouts = validation_rollouts(
        module.policy,
        batch,
        conversation_of(module),
        sampling,
        num_generations=options.num_generations_eval,
        eos_token_ids=eos_token_ids(contract.tokenizer, module.policy),
        sync_active=(lambda active: _most_over_ranks(active, module.device)) if sharded else None,
    )
    scored = module.trainer.datamodule.score_completions(rollouts.completions, rollouts.rows)
    columns = reward_table(rollouts, scored, list(contract.reward_names))
    k = options.num_generations_eval
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
