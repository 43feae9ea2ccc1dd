"""GRPOModule: the policy, the GRPO loss on packed optimizer steps, trainer scoring and held-out validation."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from ._imports import import_object
from .contract import RolloutContract, require_rollout_source
from .loss import LossStats, grpo_loss, packed_logprobs
from .pipeline.batch import StepBatch
from .sharding import check_strategy, gradient_sync, is_sharded, shard_policy
from .tooling import ConversationSpec
from .validation_metrics import ValidationTally, check_validation_options

log = logging.getLogger(__name__)


class GRPOModule(pl.LightningModule):
    """Trains a causal LM with asynchronous GRPO: one Lightning batch is one optimizer step.

    Each batch (a `StepBatch` from `GRPODataModule`) holds this rank's packed micro-batches of one optimizer step.
    `setup` reads the data module's `RolloutContract` once (sampling temperature, reward weights, advantage options):
    the module trains only on a `lightning_grpo.RolloutSource`. `on_train_batch_start` runs the trainer scorers
    (`score_step`) on groups whose advantages are pending; `training_step` runs each micro-batch's forward (tree
    attention over the packed prefix trie) and backward, with gradient sync only on the last one, clips the gradient
    norm and steps the optimizer once. The loss is TRL's async GRPO loss: a PPO-clipped ratio against the generator's
    log-probabilities, a token mean over the whole step. `validation_step` runs the training rollouts' conversations
    (prompt format, tools, environments) on held-out prompts with the policy being trained, `num_generations_eval`
    per prompt, greedy or sampled, and scores them with the data module's reward columns, weighted as in training:
    `val/reward`, `val/rewards/<name>`, `val/pass@k`, `val/mean@k` (k = `num_generations_eval`), `val/unscored_frac`
    and, with tools, `val/tools/*`. NaN rewards stay "not scored": every mean is over the completions that were
    scored. `Trainer.validate` and `val_check_interval` work.

    Several processes: DDP (`strategy="ddp"`), Lightning's FSDP on GPUs (`strategy="fsdp"`), or FSDP2 through
    `ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`, under which `configure_model` shards the
    policy with `fully_shard` (CPU with gloo too). A strategy that would not reduce the policy's gradients across
    ranks is refused at start-up.

    Logged (TRL's names): `loss`, `reward`, `reward_std`, `rewards/<name>`, `ratio`, `kl`, `entropy`,
    `clip_ratio/*`, `sample/staleness_*`, `batch/*`, `perf/step_s`, `perf/fwd_bwd_s`, `lr`.

    Args:
        model: the policy: a name or path for `lightning_grpo.models.load_policy` (`"tiny-random"`,
            `"smollm2-135m-instruct"`, a local folder, a Hub id) or an `nn.Module` (a transformers causal LM).
        learning_rate: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
        betas: AdamW's betas.
        warmup_steps: linear warm-up of the learning rate over this many optimizer steps, then constant.
        max_grad_norm: clip the gradient norm to this; None disables clipping.
        epsilon: lower clip range of the ratio (`1 - epsilon`).
        epsilon_high: upper clip range (`1 + epsilon_high`); default `epsilon` (DAPO uses 0.28).
        scorers: `TrainerScorer`s that add reward columns on the trainer (reward models, EBFT); their groups'
            advantages are computed here. An entry may be an instance, or an import path (`"pkg.mod.make_scorer"`)
            of an instance or of a factory called without arguments.
        scorer_weights: one weight per scorer column (default 1 each); the rollout columns keep the data module's
            `reward_weights`.
        dtype: the policy's dtype when loaded by name.
        val_max_tokens: tokens per validation turn; default the data module's `max_completion_length`.
        num_generations_eval: completions per held-out prompt (TRL's name; the k of `val/pass@k`). TRL's default is
            `num_generations`; here 1, since validation is greedy by default.
        val_temperature: 0 for greedy validation; above 0, sampled at this temperature (with the data module's
            `top_p` and `top_k`), which `num_generations_eval > 1` needs.
        val_pass_threshold: a completion passes (for `val/pass@k`, `val/mean@k`) when its weighted reward is at least
            this.

    Raises:
        ValueError: a non-positive `learning_rate`, `epsilon` or `max_grad_norm`, a negative `warmup_steps`,
            `scorer_weights` of the wrong length; in `setup`, a strategy whose gradients would not be synchronised.
        TypeError: (in `setup`) a data module that is not a `RolloutSource` (or none).

    Example::

        trainer = Trainer(max_epochs=1, accelerator="cpu")
        trainer.fit(GRPOModule("tiny-random"), datamodule=GRPODataModule(reward_funcs=[my_reward]))
    """

    def __init__(
        self,
        model: str | torch.nn.Module = "tiny-random",
        *,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        scorers: Sequence[Any] | None = None,
        scorer_weights: list[float] | None = None,
        dtype: Literal["float32", "bfloat16"] = "float32",
        val_max_tokens: int | None = None,
        num_generations_eval: int = 1,
        val_temperature: float = 0.0,
        val_pass_threshold: float = 1.0,
    ) -> None:
        super().__init__()
        problems = [f"{k}={v}" for k, v in (("learning_rate", learning_rate), ("epsilon", epsilon)) if not v > 0]
        if warmup_steps < 0:
            problems.append(f"warmup_steps={warmup_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            problems.append(f"max_grad_norm={max_grad_norm}")
        if problems:
            raise ValueError(
                f"`GRPOModule({', '.join(problems)})`: learning_rate, epsilon and max_grad_norm must be "
                "positive, warmup_steps at least 0."
            )
        check_validation_options(num_generations_eval, val_temperature, val_max_tokens)
        self.save_hyperparameters(ignore=["model", "scorers"])
        self.model_name = model if isinstance(model, str) else None
        self.policy: Any = model if isinstance(model, torch.nn.Module) else None
        self.scorers = [_resolve_scorer(scorer) for scorer in scorers or []]
        if scorer_weights is not None and len(scorer_weights) != len(self.scorers):
            raise ValueError(
                f"`GRPOModule(scorer_weights={scorer_weights})` needs one weight per scorer ({len(self.scorers)})."
            )
        self.automatic_optimization = False
        self.contract: RolloutContract | None = None
        self._step_started: float | None = None
        self._generate_attention: str | None = None
        self._val_tally: ValidationTally | None = None

    # -- model ------------------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Read the data module's `RolloutContract`, and refuse a strategy that would not sync the policy's gradients.

        Raises:
            TypeError: no data module, or one that is not a `lightning_grpo.RolloutSource`.
            ValueError: see `lightning_grpo.sharding.check_strategy`.
        """
        datamodule = require_rollout_source(self.trainer.datamodule, "GRPOModule")
        self.contract = datamodule.rollout_contract()
        check_strategy(self.trainer.strategy, self.trainer.world_size)

    def configure_model(self) -> None:
        if self.policy is None:
            from .models import load_policy

            self.policy = load_policy(self.model_name, dtype=getattr(torch, self.hparams.dtype))
        self.policy.train()  # loaders return eval mode; Lightning switches to eval and back around validation
        # Training switches the policy to tree attention; greedy validation batches use the loaded implementation.
        if self._generate_attention is None:
            loaded = self.policy.config._attn_implementation
            self._generate_attention = loaded if loaded and not loaded.startswith("tree") else "sdpa"
        trainer = _trainer_of(self)
        if trainer is not None:
            shard_policy(self.policy, trainer.strategy)
        for scorer in self.scorers:
            if isinstance(scorer, torch.nn.Module):
                scorer.to(self.device)

    def configure_callbacks(self) -> list[pl.Callback]:
        """The callbacks async GRPO needs, in the order they must run, unless the trainer already has them.

        `RolloutStopCallback` plans the next step, so it runs after `WeightSyncCallback` has pushed this step's
        weights; a `RolloutStopCallback` the trainer already has is moved after a `WeightSyncCallback` added here.
        """
        from .callbacks import RolloutMetricsCallback, RolloutStopCallback, WeightSyncCallback

        trainer = _trainer_of(self)
        present = list(trainer.callbacks) if trainer is not None else []

        def find(cls: type) -> pl.Callback | None:
            return next((c for c in present if isinstance(c, cls)), None)

        added = [cls() for cls in (WeightSyncCallback, RolloutMetricsCallback) if find(cls) is None]
        stop = find(RolloutStopCallback)
        if stop is None:
            return [*added, RolloutStopCallback()]
        # Lightning appends the callbacks returned here, replacing the trainer's of the same type: returning the
        # trainer's own RolloutStopCallback moves it after what is added.
        return [*added, stop] if added else []

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=tuple(hp.betas)
        )
        warmup = hp.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- training ---------------------------------------------------------------------------------------------------

    def on_train_batch_start(self, batch: StepBatch, batch_idx: int) -> None:
        self._step_started = self._step_started or time.perf_counter()
        if self.scorers:
            self._score(batch)

    def _score(self, batch: StepBatch) -> None:
        from .scoring.step import score_step

        contract = self.contract
        datamodule = self.trainer.datamodule
        scored = score_step(
            self,
            batch,
            scorers=self.scorers,
            reward_weights=self._column_weights(),
            aggregation=contract.multi_objective_aggregation,
            scale_rewards=contract.scale_rewards,
            mask_truncated_completions=contract.mask_truncated_completions,
            progress=datamodule.progress,
            group=datamodule.process_group,
        )
        if scored is not None and scored.metrics:
            self.log_dict(scored.metrics, rank_zero_only=True, on_step=True, on_epoch=False)

    def _column_weights(self) -> list[float]:
        scorer_weights = self.hparams.scorer_weights or [1.0] * len(self.scorers)
        return [*self.contract.reward_weights, *scorer_weights]

    def training_step(self, batch: StepBatch, batch_idx: int) -> None:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        started = time.perf_counter()
        stats = LossStats.zeros()
        total_loss = torch.zeros(())
        last = len(batch.micro_batches) - 1
        for i, micro_batch in enumerate(batch.micro_batches):
            micro_batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in micro_batch.items()}
            with gradient_sync(self.trainer.strategy, self.policy, self.trainer.model, enabled=i == last):
                loss, micro_stats = self._micro_batch_loss(micro_batch)
                self.manual_backward(loss)
            stats = stats + micro_stats
            total_loss += loss.detach().float().cpu()
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self._log_step(batch, stats, total_loss, fwd_bwd_s=time.perf_counter() - started)

    def _micro_batch_loss(self, micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, LossStats]:
        logprobs, entropy = packed_logprobs(self.policy, micro_batch, self.contract.temperature)
        return grpo_loss(
            logprobs,
            micro_batch["old_log_probs"],
            micro_batch["advantages"],
            normalizer=micro_batch["step_trained_tokens"],
            epsilon=self.hparams.epsilon,
            epsilon_high=self.hparams.epsilon_high,
            world_size=self.trainer.world_size,
            segment_id=micro_batch["segment_id"],
            entropy=entropy,
        )

    def _log_step(self, batch: StepBatch, stats: LossStats, loss: torch.Tensor, fwd_bwd_s: float) -> None:
        strategy = self.trainer.strategy
        sums = strategy.reduce(stats.sums(), reduce_op="sum")
        extremes = stats.extremes().clone()
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        metrics = LossStats.from_reduced(sums, extremes).metrics()
        metrics["loss"] = float(strategy.reduce(loss, reduce_op="sum"))
        metrics["lr"] = self.optimizers().param_groups[0]["lr"]
        metrics["perf/fwd_bwd_s"] = fwd_bwd_s
        now = time.perf_counter()
        if self._step_started is not None:
            metrics["perf/step_s"] = now - self._step_started
        self._step_started = now
        finite = {k: v for k, v in metrics.items() if not math.isnan(v)}
        self.log_dict(finite, on_step=True, on_epoch=False, prog_bar=False, rank_zero_only=True)
        if self.trainer.is_global_zero and batch.metrics:
            sample_metrics = {k: float(v) for k, v in batch.metrics.items() if _is_number(v) and not math.isnan(v)}
            self.log_dict(sample_metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    # -- validation -------------------------------------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        contract, hp = self.contract, self.hparams
        self._val_tally = ValidationTally(
            contract.reward_names, contract.reward_weights, hp.num_generations_eval, hp.val_pass_threshold
        )

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Every rank: conversations on this rank's held-out prompts, scored into this epoch's tally."""
        from .models import eos_token_ids
        from .validation import Sampling, reward_columns, validation_rollouts

        contract, hp = self.contract, self.hparams
        sharded = is_sharded(self.policy, self.trainer.model)
        sampling = Sampling(
            max_tokens=hp.val_max_tokens or contract.max_completion_length,
            temperature=hp.val_temperature,
            top_p=contract.top_p,
            top_k=contract.top_k,
            attention=self._generate_attention,
            fixed_length=sharded,
        )
        rollouts = validation_rollouts(
            self.policy,
            batch,
            self._conversation(),
            sampling,
            num_generations=hp.num_generations_eval,
            eos_token_ids=eos_token_ids(contract.tokenizer, self.policy),
            sync_active=self._most_active_over_ranks if sharded else None,
        )
        scored = self.trainer.datamodule.score_completions(rollouts.completions, rollouts.rows)
        columns = reward_columns(rollouts, scored, list(contract.reward_names))
        k = hp.num_generations_eval
        for start in range(0, columns.shape[1], k):
            self._val_tally.add_prompt(columns[:, start : start + k])
        for conversation in rollouts.conversations:
            self._val_tally.add_conversation(
                conversation.tool_calls, conversation.tool_failures, conversation.loop_exhausted
            )

    def on_validation_epoch_end(self) -> None:
        """Every rank: add the ranks' tallies (one all-reduce) and log `val/*`, NaN where nothing was scored."""
        tally, self._val_tally = self._val_tally, None
        if tally is None:
            return
        totals = tally.tensor().to(self.device)
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        metrics = tally.metrics(totals.cpu(), tools=self._conversation().uses_tools)
        reward = metrics.pop("val/reward")
        # Every rank holds the same exact values already; "max" over ranks keeps them bit for bit.
        self.log("val/reward", reward, on_epoch=True, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log_dict(metrics, on_epoch=True, sync_dist=True, reduce_fx="max")

    def _conversation(self) -> ConversationSpec:
        return self.contract.conversation or ConversationSpec(tokenizer=self.contract.tokenizer)

    def _most_active_over_ranks(self, active: int) -> int:
        """The most conversations still running on any rank (every rank calls it once per validation turn)."""
        value = torch.tensor([active], device=self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())


def _resolve_scorer(scorer: Any) -> Any:
    """A scorer instance, from an instance or an import path of an instance or of a zero-argument factory."""
    from .scoring.scorer import TrainerScorer

    if not isinstance(scorer, str):
        return scorer
    value = import_object(scorer, "scorers")
    if not isinstance(value, TrainerScorer) and callable(value):
        value = value()
    if not isinstance(value, TrainerScorer):
        raise ValueError(f"`scorers` entry {scorer!r} did not give a TrainerScorer but a {type(value).__name__}.")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None when it is not attached to one (a hook called by hand)."""
    try:
        return module.trainer
    except RuntimeError:
        return None
