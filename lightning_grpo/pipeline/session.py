"""Rank 0's rollout session of one fit: the rollout child, and the pipeline from its queue to every rank's steps.

`RolloutSession.start` turns the data module's options into a started `GRPORolloutWorker` (generation and reward
scoring in a CUDA-free child process) and a `RolloutPipeline` (GroupedQueue → SampleFilterQueue → StepPlanner →
collator) over its queue. Only rank 0 has one; the other ranks receive their share of each step from `StepStream`.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..data.tooling import ConversationSpec
from ..options import AdvantageEstimator, DataModuleOptions, LoopOptions, SamplingOptions, ScaleRewards
from ..serving.server_urls import server_stale_after_s
from .collating import ProgressCollator
from .ledger import RolloutProgress
from .metrics import MetricWindow
from .stream import RolloutPipeline

log = logging.getLogger(__name__)


class CollatorFactory(Protocol):
    """Makes the pipeline's collator (`lightning_grpo.scoring.collator.make_step_collator`)."""

    def __call__(
        self,
        progress: RolloutProgress,
        *,
        scorers: Sequence[Any],
        num_processes: int,
        pad_token_id: int,
        reward_names: Sequence[str],
        scale_rewards: ScaleRewards,
        advantage_estimator: AdvantageEstimator,
    ) -> ProgressCollator: ...


@dataclass(frozen=True)
class SessionOptions:
    """What the rollout side is built from: the data module's options, resolved (see `GRPODataModule`)."""

    model_name: str
    dataset: Any
    reward_funcs: Sequence[Callable]
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    options: DataModuleOptions  # the data module's options
    loop_cls: type | None
    loop_kwargs: dict[str, Any]
    world_size: int
    groups_per_step: int
    conversation: ConversationSpec  # prompt rendering, tools and environments
    lora_name: str | None = None  # the served adapter's name prefix (adapter-only vLLM sync; TRL's loop argument)
    core_sharing: Any = None  # the trainer's and the embedded generator's `CoreSharing` (trainer_threads="auto")
    vllm_lost: Any = None  # the weight fan-out's flags of lost vLLM servers (several servers), shared with the child


class RolloutSession:
    """The started rollout child and rank 0's pipeline over its queue; `close()` stops the child and its pool.

    Args:
        worker: the started `GRPORolloutWorker`.
        pipeline: the `RolloutPipeline` that `StepStream` iterates on rank 0.
        metrics: the sink the pipeline's stages append to (drained by `drain_metrics`).
    """

    def __init__(self, worker: Any, pipeline: RolloutPipeline, metrics: dict[str, list]) -> None:
        self.worker = worker
        self.pipeline = pipeline
        self._metrics = metrics
        self._window = MetricWindow()

    @classmethod
    def start(
        cls,
        session: SessionOptions,
        *,
        progress: RolloutProgress,
        scorers: Sequence[Any],
        collator: ProgressCollator,
        model_version: Callable[[], int],
        generator: Any,
        interrupted: Callable[[], bool] | None = None,
    ) -> RolloutSession:
        """Spawn the rollout child and build the pipeline over its queue.

        Args:
            session: the resolved data-module options.
            progress: the run's ledger (its consumed groups are skipped by the child).
            scorers: the module's trainer scorers; with any, the child leaves advantages pending.
            collator: the pipeline's collator, built on `progress` (with the scorers' inputs, if any).
            model_version: the policy version the staleness filter compares against (`WeightSync.version`).
            generator: the embedded generator's `GeneratorSpec`, or None for the vLLM server.
            interrupted: True once the trainer must stop (SIGTERM): waiting for rollouts then ends at once.

        Raises:
            RuntimeError: the child failed while starting (its traceback is in the message).
        """
        worker = _make_worker(session, progress, generator=generator, trainer_scored=bool(scorers))
        worker.start()
        steps = session.options.steps
        metrics: dict[str, list] = {}
        pipeline = RolloutPipeline(
            worker,
            progress,
            planner_kwargs=_planner_kwargs(session, scorers),
            collator=collator,
            model_version=model_version,
            max_staleness=steps.max_staleness,
            mask_truncated_completions=steps.mask_truncated_completions,
            drop_no_signal_groups=steps.drop_no_signal_groups,
            replace_dropped_groups=steps.replace_dropped_groups,
            heartbeat_timeout=session.options.generation.heartbeat_timeout,
            metrics=metrics,
            core_sharing=session.core_sharing,
            interrupted=interrupted,
        )
        return cls(worker, pipeline, metrics)

    def drain_metrics(self) -> dict[str, float]:
        """What the child and the pipeline measured since the last call, reduced for logging (`*_total` values are
        the increments since the last call)."""
        window = self._window
        while True:
            try:
                window.update(self.worker.metrics_queue.get_nowait())
            except (queue.Empty, OSError, ValueError):
                break
        window.update(self._metrics)
        self._metrics.clear()
        return window.flush()

    def close(self) -> None:
        """Stop the rollout child and every process under it (idempotent)."""
        self.worker.stop()


def _make_worker(session: SessionOptions, progress: RolloutProgress, *, generator: Any, trainer_scored: bool) -> Any:
    from ..rollout.worker import GRPORolloutWorker

    loop = loop_options(session, progress, generator=generator, trainer_scored=trainer_scored)
    return GRPORolloutWorker(
        loop_cls=session.loop_cls,
        child_ready_timeout=session.options.generation.child_ready_timeout,
        **loop.arguments(),
        **session.loop_kwargs,
    )


def loop_options(
    session: SessionOptions, progress: RolloutProgress, *, generator: Any, trainer_scored: bool
) -> LoopOptions:
    """The rollout loop's arguments the session sets: the data module's options, resolved for this fit."""
    opts = session.options
    sampling, rewards, steps, vllm = opts.sampling, opts.rewards, opts.steps, opts.vllm
    return LoopOptions(
        model_name=session.model_name,
        dataset=session.dataset,
        reward_funcs=list(session.reward_funcs),
        processing_class=session.tokenizer,
        eos_token_ids=list(session.eos_token_ids),
        num_generations=sampling.num_generations,
        max_inflight_tasks=(steps.max_staleness + 1) * session.groups_per_step * sampling.num_generations,
        max_tokens=sampling.max_completion_length,
        **_sampling_arguments(sampling),
        vllm_server_url=vllm.vllm_server_url,
        vllm_failover=vllm.vllm_failover,
        vllm_lost=session.vllm_lost,
        vllm_stale_after_s=server_stale_after_s(opts.generation),
        generator=generator,
        reward_weights=rewards.reward_weights,
        multi_objective_aggregation=rewards.multi_objective_aggregation,
        scale_rewards=rewards.scale_rewards,
        advantage_estimator=rewards.advantage_estimator,
        reward_num_workers=rewards.reward_num_workers,
        reward_timeout=rewards.reward_timeout,
        trainer_scored=trainer_scored,
        epochs=steps.epochs,
        seed=steps.seed,
        consumed=set(progress.consumed),
        groups_per_step=session.groups_per_step,
        max_staleness=steps.max_staleness,
        replace_early=steps.replace_early,
        lora_name=session.lora_name,
        core_sharing=session.core_sharing,
        **session.conversation.loop_options(),
    )


def _planner_kwargs(session: SessionOptions, scorers: Sequence[Any]) -> dict[str, Any]:
    steps, sampling = session.options.steps, session.options.sampling
    return {
        "num_processes": session.world_size,
        "steps": steps.gradient_accumulation_steps,
        "token_budget": steps.token_budget,
        "samples_per_row": steps.samples_per_row or sampling.num_generations,
        "scorers": list(scorers),
        "max_groups_per_step": session.groups_per_step,
    }


def _make_collator(
    session: SessionOptions, progress: RolloutProgress, scorers: Sequence[Any], make_collator: CollatorFactory
) -> ProgressCollator:
    from .._trl import get_callable_name

    rewards = session.options.rewards
    return make_collator(
        progress,
        scorers=scorers,
        num_processes=session.world_size,
        pad_token_id=session.tokenizer.pad_token_id or 0,
        reward_names=[get_callable_name(func) for func in session.reward_funcs] + session.conversation.reward_names,
        scale_rewards=rewards.scale_rewards,
        advantage_estimator=rewards.advantage_estimator,
    )


def embedded_generator_spec(
    options: DataModuleOptions, policy: Any, eos: Sequence[int], tokenizer: Any, weight_receiver: Any
) -> Any:
    """The `GeneratorSpec` of the embedded generator under the data module's options (a `GeneratorReplicasSpec` with
    `generator_replicas` > 1); None for vLLM."""
    generation, sampling = options.generation, options.sampling
    if generation.generator != "embedded":
        return None
    from ..models.dtype_probe import resolve_generator_dtype
    from ..rollout.decode_linears import decode_product
    from ..rollout.generator import GeneratorSpec, PolicySpec
    from ..rollout.replicas import GeneratorReplicasSpec

    dtype, why = resolve_generator_dtype(generation.generator_dtype, policy.dtype, decode_product)
    log.info("The embedded generator samples in %s: %s.", dtype, why)
    spec = GeneratorSpec(
        PolicySpec.from_model(policy, dtype),
        eos_token_ids=tuple(eos),
        **_sampling_arguments(sampling),
        tokenizer=tokenizer if sampling.stop else None,
        max_tokens=sampling.max_completion_length,
        max_batch_size=max(sampling.num_generations, 64),
        weight_receiver=weight_receiver,
        num_threads=generation.generator_threads,
        quantization=generation.generator_quantization,
    )
    if generation.generator_replicas == 1:
        return spec
    return GeneratorReplicasSpec(spec, generation.generator_replicas, stale_after_s=server_stale_after_s(generation))


def start_rollout_session(datamodule: Any, module: Any, make_collator: CollatorFactory) -> RolloutSession:
    """Rank 0: start the rollout session of `datamodule` (a `GRPODataModule` in `train_dataloader`, its prompts,
    rewards, weight sync and threads set up) for `module`'s policy and scorers (a `PolicySource`), its pipeline
    collating with what `make_collator` makes."""
    from ..models.loading import eos_token_ids

    options: DataModuleOptions = datamodule.options
    sync = datamodule.weight_sync
    eos = eos_token_ids(datamodule.tokenizer, module.policy)
    session = SessionOptions(
        model_name=datamodule.model_name or module.model_name or "policy",
        dataset=datamodule.train_prompts,
        reward_funcs=datamodule.reward_funcs,
        tokenizer=datamodule.tokenizer,
        eos_token_ids=tuple(eos),
        options=options,
        loop_cls=datamodule.loop_cls,
        loop_kwargs=datamodule.loop_kwargs,
        world_size=datamodule.trainer.world_size,
        groups_per_step=datamodule.groups_per_step(),
        lora_name=getattr(sync.transfer, "lora_name", None),
        vllm_lost=getattr(sync.transfer, "lost", None),
        conversation=datamodule.conversation,
        core_sharing=datamodule.core_sharing,
    )
    scorers = list(module.scorers)
    receiver = sync.receiver() if options.generation.generator == "embedded" else None  # vLLM receives by itself
    return RolloutSession.start(
        session,
        progress=datamodule.progress,
        scorers=scorers,
        collator=_make_collator(session, datamodule.progress, scorers, make_collator),
        model_version=lambda: sync.version,
        generator=embedded_generator_spec(options, module.policy, eos, datamodule.tokenizer, receiver),
        interrupted=lambda: datamodule.trainer.received_sigterm,  # Lightning's SIGTERM flag (PreemptionCallback)
    )


def _sampling_arguments(sampling: SamplingOptions) -> dict[str, Any]:
    """What the rollout loop and the embedded generator both take from the sampling options, by their names."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "stop": sampling.stop,
    }
