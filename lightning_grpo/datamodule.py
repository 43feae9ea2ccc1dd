"""GRPODataModule: the prompts, the rewards, the rollout child and the stream of optimizer steps."""

from __future__ import annotations

import logging
import math
import queue
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from datasets import Dataset
from torch.utils.data import DataLoader

from ._imports import resolve_callable
from .data import as_messages, check_columns, check_source, load_prompts
from .metrics import MetricWindow
from .pipeline.ledger import RolloutProgress
from .rollout.schedule import GroupSchedule
from .threads import is_trainer_threads, trainer_threads_for

log = logging.getLogger(__name__)

# StepStream has a length only to turn off Lightning's one-ahead prefetch (see `StepStream.__len__`).
warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined.*")

RewardFunc = Callable[..., list[float | None]]


class GRPODataModule(pl.LightningDataModule):
    """Prompts in, optimizer steps out: owns the rollout child, the reward functions and progress across resumes.

    On rank 0, `train_dataloader()` starts a `GRPORolloutWorker` (generation and reward scoring in a CUDA-free child
    process) and builds GroupedQueue → SampleFilterQueue → StepPlanner → collator → StopAwareDataset; every rank then
    receives its rows of each optimizer step, and a stop item reaches all of them at the same batch when the run's
    prompt groups are consumed. `state_dict()` carries the consumed groups, so `Trainer.fit(ckpt_path=...)` trains
    every prompt group exactly once over the interrupted and the resumed run. `teardown` (and `on_exception`) stop the
    child and its reward pool.

    Use it with `GRPOModule`; the module's callbacks (`WeightSyncCallback`, `RolloutStopCallback`,
    `RolloutMetricsCallback`) are added automatically.

    Args:
        model: the policy's name or path for the tokenizer and the generator; None takes the `GRPOModule`'s.
        tokenizer: a tokenizer name or path when it differs from `model` (or the policy is an `nn.Module`).
        dataset: `"arithmetic"` (builtin), a `.jsonl`/`.parquet` path, a `datasets.Dataset`, or a Hub dataset name. It
            needs a `prompt` column (chat messages or a string) plus the columns the reward functions read.
        dataset_size: keep the first rows (or generate this many for `"arithmetic"`).
        dataset_seed: seed of the builtin generator.
        val_dataset: held-out prompts for `validation_step`; default: the builtin task with another seed when
            `dataset="arithmetic"`, else none.
        val_size: held-out prompts to keep.
        reward_funcs: callables or import paths (`"lightning_grpo.rewards.accuracy"`, `"my_pkg.rewards:fmt"`) with
            TRL's reward signature.
        reward_weights: one weight per reward function (default all 1).
        multi_objective_aggregation: `"sum_then_normalize"` (GRPO) or `"normalize_then_sum"` (GDPO).
        scale_rewards: `"group"`, `"batch"` or `"none"`.
        reward_num_workers: processes scoring synchronous rewards (0: threads, unsafe for CPU-heavy rewards).
        reward_timeout: seconds one reward call may take before it scores NaN.
        generator: `"embedded"` (the policy on CPU in the child) or `"vllm"` (TRL's HTTP path to a vLLM server).
        vllm_server_url: the vLLM server for `generator="vllm"`.
        num_generations: completions per prompt (the group size).
        max_completion_length: tokens per completion.
        temperature: sampling temperature; the loss divides the policy's logits by the same temperature.
        top_p: nucleus sampling mass kept, in (0, 1].
        top_k: tokens kept by rank when sampling; 0 keeps all.
        epochs: passes over the prompts; the run ends when `epochs * len(dataset)` groups are consumed.
        seed: shuffles each epoch's prompt order.
        max_staleness: how many policy versions a group may lag when it trains; generation is paced to stay within
            it and the rare staler group is dropped.
        gradient_accumulation_steps: micro-batches per optimizer step (each rank runs this many forward/backward).
        samples_per_row: samples in one rank's micro-batch when `token_budget <= 0` (default: `num_generations`).
        token_budget: cap on one micro-batch row's unique tokens (tree-packed); `<= 0` caps samples instead.
        stall_groups: groups in a row consumed without one training before the run fails (default: one pass).
        mask_truncated_completions: completions that hit the length limit train nothing.
        heartbeat_timeout: seconds without a heartbeat from the rollout child before it counts as hung.
        child_ready_timeout: seconds to wait for the child to load the policy and start.
        generator_threads: torch threads of the embedded generator (None: torch's default).
        trainer_threads: torch threads the trainer trains with during `fit` (restored afterwards). `"auto"`: on a CPU
            with the embedded generator and one process, the cores the generator does not use, so the two do not
            oversubscribe the CPU (1.28x faster on 2 cores, see `lightning_grpo.threads`); a number: that many;
            None: leave torch's setting alone.
        val_batch_size: held-out prompts per validation batch.
        loop_cls: a `GRPORolloutLoop` subclass (or its import path) for the rollout child to run instead, e.g. one
            that overrides `_trainer_score_payload` to send trainer scorers what they need beyond the samples
            (EBFT's reference features) or scores each rollout itself (`_provides_rollout_reward`).
        loop_kwargs: extra keyword arguments for the loop: `loop_cls`'s own, or TRL loop arguments this data module
            does not set (such as `tools`). They travel to the child with cloudpickle.
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dataset: str | Dataset = "arithmetic",
        dataset_size: int | None = None,
        dataset_seed: int = 0,
        val_dataset: str | Dataset | None = None,
        val_size: int = 64,
        reward_funcs: Sequence[str | RewardFunc] = ("lightning_grpo.rewards.accuracy",),
        reward_weights: list[float] | None = None,
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
        scale_rewards: Literal["group", "batch", "none"] = "group",
        reward_num_workers: int = 1,
        reward_timeout: float = 30.0,
        generator: Literal["embedded", "vllm"] = "embedded",
        vllm_server_url: str = "http://localhost:8000",
        num_generations: int = 8,
        max_completion_length: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        epochs: int = 1,
        seed: int = 0,
        max_staleness: int = 2,
        gradient_accumulation_steps: int = 1,
        samples_per_row: int | None = None,
        token_budget: int = 0,
        stall_groups: int | None = None,
        mask_truncated_completions: bool = False,
        heartbeat_timeout: float = 300.0,
        child_ready_timeout: float = 300.0,
        generator_threads: int | None = 1,
        trainer_threads: int | Literal["auto"] | None = "auto",
        val_batch_size: int = 16,
        loop_cls: str | type | None = None,
        loop_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["dataset", "val_dataset", "reward_funcs", "loop_cls", "loop_kwargs"])
        self.model_name = model
        self.tokenizer_name = tokenizer
        self.dataset_source = dataset
        self.val_source = val_dataset
        self.reward_func_specs = list(reward_funcs)
        _validate_options(self.hparams)
        # Fail on a bad import path or a missing file now, before Trainer.fit launches ranks or the rollout child.
        self.reward_funcs: list[RewardFunc] = [resolve_callable(f, "reward_funcs") for f in self.reward_func_specs]
        for source in (dataset, val_dataset):
            check_source(source)
        self.loop_cls = _resolve_loop_cls(loop_cls)
        self.loop_kwargs = _checked_loop_kwargs(loop_kwargs)
        self.train_prompts: Dataset | None = None
        self.val_prompts: Dataset | None = None
        self.tokenizer: Any = None
        self.schedule: GroupSchedule | None = None
        self.progress: RolloutProgress | None = None
        self.model_version = 0
        self._threads_before: int | None = None
        self.worker: Any = None
        self.pipeline: Any = None
        self._transfer: Any = None
        self._restored: dict[str, Any] | None = None
        self._group: Any = None
        self._metrics: dict[str, list] = {}
        self._rollout_window = MetricWindow()
        self._val_pool: Any = None

    # -- setup (every rank; no processes) ---------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Load and check the prompts, tokenizer and reward functions; nothing is spawned here."""
        if stage == "fit":
            self._share_cores()
        if self.train_prompts is not None:
            return
        self.train_prompts = load_prompts(
            self.dataset_source, size=self.hparams.dataset_size, seed=self.hparams.dataset_seed
        )
        check_columns(self.train_prompts, {"prompt"}, source=f"dataset={self.dataset_source!r}")
        self.val_prompts = self._load_val_prompts()
        self.tokenizer = self._load_tokenizer()
        self.schedule = GroupSchedule(len(self.train_prompts), self.hparams.epochs, self.hparams.seed)
        self.progress = RolloutProgress(
            epochs_done=len(self.schedule), stall_groups=self.hparams.stall_groups or len(self.train_prompts)
        )
        if self._restored is not None:
            self.progress.load_state_dict(self._restored)
        world = self.trainer.world_size if self.trainer is not None else 1
        if world > 1 and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # keeps pickled batches off the (NCCL) default group

    def _share_cores(self) -> None:
        from lightning.pytorch.accelerators import CPUAccelerator

        if self._threads_before is not None:  # already set by an earlier `fit` setup
            return
        hp = self.hparams
        current = torch.get_num_threads()
        threads = trainer_threads_for(
            hp.trainer_threads,
            current=current,
            on_cpu=isinstance(self.trainer.accelerator, CPUAccelerator),
            embedded_generator=hp.generator == "embedded",
            generator_threads=hp.generator_threads,
            world_size=self.trainer.world_size,
        )
        if threads is None:
            return
        self._threads_before = current
        torch.set_num_threads(threads)
        log.info(
            "Training with %d torch threads (was %d) beside the generator's %s.",
            threads,
            self._threads_before,
            hp.generator_threads,
        )

    def _restore_threads(self) -> None:
        before, self._threads_before = self._threads_before, None
        if before is not None:
            torch.set_num_threads(before)

    def _load_val_prompts(self) -> Dataset | None:
        source = self.val_source
        if source is None and self.dataset_source == "arithmetic":
            return load_prompts("arithmetic", size=self.hparams.val_size, seed=self.hparams.dataset_seed + 10_000)
        if source is None:
            return None
        prompts = load_prompts(source, size=self.hparams.val_size)
        check_columns(prompts, {"prompt"}, source=f"val_dataset={source!r}")
        return prompts

    def _load_tokenizer(self) -> Any:
        from .models import load_tokenizer

        name = self.tokenizer_name or self.model_name or self._module_model_name()
        if name is None:
            raise ValueError(
                "GRPODataModule needs a tokenizer: pass `model=` (a name or path) or `tokenizer=`, or give the "
                "GRPOModule its policy by name."
            )
        return load_tokenizer(name)

    def _module_model_name(self) -> str | None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        name = getattr(module, "model_name", None)
        return name if isinstance(name, str) else None

    # -- state ------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The consumed prompt groups (rank 0's are written); see `RolloutProgress.state_dict`."""
        return {"progress": self.progress.state_dict() if self.progress is not None else {}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("progress") or None
        if self.progress is not None and self._restored is not None:
            self.progress.load_state_dict(self._restored)

    def progress_summary(self) -> dict[str, int] | None:
        if self.progress is None:
            return None
        return {"groups_consumed": len(self.progress.consumed), "groups_total": self.progress.epochs_done}

    def stall_error(self) -> str | None:
        """Rank 0: the stall error when the run's last groups were all excluded by trainer scoring."""
        return self.progress.stall_error() if self.progress is not None else None

    def commit(self, group_ids: Sequence[int]) -> None:
        """Rank 0: the optimizer step that trained `group_ids` is done; they go into the next checkpoint."""
        if self.progress is not None and self.trainer.is_global_zero:
            self.progress.commit(group_ids)

    # -- weights ----------------------------------------------------------------------------------------------------

    def push_weights(self, named_tensors: Any, version: int) -> None:
        """Rank 0: publish the policy's weights as `version`; the generator's next batch samples with them."""
        if self._transfer is None:
            self._transfer = self._make_transfer()
        self._transfer.pause()
        try:
            self._transfer.send_weights(named_tensors, version=version)
        finally:
            self._transfer.resume()
        self.model_version = version
        if self.worker is not None:
            self.worker.update_model_version(version)

    def _make_transfer(self) -> Any:
        from .weights.factory import make_weight_transfer

        policy = self.trainer.lightning_module.policy
        return make_weight_transfer(self.hparams.generator, policy, vllm_server_url=self.hparams.vllm_server_url)

    # -- training stream --------------------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        """Every rank's stream of optimizer steps; rank 0 starts the rollout child here."""
        from .pipeline.stream import StepStream

        source = self._start_pipeline() if self.trainer.is_global_zero else None
        stream = StepStream(
            source,
            rank=self.trainer.global_rank,
            world_size=self.trainer.world_size,
            group=self._group,
            on_stop=self._on_stream_stop,
            max_batches=len(self.schedule) + 1,
        )
        return DataLoader(stream, batch_size=None, num_workers=0, collate_fn=_identity)

    def _on_stream_stop(self) -> None:
        # StopIteration alone would start another epoch (max_epochs=-1) and iterate the ended stream again.
        if self.trainer is not None:
            self.trainer.should_stop = True

    def _start_pipeline(self) -> Any:
        from .pipeline.stream import RolloutPipeline

        if self.worker is not None:
            self.close()
        module = self.trainer.lightning_module
        scorers = list(getattr(module, "scorers", []) or [])
        self.worker = self._make_worker(module, trainer_scored=bool(scorers))
        self.worker.start()
        self.pipeline = RolloutPipeline(
            self.worker,
            self.progress,
            planner_kwargs=self._planner_kwargs(scorers),
            collator=self._make_collator(scorers),
            model_version=lambda: self.model_version,
            max_staleness=self.hparams.max_staleness,
            mask_truncated_completions=self.hparams.mask_truncated_completions,
            heartbeat_timeout=self.hparams.heartbeat_timeout,
            metrics=self._metrics,
        )
        return self.pipeline

    def groups_per_step(self) -> int:
        """Prompt groups in one optimizer step (the planner's cap and the pacing unit)."""
        hp = self.hparams
        rows = hp.gradient_accumulation_steps * self.trainer.world_size
        if hp.token_budget > 0:
            longest_prompt = max(len(ids) for ids in self._prompt_token_ids())
            per_row = hp.token_budget // (longest_prompt + hp.num_generations * hp.max_completion_length)
            return max(1, rows * max(1, per_row))
        return max(1, rows * (hp.samples_per_row or hp.num_generations) // hp.num_generations)

    def _prompt_token_ids(self) -> list[list[int]]:
        return [
            self.tokenizer.apply_chat_template(
                as_messages(row["prompt"]), add_generation_prompt=True, return_dict=False
            )
            for row in self.train_prompts
        ]

    def _planner_kwargs(self, scorers: list[Any]) -> dict[str, Any]:
        hp = self.hparams
        return {
            "num_processes": self.trainer.world_size,
            "steps": hp.gradient_accumulation_steps,
            "token_budget": hp.token_budget,
            "samples_per_row": hp.samples_per_row or hp.num_generations,
            "scorers": scorers,
            "stop_token_ids": None,
            "max_groups_per_step": self.groups_per_step(),
        }

    def _make_collator(self, scorers: list[Any]) -> Any:
        from .pipeline.collating import ProgressCollator

        names = [_reward_name(f) for f in self.reward_funcs]
        kwargs = dict(
            num_processes=self.trainer.world_size, pad_token_id=self.tokenizer.pad_token_id or 0, reward_names=names
        )
        if not scorers:
            return ProgressCollator(self.progress, **kwargs)
        from .scoring.collator import ScoringCollator

        return ScoringCollator(self.progress, scorers=scorers, **kwargs)

    def _make_worker(self, module: Any, trainer_scored: bool) -> Any:
        from .rollout.worker import GRPORolloutWorker

        hp = self.hparams
        eos = _eos_ids(self.tokenizer, module.policy)
        groups_per_step = self.groups_per_step()
        options = dict(
            model_name=self.model_name or getattr(module, "model_name", None) or "policy",
            dataset=self.train_prompts,
            reward_funcs=self.reward_funcs,
            processing_class=self.tokenizer,
            eos_token_ids=eos,
            num_generations=hp.num_generations,
            max_inflight_tasks=(hp.max_staleness + 1) * groups_per_step * hp.num_generations,
            max_tokens=hp.max_completion_length,
            temperature=hp.temperature,
            top_p=hp.top_p,
            top_k=hp.top_k,
            vllm_server_url=hp.vllm_server_url,
            generator=self._generator_spec(module, eos),
            reward_weights=hp.reward_weights,
            multi_objective_aggregation=hp.multi_objective_aggregation,
            scale_rewards=hp.scale_rewards,
            reward_num_workers=hp.reward_num_workers,
            reward_timeout=hp.reward_timeout,
            trainer_scored=trainer_scored,
            epochs=hp.epochs,
            seed=hp.seed,
            consumed=set(self.progress.consumed),
            groups_per_step=groups_per_step,
            max_staleness=hp.max_staleness,
        )
        assert options.keys() == _LOOP_OPTION_NAMES, sorted(options.keys() ^ _LOOP_OPTION_NAMES)
        return GRPORolloutWorker(
            loop_cls=self.loop_cls, child_ready_timeout=hp.child_ready_timeout, **options, **self.loop_kwargs
        )

    def _generator_spec(self, module: Any, eos: list[int]) -> Any:
        if self.hparams.generator != "embedded":
            return None
        from .rollout.generator import GeneratorSpec, PolicySpec

        hp = self.hparams
        if self._transfer is None:  # no WeightSyncCallback pushed yet: publish the current weights now
            self.push_weights(module.policy_weights(), self.model_version)
        return GeneratorSpec(
            policy=PolicySpec.from_model(module.policy),
            eos_token_ids=tuple(eos),
            temperature=hp.temperature,
            top_p=hp.top_p,
            top_k=hp.top_k,
            max_tokens=hp.max_completion_length,
            max_batch_size=max(hp.num_generations, 64),
            weight_receiver=self._transfer.receiver(),
            model_version=self.model_version,
            num_threads=hp.generator_threads,
        )

    # -- validation -------------------------------------------------------------------------------------------------

    def val_dataloader(self) -> DataLoader | list:
        """Held-out prompts in batches of `val_batch_size` rows (lists of dicts)."""
        if self.val_prompts is None:
            return []
        return DataLoader(list(self.val_prompts), batch_size=self.hparams.val_batch_size, collate_fn=list)

    def score_completions(self, completions: list[list[dict]], rows: list[dict]) -> dict[str, list[float]]:
        """Every reward function's rewards for `completions` of `rows` (validation), through a process pool."""
        from .rollout.reward_pool import RewardProcessPool

        if self._val_pool is None:
            self._val_pool = RewardProcessPool(self.reward_funcs, 1, timeout=self.hparams.reward_timeout)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
        kwargs = dict(completions=completions, prompts=[row["prompt"] for row in rows], completion_ids=None, **columns)
        futures = [self._val_pool.submit(i, **kwargs) for i in range(len(self.reward_funcs))]
        return {_reward_name(f): future.result() for f, future in zip(self.reward_funcs, futures, strict=True)}

    # -- metrics ----------------------------------------------------------------------------------------------------

    def rollout_metrics(self) -> dict[str, float]:
        """Rank 0: what the child and the pipeline measured since the last call, reduced for logging."""
        window = self._rollout_window
        if self.worker is not None:
            while True:
                try:
                    window.update(self.worker.metrics_queue.get_nowait())
                except (queue.Empty, OSError, ValueError):
                    break
        window.update(self._metrics)
        self._metrics.clear()
        if self.pipeline is not None:
            window.add("perf/rollout_wait_s", self.pipeline.wait_s)
            self.pipeline.wait_s = 0.0
        if self.progress is not None:
            window.add("progress/groups_consumed", float(len(self.progress.consumed)))
        return window.flush()

    # -- teardown ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the rollout child (and its reward pool) and release the weight transfer; idempotent."""
        worker, self.worker, self.pipeline = self.worker, None, None
        if worker is not None:
            worker.stop()
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            transfer.destroy()
        pool, self._val_pool = self._val_pool, None
        if pool is not None:
            pool.close()

    def teardown(self, stage: str) -> None:
        self.close()
        self._restore_threads()

    def on_exception(self, exception: BaseException) -> None:
        self.close()
        self._restore_threads()


def _validate_options(hp: Any) -> None:
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
    if hp.reward_num_workers < 0 or hp.reward_timeout <= 0:
        problems.append(f"reward_num_workers={hp.reward_num_workers}, reward_timeout={hp.reward_timeout}")
    if not is_trainer_threads(hp.trainer_threads):
        problems.append(f"trainer_threads={hp.trainer_threads!r} (a positive number of threads, 'auto' or None)")
    if hp.samples_per_row is not None and hp.samples_per_row < 1:
        problems.append(f"samples_per_row={hp.samples_per_row} (must be at least 1)")
    if problems:
        raise ValueError(f"GRPODataModule got invalid options: {'; '.join(problems)}.")


#: The loop arguments GRPODataModule sets from its own options (`_make_worker`); `loop_kwargs` may not set them.
_LOOP_OPTION_NAMES = frozenset(
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
        "vllm_server_url",
        "generator",
        "reward_weights",
        "multi_objective_aggregation",
        "scale_rewards",
        "reward_num_workers",
        "reward_timeout",
        "trainer_scored",
        "epochs",
        "seed",
        "consumed",
        "groups_per_step",
        "max_staleness",
    }
)


def _checked_loop_kwargs(loop_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    loop_kwargs = dict(loop_kwargs or {})
    if clash := sorted(_LOOP_OPTION_NAMES.intersection(loop_kwargs)):
        raise ValueError(
            f"`loop_kwargs` sets {clash}, which GRPODataModule sets from its own options: set them there instead "
            "(e.g. `temperature=...`), and keep `loop_kwargs` for arguments the data module does not have."
        )
    return loop_kwargs


def _resolve_loop_cls(spec: str | type | None) -> type | None:
    """The rollout loop class a `loop_cls` option names, checked to be a `GRPORolloutLoop` subclass."""
    if spec is None:
        return None
    from ._imports import import_object
    from .rollout.loop import GRPORolloutLoop

    loop_cls = import_object(spec, "loop_cls") if isinstance(spec, str) else spec
    if not (isinstance(loop_cls, type) and issubclass(loop_cls, GRPORolloutLoop)):
        raise ValueError(
            f"`loop_cls={spec!r}` is not a subclass of lightning_grpo.GRPORolloutLoop: subclass it (its hooks are "
            "`_trainer_score_payload` and `_provides_rollout_reward`) or leave `loop_cls` unset."
        )
    return loop_cls


def _reward_name(func: Callable) -> str:
    from ._trl import get_callable_name

    return get_callable_name(func)


def _eos_ids(tokenizer: Any, policy: Any) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else configured or [])
    return sorted(ids)


def _identity(item: Any) -> Any:
    return item
