"""GRPOModule: the policy, the GRPO loss on packed optimizer steps, trainer scoring and held-out validation."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy

from ._imports import import_object
from .loss import LossStats, grpo_loss, packed_logprobs
from .pipeline.batch import StepBatch

log = logging.getLogger(__name__)


class GRPOModule(pl.LightningModule):
    """Trains a causal LM with asynchronous GRPO: one Lightning batch is one optimizer step.

    Each batch (a `StepBatch` from `GRPODataModule`) holds this rank's packed micro-batches of one optimizer step.
    `on_train_batch_start` runs the trainer scorers (`score_step`) on groups whose advantages are pending;
    `training_step` runs each micro-batch's forward (tree attention over the packed prefix trie) and backward, with
    gradient sync only on the last one, clips the gradient norm and steps the optimizer once. The loss is TRL's async
    GRPO loss: a PPO-clipped ratio against the generator's log-probabilities, a token mean over the whole step.
    `validation_step` samples greedy completions of held-out prompts and scores them with the data module's reward
    functions (`val/reward`, `val/rewards/<name>`), so `Trainer.validate` and `val_check_interval` work.

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
        val_max_tokens: tokens per greedy validation completion; default the data module's `max_completion_length`.

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
        self.save_hyperparameters(ignore=["model", "scorers"])
        self.model_name = model if isinstance(model, str) else None
        self.policy: Any = model if isinstance(model, torch.nn.Module) else None
        self.scorers = [_resolve_scorer(scorer) for scorer in scorers or []]
        if scorer_weights is not None and len(scorer_weights) != len(self.scorers):
            raise ValueError(
                f"`GRPOModule(scorer_weights={scorer_weights})` needs one weight per scorer ({len(self.scorers)})."
            )
        self.automatic_optimization = False
        self._step_started: float | None = None
        self._generate_attention: str | None = None

    # -- model ------------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.policy is None:
            from .models import load_policy

            self.policy = load_policy(self.model_name, dtype=getattr(torch, self.hparams.dtype))
        self.policy.train()  # loaders return eval mode; Lightning switches to eval and back around validation
        # Training switches the policy to tree attention; greedy validation batches use the loaded implementation.
        if self._generate_attention is None:
            loaded = self.policy.config._attn_implementation
            self._generate_attention = loaded if loaded and not loaded.startswith("tree") else "sdpa"
        for scorer in self.scorers:
            if isinstance(scorer, torch.nn.Module):
                scorer.to(self.device)

    def policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's `(name, tensor)` pairs, as the weight transfer sends them."""
        return ((name, param.detach()) for name, param in self.policy.named_parameters())

    def configure_callbacks(self) -> list[pl.Callback]:
        """The callbacks async GRPO needs, unless the trainer already has one of the same type."""
        from .callbacks import RolloutMetricsCallback, RolloutStopCallback, WeightSyncCallback

        present = {type(c) for c in self.trainer.callbacks} if self._trainer is not None else set()
        needed = [RolloutStopCallback, WeightSyncCallback, RolloutMetricsCallback]
        return [cls() for cls in needed if not any(issubclass(p, cls) for p in present)]

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=tuple(hp.betas)
        )
        warmup = hp.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- training ---------------------------------------------------------------------------------------------------

    @property
    def temperature(self) -> float:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        return float(getattr(getattr(datamodule, "hparams", {}), "temperature", 1.0) or 1.0)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if not isinstance(batch, StepBatch) or batch.stop:
            # The stop item trains nothing. RolloutStopCallback set `should_stop` (or raised); letting the batch
            # through, rather than returning -1, keeps the end-of-fit validation that `should_stop` allows.
            if isinstance(batch, StepBatch):
                _hide_last_step_metrics(self.trainer)
            return None
        self._step_started = self._step_started or time.perf_counter()
        if self.scorers:
            self._score(batch)
        return None

    def _score(self, batch: StepBatch) -> None:
        from .scoring.step import score_step

        datamodule = self.trainer.datamodule
        hp = datamodule.hparams
        scored = score_step(
            self,
            batch,
            scorers=self.scorers,
            reward_weights=self._column_weights(len(batch.reward_names)),
            aggregation=hp.multi_objective_aggregation,
            scale_rewards=hp.scale_rewards,
            mask_truncated_completions=hp.mask_truncated_completions,
            progress=datamodule.progress if self.trainer.is_global_zero else None,
            group=getattr(datamodule, "_group", None),
        )
        if scored is not None and scored.metrics:
            self.log_dict(scored.metrics, rank_zero_only=True, on_step=True, on_epoch=False)

    def _column_weights(self, num_rollout_columns: int) -> list[float]:
        rollout = self.trainer.datamodule.hparams.reward_weights or [1.0] * num_rollout_columns
        return [*rollout, *(self.hparams.scorer_weights or [1.0] * len(self.scorers))]

    def training_step(self, batch: StepBatch, batch_idx: int) -> None:
        if batch.stop:
            return
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        started = time.perf_counter()
        stats = LossStats.zeros()
        total_loss = torch.zeros(())
        last = len(batch.micro_batches) - 1
        for i, micro_batch in enumerate(batch.micro_batches):
            micro_batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in micro_batch.items()}
            with self._no_grad_sync(i < last):
                loss, micro_stats = self._micro_batch_loss(micro_batch)
                self.manual_backward(loss)
            stats = stats + micro_stats
            total_loss += loss.detach().float().cpu()
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        self.trainer.datamodule.commit(batch.group_ids)
        self._log_step(batch, stats, total_loss, fwd_bwd_s=time.perf_counter() - started)

    def _micro_batch_loss(self, micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, LossStats]:
        logprobs, entropy = packed_logprobs(self.policy, micro_batch, self.temperature)
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

    def _no_grad_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """Gradient all-reduce only on a step's last backward (one all-reduce per optimizer step under DDP)."""
        strategy = self.trainer.strategy
        if skip and isinstance(strategy, ParallelStrategy):
            return strategy.block_backward_sync()
        return contextlib.nullcontext()

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

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        datamodule = self.trainer.datamodule
        completions = self._greedy_completions(batch, datamodule.tokenizer)
        rewards = datamodule.score_completions(completions, batch)
        size = len(batch)
        total = torch.tensor([math.fsum(_nan_to_zero(sum(vals) for vals in zip(*rewards.values(), strict=True)))])
        self.log("val/reward", total / size, batch_size=size, sync_dist=True, on_epoch=True, prog_bar=True)
        for name, values in rewards.items():
            value = torch.tensor([math.fsum(_nan_to_zero(values)) / size])
            self.log(f"val/rewards/{name}", value, batch_size=size, sync_dist=True, on_epoch=True)

    @torch.no_grad()
    def _greedy_completions(self, rows: list[dict[str, Any]], tokenizer: Any) -> list[list[dict[str, str]]]:
        from .data import as_messages

        max_tokens = self.hparams.val_max_tokens or self.trainer.datamodule.hparams.max_completion_length
        prompts = [
            tokenizer.apply_chat_template(as_messages(row["prompt"]), add_generation_prompt=True, return_dict=False)
            for row in rows
        ]
        width = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        policy = self.policy
        previous = policy.config._attn_implementation
        policy.set_attn_implementation(self._generate_attention)  # a padded batch, not a packed trie
        try:
            out = policy.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        finally:
            policy.set_attn_implementation(previous)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return [[{"role": "assistant", "content": text}] for text in texts]


def _hide_last_step_metrics(trainer: pl.Trainer) -> None:
    """Keeps the stop batch from adding a copy of the last step's metrics to every logger.

    At each batch end Lightning logs every step-only value it holds, also those no hook logged in this batch, so the
    stop batch (which trains nothing) would log the last optimizer step's row again under the next step number. This
    marks those values as already reported, the way Lightning marks them after a reset, without touching them: the
    progress bar and `callback_metrics` keep them. It reads Lightning's private result collection; should that change,
    the only effect is the duplicate row again.
    """
    results = getattr(trainer, "_results", None)
    if results is None or not hasattr(results, "valid_items"):
        return
    for _, metric in list(results.valid_items()):
        meta = getattr(metric, "meta", None)
        if meta is not None and meta.on_step and not meta.on_epoch:
            metric.has_reset = True


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
