"""`GRPODataModule`'s options as typed, frozen records: what each part of the rollout side reads.

The data module's flat, TRL-named arguments stay its interface (the YAML keys, `save_hyperparameters`, the
checkpoint); `DataModuleOptions.from_hparams` reads each of them once, into the record of the concern it belongs to,
and every function below the data module takes the record(s) it reads. Defaults live in one place, the data module's
signature: the records have none. Checks of the values are `lightning_grpo.data.options.validate_options`.

This module imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
ScaleRewards = Literal["group", "batch", "none"]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_plus_plus"]
Generator = Literal["embedded", "vllm"]
GeneratorDtype = Literal["auto", "float32", "bfloat16"]
GeneratorQuantization = Literal["int8"]
VLLMTransfer = Literal["auto", "http", "nccl", "lora"]
PromptFormat = Literal["auto", "chat", "text"]
DatasetFormat = Literal["gsm8k", "math", "prompt_answer"]
TrainerThreads = int | Literal["auto"] | None


def is_trainer_threads(option: object) -> bool:
    """Whether `option` is a valid `trainer_threads`: a positive number of threads, `"auto"` or None."""
    return option is None or option == "auto" or (isinstance(option, int) and option >= 1)


@dataclass(frozen=True, slots=True)
class DataOptions:
    """Where the prompts and the tokenizer come from."""

    model: str | None  #: the policy's name or path (tokenizer, generator); None: the `GRPOModule`'s
    tokenizer: str | None  #: a tokenizer name or path when it differs from `model`
    dataset_size: int | None  #: rows kept (or generated); None: all
    dataset_seed: int  #: seed of the prompt generators
    dataset_format: DatasetFormat | None  #: the column preset of a file or `Dataset`; None: columns as they are
    dataset_options: dict[str, Any] | None  #: the preset's or the task generator's options
    val_size: int  #: held-out prompts kept
    val_batch_size: int  #: held-out prompts per validation batch
    allow_changed_data: bool  #: resume on other data (a new ledger) instead of refusing


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How each completion is sampled (the loss divides logits by the same `temperature`)."""

    num_generations: int  #: completions per prompt (the group size)
    max_completion_length: int  #: tokens per completion
    temperature: float  #: sampling temperature
    top_p: float  #: nucleus mass kept, in (0, 1]
    top_k: int  #: tokens kept by rank; 0 keeps all
    min_p: float | None  #: drop tokens below `min_p` times the most likely; None keeps all
    repetition_penalty: float  #: above 1 discourages repeated tokens; 1 is off
    stop: list[str] | None  #: strings that end a completion as an EOS does


@dataclass(frozen=True, slots=True)
class RewardOptions:
    """How rewards are scored and turned into advantages."""

    reward_weights: list[float] | None  #: one weight per reward column; None: all 1
    multi_objective_aggregation: MultiObjectiveAggregation  #: GRPO's sum-then-normalize or GDPO's order
    scale_rewards: ScaleRewards  #: what the advantages are divided by
    advantage_estimator: AdvantageEstimator  #: the baseline subtracted from each reward
    reward_num_workers: int  #: processes scoring synchronous rewards; 0: threads
    reward_timeout: float  #: seconds one reward call may take before it scores NaN


@dataclass(frozen=True, slots=True)
class StepOptions:
    """The prompt-group schedule and how groups become optimizer steps."""

    epochs: int  #: passes over the prompts
    seed: int  #: shuffles each epoch's prompt order
    max_staleness: int  #: policy versions a group may lag when it trains
    gradient_accumulation_steps: int  #: micro-batches per optimizer step on each rank
    samples_per_row: int | None  #: samples in one micro-batch row without a token budget; None: `num_generations`
    token_budget: int  #: unique tokens in one micro-batch row; <= 0: cap samples instead
    stall_groups: int | None  #: groups in a row consumed without training before the run fails; None: one pass
    mask_truncated_completions: bool  #: truncated completions train nothing
    drop_no_signal_groups: bool  #: groups whose completions all score alike are dropped, not trained
    replace_dropped_groups: bool  #: a dropped group's place in its step goes to the next group; False: stays empty
    replace_early: bool  #: a group without signal's replacement starts when it is scored, not when its step is planned


@dataclass(frozen=True, slots=True)
class GeneratorOptions:
    """Which generator samples, in which processes and threads, and how long they may be silent."""

    generator: Generator  #: the policy on CPU in the rollout child, or a vLLM server
    generator_threads: int | None  #: torch threads of the embedded generator (each replica's); None: torch's
    generator_dtype: GeneratorDtype | None  #: the embedded generator's weights and KV cache; None: the policy's
    generator_quantization: GeneratorQuantization | None  #: the embedded generator's layer weights as int8; None: not
    generator_replicas: int  #: embedded generator processes
    trainer_threads: TrainerThreads  #: the trainer's torch threads during `fit` (see `is_trainer_threads`)
    heartbeat_timeout: float  #: seconds without a heartbeat before the rollout child counts as hung
    child_ready_timeout: float  #: seconds the rollout child may take to start


@dataclass(frozen=True, slots=True)
class VLLMOptions:
    """The vLLM servers of `generator="vllm"` and how weights reach them."""

    vllm_server_url: str | list[str]  #: one server or several
    vllm_failover: bool  #: with several servers, go on with the others when one is lost
    vllm_server_timeout: float  #: seconds set-up waits for each server's `/health`
    vllm_transfer: VLLMTransfer  #: the weight transfer backend


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How prompts become conversations, and how long tool rounds may go on."""

    max_tool_calling_iterations: int | None  #: tool rounds in one conversation; None: no limit
    tool_timeout: float | None  #: seconds a tool call (or an environment's reset or reward) may take; None: no limit
    prompt_format: PromptFormat  #: how a string prompt is used


Record = TypeVar("Record", bound="DataclassInstance")


def from_flat(record: type[Record], flat: Mapping[str, Any]) -> Record:
    """`record` built from the flat options (a `hparams` mapping) that name its fields, each read once.

    Raises:
        KeyError: a field missing from `flat`.
    """
    return record(**{field.name: flat[field.name] for field in dataclasses.fields(record)})


@dataclass(frozen=True, slots=True)
class DataModuleOptions:
    """Every option of `GRPODataModule` that is a plain value, one record per concern (the arguments that may be
    objects, such as `dataset` or `reward_funcs`, are held by the data module itself)."""

    data: DataOptions  #: prompts and tokenizer
    sampling: SamplingOptions  #: how completions are sampled
    rewards: RewardOptions  #: rewards and advantages
    steps: StepOptions  #: the schedule and the step plan
    generation: GeneratorOptions  #: the generator's processes and threads
    vllm: VLLMOptions  #: the vLLM servers
    chat: ChatOptions  #: conversations and tools

    @classmethod
    def records(cls) -> dict[str, type]:
        """The record type of each field, by field name."""
        hints = typing.get_type_hints(cls)
        return {field.name: hints[field.name] for field in dataclasses.fields(cls)}

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> DataModuleOptions:
        """The records of the data module's hyper-parameters (its `__init__` arguments by name).

        Raises:
            KeyError: an option missing from `hparams`.
        """
        return cls(
            data=from_flat(DataOptions, hparams),
            sampling=from_flat(SamplingOptions, hparams),
            rewards=from_flat(RewardOptions, hparams),
            steps=from_flat(StepOptions, hparams),
            generation=from_flat(GeneratorOptions, hparams),
            vllm=from_flat(VLLMOptions, hparams),
            chat=from_flat(ChatOptions, hparams),
        )

    def replace(self, **changes: Any) -> DataModuleOptions:
        """A copy with each named option (by its flat name, `gradient_accumulation_steps=2`) changed in its record.

        Raises:
            TypeError: a name that is no option of the records.
        """
        records = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        unknown = set(changes)
        for name, record in records.items():
            mine = {key: value for key, value in changes.items() if key in _field_names(type(record))}
            if mine:
                records[name] = dataclasses.replace(record, **mine)
                unknown -= mine.keys()
        if unknown:
            raise TypeError(f"`DataModuleOptions.replace` got {sorted(unknown)}, which no record has.")
        return DataModuleOptions(**records)


def _field_names(record: type) -> set[str]:
    return {field.name for field in dataclasses.fields(record)}


@dataclass(frozen=True, slots=True)
class LoopOptions:
    """The rollout loop's arguments that the data module's rollout session sets from its options (the names of
    `GRPORolloutLoop` and TRL's loop); `GRPODataModule(loop_kwargs=...)` may set only others."""

    model_name: str  #: the model name requests and the embedded generator use
    dataset: Any  #: the training prompts (a `datasets.Dataset`)
    reward_funcs: list[Callable[..., Any]]  #: the reward functions, scored in the child
    processing_class: Any  #: the tokenizer
    eos_token_ids: list[int]  #: tokens that end a completion
    num_generations: int  #: completions per prompt
    max_inflight_tasks: int  #: completions in flight at most (the pacing window in samples)
    max_tokens: int  #: tokens per completion
    temperature: float  #: sampling temperature
    top_p: float  #: nucleus mass kept
    top_k: int  #: tokens kept by rank; 0 keeps all
    min_p: float | None  #: min-p; None keeps all
    repetition_penalty: float  #: 1 is off
    stop: list[str] | None  #: stop strings
    vllm_server_url: str | list[str]  #: the vLLM servers
    vllm_failover: bool  #: go on without a lost server
    vllm_lost: Any  #: the weight fan-out's shared flags of lost servers, or None
    vllm_stale_after_s: float  #: seconds a silent server may take before it is lost
    generator: Any  #: the embedded generator's spec, or None for vLLM
    reward_weights: list[float] | None  #: one weight per reward column; None: all 1
    multi_objective_aggregation: MultiObjectiveAggregation  #: how reward columns are combined
    scale_rewards: ScaleRewards  #: what advantages are divided by
    advantage_estimator: AdvantageEstimator  #: the advantages' baseline
    reward_num_workers: int  #: reward processes; 0: threads
    reward_timeout: float  #: seconds one reward call may take
    trainer_scored: bool  #: advantages are left pending for the trainer's scorers
    epochs: int  #: passes over the prompts
    seed: int  #: the schedule's seed
    consumed: set[int]  #: group ids a resumed run skips
    groups_per_step: int  #: prompt groups in one optimizer step (the pacing unit)
    max_staleness: int  #: policy versions a group may lag
    replace_early: bool  #: tag groups without signal when scored and start their replacements then
    lora_name: str | None  #: the served adapter's name prefix (adapter-only vLLM sync)
    core_sharing: Any  #: the trainer's and the embedded generator's `CoreSharing`, or None
    tools: list[Callable[..., Any]] | None  #: tools the policy may call
    environment_factory: Any  #: environment classes or factories, or None
    max_tool_calling_iterations: int | None  #: tool rounds in one conversation
    tool_timeout: float | None  #: seconds one tool call may take
    prompt_format: PromptFormat  #: how a string prompt is used

    def arguments(self) -> dict[str, Any]:
        """The loop's keyword arguments (the values themselves, not copies)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


#: The loop arguments the data module sets from its own options; `loop_kwargs` may not set them.
LOOP_OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(LoopOptions))
