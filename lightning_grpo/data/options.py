"""Checks of `GRPODataModule`'s options, run at construction so a bad value fails before anything starts."""

from __future__ import annotations

import math
from typing import Any, get_args

from .._imports import import_object
from ..models.dtype_probe import GENERATOR_DTYPES
from ..options import (
    LOOP_OPTION_NAMES,
    AdvantageEstimator,
    DataModuleOptions,
    GeneratorOptions,
    GeneratorQuantization,
    PromptFormat,
    SamplingOptions,
    VLLMTransfer,
    is_trainer_threads,
)
from ..rollout.stop_strings import VLLM_MAX_STOP_STRINGS, check_stop
from ..serving.server_urls import server_urls
from .formats import DATASET_FORMATS


def validate_options(options: DataModuleOptions) -> None:
    """Raise one `ValueError` listing every out-of-range option of `GRPODataModule`."""
    sampling, rewards, steps, data = options.sampling, options.rewards, options.steps, options.data
    counts = {
        "num_generations": sampling.num_generations,
        "max_completion_length": sampling.max_completion_length,
        "epochs": steps.epochs,
        "gradient_accumulation_steps": steps.gradient_accumulation_steps,
        "val_size": data.val_size,
        "val_batch_size": data.val_batch_size,
    }
    problems = [f"{name}={value} (must be at least 1)" for name, value in counts.items() if value < 1]
    if sampling.num_generations < 2:
        problems.append(f"num_generations={sampling.num_generations} (a group needs at least 2 completions to compare)")
    if steps.max_staleness < 0:
        problems.append(f"max_staleness={steps.max_staleness} (must be at least 0)")
    problems += _sampling_problems(sampling, options.generation.generator)
    if rewards.reward_num_workers < 0 or rewards.reward_timeout <= 0:
        problems.append(f"reward_num_workers={rewards.reward_num_workers}, reward_timeout={rewards.reward_timeout}")
    if not is_trainer_threads(options.generation.trainer_threads):
        problems.append(
            f"trainer_threads={options.generation.trainer_threads!r} (a positive number of threads, 'auto' or None)"
        )
    if steps.replace_early and not (steps.drop_no_signal_groups and steps.replace_dropped_groups):
        problems.append(
            f"replace_early=True with drop_no_signal_groups={steps.drop_no_signal_groups}, replace_dropped_groups="
            f"{steps.replace_dropped_groups} (it starts the replacements of dropped groups without signal: set both "
            "True, or replace_early=False)"
        )
    if steps.samples_per_row is not None and steps.samples_per_row < 1:
        problems.append(f"samples_per_row={steps.samples_per_row} (must be at least 1)")
    if rewards.advantage_estimator not in get_args(AdvantageEstimator):
        problems.append(f"advantage_estimator={rewards.advantage_estimator!r} (one of {_choices(AdvantageEstimator)})")
    elif rewards.advantage_estimator == "reinforce_plus_plus" and rewards.scale_rewards != "batch":
        problems.append(
            f"advantage_estimator='reinforce_plus_plus' with scale_rewards={rewards.scale_rewards!r} (REINFORCE++ "
            "normalises over the batch: set scale_rewards='batch')"
        )
    if options.vllm.vllm_transfer not in get_args(VLLMTransfer):
        problems.append(f"vllm_transfer={options.vllm.vllm_transfer!r} (one of {_choices(VLLMTransfer)})")
    problems += _server_problems(options)
    problems += _replica_problems(options.generation)
    problems += _generator_dtype_problems(options.generation)
    problems += _quantization_problems(options.generation)
    problems += _chat_problems(options)
    if problems:
        raise ValueError(f"GRPODataModule got invalid options: {'; '.join(problems)}.")


def _choices(choices: Any) -> str:
    """`'a', 'b', 'c'`: the values of a `Literal`."""
    return ", ".join(map(repr, get_args(choices)))


def _sampling_problems(sampling: SamplingOptions, generator: str) -> list[str]:
    problems = []
    if not (sampling.temperature > 0 and math.isfinite(sampling.temperature)):
        problems.append(f"temperature={sampling.temperature} (must be positive)")
    if not 0 < sampling.top_p <= 1:
        problems.append(f"top_p={sampling.top_p} (must be in (0, 1])")
    if sampling.min_p is not None and not 0 <= sampling.min_p <= 1:
        problems.append(f"min_p={sampling.min_p} (must be in [0, 1], or None)")
    if not (sampling.repetition_penalty > 0 and math.isfinite(sampling.repetition_penalty)):
        problems.append(f"repetition_penalty={sampling.repetition_penalty} (must be positive; 1 is off)")
    try:
        stop = check_stop(sampling.stop)
    except ValueError as error:
        problems.append(str(error))
    else:
        if generator == "vllm" and len(stop) > VLLM_MAX_STOP_STRINGS:
            problems.append(
                f"stop has {len(stop)} strings, but a vLLM server takes at most {VLLM_MAX_STOP_STRINGS} per request"
            )
    return problems


def _chat_problems(options: DataModuleOptions) -> list[str]:
    chat, data = options.chat, options.data
    problems = []
    if chat.max_tool_calling_iterations is not None and chat.max_tool_calling_iterations < 0:
        problems.append(f"max_tool_calling_iterations={chat.max_tool_calling_iterations} (must be at least 0, or None)")
    if chat.tool_timeout is not None and not chat.tool_timeout > 0:
        problems.append(f"tool_timeout={chat.tool_timeout} (must be positive, or None for no limit)")
    if chat.prompt_format not in get_args(PromptFormat):
        problems.append(f"prompt_format={chat.prompt_format!r} (one of {_choices(PromptFormat)})")
    if data.dataset_format is not None and data.dataset_format not in DATASET_FORMATS:
        problems.append(
            f"dataset_format={data.dataset_format!r} (one of {', '.join(map(repr, DATASET_FORMATS))}, or None)"
        )
    if data.dataset_options is not None and not isinstance(data.dataset_options, dict):
        problems.append(f"dataset_options={data.dataset_options!r} (a mapping of option names to values, or None)")
    return problems


def _server_problems(options: DataModuleOptions) -> list[str]:
    try:
        urls = server_urls(options.vllm.vllm_server_url)
    except ValueError as error:
        return [str(error).rstrip(".")]
    if len(urls) > 1 and options.vllm.vllm_transfer == "nccl":
        return [
            f"vllm_transfer='nccl' with {len(urls)} servers in vllm_server_url (TRL's NCCL client feeds one server: "
            "start one with data parallelism, `--data-parallel-size N`, and pass its one URL, or use 'http')"
        ]
    return []


def _generator_dtype_problems(generation: GeneratorOptions) -> list[str]:
    choice = generation.generator_dtype
    if choice is not None and choice not in GENERATOR_DTYPES:
        return [f"generator_dtype={choice!r} (one of {', '.join(map(repr, GENERATOR_DTYPES))}, or None: the policy's)"]
    if choice not in (None, "auto") and generation.generator != "embedded":
        return [
            f"generator_dtype={choice!r} with generator={generation.generator!r} (it sets the embedded generator's "
            "dtype; a vLLM server's is its own `--dtype`: leave generator_dtype='auto' or None)"
        ]
    return []


def _quantization_problems(generation: GeneratorOptions) -> list[str]:
    choice = generation.generator_quantization
    if choice is not None and choice not in get_args(GeneratorQuantization):
        names = ", ".join(map(repr, get_args(GeneratorQuantization)))
        return [f"generator_quantization={choice!r} (one of {names}, or None: none)"]
    if choice is not None and generation.generator != "embedded":
        return [
            f"generator_quantization={choice!r} with generator={generation.generator!r} (it quantizes the embedded "
            "generator's weights; a vLLM server's is its own `--quantization`: leave generator_quantization None)"
        ]
    return []


def _replica_problems(generation: GeneratorOptions) -> list[str]:
    replicas = generation.generator_replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        return [f"generator_replicas={replicas!r} (an int >= 1: the embedded generator's processes)"]
    if replicas > 1 and generation.generator != "embedded":
        return [
            f"generator_replicas={replicas} with generator={generation.generator!r} (replicas are the embedded "
            "generator's: for several vLLM servers, list their URLs in vllm_server_url and leave generator_replicas=1)"
        ]
    return []


def check_dataset_options(
    dataset: Any, val_dataset: Any, dataset_format: str | None, dataset_options: dict[str, Any] | None
) -> None:
    """Raise one `ValueError` when `dataset_format` or `dataset_options` do not fit the sources: a preset with no file,
    `Dataset` or Hub dataset to map, options that neither the preset nor a builtin task takes, an unknown
    reasoning-gym task. Each builtin task checks its own options (`tasks.BuiltinTask.option_problems`). Nothing is
    loaded or generated (reasoning-gym's config classes only)."""
    from .formats import format_option_problems
    from .tasks import builtin_task

    sources = [source for source in (dataset, val_dataset) if source is not None]
    tasks = {source: task for source in sources if (task := builtin_task(source)) is not None}
    rows = [source for source in sources if builtin_task(source) is None]
    takers = {source: task.option_problems for source, task in tasks.items() if task.option_problems is not None}
    problems = [problem for source, check in takers.items() for problem in check(source, dataset_options or {})]
    if dataset_format is not None and dataset_format in DATASET_FORMATS:
        if not rows:
            problems.append(
                f"dataset_format={dataset_format!r} maps a file, a Dataset or a Hub dataset, but dataset={dataset!r} "
                "is generated (it already has `prompt` and `answer`): leave dataset_format unset"
            )
        elif not takers:
            problems += format_option_problems(dataset_format, dataset_options or {})
    elif dataset_options and not takers:
        problems.append(
            f"dataset_options={dataset_options!r} is for a dataset_format preset or a builtin task that takes options "
            f"(arithmetic, number_guess, `reasoning_gym:<task>`), but dataset_format is None and dataset={dataset!r}"
        )
    if problems:
        raise ValueError(f"GRPODataModule got invalid dataset options: {'; '.join(problems)}.")


def checked_loop_kwargs(loop_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`loop_kwargs` as a dict, refusing the loop arguments the data module sets from its own options."""
    loop_kwargs = dict(loop_kwargs or {})
    if clash := sorted(LOOP_OPTION_NAMES.intersection(loop_kwargs)):
        raise ValueError(
            f"`loop_kwargs` sets {clash}, which GRPODataModule sets from its own options: set them there instead "
            "(e.g. `temperature=...`), and keep `loop_kwargs` for arguments the data module does not have."
        )
    return loop_kwargs


def resolve_loop_cls(spec: str | type | None) -> type | None:
    """The rollout loop class a `loop_cls` option names, checked to be a `GRPORolloutLoop` subclass."""
    if spec is None:
        return None
    from ..rollout.loop import GRPORolloutLoop

    loop_cls = import_object(spec, "loop_cls") if isinstance(spec, str) else spec
    if not (isinstance(loop_cls, type) and issubclass(loop_cls, GRPORolloutLoop)):
        raise ValueError(
            f"`loop_cls={spec!r}` is not a subclass of lightning_grpo.GRPORolloutLoop: subclass it (its hooks are "
            "`_trainer_score_payload` and `_provides_rollout_reward`) or leave `loop_cls` unset."
        )
    return loop_cls
