"""`GRPOModule`'s validation hooks, delegated: a `ValidationEpoch` started with the epoch, each batch of held-out
prompts run through the training rollouts' conversations and scored into its tally, and the tallies added over ranks
into the `val/*` metrics the module logs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..data.tooling import ConversationSpec
from ..models.loading import eos_token_ids
from ..training.module_options import ValidationOptions
from .metrics import ValidationTally
from .rollouts import Sampling, reward_table, validation_rollouts

if TYPE_CHECKING:
    from ..contract import RolloutContract, RolloutSource


@dataclass(slots=True)
class ValidationEpoch:
    """One validation epoch: the tally its batches are scored into, and how they are run (the same for each batch).

    Attributes:
        tally: the epoch's counts on this rank.
        contract: the rollouts' contract: the reward columns and weights, the conversations, the tokenizer.
        sampling: how the held-out prompts are generated.
        num_generations: completions per prompt (the k of `val/pass@k`).
        device: where the ranks' counts are reduced (the module's device).
    """

    tally: ValidationTally
    contract: RolloutContract
    sampling: Sampling
    num_generations: int
    device: torch.device


def start_epoch(
    contract: RolloutContract, options: ValidationOptions, attention: str | None, sharded: bool, device: torch.device
) -> ValidationEpoch:
    """Every rank: an empty tally with the contract's reward columns and weights, and the sampling `options` say; the
    padded batches run with the `attention` implementation (None: `"sdpa"`).

    A `sharded` policy's forward is a collective, so then every rank runs the same number of forward passes
    (`fixed_length`, and the number of conversations still active agreed over ranks, on `device`).
    """
    tally = ValidationTally(
        contract.reward_names, contract.reward_weights, options.num_generations_eval, options.val_pass_threshold
    )
    sampling = Sampling(
        max_tokens=options.val_max_tokens or contract.max_completion_length,
        temperature=options.val_temperature,
        top_p=contract.top_p,
        top_k=contract.top_k,
        attention=attention or "sdpa",
        fixed_length=sharded,
        stop=contract.stop,
    )
    return ValidationEpoch(tally, contract, sampling, options.num_generations_eval, device)


def validate_batch(
    policy: torch.nn.Module, batch: list[dict[str, Any]], epoch: ValidationEpoch | None, source: RolloutSource
) -> None:
    """Every rank: the conversations of `policy` on this rank's held-out prompts, scored by the data module
    (`source.score_completions`) into the epoch's tally.

    Raises:
        RuntimeError: no epoch (`start_epoch` runs when the validation epoch starts).
    """
    if epoch is None:
        raise RuntimeError("`validate_batch` scores into the epoch's tally: `start_epoch` runs when the epoch starts.")
    contract, k = epoch.contract, epoch.num_generations
    rollouts = validation_rollouts(
        policy,
        batch,
        _conversation(contract),
        epoch.sampling,
        num_generations=k,
        eos_token_ids=eos_token_ids(contract.tokenizer, policy),
        sync_active=(lambda active: _most_over_ranks(active, epoch.device)) if epoch.sampling.fixed_length else None,
    )
    scored = source.score_completions(rollouts.completions, rollouts.rows)
    columns = reward_table(rollouts, scored, list(contract.reward_names))
    for start in range(0, columns.shape[1], k):
        epoch.tally.add_prompt(columns[:, start : start + k])
    for conversation in rollouts.conversations:
        epoch.tally.add_conversation(
            conversation.tool_calls, conversation.tool_failures, conversation.loop_exhausted, len(conversation.turns)
        )


def epoch_metrics(epoch: ValidationEpoch, world_size: int) -> dict[str, float]:
    """Every rank: the `val/*` metrics of the ranks' tallies added up (one all-reduce), NaN where nothing was scored;
    every rank returns the same values."""
    totals = epoch.tally.tensor().to(epoch.device)
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
    return epoch.tally.metrics(totals.cpu(), tools=_conversation(epoch.contract).uses_tools)


def _conversation(contract: RolloutContract) -> ConversationSpec:
    """The conversations of training (tools, environments, prompt format), or plain chat."""
    return contract.conversation or ConversationSpec(tokenizer=contract.tokenizer)


def _most_over_ranks(active: int, device: torch.device) -> int:
    """The most conversations still running on any rank (every rank calls it once per validation turn)."""
    value = torch.tensor([active], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())
