"""Checks of `GRPODataModule`'s options, run at construction so a bad value fails before anything starts."""

from __future__ import annotations

import math
from typing import Any

from .._imports import import_object
from ..models.precision import GENERATOR_DTYPES
from ..pipeline.session import LOOP_OPTION_NAMES
from ..rollout.stop_strings import VLLM_MAX_STOP_STRINGS, check_stop
from ..rollout.vllm_servers import server_urls
from ..training.threads import is_trainer_threads
from .formats import DATASET_FORMATS


def validate_options(hp: Any) -> None:
    """Raise one `ValueError` listing every out-of-range option of `GRPODataModule` (its `hparams`)."""
    problems = []
    for name in (
        "num_generations",
        "max_completion_length",
        "epochs",
        "gradient_accumulation_steps",
        "val_size",
        "val_batch_size",
    ):
        if hp[name] < 1:
            problems.append(f"{name}={hp[name]} (must be at least 1)")
    if hp.num_generations < 2:
        problems.append(f"num_generations={hp.num_generations} (a group needs at least 2 completions to compare)")
    if hp.max_staleness < 0:
        problems.append(f"max_staleness={hp.max_staleness} (must be at least 0)")
    if not (hp.temperature > 0 and math.isfinite(hp.temperature)):
        problems.append(f"temperature={hp.temperature} (must be positive)")
    if not 0 < hp.top_p <= 1:
        problems.append(f"top_p={hp.top_p} (must be in (0, 1])")
    if hp.min_p is not None and not 0 <= hp.min_p <= 1:
        problems.append(f"min_p={hp.min_p} (must be in [0, 1], or None)")
    if not (hp.repetition_penalty > 0 and math.isfinite(hp.repetition_penalty)):
        problems.append(f"repetition_penalty={hp.repetition_penalty} (must be positive; 1 is off)")
    try:
        stop = check_stop(hp.stop)
    except ValueError as error:
        problems.append(str(error))
    else:
        if hp.generator == "vllm" and len(stop) > VLLM_MAX_STOP_STRINGS:
            problems.append(
                f"stop has {len(stop)} strings, but a vLLM server takes at most {VLLM_MAX_STOP_STRINGS} per request"
            )
    if hp.reward_num_workers < 0 or hp.reward_timeout <= 0:
        problems.append(f"reward_num_workers={hp.reward_num_workers}, reward_timeout={hp.reward_timeout}")
    if not is_trainer_threads(hp.trainer_threads):
        problems.append(f"trainer_threads={hp.trainer_threads!r} (a positive number of threads, 'auto' or None)")
    if hp.samples_per_row is not None and hp.samples_per_row < 1:
        problems.append(f"samples_per_row={hp.samples_per_row} (must be at least 1)")
    if hp.advantage_estimator not in ("grpo", "rloo", "reinforce_plus_plus"):
        problems.append(
            f"advantage_estimator={hp.advantage_estimator!r} (one of 'grpo', 'rloo', 'reinforce_plus_plus')"
        )
    elif hp.advantage_estimator == "reinforce_plus_plus" and hp.scale_rewards != "batch":
        problems.append(
            f"advantage_estimator='reinforce_plus_plus' with scale_rewards={hp.scale_rewards!r} (REINFORCE++ "
            "normalises over the batch: set scale_rewards='batch')"
        )
    if hp.vllm_transfer not in ("auto", "http", "nccl", "lora"):
        problems.append(f"vllm_transfer={hp.vllm_transfer!r} (one of 'auto', 'http', 'nccl', 'lora')")
    problems += _server_problems(hp)
    problems += _replica_problems(hp)
    problems += _generator_dtype_problems(hp)
    if hp.max_tool_calling_iterations is not None and hp.max_tool_calling_iterations < 0:
        problems.append(f"max_tool_calling_iterations={hp.max_tool_calling_iterations} (must be at least 0, or None)")
    if hp.tool_timeout is not None and not hp.tool_timeout > 0:
        problems.append(f"tool_timeout={hp.tool_timeout} (must be positive, or None for no limit)")
    if hp.prompt_format not in ("auto", "chat", "text"):
        problems.append(f"prompt_format={hp.prompt_format!r} (one of 'auto', 'chat', 'text')")
    if hp.dataset_format is not None and hp.dataset_format not in DATASET_FORMATS:
        problems.append(
            f"dataset_format={hp.dataset_format!r} (one of {', '.join(map(repr, DATASET_FORMATS))}, or None)"
        )
    if hp.dataset_options is not None and not isinstance(hp.dataset_options, dict):
        problems.append(f"dataset_options={hp.dataset_options!r} (a mapping of option names to values, or None)")
    if problems:
        raise ValueError(f"GRPODataModule got invalid options: {'; '.join(problems)}.")


def _server_problems(hp: Any) -> list[str]:
    try:
        urls = server_urls(hp.vllm_server_url)
    except ValueError as error:
        return [str(error).rstrip(".")]
    if len(urls) > 1 and hp.vllm_transfer == "nccl":
        return [
            f"vllm_transfer='nccl' with {len(urls)} servers in vllm_server_url (TRL's NCCL client feeds one server: "
            "start one with data parallelism, `--data-parallel-size N`, and pass its one URL, or use 'http')"
        ]
    return []


def _generator_dtype_problems(hp: Any) -> list[str]:
    choice = hp.generator_dtype
    if choice is not None and choice not in GENERATOR_DTYPES:
        return [f"generator_dtype={choice!r} (one of {', '.join(map(repr, GENERATOR_DTYPES))}, or None: the policy's)"]
    if choice not in (None, "auto") and hp.generator != "embedded":
        return [
            f"generator_dtype={choice!r} with generator={hp.generator!r} (it sets the embedded generator's dtype; a "
            "vLLM server's is its own `--dtype`: leave generator_dtype='auto' or None)"
        ]
    return []


def _replica_problems(hp: Any) -> list[str]:
    replicas = hp.generator_replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        return [f"generator_replicas={replicas!r} (an int >= 1: the embedded generator's processes)"]
    if replicas > 1 and hp.generator != "embedded":
        return [
            f"generator_replicas={replicas} with generator={hp.generator!r} (replicas are the embedded generator's: "
            "for several vLLM servers, list their URLs in vllm_server_url and leave generator_replicas=1)"
        ]
    return []


def check_dataset_options(
    dataset: Any, val_dataset: Any, dataset_format: str | None, dataset_options: dict[str, Any] | None
) -> None:
    """Raise one `ValueError` when `dataset_format` or `dataset_options` do not fit the sources: a preset with no file,
    `Dataset` or Hub dataset to map, options of neither the preset nor the reasoning-gym task, an unknown task.
    Nothing is loaded or generated (reasoning-gym's config classes only)."""
    from .formats import format_option_problems
    from .reasoning_gym import is_reasoning_gym, option_problems
    from .sources import arithmetic_option_problems, is_generated

    sources = [source for source in (dataset, val_dataset) if source is not None]
    gyms = [source for source in sources if is_reasoning_gym(source)]
    rows = [source for source in sources if not is_generated(source)]
    problems = [problem for source in dict.fromkeys(gyms) for problem in option_problems(source, dataset_options)]
    if dataset_format is not None and dataset_format in DATASET_FORMATS:
        if not rows:
            problems.append(
                f"dataset_format={dataset_format!r} maps a file, a Dataset or a Hub dataset, but dataset={dataset!r} "
                "is generated (it already has `prompt` and `answer`): leave dataset_format unset"
            )
        elif not gyms:
            problems += format_option_problems(dataset_format, dataset_options or {})
    elif dataset_options and "arithmetic" in sources and not gyms:
        problems += arithmetic_option_problems(dataset_options)
    elif dataset_options and "number_guess" in sources and not gyms:
        from ..environments.number_guess import option_problems as number_guess_option_problems

        problems += number_guess_option_problems(dataset_options)
    elif dataset_options and not gyms:
        problems.append(
            f"dataset_options={dataset_options!r} is for a dataset_format preset or a `reasoning_gym:<task>` dataset, "
            f"but dataset_format is None and dataset={dataset!r}"
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
