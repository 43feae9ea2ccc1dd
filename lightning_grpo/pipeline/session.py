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
from typing import Any

from ..data.tooling import ConversationSpec
from .ledger import RolloutProgress
from .metrics import MetricWindow
from .stream import RolloutPipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionOptions:
    """What the rollout side is built from: the data module's options, resolved (see `GRPODataModule`)."""

    model_name: str
    dataset: Any
    reward_funcs: Sequence[Callable]
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    hparams: Any  # the data module's hyper-parameters
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
        options: SessionOptions,
        *,
        progress: RolloutProgress,
        scorers: Sequence[Any],
        model_version: Callable[[], int],
        generator: Any,
        interrupted: Callable[[], bool] | None = None,
    ) -> RolloutSession:
        """Spawn the rollout child and build the pipeline over its queue.

        Args:
            options: the resolved data-module options.
            progress: the run's ledger (its consumed groups are skipped by the child).
            scorers: the module's trainer scorers; with any, the child leaves advantages pending.
            model_version: the policy version the staleness filter compares against (`WeightSync.version`).
            generator: the embedded generator's `GeneratorSpec`, or None for the vLLM server.
            interrupted: True once the trainer must stop (SIGTERM): waiting for rollouts then ends at once.

        Raises:
            RuntimeError: the child failed while starting (its traceback is in the message).
        """
        worker = _make_worker(options, progress, generator=generator, trainer_scored=bool(scorers))
        worker.start()
        hp = options.hparams
        metrics: dict[str, list] = {}
        pipeline = RolloutPipeline(
            worker,
            progress,
            planner_kwargs=_planner_kwargs(options, scorers),
            collator=_make_collator(options, progress, scorers),
            model_version=model_version,
            max_staleness=hp.max_staleness,
            mask_truncated_completions=hp.mask_truncated_completions,
            heartbeat_timeout=hp.heartbeat_timeout,
            metrics=metrics,
            core_sharing=options.core_sharing,
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


def _make_worker(options: SessionOptions, progress: RolloutProgress, *, generator: Any, trainer_scored: bool) -> Any:
    from ..rollout.vllm_servers import server_stale_after_s
    from ..rollout.worker import GRPORolloutWorker

    hp = options.hparams
    loop_options = dict(
        model_name=options.model_name,
        dataset=options.dataset,
        reward_funcs=list(options.reward_funcs),
        processing_class=options.tokenizer,
        eos_token_ids=list(options.eos_token_ids),
        num_generations=hp.num_generations,
        max_inflight_tasks=(hp.max_staleness + 1) * options.groups_per_step * hp.num_generations,
        max_tokens=hp.max_completion_length,
        temperature=hp.temperature,
        top_p=hp.top_p,
        top_k=hp.top_k,
        min_p=hp.min_p,
        repetition_penalty=hp.repetition_penalty,
        stop=hp.stop,
        vllm_server_url=hp.vllm_server_url,
        vllm_failover=hp.get("vllm_failover", False),
        vllm_lost=options.vllm_lost,
        vllm_stale_after_s=server_stale_after_s(hp),
        generator=generator,
        reward_weights=hp.reward_weights,
        multi_objective_aggregation=hp.multi_objective_aggregation,
        scale_rewards=hp.scale_rewards,
        advantage_estimator=hp.advantage_estimator,
        reward_num_workers=hp.reward_num_workers,
        reward_timeout=hp.reward_timeout,
        trainer_scored=trainer_scored,
        epochs=hp.epochs,
        seed=hp.seed,
        consumed=set(progress.consumed),
        groups_per_step=options.groups_per_step,
        max_staleness=hp.max_staleness,
        lora_name=options.lora_name,
        core_sharing=options.core_sharing,
        **options.conversation.loop_options(),
    )
    if loop_options.keys() != LOOP_OPTION_NAMES:  # the two lists are kept together on purpose
        raise RuntimeError(f"LOOP_OPTION_NAMES is out of date: {sorted(loop_options.keys() ^ LOOP_OPTION_NAMES)}")
    return GRPORolloutWorker(
        loop_cls=options.loop_cls,
        child_ready_timeout=hp.child_ready_timeout,
        **loop_options,
        **options.loop_kwargs,
    )


#: The loop arguments the session sets from the data module's options; `loop_kwargs` may not set them.
LOOP_OPTION_NAMES = frozenset(
    {
        "model_name",
        "dataset",
        "reward_funcs",
        "processing_class",
        "eos_token_ids",
        "num_generations",
        "max_inflight_tasks",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop",
        "vllm_server_url",
        "vllm_failover",
        "vllm_lost",
        "vllm_stale_after_s",
        "generator",
        "reward_weights",
        "multi_objective_aggregation",
        "scale_rewards",
        "advantage_estimator",
        "reward_num_workers",
        "reward_timeout",
        "trainer_scored",
        "epochs",
        "seed",
        "consumed",
        "groups_per_step",
        "max_staleness",
        "lora_name",
        "core_sharing",
        "tools",
        "environment_factory",
        "max_tool_calling_iterations",
        "tool_timeout",
        "prompt_format",
    }
)


def _planner_kwargs(options: SessionOptions, scorers: Sequence[Any]) -> dict[str, Any]:
    hp = options.hparams
    return {
        "num_processes": options.world_size,
        "steps": hp.gradient_accumulation_steps,
        "token_budget": hp.token_budget,
        "samples_per_row": hp.samples_per_row or hp.num_generations,
        "scorers": list(scorers),
        "max_groups_per_step": options.groups_per_step,
    }


def _make_collator(options: SessionOptions, progress: RolloutProgress, scorers: Sequence[Any]) -> Any:
    from .._trl import get_callable_name

    names = [get_callable_name(func) for func in options.reward_funcs] + options.conversation.reward_names
    hp = options.hparams
    kwargs = dict(
        num_processes=options.world_size,
        pad_token_id=options.tokenizer.pad_token_id or 0,
        reward_names=names,
        scale_rewards=hp.scale_rewards,
        advantage_estimator=hp.advantage_estimator,
    )
    if not scorers:
        from .collating import ProgressCollator

        return ProgressCollator(progress, **kwargs)
    from ..scoring.collator import ScoringCollator

    return ScoringCollator(progress, scorers=scorers, **kwargs)


def embedded_generator_spec(hp: Any, policy: Any, eos: Sequence[int], tokenizer: Any, weight_receiver: Any) -> Any:
    """The `GeneratorSpec` of the embedded generator under the data module's options `hp` (a `GeneratorReplicasSpec`
    with `generator_replicas` > 1); None for vLLM."""
    if hp.generator != "embedded":
        return None
    from ..models.precision import resolve_generator_dtype
    from ..rollout.generator import GeneratorSpec, PolicySpec
    from ..rollout.replicas import GeneratorReplicasSpec
    from ..rollout.vllm_servers import server_stale_after_s

    dtype, why = resolve_generator_dtype(hp.generator_dtype, policy.dtype)
    log.info("The embedded generator samples in %s: %s.", dtype, why)
    spec = GeneratorSpec(
        PolicySpec.from_model(policy, dtype),
        eos_token_ids=tuple(eos),
        temperature=hp.temperature,
        top_p=hp.top_p,
        top_k=hp.top_k,
        min_p=hp.min_p,
        repetition_penalty=hp.repetition_penalty,
        stop=hp.stop,
        tokenizer=tokenizer if hp.stop else None,
        max_tokens=hp.max_completion_length,
        max_batch_size=max(hp.num_generations, 64),
        weight_receiver=weight_receiver,
        num_threads=hp.generator_threads,
    )
    if hp.generator_replicas == 1:
        return spec
    return GeneratorReplicasSpec(spec, hp.generator_replicas, stale_after_s=server_stale_after_s(hp))


def start_rollout_session(datamodule: Any, module: Any) -> RolloutSession:
    """Rank 0: start the rollout session of `datamodule` (a `GRPODataModule` in `train_dataloader`, its prompts,
    rewards, weight sync and threads set up) for `module`'s policy and scorers (a `PolicySource`)."""
    from ..models.loading import eos_token_ids

    hp, sync = datamodule.hparams, datamodule.weight_sync
    eos = eos_token_ids(datamodule.tokenizer, module.policy)
    options = SessionOptions(
        model_name=datamodule.model_name or module.model_name or "policy",
        dataset=datamodule.train_prompts,
        reward_funcs=datamodule.reward_funcs,
        tokenizer=datamodule.tokenizer,
        eos_token_ids=tuple(eos),
        hparams=hp,
        loop_cls=datamodule.loop_cls,
        loop_kwargs=datamodule.loop_kwargs,
        world_size=datamodule.trainer.world_size,
        groups_per_step=datamodule.groups_per_step(),
        lora_name=getattr(sync.transfer, "lora_name", None),
        vllm_lost=getattr(sync.transfer, "lost", None),
        conversation=datamodule.conversation,
        core_sharing=datamodule.core_sharing,
    )
    receiver = sync.receiver() if hp.generator == "embedded" else None  # a vLLM server receives by itself
    return RolloutSession.start(
        options,
        progress=datamodule.progress,
        scorers=list(module.scorers),
        model_version=lambda: sync.version,
        generator=embedded_generator_spec(hp, module.policy, eos, datamodule.tokenizer, receiver),
        interrupted=lambda: datamodule.trainer.received_sigterm,  # Lightning's SIGTERM flag (PreemptionCallback)
    )
