"""GRPODataModule: the prompts, the rewards, the rollout session and the stream of optimizer steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from datasets import Dataset
from torch.utils.data import DataLoader
from typing_extensions import override

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

RewardFunc = Callable[..., list[float | None]]

# Arguments that may be objects: kept as given, out of the hyper-parameters (a checkpoint holds plain values only).
_OBJECT_ARGUMENTS = [
    "dataset", "val_dataset", "reward_funcs", "loop_cls", "loop_kwargs", "weight_transfer", "tools",
    "environment_factory",
]  # fmt: skip


class GRPODataModule(pl.LightningDataModule):
    """Prompts in, optimizer steps out: owns the rollout child, the reward functions and progress across resumes.

    On rank 0 a CUDA-free child process generates each prompt's group of completions and scores it; every rank
    receives its share of each optimizer step. Its state (the consumed groups and the policy version) makes a resumed
    `Trainer.fit(ckpt_path=...)` train every group exactly once. Use it with `GRPOModule`, which reads it through
    `lightning_grpo.RolloutSource` and adds the callbacks it needs; the data-flow page of the docs walks its hooks.

    Args:
        model: the policy's name or path for the tokenizer and the generator; None takes the `GRPOModule`'s.
        tokenizer: a tokenizer name or path when it differs from `model` (or the policy is an `nn.Module`).
        dataset: `"arithmetic"` (builtin), `"reasoning_gym:<task>"`, a `.jsonl`/`.parquet` path, a `datasets.Dataset`
            or a Hub dataset name, with a `prompt` column (chat messages or a string) and the columns rewards read.
        dataset_format: a preset mapping the columns of `dataset` and `val_dataset` to `prompt` and the final
            `answer`: `"gsm8k"`, `"math"` or `"prompt_answer"` (see `lightning_grpo.data.formats`); None: as they are.
        dataset_options: the preset's column names and instruction (`{"question_key": "query"}`), a reasoning-gym
            task's options (`{"min_numbers": 3}`, `system_prompt`), or the arithmetic task's raw-text `template`.
        prompt_format: how a string `prompt` is used: `"auto"` (a user message when the tokenizer has a chat
            template, else raw text), `"chat"` or `"text"` (raw, and completions reach the rewards as strings).
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
        advantage_estimator: the baseline: `"grpo"` (the group mean), `"rloo"` (the mean of the group's other
            completions) or `"reinforce_plus_plus"` (REINFORCE++-baseline; needs `scale_rewards="batch"`).
        reward_num_workers: processes scoring synchronous rewards (0: threads, unsafe for CPU-heavy rewards).
        reward_timeout: seconds one reward call may take before it scores NaN.
        generator: `"embedded"` (the policy on CPU in the child) or `"vllm"` (TRL's HTTP path to a vLLM server).
        vllm_server_url: the vLLM server for `generator="vllm"`, or a list of them (each group goes to the least
            loaded one; every weight push reaches all).
        vllm_failover: with several servers, go on with the others when one is lost (`vllm/servers_lost_total`).
        vllm_server_timeout: seconds set-up waits for each server's `/health` (TRL's `vllm_server_timeout`).
        vllm_transfer: how weights reach a vLLM server: `"http"` (through `/dev/shm`), `"nccl"` (TRL's client),
            `"lora"` (the adapter alone, to a server with `--enable-lora`) or `"auto"` (NCCL with CUDA, else HTTP).
        weight_transfer: a TRL `WeightTransferProtocol` (or a factory called with the policy) to push weights through
            instead of the generator's own backend; with `generator="embedded"` it must also have `receiver()`.
        num_generations: completions per prompt (the group size).
        max_completion_length: tokens per completion.
        temperature: sampling temperature; the loss divides the policy's logits by the same temperature.
        top_p: nucleus sampling mass kept, in (0, 1].
        top_k: tokens kept by rank when sampling; 0 keeps all.
        min_p: drop tokens less likely than `min_p` times the most likely, in [0, 1] (TRL's `min_p`); None keeps all.
        repetition_penalty: > 0 (TRL's); above 1 discourages tokens already in the prompt or completion; 1 is off.
        stop: strings that end a completion as an EOS does (vLLM's `stop`: kept, not truncated), in validation too.
        epochs: passes over the prompts (a resume may raise it); the run ends after `epochs * len(dataset)` groups.
        seed: shuffles each epoch's prompt order.
        max_staleness: policy versions a group may lag when it trains (generation is paced to it; a staler one drops).
        gradient_accumulation_steps: micro-batches per optimizer step (each rank runs this many forward/backward).
        samples_per_row: samples in one rank's micro-batch when `token_budget <= 0` (default: `num_generations`).
        token_budget: cap on one micro-batch row's unique tokens (tree-packed); `<= 0` caps samples instead.
        stall_groups: groups in a row consumed without one training before the run fails (default: one pass).
        mask_truncated_completions: completions that hit the length limit train nothing.
        drop_no_signal_groups: drop groups whose advantages are all 0 (DAPO's dynamic sampling); False trains them.
        replace_dropped_groups: a dropped group's place in its step goes to the next group; False: stays empty.
        replace_early: start the replacement of a group without signal when it is scored (staler, less waiting).
        heartbeat_timeout: seconds without a heartbeat from the rollout child before it counts as hung.
        child_ready_timeout: seconds to wait for the child to load the policy and start.
        generator_threads: torch threads of the embedded generator (None: torch's default), or of each replica.
        generator_dtype: the embedded generator's weights and KV cache: `"auto"` (bf16 where this CPU multiplies it
            faster, else the policy's dtype), `"bfloat16"`, `"float32"`, or None (the policy's).
        generator_quantization: `"int8"`: the embedded generator's layer weights as int8 on AMX-INT8 CPUs (see
            `EmbeddedGenerator`; pair with `vllm_importance_sampling_correction=True`); None: the policy's weights.
        generator_replicas: embedded generator processes on `generator_threads` cores each (1: in the rollout child).
        trainer_threads: torch threads the trainer trains with during `fit` (restored afterwards). `"auto"`: on a CPU
            with the embedded generator, the cores it leaves (sharing idle ones); a number: that many; None: torch's.
        val_batch_size: held-out prompts per validation batch.
        loop_cls: a `GRPORolloutLoop` subclass (or its import path) for the rollout child to run instead (one that
            sends trainer scorers more than the samples, or scores each rollout itself).
        loop_kwargs: extra keyword arguments for the loop: `loop_cls`'s own, or TRL loop arguments this data module
            does not set (such as `chat_template_kwargs`). They travel to the child with cloudpickle.
        tools: functions the policy may call (callables or import paths, TRL's `tools`), each with type hints and a
            docstring with `Args:`; a tool's result is context for the policy's next turn, never trained.
        environment_factory: a class or function making an environment, an import path, or a dict of them picked by
            each row's `environment` column (TRL's): `reset(**row)`, tool methods and an optional `get_reward()`.
        max_tool_calling_iterations: tool rounds per conversation, later ones cut off; None: no limit (TRL's default).
        tool_timeout: seconds a tool call, an environment's `reset` or its `get_reward` may take; None: no limit.
        allow_changed_data: resume with other prompts, `seed`, `num_generations` or groups per step, or fewer `epochs`,
            than the checkpoint's (else refused), with a new ledger.

    Raises:
        ValueError: a bad option (every problem in one message), a reward, tool, environment or loop import path
            that does not import, a tool without a schema (type hints and an `Args:` docstring), an environment class
            without `reset`, `loop_kwargs` that set the data module's own options; in `setup`, a dataset without a
            `prompt` column, prompts the tokenizer cannot render (chat messages without a chat template, tools with
            raw-text prompts) or a group that can never fit one optimizer step (the message names the knob).
        FileNotFoundError: a dataset file that does not exist.

    Example::

        import lightning.pytorch as pl
        from lightning_grpo import GRPODataModule, GRPOModule

        data = GRPODataModule(
            dataset="arithmetic",  # or a .jsonl/.parquet path, a Dataset, a Hub name
            dataset_size=4,
            reward_funcs=["lightning_grpo.rewards.numeric_closeness"],
            num_generations=4,  # completions per prompt: one group
            max_completion_length=16,
        )
        trainer = pl.Trainer(max_epochs=-1, limit_val_batches=0, logger=False)
        trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=data)
        print(data.progress_summary())  # every group trained, or dropped (no signal)
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
        drop_no_signal_groups: bool = True,
        replace_dropped_groups: bool = True,
        replace_early: bool = False,
        heartbeat_timeout: float = 300.0,
        child_ready_timeout: float = 300.0,
        generator_threads: int | None = 1,
        generator_dtype: Literal["auto", "float32", "bfloat16"] | None = "auto",
        generator_quantization: Literal["int8"] | None = None,
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
        self.model_name, self.tokenizer_name = model, tokenizer
        self.dataset, self.val_dataset = dataset, val_dataset  # as given; `setup` loads them into `*_prompts`
        self.options = DataModuleOptions.from_hparams(self.hparams)  # what every part below reads, typed
        validate_options(self.options)
        # Fail on a bad import path or a missing file now, before Trainer.fit launches ranks or the rollout child.
        self.reward_funcs: list[RewardFunc] = [resolve_callable(f, "reward_funcs") for f in reward_funcs]
        for source in (dataset, val_dataset):
            check_source(source)
        check_dataset_options(dataset, val_dataset, dataset_format, dataset_options)
        self.loop_cls = resolve_loop_cls(loop_cls)
        self.loop_kwargs = checked_loop_kwargs(loop_kwargs)
        self.tools = resolve_tools(tools)
        self.environment_factory = resolve_environment_factory(environment_factory)
        self.weight_transfer = weight_transfer
        self.train_prompts: Dataset | None = None
        self.val_prompts: Dataset | None = None
        self.tokenizer: Any = None
        self.conversation: ConversationSpec | None = None
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

    # -- hooks, in the order Lightning calls them -------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        """Every rank, nothing spawned: load and check the prompts and the tokenizer, build the contract; for `fit`,
        set the trainer's threads, check that a group fits one optimizer step and build the weight sync."""
        ignore_leafspec_deprecation()
        self.check_data()
        if stage == "fit":
            world = self.trainer.world_size
            self._threads.apply(self.options.generation, on_cpu=runs_on_cpu(self.trainer), world_size=world)
            check_group_fits(self.options, world, self._longest_prompt)
            self._make_weight_sync()
            if world > 1 and dist.is_available() and dist.is_initialized() and self.process_group is None:
                self.process_group = dist.new_group(backend="gloo")  # pickled batches stay off the (NCCL) default group

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """On resume, after `setup`: the consumed groups and the policy version; another run's state is refused."""
        if self.train_prompts is not None:  # refuse a checkpoint of another run (see `allow_changed_data`)
            allowed = self.options.data.allow_changed_data
            state_dict = checked_restore(state_dict, self.run_identity(), allow_changed=allowed)
        self._restored = {key: value for key, value in state_dict.items() if value}
        if self._progress is not None and "progress" in self._restored:
            self._progress.load_state_dict(self._restored["progress"])
        if self.weight_sync is not None and "weight_sync" in self._restored:
            self.weight_sync.load_state_dict(self._restored["weight_sync"])

    @override
    def train_dataloader(self) -> StepStream:
        """Every rank's stream of optimizer steps: push the (restored) weights once, then rank 0 starts the rollouts.
        A bare iterable with a length (no `DataLoader`), so Lightning fetches no batch ahead and warns of nothing."""
        module = require_policy_source(self.trainer.lightning_module, "GRPODataModule")
        sync, schedule = self.weight_sync, self.schedule
        if sync is None or schedule is None:
            raise RuntimeError("`GRPODataModule.train_dataloader()` runs after `setup` (Trainer.fit calls both).")
        sync.push(module.policy, wrapped=self.trainer.model)  # every rank: gathering sharded weights is a collective
        source = self._start_session(module, sync) if self.trainer.is_global_zero else None
        self._threads.borrow_generator_cores(module.policy)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        group, batches = self.process_group, len(schedule)
        self._stream = StepStream(source, rank=rank, world_size=world, group=group, max_batches=batches)
        return self._stream

    @override
    def val_dataloader(self) -> DataLoader | list:
        """Held-out prompts in batches of `val_batch_size` rows (lists of dicts); none without `val_dataset`."""
        if self.val_prompts is None:
            ignore_empty_val_loader()
            return []
        return DataLoader(list(self.val_prompts), batch_size=self.options.data.val_batch_size, collate_fn=list)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The consumed prompt groups and the policy version (rank 0's are written); plain types only."""
        state: dict[str, Any] = {"progress": self._progress.state_dict() if self._progress is not None else {}}
        sync = self.weight_sync.state_dict() if self.weight_sync is not None else self._restored.get("weight_sync")
        if sync is not None:
            state["weight_sync"] = sync
        if self.train_prompts is not None:
            state["run"] = self.run_identity()
        return state

    @override
    def teardown(self, stage: str) -> None:
        self.close()
        self._threads.restore()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.close()
        self._threads.restore()

    # -- what GRPOModule and the callbacks call (`RolloutSource`) ---------------------------------------------------

    def rollout_contract(self) -> RolloutContract:
        """What the module needs to know of the rollouts (`RolloutContract`); a `RuntimeError` before `setup`."""
        if self._contract is None:
            raise RuntimeError(
                "`GRPODataModule.rollout_contract()` is available once `setup` ran (Trainer.fit does it)."
            )
        return self._contract

    @property
    def progress(self) -> RolloutProgress | None:
        """Rank 0's progress ledger (None on other ranks and before `setup`)."""
        return self._progress if self.trainer is None or self.trainer.is_global_zero else None

    def finish_step(self, batch: StepBatch, *, look_ahead: bool) -> RolloutStop | None:
        """Every rank, after `batch`'s optimizer step: commit its groups (rank 0), and with `look_ahead` fetch the next
        step now; the stop item when the stream ended there. A `RuntimeError` outside a fit."""
        if self._stream is None:
            raise RuntimeError("`GRPODataModule.finish_step` is called during `Trainer.fit`, after a step trained.")
        if self._progress is not None and self.trainer.is_global_zero:
            self._progress.commit(batch.group_ids)
        return self._stream.look_ahead() if look_ahead else None

    def stream_stop(self) -> RolloutStop | None:
        """The stop item the training stream ended with (every rank), or None while it goes on."""
        return self._stream.stop if self._stream is not None else None

    def rollout_metrics(self) -> dict[str, float]:
        """Rank 0: what the child and the pipeline measured since the last call, and `progress/groups_consumed`."""
        metrics = self._session.drain_metrics() if self._session is not None else {}
        if self._progress is not None:
            metrics["progress/groups_consumed"] = float(self._progress.final_group_count())
        return metrics

    def progress_summary(self) -> dict[str, int] | None:
        """Rank 0's progress in prompt groups (see `RolloutSource.progress_summary`); None before `setup`."""
        return self._progress.summary() if self._progress is not None else None

    def score_completions(self, completions: list[list[dict]], rows: list[dict]) -> dict[str, list[float]]:
        """Every reward function's rewards for `completions` of `rows` (validation), through a process pool."""
        return self._val_scorer.score(completions, rows)

    # -- checks, inspection and shutdown ----------------------------------------------------------------------------

    def check_data(self, world_size: int | None = None) -> None:
        """Load and check the prompts and the tokenizer now, as `setup` does first (the command line calls it before
        it starts anything); with `world_size`, also check that a group fits one optimizer step on that many ranks.

        Raises:
            ValueError: a dataset without a `prompt` column or a column a reward function takes by name, a tokenizer
                that cannot be loaded, a group that can never fit one step.
        """
        if self.train_prompts is None:
            self._load()
        if world_size is not None:
            check_group_fits(self.options, world_size, self._longest_prompt)

    def run_identity(self, world_size: int | None = None) -> dict[str, Any]:
        """What the ledger depends on (`lightning_grpo.pipeline.run_identity`), once the prompts are loaded."""
        if self._identity is None:
            world = world_size or (self.trainer.world_size if self.trainer is not None else 1)
            self._identity = run_identity(
                self.train_prompts, self.options, groups_per_step(self.options, world, self._longest_prompt)
            )
        return self._identity

    def groups_per_step(self) -> int:
        """Prompt groups in one optimizer step (the planner's cap and the pacing unit)."""
        return groups_per_step(self.options, self.trainer.world_size, self._longest_prompt)

    @property
    def core_sharing(self) -> CoreSharing | None:
        """With `trainer_threads="auto"` on a shared CPU, during a fit: how trainer and generator share cores."""
        return self._threads.core_sharing

    @property
    def rollout_worker(self) -> Any:
        """Rank 0's `GRPORolloutWorker` during a fit (its `pid`, `check_health`), else None."""
        return self._session.worker if self._session is not None else None

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

    # -- private helpers --------------------------------------------------------------------------------------------

    def _load(self) -> None:
        options = self.options
        data = prepare_prompts(
            options.data,
            options.chat,
            dataset=self.dataset,
            val_dataset=self.val_dataset,
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
        name = getattr(self.trainer.lightning_module if self.trainer is not None else None, "model_name", None)
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

    def _start_session(self, module: PolicySource, sync: WeightSync) -> RolloutPipeline:
        if self._session is not None:
            self._session.close()
        self._session = start_rollout_session(self, module, make_collator=make_step_collator)
        sync.on_version(self._session.worker.update_model_version)
        return self._session.pipeline

    def _longest_prompt(self) -> int:
        return longest_prompt(self.conversation, self.train_prompts)
