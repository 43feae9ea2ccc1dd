"""GRPOModule: the policy, the GRPO loss on packed optimizer steps, trainer scoring and held-out validation."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from peft import LoraConfig

from ._lightning_noise import ignore_manual_optimization_checkpoints
from .contract import RolloutContract, require_rollout_source
from .models.lora import is_peft_model
from .pipeline.batch import MicroBatch, StepBatch
from .scoring.trainer_scorer import resolve_scorer
from .training.checkpoint import load_module_state, save_module_state
from .training.checkpoint_io import use_atomic_checkpoints
from .training.loss import LossContext, LossStats, micro_batch_loss
from .training.loss_options import ImportanceSamplingLevel, ImportanceSamplingMode, LossType
from .training.loss_stats import metrics_over_ranks
from .training.module_options import ModuleOptions
from .training.optimizers import build_optimizers, check_optimizer_options
from .training.policy import apply_peft, check_peft_config, enable_activation_checkpointing, trainable_parameters
from .training.reference import ReferenceModel, ReferencePolicy, adapters_start_at_zero, make_reference
from .training.sharding import check_strategy, clip_gradient_norm, gradient_scaler, gradient_sync, shard_policy
from .training.step_metrics import StepMetrics
from .validation.metrics import ValidationTally, check_validation_options
from .validation.step import log_tally, start_tally, validate_batch
from .weights.adapters import adapter_config

log = logging.getLogger(__name__)


class GRPOModule(pl.LightningModule):
    """Trains a causal LM with asynchronous GRPO: one Lightning batch is one optimizer step.

    Each batch (a `StepBatch` from `GRPODataModule`) holds this rank's packed micro-batches of one optimizer step.
    `setup` reads the data module's `RolloutContract` once (sampling temperature, reward weights, advantage options):
    the module trains only on a `lightning_grpo.RolloutSource`. `on_train_batch_start` runs the trainer scorers
    (`score_step`) on groups whose advantages are pending; `training_step` runs each micro-batch's forward (tree
    attention over the packed prefix trie) and backward, with gradient sync only on the last one, clips the gradient
    norm and steps the optimizer, `num_iterations` times on the same step (the learning-rate schedule steps per
    optimizer step; the step's groups are committed once, after the last). The loss is TRL GRPOTrainer's family
    (`loss_type`, with its options under the same names, defaults and meanings), with the ratio taken against the
    generator's log-probabilities (as in TRL's async GRPO), each loss type normalised exactly over the step's ranks
    and micro-batches; with `beta > 0` a frozen reference model (`lightning_grpo.training.reference`) adds GRPOTrainer's KL
    term. `validation_step` runs the training rollouts' conversations
    (prompt format, tools, environments) on held-out prompts with the policy being trained, `num_generations_eval`
    per prompt, greedy or sampled, and scores them with the data module's reward columns, weighted as in training:
    `val/reward`, `val/rewards/<name>`, `val/pass@k`, `val/mean@k` (k = `num_generations_eval`), `val/unscored_frac`
    and, with tools, `val/tools/*`. NaN rewards stay "not scored": every mean is over the completions that were
    scored. `Trainer.validate` and `val_check_interval` work.

    LoRA: with `peft_config` the policy is wrapped with PEFT adapters in `configure_model`; only the adapters train
    (and are in the optimizer), checkpoints hold the adapters (plus optimizer and run state), not the base weights,
    and the generator receives merged weights (or the adapter, with `GRPODataModule(vllm_transfer="lora")`).
    `lightning-grpo export` writes a checkpoint's policy as a Hugging Face folder. `gradient_checkpointing`
    recomputes activations in the backward; Lightning's `precision="bf16-mixed"` (autocast) and `"bf16-true"` work
    with the packed forward, the log-probabilities and the loss staying float32.

    Several processes: DDP (`strategy="ddp"`), Lightning's FSDP on GPUs (`strategy="fsdp"`), or FSDP2 through
    `ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`, under which `configure_model` shards the
    policy with `fully_shard` (CPU with gloo too). A strategy that would not reduce the policy's gradients across
    ranks is refused at start-up.

    Logged (TRL's names): `loss`, `reward`, `reward_std`, `rewards/<name>`, `ratio`, `entropy`, `clip_ratio/*`
    (clipped losses), `cispo_clip_ratio`, `vespo/phi_seq_mean`, `kl` (to the reference, with `beta > 0`),
    `sampling/sampling_logp_difference/{mean,max}` (trainer vs generator at the step's first pass),
    `sampling/importance_sampling_ratio/{min,mean,max}` (with the correction), `policy_loss` and `entropy_coef`
    (with an entropy bonus), the masked fractions `sampling/is_masked_frac`, `off_policy/masked_frac` and
    `entropy/masked_frac`, `sample/staleness_*`, `batch/*`, `perf/step_s`, `perf/fwd_bwd_s`, `lr` (the learning rate the step trained with).
    Each optimizer step's metrics reach every logger once, as one row (`step_metrics`, a `StepMetrics`); a `*_total`
    metric is the run's count so far, kept in the checkpoint.

    Optimizer and schedule: AdamW (`learning_rate`, `weight_decay`, `betas`; torch's fused kernel, TRL's default,
    where it takes the parameters) with a linear warm-up over `warmup_steps` and then a constant rate, unless
    `optimizer` / `lr_scheduler` say otherwise. Both follow LightningCLI's callable pattern: in YAML,
    `model.optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.1}}` and
    `model.lr_scheduler: {class_path: torch.optim.lr_scheduler.CosineAnnealingLR, init_args: {T_max: 40}}`; in
    Python, any callable such as `functools.partial(torch.optim.SGD, lr=0.1)`. The optimizer gets the policy's
    parameters that require grad, once `configure_model` has loaded the policy. With `warmup_steps` and an
    `lr_scheduler`, the warm-up runs first and the scheduler starts after it (`SequentialLR`). Resuming from a
    checkpoint restores both.

    Args:
        model: the policy: a name or path for `lightning_grpo.models.load_policy` (`"tiny-random"`,
            `"smollm2-135m-instruct"`, `"gemma-3-270m"`, a local folder, a Hub id) or an `nn.Module` (a transformers causal LM).
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
        epsilon_high: upper clip range (`1 + epsilon_high`), at least `epsilon`; default `epsilon` (DAPO uses 0.28).
            With `loss_type="cispo"` the cap of the ratio itself (ScaleRL uses 5.0).
        loss_type: TRL's: `"dapo"` (token mean over the step), `"bnpo"` (the same here: the step is the batch),
            `"grpo"` (mean over sequences of each one's token mean), `"dr_grpo"` (sum over sequences times
            `max_completion_length`), `"cispo"`, `"sapo"`, `"luspo"` (sequence sums), `"vespo"`.
        importance_sampling_level: `"token"`, or `"sequence"` (GSPO: one ratio per completion, the exponentiated mean
            of its log-ratios).
        delta: two-sided clip (INTELLECT-2): cap the ratio at `delta` (> 1) in the clipped losses; None: off.
        beta: weight of the KL to the reference model (k3 estimator, per token); 0 loads no reference.
        use_bias_correction_kl: multiply the KL term by the ratio (DeepSeek-V3.2's unbiased KL gradient), as TRL.
        sync_ref_model: mix the policy into the reference every `ref_model_sync_steps` optimizer steps (TR-DPO);
            needs `beta > 0`.
        ref_model_mixup_alpha: TR-DPO's alpha: `reference = alpha * policy + (1 - alpha) * reference`.
        ref_model_sync_steps: TR-DPO's tau, in optimizer steps.
        vllm_importance_sampling_correction: correct for the generator-trainer mismatch as GRPOTrainer does with vLLM:
            the ratio is taken against the policy at the step's first pass and each term is weighted by
            `exp(first pass - generator)`, truncated or masked by the mode and the clip bounds. Default False (TRL:
            True, applied only with vLLM): without it the ratio is against the generator's log-probabilities.
        vllm_importance_sampling_mode: `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or
            `"sequence_mask"` (TRL's default).
        vllm_importance_sampling_clip_min: lower bound of that weight (None: none).
        vllm_importance_sampling_clip_max: upper bound of that weight (TRL's 3.0; None: none).
        vllm_importance_sampling_cap: deprecated name of `vllm_importance_sampling_clip_max`, as in TRL.
        off_policy_mask_threshold: drop a negative-advantage completion whose mean KL from the generator exceeds
            this (DeepSeek-V3.2's off-policy sequence mask); None: off.
        top_entropy_quantile: train only the terms whose entropy is in this top quantile of each micro-batch's (over
            ranks), as GRPOTrainer; 1 keeps all.
        entropy_coef: weight of an entropy bonus (the mean entropy of the trained terms over the step).
        num_iterations: optimizer steps on each planned step (GRPO's mu); the ratio is always against the
            generator's log-probabilities, the reference's are computed once per planned step.
        sapo_temperature_neg, sapo_temperature_pos: SAPO's gate temperatures (`loss_type="sapo"`).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weights (`loss_type="vespo"`).
        scorers: `TrainerScorer`s that add reward columns on the trainer (reward models, EBFT); their groups'
            advantages are computed here. An entry may be an instance, or an import path (`"pkg.mod.make_scorer"`)
            of an instance or of a factory called without arguments.
        scorer_weights: one weight per scorer column (default 1 each); the rollout columns keep the data module's
            `reward_weights`.
        dtype: the policy's dtype when loaded by name.
        peft_config: a `peft.LoraConfig` to train LoRA adapters instead of the whole policy (in YAML:
            `class_path: peft.LoraConfig` with `init_args: {r: 16, lora_alpha: 32, target_modules: all-linear}`).
            Checked here against the policy's modules (a policy given by name: against its config, weightless).
            A `peft.PeftModel` passed as `model` keeps its adapters (its active adapter's config is taken).
        gradient_checkpointing: recompute each decoder layer's activations in the backward (less memory, more time).
        val_max_tokens: tokens per validation turn; default the data module's `max_completion_length`.
        num_generations_eval: completions per held-out prompt (TRL's name; the k of `val/pass@k`). TRL's default is
            `num_generations`; here 1, since validation is greedy by default.
        val_temperature: 0 for greedy validation; above 0, sampled at this temperature (with the data module's
            `top_p` and `top_k`), which `num_generations_eval > 1` needs.
        val_pass_threshold: a completion passes (for `val/pass@k`, `val/mean@k`) when its weighted reward is at least
            this.

    Raises:
        ValueError: a non-positive `learning_rate` or `max_grad_norm`, a negative `warmup_steps`, `scorer_weights` of
            the wrong length, an out-of-range loss option or a combination GRPOTrainer refuses (both named), a
            `peft_config` whose `target_modules` match no module of the policy (the message lists those LoRA can
            adapt), `sync_ref_model` with LoRA, an `optimizer` or
            `lr_scheduler` that cannot be built (or a `ReduceLROnPlateau`, which needs a monitored metric); in `setup`, a strategy whose gradients would not be synchronised;
            when a checkpoint is restored, one without this policy's adapters.
        TypeError: a `peft_config` that is not a `peft.LoraConfig`; (in `setup`) a data module that is not a
            `RolloutSource` (or none).

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
        loss_type: LossType = "dapo",
        importance_sampling_level: ImportanceSamplingLevel = "token",
        delta: float | None = None,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        vllm_importance_sampling_correction: bool = False,
        vllm_importance_sampling_mode: ImportanceSamplingMode = "sequence_mask",
        vllm_importance_sampling_clip_min: float | None = None,
        vllm_importance_sampling_clip_max: float | None = 3.0,
        vllm_importance_sampling_cap: float | None = None,
        off_policy_mask_threshold: float | None = None,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        num_iterations: int = 1,
        sapo_temperature_neg: float = 1.05,
        sapo_temperature_pos: float = 1.0,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        scorers: Sequence[Any] | None = None,
        scorer_weights: list[float] | None = None,
        dtype: Literal["float32", "bfloat16"] = "float32",
        val_max_tokens: int | None = None,
        peft_config: LoraConfig | None = None,
        gradient_checkpointing: bool = False,
        num_generations_eval: int = 1,
        val_temperature: float = 0.0,
        val_pass_threshold: float = 1.0,
    ) -> None:
        super().__init__()
        defaults = {name: p.default for name, p in inspect.signature(GRPOModule.__init__).parameters.items()}
        check_optimizer_options(
            optimizer,
            lr_scheduler,
            defaults,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
        )
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        if peft_config is None and is_peft_model(model):
            peft_config = adapter_config(model)  # a PEFT model passed in trains and checkpoints the same way
        if peft_config is not None:
            check_peft_config(peft_config, model)
            self.strict_loading = False  # checkpoints hold the adapters, not the base weights
        # The LoRA config goes in as plain JSON; callables stay out (the checkpoint is loaded with weights_only=True).
        self.save_hyperparameters(ignore=["model", "scorers", "peft_config", "optimizer", "lr_scheduler"])
        self.peft_config = peft_config
        self.options = ModuleOptions.from_hparams(self.hparams, lora=peft_config is not None)  # what helpers read
        self.loss_options = self.options.loss
        check_validation_options(num_generations_eval, val_temperature, val_max_tokens)
        self.model_name = model if isinstance(model, str) else None
        self.policy: Any = model if isinstance(model, torch.nn.Module) else None
        self.scorers = [resolve_scorer(scorer) for scorer in scorers or []]
        if scorer_weights is not None and len(scorer_weights) != len(self.scorers):
            raise ValueError(
                f"`GRPOModule(scorer_weights={scorer_weights})` needs one weight per scorer ({len(self.scorers)})."
            )
        self.automatic_optimization = False
        self.reference: ReferencePolicy | None = None
        self.contract: RolloutContract | None = None
        self.step_metrics = StepMetrics()
        self.scored_step: Any = None  # the last step's `ScoredStep` (trainer scorers), for the completions table
        self._step_started: float | None = None
        self._generate_attention: str | None = None
        self._val_tally: ValidationTally | None = None

    # -- model ------------------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Read the data module's `RolloutContract`, and refuse a strategy that would not sync the policy's gradients.

        Raises:
            TypeError: no data module, or one that is not a `lightning_grpo.RolloutSource`.
            ValueError: see `lightning_grpo.training.sharding.check_strategy`.
        """
        datamodule = require_rollout_source(self.trainer.datamodule, "GRPOModule")
        self.contract = datamodule.rollout_contract()
        check_strategy(self.trainer.strategy, self.trainer.world_size)
        use_atomic_checkpoints(self.trainer.strategy)  # a kill during a save leaves the previous checkpoint whole
        ignore_manual_optimization_checkpoints()

    def configure_model(self) -> None:
        if self.policy is None and self.model_name is not None:  # by name (a module passed in is the policy)
            from .models.loading import load_policy

            self.policy = load_policy(self.model_name, dtype=getattr(torch, self.options.dtype))
        fresh_adapters = self.peft_config is not None and not is_peft_model(self.policy)
        if fresh_adapters:
            self.policy = apply_peft(self.policy, self.peft_config)
        if self.hparams.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)
        self.policy.train()  # loaders return eval mode; Lightning switches to eval and back around validation
        # Training switches the policy to tree attention; greedy validation batches use the loaded implementation.
        if self._generate_attention is None:
            loaded = self.policy.config._attn_implementation
            self._generate_attention = loaded if loaded and not loaded.startswith("tree") else "sdpa"
        if self.loss_options.beta != 0 and self.reference is None:
            # the initial policy, before a checkpoint is restored
            zero = fresh_adapters and adapters_start_at_zero(self.peft_config)
            self.reference = make_reference(self.policy, adapters_start_at_zero=zero)
        trainer = _trainer_of(self)
        if trainer is not None:
            shard_policy(self.policy, trainer.strategy)
            if isinstance(self.reference, ReferenceModel):
                self.reference.shard(trainer.strategy)
        for scorer in self.scorers:
            if isinstance(scorer, torch.nn.Module):
                scorer.to(self.device)

    def configure_callbacks(self) -> list[pl.Callback]:
        """The callbacks async GRPO needs, in the order they must run, unless the trainer already has them (see
        `lightning_grpo.callbacks.defaults.required_callbacks`). Maps the trainer's `accumulate_grad_batches` and
        `gradient_clip_val` onto our options first (`lightning_grpo.training.lightning_flags`)."""
        from .callbacks.defaults import required_callbacks
        from .training.lightning_flags import apply_lightning_flags

        trainer = _trainer_of(self)
        if trainer is not None:  # Lightning calls this hook before it refuses these flags for manual optimization
            apply_lightning_flags(trainer, self, trainer.datamodule)
        return required_callbacks(list(trainer.callbacks) if trainer is not None else [])

    def configure_optimizers(self) -> dict[str, Any]:
        """The optimizer over the policy's parameters that require grad, and its per-step schedule (see the class)."""
        hp = self.hparams
        return build_optimizers(
            trainable_parameters(self.policy),
            optimizer=self.optimizer_factory,
            lr_scheduler=self.lr_scheduler_factory,
            learning_rate=hp.learning_rate,
            weight_decay=hp.weight_decay,
            betas=hp.betas,
            warmup_steps=hp.warmup_steps,
            fused=gradient_scaler(self._trainer) is None,  # see `build_optimizers`
        )

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Every rank: the policy's record for `lightning-grpo export`, the metric totals, a TR-DPO-mixed reference;
        with LoRA only the adapters (see `lightning_grpo.training.checkpoint`)."""
        save_module_state(self, checkpoint, dtype=self.options.dtype)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the metric totals and a mixed reference; with LoRA, refuse a checkpoint without the adapters."""
        load_module_state(self, checkpoint)

    # -- training ---------------------------------------------------------------------------------------------------

    def on_train_batch_start(self, batch: StepBatch, batch_idx: int) -> None:
        self._step_started = self._step_started or time.perf_counter()
        if self.scorers:
            from .scoring.step import score_module_step

            self.scored_step = score_module_step(self, batch, scorer_weights=self.options.scorer_weights)

    def on_fit_start(self) -> None:
        if isinstance(self.reference, ReferenceModel):
            self.reference.to(self.device)

    def training_step(self, batch: StepBatch, batch_idx: int) -> None:
        """`num_iterations` optimizer steps on this planned step (each: every micro-batch's forward and backward, the
        gradient clip, the optimizer and the learning-rate schedule); stops early at `Trainer(max_steps=...)`."""
        started = time.perf_counter()
        micro_batches = [
            {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in mb.items()} for mb in batch.micro_batches
        ]
        context = LossContext.for_step(self.contract, self.trainer.world_size, len(micro_batches))
        if self.reference is not None:
            for micro_batch in micro_batches:  # once per planned step, as GRPOTrainer does per generation
                micro_batch["ref_log_probs"] = self.reference.logprobs(micro_batch, context)
        stats, iterations = LossStats(), 0
        lr = self.optimizers().param_groups[0]["lr"]  # the rate this step trains with (the scheduler moves it after)
        for iteration in range(self.options.num_iterations):
            stats = stats + self._optimizer_step(micro_batches, context, first=iteration == 0)
            iterations += 1
            self._sync_reference()
            if _max_steps_reached(self.trainer):
                break
        self._log_step(batch, stats, iterations, lr=lr, fwd_bwd_s=time.perf_counter() - started)

    def _optimizer_step(self, micro_batches: list[MicroBatch], context: LossContext, first: bool) -> LossStats:
        optimizer = self.optimizers()
        stats = LossStats()
        last = len(micro_batches) - 1
        for i, micro_batch in enumerate(micro_batches):
            with gradient_sync(self.trainer.strategy, self.policy, self.trainer.model, enabled=i == last):
                loss, micro_stats, logprobs = micro_batch_loss(self.policy, micro_batch, self.loss_options, context)
                self.manual_backward(loss)
            if first and self.options.num_iterations > 1:
                micro_batch["proximal_log_probs"] = logprobs  # the later updates' anchor and mismatch reference
            stats = stats + micro_stats
        if self.hparams.max_grad_norm is not None:
            clip_gradient_norm(self, optimizer, self.hparams.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.lr_schedulers().step()
        return stats

    def _sync_reference(self) -> None:
        """TR-DPO: after every `ref_model_sync_steps`-th optimizer step, as GRPOTrainer's `SyncRefModelCallback`."""
        sync = self.options.reference
        if not sync.sync_ref_model or self.trainer.global_step % sync.ref_model_sync_steps:
            return
        if not isinstance(self.reference, ReferenceModel):  # TR-DPO is refused with LoRA: always a model here
            return
        from .weights.parameters import full_parameters

        with full_parameters(self.trainer.model):
            self.reference.mix(self.policy, sync.ref_model_mixup_alpha)

    def _log_step(self, batch: StepBatch, stats: LossStats, iterations: int, lr: float, fwd_bwd_s: float) -> None:
        metrics = metrics_over_ranks(stats, self.trainer.strategy, self.trainer.world_size)
        for total in ("loss", "policy_loss"):  # the mean over this step's updates
            if total in metrics:
                metrics[total] /= iterations
        if self.loss_options.entropy_coef != 0:
            metrics["entropy_coef"] = self.loss_options.entropy_coef
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

    # -- validation -------------------------------------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self._val_tally = start_tally(self, self.options.validation)

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Every rank: conversations on this rank's held-out prompts, scored into this epoch's tally."""
        validate_batch(self, batch, self._val_tally, self.options.validation, attention=self._generate_attention)

    def on_validation_epoch_end(self) -> None:
        """Every rank: add the ranks' tallies (one all-reduce) and log `val/*`, NaN where nothing was scored."""
        tally, self._val_tally = self._val_tally, None
        if tally is not None:
            log_tally(self, tally)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _max_steps_reached(trainer: pl.Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps


def _trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None when it is not attached to one (a hook called by hand)."""
    try:
        return module.trainer
    except RuntimeError:
        return None
