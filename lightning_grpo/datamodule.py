"""GRPODataModule: the prompts, the rewards, the rollout session and the stream of optimizer steps."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from datasets import Dataset
from torch.utils.data import DataLoader

from ._imports import resolve_callable
from ._lightning_noise import ignore_empty_val_loader, ignore_leafspec_deprecation
from .contract import PolicySource, RolloutContract, build_contract, require_policy_source
from .data.options import check_dataset_options, checked_loop_kwargs, resolve_loop_cls, validate_options
from .data.preparation import longest_prompt, prepare_prompts
from .data.sources import check_source
from .data.tooling import ConversationSpec, resolve_environment_factory, resolve_tools
from .options import DataModuleOptions
from .pipeline.batch import StepBatch
from .pipeline.ledger import RolloutProgress, RolloutStop
from .pipeline.run_identity import checked_restore, run_identity
from .pipeline.session import RolloutSession, start_rollout_session
from .pipeline.step_size import check_group_fits, groups_per_step
from .pipeline.stream import RolloutPipeline, StepStream
from .rollout.core_sharing import CoreSharing
from .rollout.schedule import GroupSchedule
from .scoring.collator import make_step_collator
from .serving.server_checks import check_vllm_servers
from .training.threads import FitThreads, runs_on_cpu
from .validation.scoring import ValidationScorer
from .weights.factory import build_weight_sync
from .weights.sync import WeightSync

log = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]

# Arguments that may be objects: kept as given, out of the hyper-parameters (a checkpoint holds plain values only).
_OBJECT_ARGUMENTS = [
    "dataset", "val_dataset", "reward_funcs", "loop_cls", "loop_kwargs", "weight_transfer", "tools",
    "environment_factory",
]  # fmt: skip


class GRPODataModule(pl.LightningDataModule):
    """Prompts in, optimizer steps out: owns the rollout child, the reward functions and progress across resumes.

    `setup` (every rank, nothing spawned) loads the prompts and the tokenizer, checks that a group fits a step, and
    builds the `RolloutContract` the module reads and the `WeightSync` that owns weight pushes and the policy
    version. `train_dataloader()` pushes the trainer's weights once (every rank: gathering sharded weights is a
    collective), then rank 0 starts the rollout session (a `GRPORolloutWorker`: generation and reward scoring in a
    CUDA-free child process; GroupedQueue → SampleFilterQueue → StepPlanner → collator over its queue), and every
    rank receives its share of each optimizer step from a `StepStream`. `state_dict()` carries the consumed groups
    and the policy version, so `Trainer.fit(ckpt_path=...)` trains every prompt group exactly once over the
    interrupted and the resumed run. `teardown` (and `on_exception`) stop the child and its reward pool.

    It implements `lightning_grpo.RolloutSource`, what `GRPOModule` and the callbacks call. Use it with `GRPOModule`;
    the module's callbacks (`WeightSyncCallback`, `RolloutMetricsCallback`, `RolloutStopCallback`) are added
    automatically.

    Raises:
        ValueError: a bad option (every problem in one message), a reward, tool, environment or loop import path
            that does not import, a tool without a schema (type hints and an `Args:` docstring), an environment class
            without `reset`, `loop_kwargs` that set the data module's own options; in `setup`, a dataset without a
            `prompt` column, prompts the tokenizer cannot render (chat messages without a chat template, tools with
            raw-text prompts) or a group that can never fit one optimizer step (the message names the knob).
        FileNotFoundError: a dataset file that does not exist.

    Args:
        model: the policy's name or path for the tokenizer and the generator; None takes the `GRPOModule`'s.
        tokenizer: a tokenizer name or path when it differs from `model` (or the policy is an `nn.Module`).
        dataset: `"arithmetic"` (builtin), `"reasoning_gym:<task>"` (scored by `lightning_grpo.rewards.reasoning_gym`),
            a `.jsonl`/`.parquet` path, a `datasets.Dataset`, or a Hub dataset name. It needs a `prompt` column (chat
            messages or a string) plus the columns the reward functions read, unless `dataset_format` maps them.
        dataset_format: a preset mapping a file's (or `Dataset`'s) columns to `prompt` and the final `answer`, for
            `dataset` and `val_dataset`: `"gsm8k"` (`question`, `answer` ending in `#### 72`), `"math"` (`problem`,
            `solution` with `\\boxed{}`, `answer` if present) or `"prompt_answer"`; a row without an extractable
            answer is an error naming it. None: columns as they are. See `lightning_grpo.data.formats`.
        dataset_options: the preset's column names and instruction (`{"question_key": "query"}`), the reasoning-gym
            task's generator options (`{"min_numbers": 3}`) and `system_prompt`, or the arithmetic task's raw-text
            `template` (`{"template": "User: {question}\\nAssistant:"}`, for a base model).
        prompt_format: how a string `prompt` is used: `"auto"` (one user message when the tokenizer has a chat
            template, else raw text), `"chat"` (always one user message) or `"text"` (always raw text, TRL's
            standard format: no template, and completions reach the rewards as strings). Chat messages always use
            the template.
        dataset_size: keep the first rows (or generate this many for `"arithmetic"` and reasoning-gym tasks).
        dataset_seed: seed of the generators.
        val_dataset: held-out prompts for `validation_step`; default: the same generator with another seed when
            `dataset` is `"arithmetic"` or a reasoning-gym task, else none.
        val_size: held-out prompts to keep.
        reward_funcs: callables or import paths (`"lightning_grpo.rewards.accuracy"`, `"my_pkg.rewards:fmt"`) with
            TRL's reward signature.
        reward_weights: one weight per reward column: the reward functions', then one per environment class with a
            `get_reward` (default all 1).
        multi_objective_aggregation: `"sum_then_normalize"` (GRPO) or `"normalize_then_sum"` (GDPO).
        scale_rewards: `"group"` (divide by the group's std), `"batch"` (by one std over each optimizer step's groups,
            GRPOTrainer's form over its batch) or `"none"`.
        advantage_estimator: the baseline subtracted from each completion's reward: `"grpo"` (the group mean),
            `"rloo"` (the mean of the group's other completions, TRL's `RLOOTrainer`) or `"reinforce_plus_plus"`
            (the group mean, then REINFORCE++-baseline's normalisation by the std of the advantages over the step;
            needs `scale_rewards="batch"`).
        reward_num_workers: processes scoring synchronous rewards (0: threads, unsafe for CPU-heavy rewards).
        reward_timeout: seconds one reward call may take before it scores NaN.
        generator: `"embedded"` (the policy on CPU in the child) or `"vllm"` (TRL's HTTP path to a vLLM server).
        vllm_server_url: the vLLM server for `generator="vllm"`, or a list of them: each group goes to the least
            loaded one, and every weight push reaches all of them (see `lightning_grpo.rollout.vllm_routing`).
        vllm_failover: with several servers, go on with the others when one is lost (`vllm/servers_lost_total`).
        vllm_server_timeout: seconds set-up waits for each server's `/health` (TRL's `vllm_server_timeout`).
        vllm_transfer: how weights reach a vLLM server: `"http"` (safetensors in `/dev/shm`, no GPU needed),
            `"nccl"` (TRL's client), `"lora"` (a LoRA policy's adapter alone, for a server started with
            `--enable-lora`) or `"auto"` (NCCL with CUDA, else HTTP). See `make_weight_transfer`.
        weight_transfer: a TRL `WeightTransferProtocol` (or a factory called with the policy) to push weights through
            instead of the generator's own backend; with `generator="embedded"` it must also have `receiver()`.
        num_generations: completions per prompt (the group size).
        max_completion_length: tokens per completion.
        temperature: sampling temperature; the loss divides the policy's logits by the same temperature.
        top_p: nucleus sampling mass kept, in (0, 1].
        top_k: tokens kept by rank when sampling; 0 keeps all.
        min_p: drop tokens less likely than `min_p` times the most likely, in [0, 1] (TRL's `min_p`); None keeps all.
        repetition_penalty: > 0 (TRL's `repetition_penalty`); above 1 discourages tokens already in the prompt or
            the completion, as vLLM applies it; 1 is off.
        stop: strings that end a completion as an EOS does (vLLM's `stop`): the completion keeps the token that
            completed the string, is not truncated, and its text contains it. Validation's turns stop at them too.
        epochs: passes over the prompts (a resume may raise it); the run ends after `epochs * len(dataset)` groups.
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
        generator_threads: torch threads of the embedded generator (None: torch's default), or of each replica.
        generator_dtype: the embedded generator's weights and KV cache: `"auto"`, bf16 where this CPU multiplies it
            faster (`models.dtype_probe`), else the policy's dtype; `"bfloat16"`, `"float32"`, or None (the policy's).
            It samples by its own logprobs: train with `AutoPrecision`, or correct with `vllm_importance_sampling_*`.
        generator_replicas: embedded generator processes, each on `generator_threads` cores of its own (when the
            machine has them): each group is sampled on one, picked by load, every weight push reaches all, and one
            that dies fails the run naming it (see `lightning_grpo.rollout.replicas`). 1: the generator runs in the
            rollout child. For several vLLM servers, list them in `vllm_server_url`.
        trainer_threads: torch threads the trainer trains with during `fit` (restored afterwards). `"auto"`: on a CPU
            with the embedded generator and one process, the cores the generator leaves, each side also running on
            the other's while it is idle (see `lightning_grpo.training.threads`); a number: that many, always; None:
            leave torch's setting alone.
        val_batch_size: held-out prompts per validation batch.
        loop_cls: a `GRPORolloutLoop` subclass (or its import path) for the rollout child to run instead, e.g. one
            that overrides `_trainer_score_payload` to send trainer scorers what they need beyond the samples
            (EBFT's reference features) or scores each rollout itself (`_provides_rollout_reward`).
        loop_kwargs: extra keyword arguments for the loop: `loop_cls`'s own, or TRL loop arguments this data module
            does not set (such as `chat_template_kwargs`). They travel to the child with cloudpickle.
        tools: functions the policy may call (callables or import paths, TRL's `tools`): each needs type hints and
            a docstring with `Args:`, from which the chat template shows it to the policy. Rollouts become
            conversations: the policy's tool calls run, their results are context for its next turn (never
            trained). A tool that raises, hangs past `tool_timeout` or returns something unprintable answers with
            an error message and is counted (`tools/*`). They travel to the child with cloudpickle.
        environment_factory: a class or function making an environment (or an import path, or a dict of them picked
            by each row's `environment` column; TRL's `environment_factory`): `reset(**row)` starts a rollout (a
            string it returns is appended to the prompt), its public methods are the rollout's tools, and
            `get_reward()` (optional) is one more reward column named after its class. A `reset` or `get_reward`
            that fails scores the rollout NaN, never 0.
        max_tool_calling_iterations: tool rounds in one conversation; a policy that asks for more is cut off there
            (counted in `tools/loop_exhausted_frac`). None: no limit (TRL's default, which lets a policy that never
            stops calling tools run until its context overflows).
        tool_timeout: seconds a tool call, an environment's `reset` or its `get_reward` may take; None: no limit.
        allow_changed_data: resume with other prompts, `seed`, `num_generations` or groups per step, or fewer `epochs`,
            than the checkpoint's (else refused: `lightning_grpo.pipeline.run_identity`), with a new ledger.
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dataset: str | Dataset = "arithmetic",
        dataset_size: int | None = None,
        dataset_seed: int = 0,
        dataset_format: Literal["gsm8k", "math", "prompt_answer"] | None = None,
        dataset_options: dict[str, Any] | None = None,
        val_dataset: str | Dataset | None = None,
        val_size: int = 64,
        reward_funcs: Sequence[str | RewardFunc] = ("lightning_grpo.rewards.accuracy",),
        reward_weights: list[float] | None = None,
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
        scale_rewards: Literal["group", "batch", "none"] = "group",
        advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo",
        reward_num_workers: int = 1,
        reward_timeout: float = 30.0,
        generator: Literal["embedded", "vllm"] = "embedded",
        vllm_server_url: str | list[str] = "http://localhost:8000",
        vllm_failover: bool = False,
        vllm_server_timeout: float = 240.0,
        vllm_transfer: Literal["auto", "http", "nccl", "lora"] = "auto",
        weight_transfer: Any = None,
        num_generations: int = 8,
        max_completion_length: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        stop: list[str] | None = None,
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
        generator_dtype: Literal["auto", "float32", "bfloat16"] | None = "auto",
        generator_replicas: int = 1,
        trainer_threads: int | Literal["auto"] | None = "auto",
        val_batch_size: int = 16,
        loop_cls: str | type | None = None,
        loop_kwargs: dict[str, Any] | None = None,
        tools: Sequence[str | Callable] | None = None,
        environment_factory: str | Callable | dict[str, str | Callable] | None = None,
        max_tool_calling_iterations: int | None = 8,
        tool_timeout: float | None = 60.0,
        prompt_format: Literal["auto", "chat", "text"] = "auto",
        allow_changed_data: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=_OBJECT_ARGUMENTS)
        self.model_name = model
        self.tokenizer_name = tokenizer
        self.dataset_source = dataset
        self.val_source = val_dataset
        self.reward_func_specs = list(reward_funcs)
        self.options = DataModuleOptions.from_hparams(self.hparams)  # what every part below reads, typed
        validate_options(self.options)
        # Fail on a bad import path or a missing file now, before Trainer.fit launches ranks or the rollout child.
        self.reward_funcs: list[RewardFunc] = [resolve_callable(f, "reward_funcs") for f in self.reward_func_specs]
        for source in (dataset, val_dataset):
            check_source(source)
        check_dataset_options(dataset, val_dataset, dataset_format, dataset_options)
        self.loop_cls = resolve_loop_cls(loop_cls)
        self.loop_kwargs = checked_loop_kwargs(loop_kwargs)
        self.tools = resolve_tools(tools)
        self.environment_factory = resolve_environment_factory(environment_factory)
        self.conversation: ConversationSpec | None = None
        self.weight_transfer = weight_transfer
        self.train_prompts: Dataset | None = None
        self.val_prompts: Dataset | None = None
        self.tokenizer: Any = None
        self.schedule: GroupSchedule | None = None
        self.weight_sync: WeightSync | None = None
        self.process_group: Any = None
        self._progress: RolloutProgress | None = None
        self._contract: RolloutContract | None = None
        self._restored: dict[str, Any] = {}
        self._identity: dict[str, Any] | None = None
        self._session: RolloutSession | None = None
        self._stream: StepStream | None = None
        self._threads = FitThreads()
        self._val_scorer = ValidationScorer(self.reward_funcs, timeout=reward_timeout)

    # -- setup (every rank; no processes) ---------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Load and check the prompts and the tokenizer, and build the contract; for `fit`, check that a group fits
        one optimizer step and build the weight sync. Nothing is spawned here."""
        ignore_leafspec_deprecation()
        if self.train_prompts is None:
            self._load()
        if stage == "fit":
            world = self.trainer.world_size
            self._threads.apply(self.options.generation, on_cpu=runs_on_cpu(self.trainer), world_size=world)
            check_group_fits(self.options, world, self._longest_prompt)
            self._make_weight_sync()
            if world > 1 and dist.is_available() and dist.is_initialized() and self.process_group is None:
                self.process_group = dist.new_group(backend="gloo")  # pickled batches stay off the (NCCL) default group

    def check_data(self, world_size: int | None = None) -> None:
        """Load the prompts and the tokenizer now and check them, as `setup` does first (it then reuses them).

        `lightning-grpo` calls it before `fit` or `validate` starts anything, so a dataset without a column it needs
        ends the command with exit code 2 and one line, instead of a traceback from inside `Trainer.fit`.

        Args:
            world_size: also check that a group fits one optimizer step on this many processes.

        Raises:
            ValueError: a dataset (or `val_dataset`) without a `prompt` column or without a column a reward function
                takes by name (`answer` for `accuracy`), a tokenizer that cannot be loaded, a group that can never
                fit one step.
        """
        if self.train_prompts is None:
            self._load()
        if world_size is not None:
            check_group_fits(self.options, world_size, self._longest_prompt)

    def _load(self) -> None:
        options = self.options
        data = prepare_prompts(
            options.data,
            options.chat,
            dataset=self.dataset_source,
            val_dataset=self.val_source,
            reward_funcs=self.reward_funcs,
            tokenizer_name=self.tokenizer_name or self.model_name or self._module_model_name(),
            tools=self.tools,
            environment_factory=self.environment_factory,
        )
        self.val_prompts, self.tokenizer, self.conversation = data.val_prompts, data.tokenizer, data.conversation
        self.schedule = GroupSchedule(len(data.prompts), options.steps.epochs, options.steps.seed)
        stall_groups = options.steps.stall_groups or len(data.prompts)
        self._progress = RolloutProgress(total_groups=len(self.schedule), stall_groups=stall_groups)
        if "progress" in self._restored:
            self._progress.load_state_dict(self._restored["progress"])
        self._contract = build_contract(options, data, self.reward_funcs)
        self.train_prompts = data.prompts

    def _module_model_name(self) -> str | None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        name = getattr(module, "model_name", None)
        return name if isinstance(name, str) else None

    def _make_weight_sync(self) -> None:
        if self.weight_sync is not None:
            return
        is_zero = self.trainer.is_global_zero
        if is_zero:  # a server that is not there, or serves another model, fails here in one line
            check_vllm_servers(self.options, self.model_name or self._module_model_name() or "policy")
        self.weight_sync = build_weight_sync(self.options, self.weight_transfer, is_global_zero=is_zero)
        if "weight_sync" in self._restored:
            self.weight_sync.load_state_dict(self._restored["weight_sync"])

    @property
    def core_sharing(self) -> CoreSharing | None:
        """During a fit with `trainer_threads="auto"` on a shared CPU: the flags by which the trainer and the embedded
        generator run on each other's cores while the other is idle; otherwise None."""
        return self._threads.core_sharing

    # -- the contract and state -------------------------------------------------------------------------------------

    def rollout_contract(self) -> RolloutContract:
        """What the module needs to know of the rollouts (see `RolloutContract`); available once `setup` ran.

        Raises:
            RuntimeError: before `setup`.
        """
        if self._contract is None:
            raise RuntimeError(
                "`GRPODataModule.rollout_contract()` is available once `setup` ran (Trainer.fit does it)."
            )
        return self._contract

    @property
    def progress(self) -> RolloutProgress | None:
        """Rank 0's progress ledger (None on other ranks and before `setup`)."""
        on_rank_zero = self.trainer is None or self.trainer.is_global_zero
        return self._progress if on_rank_zero else None

    def state_dict(self) -> dict[str, Any]:
        """The consumed prompt groups and the policy version (rank 0's are written); plain types only."""
        state: dict[str, Any] = {"progress": self._progress.state_dict() if self._progress is not None else {}}
        sync = self.weight_sync.state_dict() if self.weight_sync is not None else self._restored.get("weight_sync")
        if sync is not None:
            state["weight_sync"] = sync
        if self.train_prompts is not None:
            state["run"] = self.run_identity()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.train_prompts is not None:  # refuse a checkpoint of another run (see `allow_changed_data`)
            allowed = self.options.data.allow_changed_data
            state_dict = checked_restore(state_dict, self.run_identity(), allow_changed=allowed)
        self._restored = {key: value for key, value in state_dict.items() if value}
        if self._progress is not None and "progress" in self._restored:
            self._progress.load_state_dict(self._restored["progress"])
        if self.weight_sync is not None and "weight_sync" in self._restored:
            self.weight_sync.load_state_dict(self._restored["weight_sync"])

    def run_identity(self, world_size: int | None = None) -> dict[str, Any]:
        """What the ledger depends on (`lightning_grpo.pipeline.run_identity`), once the prompts are loaded."""
        if self._identity is None:
            world = world_size or (self.trainer.world_size if self.trainer is not None else 1)
            self._identity = run_identity(
                self.train_prompts, self.options, groups_per_step(self.options, world, self._longest_prompt)
            )
        return self._identity

    @property
    def rollout_worker(self) -> Any:
        """Rank 0's `GRPORolloutWorker` during a fit (its `pid`, `check_health`), else None."""
        return self._session.worker if self._session is not None else None

    def progress_summary(self) -> dict[str, int] | None:
        """Rank 0's progress in prompt groups (see `RolloutSource.progress_summary`); None before `setup`."""
        return self._progress.summary() if self._progress is not None else None

    # -- training stream --------------------------------------------------------------------------------------------

    def train_dataloader(self) -> StepStream:
        """Every rank's stream of optimizer steps: push the weights once, then rank 0 starts the rollout session.

        Runs after a checkpoint is restored (model, optimizer, this module's state), so the generator starts from the
        restored weights under the restored version. The stream is handed to Lightning as it is: it yields whole
        `StepBatch`es (no collation, no workers), and a bare iterable with a length is what turns Lightning's
        one-ahead prefetch off without its warning about `IterableDataset`s in `DataLoader`s with `__len__`.
        """
        module = require_policy_source(self.trainer.lightning_module, "GRPODataModule")
        sync, schedule = self.weight_sync, self.schedule
        if sync is None or schedule is None:
            raise RuntimeError("`GRPODataModule.train_dataloader()` runs after `setup` (Trainer.fit calls both).")
        sync.push(module.policy, wrapped=self.trainer.model)
        source = self._start_session(module, sync) if self.trainer.is_global_zero else None
        self._threads.borrow_generator_cores(module.policy)
        self._stream = StepStream(
            source,
            rank=self.trainer.global_rank,
            world_size=self.trainer.world_size,
            group=self.process_group,
            max_batches=len(schedule),
        )
        return self._stream

    def finish_step(self, batch: StepBatch, *, look_ahead: bool) -> RolloutStop | None:
        """Every rank, after `batch`'s optimizer step: commit its groups (rank 0), and with `look_ahead` fetch the next
        step now. Returns the stop item when the stream ended there (see `RolloutStopCallback`).

        Raises:
            RuntimeError: outside a fit (no stream).
        """
        if self._stream is None:
            raise RuntimeError("`GRPODataModule.finish_step` is called during `Trainer.fit`, after a step trained.")
        if self._progress is not None and self.trainer.is_global_zero:
            self._progress.commit(batch.group_ids)
        return self._stream.look_ahead() if look_ahead else None

    def stream_stop(self) -> RolloutStop | None:
        """The stop item the training stream ended with (every rank), or None while it goes on."""
        return self._stream.stop if self._stream is not None else None

    def _start_session(self, module: PolicySource, sync: WeightSync) -> RolloutPipeline:
        if self._session is not None:
            self._session.close()
        self._session = start_rollout_session(self, module, make_collator=make_step_collator)
        sync.on_version(self._session.worker.update_model_version)
        return self._session.pipeline

    def groups_per_step(self) -> int:
        """Prompt groups in one optimizer step (the planner's cap and the pacing unit)."""
        return groups_per_step(self.options, self.trainer.world_size, self._longest_prompt)

    def _longest_prompt(self) -> int:
        return longest_prompt(self.conversation, self.train_prompts)

    # -- validation -------------------------------------------------------------------------------------------------

    def val_dataloader(self) -> DataLoader | list:
        """Held-out prompts in batches of `val_batch_size` rows (lists of dicts); none without `val_dataset`."""
        if self.val_prompts is None:
            ignore_empty_val_loader()
            return []
        return DataLoader(list(self.val_prompts), batch_size=self.options.data.val_batch_size, collate_fn=list)

    def score_completions(self, completions: list[list[dict]], rows: list[dict]) -> dict[str, list[float]]:
        """Every reward function's rewards for `completions` of `rows` (validation), through a process pool."""
        return self._val_scorer.score(completions, rows)

    # -- metrics ----------------------------------------------------------------------------------------------------

    def rollout_metrics(self) -> dict[str, float]:
        """Rank 0: what the child and the pipeline measured since the last call, reduced for logging (`*_total`
        values are increments), and `progress/groups_consumed` (trained in finished steps, or dropped)."""
        metrics = self._session.drain_metrics() if self._session is not None else {}
        if self._progress is not None:
            metrics["progress/groups_consumed"] = float(self._progress.final_group_count())
        return metrics

    # -- teardown ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the rollout child (and its reward pool) and release the weight transfer; idempotent."""
        session, self._session = self._session, None
        if session is not None:
            session.close()
        sync, self.weight_sync = self.weight_sync, None
        if sync is not None:
            self._restored["weight_sync"] = sync.state_dict()  # a later fit on this module goes on from here
            sync.close()
        self._val_scorer.close()

    def teardown(self, stage: str) -> None:
        self.close()
        self._threads.restore()

    def on_exception(self, exception: BaseException) -> None:
        self.close()
        self._threads.restore()
