"""GRPOModule: the policy, the GRPO loss on packed optimizer steps, trainer scoring and held-out validation."""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from peft import LoraConfig
from typing_extensions import override

from ._lightning_noise import ignore_manual_optimization_checkpoints
from .callbacks.defaults import required_callbacks
from .contract import RolloutContract, require_rollout_source
from .models.lora import is_peft_model
from .pipeline.batch import MicroBatch, StepBatch
from .scoring.step import ScoredStep, score_module_step
from .scoring.trainer_scorer import resolve_scorer
from .training.checkpoint import load_module_state, save_module_state
from .training.checkpoint_io import use_atomic_checkpoints
from .training.compilation import compile_policy
from .training.lightning_flags import apply_lightning_flags
from .training.loss import LossContext, LossStats, micro_batch_loss
from .training.loss_options import ImportanceSamplingLevel, ImportanceSamplingMode, LossType
from .training.model_setup import generation_attention, policy_forward, prepare_policy, prepare_reference, shard_models
from .training.module_options import ModuleOptions
from .training.optimizers import build_optimizers, check_optimizer_options
from .training.policy import check_peft_config, policy_record, trainable_parameters
from .training.reference import ReferenceModel, ReferencePolicy
from .training.router_aux_loss import check_router_aux_loss_coef
from .training.sharding import check_strategy, clip_gradient_norm, gradient_scaler, gradient_sync, is_sharded
from .training.step import max_steps_reached, numeric_metrics, step_inputs, step_row, sync_reference
from .training.step_metrics import StepMetrics
from .validation.metrics import check_validation_options
from .validation.step import ValidationEpoch, epoch_metrics, start_epoch, validate_batch
from .weights.adapters import adapter_config


class GRPOModule(pl.LightningModule):
    """Trains a causal LM with asynchronous GRPO on a `GRPODataModule`'s rollouts: one batch is one optimizer step.

    Each batch (a `StepBatch`) holds this rank's packed micro-batches of one optimizer step. The loss is TRL
    GRPOTrainer's family under its names, defaults and meanings, normalised over the whole step, with the ratio taken
    against the generator's log-probabilities. It optimizes manually and adds the callbacks async GRPO needs. The
    guides (losses, optimizers, LoRA, validation, distributed) and the metrics reference say more.

    Args:
        model: the policy: a `lightning_grpo.models.load_policy` name or path (`"tiny-random"`,
            `"smollm2-135m-instruct"`, `"gemma-3-270m"`, a local folder, a Hub id) or a transformers causal LM.
        learning_rate: the default AdamW's learning rate.
        weight_decay: the default AdamW's weight decay.
        betas: the default AdamW's betas.
        warmup_steps: linear warm-up over this many optimizer steps, from `1 / (warmup_steps + 1)` of the rate; then
            constant, or `lr_scheduler`.
        optimizer: builds the optimizer from the parameters to train (`OptimizerCallable`); None: AdamW with
            `learning_rate`, `weight_decay` and `betas` (ignored, with a warning, beside an `optimizer`).
        lr_scheduler: builds a scheduler from the optimizer (`LRSchedulerCallable`), stepped per optimizer step.
        max_grad_norm: clip the gradient norm to this; None disables clipping.
        epsilon: lower clip range of the ratio (`1 - epsilon`).
        epsilon_high: upper clip range (`1 + epsilon_high`), at least `epsilon`; default `epsilon` (DAPO uses 0.28).
            With `loss_type="cispo"` the cap of the ratio itself (ScaleRL uses 5.0).
        loss_type: TRL's: `"dapo"` (token mean over the step), `"bnpo"` (the same here), `"grpo"` (mean of each
            sequence's token mean), `"dr_grpo"`, `"cispo"`, `"sapo"`, `"luspo"` or `"vespo"`.
        importance_sampling_level: `"token"`, or `"sequence"` (GSPO: one ratio per completion).
        delta: two-sided clip (INTELLECT-2): cap the ratio at `delta` (> 1) in the clipped losses; None: off.
        beta: weight of the KL to the reference model (k3 estimator, per token); 0 loads no reference.
        use_bias_correction_kl: multiply the KL term by the ratio (DeepSeek-V3.2's unbiased KL gradient), as TRL.
        sync_ref_model: mix the policy into the reference every `ref_model_sync_steps` steps (TR-DPO; `beta > 0`).
        ref_model_mixup_alpha: TR-DPO's alpha: `reference = alpha * policy + (1 - alpha) * reference`.
        ref_model_sync_steps: TR-DPO's tau, in optimizer steps.
        vllm_importance_sampling_correction: anchor the ratio on the step's first pass and weight each term by
            `exp(first pass - generator)`, as GRPOTrainer with vLLM (TRL: True, with vLLM only).
        vllm_importance_sampling_mode: `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or `"sequence_mask"`.
        vllm_importance_sampling_clip_min: lower bound of that weight (None: none).
        vllm_importance_sampling_clip_max: upper bound of that weight (TRL's 3.0; None: none).
        vllm_importance_sampling_cap: deprecated name of `vllm_importance_sampling_clip_max`, as in TRL.
        off_policy_mask_threshold: drop a negative-advantage completion whose mean KL from the generator exceeds
            this (DeepSeek-V3.2's off-policy sequence mask); None: off.
        top_entropy_quantile: train only the terms in this top entropy quantile of each micro-batch; 1 keeps all.
        entropy_coef: weight of an entropy bonus (the mean entropy of the trained terms over the step).
        num_iterations: optimizer steps on each planned step (GRPO's mu).
        sapo_temperature_neg, sapo_temperature_pos: SAPO's gate temperatures (`loss_type="sapo"`).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weights (`loss_type="vespo"`).
        scorers: `TrainerScorer`s that add reward columns on the trainer (reward models, EBFT): instances, or import
            paths (`"pkg.mod.make_scorer"`) of an instance or of a factory called without arguments.
        scorer_weights: one weight per scorer column (default 1 each), after the data module's `reward_weights`.
        dtype: the policy's dtype when loaded by name.
        peft_config: a `peft.LoraConfig` to train LoRA adapters instead of the whole policy, checked here against the
            policy's modules. A `peft.PeftModel` passed as `model` keeps its adapters (and its active config).
        gradient_checkpointing: recompute each decoder layer's activations in the backward (less memory, more time).
        torch_compile: compile each decoder layer for training (`training.compilation`); TRL's name and default.
        torch_compile_backend: its `torch.compile` backend, None: `"inductor"`; setting it turns compilation on.
        torch_compile_mode: its `torch.compile` mode, None: the backend's; setting it turns compilation on.
        packing: "tree" (one forward over the packed trie, exact where every layer is attention), "padded" or "auto".
        router_aux_loss_coef: an MoE model's load-balancing loss weight (as GRPOTrainer); None: its config's own.
        val_max_tokens: tokens per validation turn; default the data module's `max_completion_length`.
        num_generations_eval: completions per held-out prompt (TRL's name; the k of `val/pass@k`); 1 (TRL:
            `num_generations`), since validation is greedy by default.
        val_temperature: 0 for greedy validation; above 0, sampled at this temperature (with the data module's
            `top_p` and `top_k`), which `num_generations_eval > 1` needs.
        val_pass_threshold: a completion passes (`val/pass@k`, `val/mean@k`) when its weighted reward reaches this.

    Raises:
        ValueError: a non-positive `learning_rate` or `max_grad_norm`, a negative `warmup_steps`, `scorer_weights` of
            the wrong length, a bad loss or validation option or a combination GRPOTrainer refuses (both named), a
            `peft_config` whose `target_modules` match no module of the policy, `sync_ref_model` with LoRA, an
            `optimizer` or `lr_scheduler` that cannot be built (or a `ReduceLROnPlateau`); in `setup`, a strategy
            whose gradients would not be synchronised; on restore, a checkpoint without this policy's adapters;
            `packing="tree"` for a model it is not exact for, a nonzero `router_aux_loss_coef` on a dense model.
        TypeError: a `peft_config` that is not a `peft.LoraConfig`; in `setup`, no `RolloutSource` data module.

    Example::

        import lightning.pytorch as pl
        from lightning_grpo import GRPODataModule, GRPOModule

        module = GRPOModule("tiny-random", learning_rate=1e-3, loss_type="grpo", beta=0.04)
        data = GRPODataModule(
            dataset_size=4,
            num_generations=4,
            reward_funcs=["lightning_grpo.rewards.numeric_closeness"],
        )
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False)
        trainer.fit(module, datamodule=data)
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
        torch_compile: bool = False,
        torch_compile_backend: str | None = None,
        torch_compile_mode: str | None = None,
        packing: Literal["auto", "tree", "padded"] = "auto",
        router_aux_loss_coef: float | None = None,
        num_generations_eval: int = 1,
        val_temperature: float = 0.0,
        val_pass_threshold: float = 1.0,
    ) -> None:
        super().__init__()
        defaults = {name: p.default for name, p in inspect.signature(GRPOModule.__init__).parameters.items()}
        adamw = {"learning_rate": learning_rate, "weight_decay": weight_decay, "betas": betas}
        check_optimizer_options(
            optimizer, lr_scheduler, defaults, warmup_steps=warmup_steps, max_grad_norm=max_grad_norm, **adamw
        )
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        if peft_config is None and is_peft_model(model):
            peft_config = adapter_config(model)  # a PEFT model passed in trains and checkpoints the same way
        check_router_aux_loss_coef(model, router_aux_loss_coef)
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
        self._contract: RolloutContract | None = None
        self.step_metrics = StepMetrics()
        self.scored_step: ScoredStep | None = None  # the last step's trainer scoring, for the completions table
        self._step_started: float | None = None
        self._generate_attention: str | None = None
        self._forward: Any = None  # (packing path, MoE loss weight) of the policy, decided in configure_model
        self._val_epoch: ValidationEpoch | None = None

    @property
    def contract(self) -> RolloutContract:
        """The data module's `RolloutContract` (sampling, reward weights, advantage options), read in `setup`."""
        if self._contract is None:
            raise RuntimeError("`GRPOModule.contract` is read from the data module in `setup` (Trainer.fit runs it).")
        return self._contract

    # -- hooks, in the order Lightning calls them -------------------------------------------------------------------

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        """The callbacks async GRPO needs, unless the trainer has them (`callbacks.defaults.required_callbacks`);
        first maps the trainer's `accumulate_grad_batches` and `gradient_clip_val` onto our options."""
        trainer = _trainer_of(self)
        if trainer is None:
            return required_callbacks([])
        apply_lightning_flags(trainer, self, trainer.datamodule)  # Lightning refuses them later (manual optimization)
        return required_callbacks(list(trainer.callbacks))

    @override
    def setup(self, stage: str) -> None:
        """Read the data module's `RolloutContract`; refuse a strategy that would not sync the policy's gradients."""
        self._contract = require_rollout_source(self.trainer.datamodule, "GRPOModule").rollout_contract()
        check_strategy(self.trainer.strategy, self.trainer.world_size)
        use_atomic_checkpoints(self.trainer.strategy)  # a kill during a save leaves the previous checkpoint whole
        ignore_manual_optimization_checkpoints()

    @override
    def configure_model(self) -> None:
        """Load the policy (by name), add LoRA, build the reference (`beta > 0`), shard (FSDP2), compile layers."""
        hp = self.hparams
        policy = prepare_policy(self.policy, self.model_name, hp.dtype, self.peft_config, hp.gradient_checkpointing)
        self.policy, fresh_adapters = policy
        self._generate_attention = self._generate_attention or generation_attention(self.policy)
        self._forward = self._forward or policy_forward(self.policy, hp.packing, hp.router_aux_loss_coef)
        beta = self.loss_options.beta
        self.reference = prepare_reference(self.reference, self.policy, beta, fresh_adapters, self.peft_config)
        if (trainer := _trainer_of(self)) is not None:
            shard_models(trainer.strategy, self.policy, self.reference)
        compile_policy(self.policy, self.options.compile)  # after sharding, so each compiled layer is its shard
        for scorer in self.scorers:
            if isinstance(scorer, torch.nn.Module):
                scorer.to(self.device)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the metric totals and a mixed reference; with LoRA, refuse a checkpoint without the adapters."""
        lora = self.peft_config is not None
        self.step_metrics.load_state_dict(load_module_state(checkpoint, self.policy, self.reference, lora=lora))

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """The optimizer over the policy's parameters that require grad, and its per-step schedule."""
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

    @override
    def on_fit_start(self) -> None:
        if isinstance(self.reference, ReferenceModel):
            self.reference.to(self.device)

    @override
    def on_train_batch_start(self, batch: StepBatch, batch_idx: int) -> None:
        """Every rank: the trainer scorers score the step's pending groups (`score_step`)."""
        self._step_started = self._step_started or time.perf_counter()
        if not self.scorers:
            return
        source, weights = self.trainer.datamodule, self.options.scorer_weights
        self.scored_step = score_module_step(
            self, batch, self.contract, self.scorers, weights, source.progress, source.process_group
        )
        if self.scored_step is not None and self.scored_step.metrics and self.trainer.is_global_zero:
            self.step_metrics.add(self, self.scored_step.metrics)  # rank 0: the scoring metrics join the step's row

    @override
    def training_step(self, batch: StepBatch, batch_idx: int) -> None:
        """`num_iterations` optimizer steps on this planned step (each: every micro-batch's forward and backward, the
        gradient clip, the optimizer and the learning-rate schedule); stops early at `Trainer(max_steps=...)`."""
        started = time.perf_counter()
        inputs = (batch, self.device, self.contract, self.trainer.world_size, self.reference, self._forward)
        micro_batches, context = step_inputs(*inputs)
        lr = self.optimizers().param_groups[0]["lr"]  # the rate this step trains with (the scheduler moves it after)
        stats, iterations = LossStats(), 0
        for iteration in range(self.options.num_iterations):
            stats = stats + self._optimizer_step(micro_batches, context, first=iteration == 0)
            iterations += 1
            sync_reference(self.reference, self.policy, self.trainer.model, self.options.reference, self.global_step)
            if max_steps_reached(self.trainer):
                break
        self._log_step(batch, stats, iterations, lr=lr, fwd_bwd_s=time.perf_counter() - started)

    @override
    def on_train_batch_end(self, outputs: Any, batch: StepBatch, batch_idx: int) -> None:
        """After every callback's: send this step's metrics to the loggers, once (see `StepMetrics`)."""
        self.step_metrics.flush(self.trainer)

    @override
    def on_validation_epoch_start(self) -> None:
        sharded = is_sharded(self.policy, self.trainer.model)
        options = self.options.validation
        self._val_epoch = start_epoch(self.contract, options, self._generate_attention, sharded, self.device)

    @override
    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Every rank: conversations on this rank's held-out prompts, scored into this epoch's tally."""
        validate_batch(self.policy, batch, self._val_epoch, self.trainer.datamodule)

    @override
    def on_validation_epoch_end(self) -> None:
        """Every rank: add the ranks' tallies (one all-reduce) and log `val/*`, NaN where nothing was scored."""
        epoch, self._val_epoch = self._val_epoch, None
        if epoch is None:
            return
        metrics = epoch_metrics(epoch, self.trainer.world_size)
        # Every rank holds the same exact values already; "max" over ranks keeps them bit for bit.
        self.log("val/reward", metrics.pop("val/reward"), on_epoch=True, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log_dict(metrics, on_epoch=True, sync_dist=True, reduce_fx="max")

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Every rank: the policy's record for `lightning-grpo export`, the metric totals, a TR-DPO-mixed reference;
        with LoRA only the adapters (see `lightning_grpo.training.checkpoint`)."""
        record = policy_record(self.model_name, self.peft_config, self.options.dtype)
        save_module_state(checkpoint, record, self.policy, self.reference, self.step_metrics.state_dict())

    # -- private helpers ----------------------------------------------------------------------------------------------

    def _optimizer_step(self, micro_batches: list[MicroBatch], context: LossContext, first: bool) -> LossStats:
        """One optimizer step over the micro-batches, gradients synced on the last one only; their loss statistics."""
        optimizer, stats, last = self.optimizers(), LossStats(), len(micro_batches) - 1
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

    def _log_step(self, batch: StepBatch, stats: LossStats, iterations: int, lr: float, fwd_bwd_s: float) -> None:
        """Every rank reduces the step's loss statistics; rank 0 adds them and the batch's metrics to the step's row."""
        now, started = time.perf_counter(), self._step_started
        step_s, self._step_started = (now - started if started is not None else None), now
        metrics = step_row(stats, iterations, self.trainer, self.loss_options.entropy_coef, lr, fwd_bwd_s, step_s)
        if self.trainer.is_global_zero:
            self.step_metrics.add(self, metrics)
            self.step_metrics.add(self, numeric_metrics(batch.metrics))


def _trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None when it is not attached to one (a hook called by hand)."""
    try:
        return module.trainer
    except RuntimeError:
        return None
