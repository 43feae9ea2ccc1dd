"""GRPOModule: the policy, the GRPO loss on packed optimizer steps, trainer scoring and held-out validation."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn

from ._imports import import_object
from .contract import RolloutContract, require_rollout_source
from .loss import LossStats, grpo_loss, packed_logprobs
from .pipeline.batch import StepBatch
from .sharding import check_strategy, gradient_sync, is_sharded, shard_policy
from .step_metrics import StepMetrics
from .validation import greedy_completions

log = logging.getLogger(__name__)


class GRPOModule(pl.LightningModule):
    """Trains a causal LM with asynchronous GRPO: one Lightning batch is one optimizer step.

    Each batch (a `StepBatch` from `GRPODataModule`) holds this rank's packed micro-batches of one optimizer step.
    `setup` reads the data module's `RolloutContract` once (sampling temperature, reward weights, advantage options):
    the module trains only on a `lightning_grpo.RolloutSource`. `on_train_batch_start` runs the trainer scorers
    (`score_step`) on groups whose advantages are pending; `training_step` runs each micro-batch's forward (tree
    attention over the packed prefix trie) and backward, with gradient sync only on the last one, clips the gradient
    norm and steps the optimizer once. The loss is TRL's async GRPO loss: a PPO-clipped ratio against the generator's
    log-probabilities, a token mean over the whole step. `validation_step` samples greedy completions of held-out
    prompts and scores them with the data module's reward functions (`val/reward`, `val/rewards/<name>`), so
    `Trainer.validate` and `val_check_interval` work.

    Several processes: DDP (`strategy="ddp"`), Lightning's FSDP on GPUs (`strategy="fsdp"`), or FSDP2 through
    `ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`, under which `configure_model` shards the
    policy with `fully_shard` (CPU with gloo too). A strategy that would not reduce the policy's gradients across
    ranks is refused at start-up.

    Logged (TRL's names): `loss`, `reward`, `reward_std`, `rewards/<name>`, `ratio`, `kl`, `entropy`,
    `clip_ratio/*`, `sample/staleness_*`, `batch/*`, `perf/step_s`, `perf/fwd_bwd_s`, `lr` (the learning rate the
    step trained with). Each optimizer step's metrics reach every logger once, as one row (`step_metrics`, a
    `StepMetrics`); a `*_total` metric is the run's count so far, kept in the checkpoint.

    Optimizer and schedule: AdamW (`learning_rate`, `weight_decay`, `betas`) with a linear warm-up over
    `warmup_steps` and then a constant rate, unless `optimizer` / `lr_scheduler` say otherwise. Both follow
    LightningCLI's callable pattern: in YAML, `model.optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.1}}`
    and `model.lr_scheduler: {class_path: torch.optim.lr_scheduler.CosineAnnealingLR, init_args: {T_max: 40}}`; in
    Python, any callable such as `functools.partial(torch.optim.SGD, lr=0.1)`. The optimizer gets the policy's
    parameters that require grad, once `configure_model` has loaded the policy. With `warmup_steps` and an
    `lr_scheduler`, the warm-up runs first and the scheduler starts after it (`SequentialLR`). Resuming from a
    checkpoint restores both.

    Args:
        model: the policy: a name or path for `lightning_grpo.models.load_policy` (`"tiny-random"`,
            `"smollm2-135m-instruct"`, a local folder, a Hub id) or an `nn.Module` (a transformers causal LM).
        learning_rate: the default AdamW's learning rate.
        weight_decay: the default AdamW's weight decay.
        betas: the default AdamW's betas.
        warmup_steps: linear warm-up of the learning rate over this many optimizer steps, from `1 / (warmup_steps
            + 1)` of the rate; then constant, or `lr_scheduler`.
        optimizer: builds the optimizer from the parameters to train (`OptimizerCallable`); None: AdamW with
            `learning_rate`, `weight_decay` and `betas` (with an `optimizer`, those are ignored, with a warning).
        lr_scheduler: builds a learning-rate scheduler from the optimizer (`LRSchedulerCallable`), stepped once per
            optimizer step; None: constant after the warm-up.
        max_grad_norm: clip the gradient norm to this; None disables clipping.
        epsilon: lower clip range of the ratio (`1 - epsilon`).
        epsilon_high: upper clip range (`1 + epsilon_high`); default `epsilon` (DAPO uses 0.28).
        scorers: `TrainerScorer`s that add reward columns on the trainer (reward models, EBFT); their groups'
            advantages are computed here. An entry may be an instance, or an import path (`"pkg.mod.make_scorer"`)
            of an instance or of a factory called without arguments.
        scorer_weights: one weight per scorer column (default 1 each); the rollout columns keep the data module's
            `reward_weights`.
        dtype: the policy's dtype when loaded by name.
        val_max_tokens: tokens per greedy validation completion; default the data module's `max_completion_length`.

    Raises:
        ValueError: a non-positive `learning_rate`, `epsilon` or `max_grad_norm`, a negative `warmup_steps`,
            `scorer_weights` of the wrong length, an `optimizer` or `lr_scheduler` that cannot be built (or a
            `ReduceLROnPlateau`, which needs a monitored metric); in `setup`, a strategy whose gradients would not be
            synchronised.
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
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        max_grad_norm: float | None = 1.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        scorers: Sequence[Any] | None = None,
        scorer_weights: list[float] | None = None,
        dtype: Literal["float32", "bfloat16"] = "float32",
        val_max_tokens: int | None = None,
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
        _check_optimizer_options(
            optimizer, lr_scheduler, learning_rate=learning_rate, weight_decay=weight_decay, betas=betas
        )
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        # Callables stay out of the checkpoint's hyper-parameters (it is loaded with weights_only=True).
        self.save_hyperparameters(ignore=["model", "scorers", "optimizer", "lr_scheduler"])
        self.model_name = model if isinstance(model, str) else None
        self.policy: Any = model if isinstance(model, torch.nn.Module) else None
        self.scorers = [_resolve_scorer(scorer) for scorer in scorers or []]
        if scorer_weights is not None and len(scorer_weights) != len(self.scorers):
            raise ValueError(
                f"`GRPOModule(scorer_weights={scorer_weights})` needs one weight per scorer ({len(self.scorers)})."
            )
        self.automatic_optimization = False
        self.contract: RolloutContract | None = None
        self.step_metrics = StepMetrics()
        self.scored_step: Any = None  # the last step's `ScoredStep` (trainer scorers), for the completions table
        self._step_started: float | None = None
        self._generate_attention: str | None = None

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

        `WeightSyncCallback` pushes this step's weights; `RolloutStopCallback` then plans the next step (the
        look-ahead); `RolloutMetricsCallback` logs what the rollout side measured up to there, the look-ahead's drops
        included. Lightning appends the callbacks returned here after the trainer's, replacing the trainer's own of
        the same types: a callback the trainer has is returned (moved) only when one before it in that order is
        added or comes after it. A `CompletionsTableCallback` is added when the trainer has none; it may run anywhere.
        """
        from .callbacks import CompletionsTableCallback, RolloutMetricsCallback, RolloutStopCallback, WeightSyncCallback

        trainer = _trainer_of(self)
        present = list(trainer.callbacks) if trainer is not None else []

        def find(cls: type) -> pl.Callback | None:
            return next((c for c in present if isinstance(c, cls)), None)

        returned: list[pl.Callback] = []
        position = -1
        for cls in (WeightSyncCallback, RolloutStopCallback, RolloutMetricsCallback):
            own = find(cls)
            if own is None:
                returned.append(cls())
            elif returned or present.index(own) < position:
                returned.append(own)
            else:
                position = present.index(own)
        if find(CompletionsTableCallback) is None:
            returned.append(CompletionsTableCallback())
        return returned

    def configure_optimizers(self) -> dict[str, Any]:
        """The optimizer over the policy's parameters that require grad, and its per-step schedule (see the class)."""
        hp = self.hparams
        parameters = [p for p in self.policy.parameters() if p.requires_grad]
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(parameters)
        else:
            optimizer = torch.optim.AdamW(
                parameters, lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=tuple(hp.betas)
            )
        warmup = hp.warmup_steps
        lr_scheduler = torch.optim.lr_scheduler
        scheduler = lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup)
        if self.lr_scheduler_factory is not None:
            after = self.lr_scheduler_factory(optimizer)
            scheduler = (
                lr_scheduler.SequentialLR(optimizer, [scheduler, after], milestones=[warmup]) if warmup else after
            )
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
        self.scored_step = scored
        if scored is not None and scored.metrics and self.trainer.is_global_zero:
            self.step_metrics.add(self, scored.metrics)

    def _column_weights(self) -> list[float]:
        scorer_weights = self.hparams.scorer_weights or [1.0] * len(self.scorers)
        return [*self.contract.reward_weights, *scorer_weights]

    def training_step(self, batch: StepBatch, batch_idx: int) -> None:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        started = time.perf_counter()
        stats = LossStats.zeros()
        total_loss = torch.zeros(())
        lr = optimizer.param_groups[0]["lr"]  # the rate this step trains with (the scheduler moves it after)
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
        self._log_step(batch, stats, total_loss, lr=lr, fwd_bwd_s=time.perf_counter() - started)

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

    def _log_step(self, batch: StepBatch, stats: LossStats, loss: torch.Tensor, lr: float, fwd_bwd_s: float) -> None:
        strategy = self.trainer.strategy
        sums = strategy.reduce(stats.sums(), reduce_op="sum")
        extremes = stats.extremes().clone()
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        metrics = LossStats.from_reduced(sums, extremes).metrics()
        metrics["loss"] = float(strategy.reduce(loss, reduce_op="sum"))
        metrics["lr"] = lr
        metrics["perf/fwd_bwd_s"] = fwd_bwd_s
        now = time.perf_counter()
        if self._step_started is not None:
            metrics["perf/step_s"] = now - self._step_started
        self._step_started = now
        if self.trainer.is_global_zero:
            self.step_metrics.add(self, metrics)
            self.step_metrics.add(self, {k: v for k, v in batch.metrics.items() if _is_number(v)})

    def on_train_batch_end(self, outputs: Any, batch: StepBatch, batch_idx: int) -> None:
        """After every callback's: send this step's metrics to the loggers, once (see `StepMetrics`)."""
        self.step_metrics.flush(self.trainer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grpo_metric_totals"] = self.step_metrics.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.step_metrics.load_state_dict(checkpoint.get("grpo_metric_totals", {}))

    # -- validation -------------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        completions = greedy_completions(
            self.policy,
            batch,
            self.contract.tokenizer,
            max_tokens=self.hparams.val_max_tokens or self.contract.max_completion_length,
            attention=self._generate_attention,
            fixed_length=is_sharded(self.policy, self.trainer.model),
        )
        rewards = self.trainer.datamodule.score_completions(completions, batch)
        size = len(batch)
        total = torch.tensor([math.fsum(_nan_to_zero(sum(vals) for vals in zip(*rewards.values(), strict=True)))])
        self.log("val/reward", total / size, batch_size=size, sync_dist=True, on_epoch=True, prog_bar=True)
        for name, values in rewards.items():
            value = torch.tensor([math.fsum(_nan_to_zero(values)) / size])
            self.log(f"val/rewards/{name}", value, batch_size=size, sync_dist=True, on_epoch=True)


def _check_optimizer_options(optimizer: Any, lr_scheduler: Any, **adamw: Any) -> None:
    """Warn that AdamW's own options are ignored beside an `optimizer`, and build the optimizer and the scheduler
    once over a stand-in parameter, so that a bad argument of theirs fails now rather than inside fit."""
    defaults = inspect.signature(GRPOModule.__init__).parameters
    changed = [f"{key}={value}" for key, value in adamw.items() if _plain(value) != _plain(defaults[key].default)]
    if optimizer is not None and changed:
        rank_zero_warn(
            f"`GRPOModule(optimizer=..., {', '.join(changed)})`: learning_rate, weight_decay and betas configure the "
            "default AdamW only, so they are ignored; the optimizer's own arguments (`init_args` in YAML) apply."
        )
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for name, factory, argument in (
        ("optimizer", optimizer, [torch.nn.Parameter(torch.zeros(1))]),
        ("lr_scheduler", lr_scheduler, probe),
    ):
        if factory is None:
            continue
        try:
            built = factory(argument)
        except (TypeError, ValueError) as error:
            raise ValueError(f"`GRPOModule({name}=...)` cannot be built: {type(error).__name__}: {error}") from error
        if isinstance(built, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "`GRPOModule(lr_scheduler=ReduceLROnPlateau)` needs a monitored metric at each step; GRPOModule steps "
                "its scheduler once per optimizer step without one. Use a step-based scheduler (CosineAnnealingLR, "
                "LinearLR, OneCycleLR, ...)."
            )


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


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


def _nan_to_zero(values: Any) -> list[float]:
    return [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]


def _trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None when it is not attached to one (a hook called by hand)."""
    try:
        return module.trainer
    except RuntimeError:
        return None
