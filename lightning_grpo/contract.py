"""The contract between GRPOModule and GRPODataModule: what training needs from the rollout side, and what the
callbacks call on it.

`RolloutContract` is a frozen record the data module builds in `setup` and the module reads once, in its own
`setup`: nothing the loss or the scorers depend on is read from the data module's hyper-parameters or private
attributes, and nothing has a silent default. `RolloutSource` is the small protocol the module and the callbacks
call; `GRPODataModule` implements it, and so can any data module that feeds `GRPOModule` its own `StepBatch`es.
`PolicySource` is the reverse direction: what the data module reads from the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .options import AdvantageEstimator, DataModuleOptions, MultiObjectiveAggregation, ScaleRewards

if TYPE_CHECKING:
    import torch

    from .data.preparation import PromptData
    from .data.tooling import ConversationSpec
    from .pipeline.batch import StepBatch
    from .pipeline.ledger import RolloutProgress, RolloutStop
    from .weights.sync import WeightSync


@dataclass(frozen=True)
class RolloutContract:
    """What the rollouts a `GRPOModule` trains on were made with, and how their advantages are formed.

    Attributes:
        tokenizer: the policy's tokenizer (validation renders prompts and decodes completions with it).
        temperature: the generator's sampling temperature; the loss divides the policy's logits by it.
        top_p: the generator's nucleus mass; the loss scores the same truncated distribution.
        top_k: the generator's top-k (0 = off); likewise.
        min_p: the generator's min-p (None = off); likewise.
        max_completion_length: tokens per completion (validation's default budget).
        reward_names: the rollout reward columns, in `StepBatch.reward_names` order: the reward functions', then one
            per environment class with a `get_reward`.
        reward_weights: one weight per rollout reward column.
        multi_objective_aggregation: `"sum_then_normalize"` or `"normalize_then_sum"`.
        scale_rewards: `"group"`, `"batch"` or `"none"`.
        mask_truncated_completions: truncated completions train nothing.
        drop_no_signal_groups: trainer-scored samples whose advantage is exactly 0 leave the loss (and a group with
            none left is dropped); False: they train, counted in the normaliser, as GRPOTrainer's do.
        advantage_estimator: the advantages' baseline, `"grpo"`, `"rloo"` or `"reinforce_plus_plus"` (trainer-scored
            groups are scored with it).
        conversation: how prompts become conversations (prompt format, tools, environments), which validation runs
            the same way; None: single-turn chat prompts without tools.
        stop: the generator's stop strings; validation's turns end at them too.

    Example::

        import lightning.pytorch as pl

        from lightning_grpo import GRPODataModule, GRPOModule

        module = GRPOModule("tiny-random")
        data = GRPODataModule(dataset_size=4, num_generations=4, temperature=0.7)
        pl.Trainer(accelerator="cpu", max_steps=1, logger=False).fit(module, datamodule=data)
        contract = module.contract  # what the data module's rollouts were made with
        assert contract.temperature == 0.7
    """

    tokenizer: Any
    temperature: float
    top_p: float
    top_k: int
    max_completion_length: int
    reward_names: tuple[str, ...]
    reward_weights: tuple[float, ...]
    multi_objective_aggregation: MultiObjectiveAggregation
    scale_rewards: ScaleRewards
    mask_truncated_completions: bool
    advantage_estimator: AdvantageEstimator = "grpo"
    min_p: float | None = None
    conversation: ConversationSpec | None = None
    stop: tuple[str, ...] = ()
    drop_no_signal_groups: bool = True

    def __post_init__(self) -> None:
        if len(self.reward_weights) != len(self.reward_names):
            raise ValueError(
                f"`RolloutContract(reward_weights={list(self.reward_weights)})` needs one weight per reward column "
                f"{list(self.reward_names)}."
            )


def build_contract(options: DataModuleOptions, data: PromptData, reward_funcs: Sequence[Callable]) -> RolloutContract:
    """The `RolloutContract` of the loaded prompts `data` under the data module's options."""
    from ._trl import get_callable_name

    sampling, rewards = options.sampling, options.rewards
    names = (*(get_callable_name(func) for func in reward_funcs), *data.conversation.reward_names)
    weights = tuple(rewards.reward_weights[: len(names)]) if rewards.reward_weights else (1.0,) * len(names)
    return RolloutContract(
        tokenizer=data.tokenizer,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_completion_length=sampling.max_completion_length,
        reward_names=names,
        reward_weights=weights,
        multi_objective_aggregation=rewards.multi_objective_aggregation,
        scale_rewards=rewards.scale_rewards,
        mask_truncated_completions=options.steps.mask_truncated_completions,
        advantage_estimator=rewards.advantage_estimator,
        min_p=sampling.min_p,
        conversation=data.conversation,
        stop=tuple(sampling.stop or ()),
        drop_no_signal_groups=options.steps.drop_no_signal_groups,
    )


@runtime_checkable
class RolloutSource(Protocol):
    """What `GRPOModule` and the callbacks call on their data module (`GRPODataModule` implements it).

    Attributes:
        weight_sync: pushes the policy to the generator and keeps the policy version (`WeightSyncCallback`).
        progress: rank 0's progress ledger (None on other ranks); `score_step` reports scored groups to it.
        process_group: the process group trainer scoring gathers over (None: the default one).

    Example::

        from lightning_grpo import GRPODataModule, RolloutSource

        assert isinstance(GRPODataModule(), RolloutSource)
    """

    weight_sync: WeightSync | None
    progress: RolloutProgress | None
    process_group: Any

    def rollout_contract(self) -> RolloutContract:
        """The contract, once `setup` ran (`GRPOModule.setup` reads it)."""
        ...

    def finish_step(self, batch: StepBatch, *, look_ahead: bool) -> RolloutStop | None:
        """Every rank, after `batch` trained: record it, and with `look_ahead` fetch the next step.

        Returns the stream's `RolloutStop` when it ended there (`RolloutStopCallback` ends the run on it).
        """
        ...

    def stream_stop(self) -> RolloutStop | None:
        """The `RolloutStop` the training stream ended with, if it ended."""
        ...

    def rollout_metrics(self) -> dict[str, float]:
        """Rank 0: what the rollout side measured since the last call (`RolloutMetricsCallback`)."""
        ...

    def progress_summary(self) -> dict[str, int] | None:
        """Rank 0: `{"groups_consumed", "groups_total", "groups_trained", "groups_dropped"}` (`GRPOProgressBar`).

        Consumed: trained in a finished optimizer step, or dropped; a run ends when it reaches the total.
        """
        ...

    def score_completions(self, completions: list[list[dict]], rows: list[dict]) -> dict[str, list[float]]:
        """Every reward function's rewards for validation `completions` of `rows`."""
        ...


@runtime_checkable
class PolicySource(Protocol):
    """What the data module reads from its LightningModule (`GRPOModule` implements it).

    Attributes:
        policy: the causal LM being trained (unwrapped; sharded in place under FSDP2).
        model_name: the policy's `load_policy` name, or None for a policy passed as a module.
        scorers: trainer scorers; with any, advantages are left pending for `score_step`.
    """

    policy: torch.nn.Module
    model_name: str | None
    scorers: Sequence[Any]


def require_rollout_source(datamodule: Any, who: str) -> RolloutSource:
    """`datamodule`, checked to be a `RolloutSource`.

    Raises:
        TypeError: naming `who` needs it, what it got, and the fix.
    """
    if not isinstance(datamodule, RolloutSource):
        got = "no data module" if datamodule is None else f"a {type(datamodule).__name__}"
        raise TypeError(
            f"{who} trains on a GRPODataModule (or a data module implementing lightning_grpo.RolloutSource), but got "
            f"{got}: pass `datamodule=GRPODataModule(...)` to `Trainer.fit`/`validate`. GRPOModule reads the "
            "rollouts' sampling temperature, reward weights and advantage options from it, and weights are pushed "
            "through it."
        )
    return datamodule


def require_policy_source(module: Any, who: str) -> PolicySource:
    """`module`, checked to be a `PolicySource`.

    Raises:
        TypeError: naming `who` needs it and what it got.
    """
    if not isinstance(module, PolicySource):
        raise TypeError(
            f"{who} trains a GRPOModule (or a LightningModule with `policy`, `model_name` and `scorers`); "
            f"got {type(module).__name__}."
        )
    return module
