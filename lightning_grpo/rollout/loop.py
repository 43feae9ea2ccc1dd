"""The rollout loop that runs in the CUDA-free child: schedule groups, generate, score, compute advantages.

Everything here runs inside the child process `GRPORolloutWorker` spawns. `GRPORolloutLoop` is TRL 1.16's rollout
loop with GRPOTrainer's reward options and parallel scoring, a finite and reproducible group schedule, paced
admission, multi-turn rollouts with tools and environments whose faults stay contained, and an embedded CPU
generator besides TRL's vLLM HTTP path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._trl import (
    RolloutGroup,
    _AsyncRolloutLoop,
    add_response_schema,
    is_async_callable,
)
from .advantages import AdvantageEstimator, Aggregation, ScaleRewards, compute_group_advantages, learning_signal
from .chat import PromptFormat, conversation_chat_template, ensure_tool_parser
from .conversation import Conversation, ConversationOptions
from .environments import Environments, prompt_of, tool_methods, with_observation
from .groups import Group, Rollout, assemble
from .pacing import Pacing
from .records import GENERATOR_REPLICA, LEARNING_SIGNAL, NO_SIGNAL, SCORE_PAYLOAD, RolloutSample, without_signal
from .reward_calls import InlineRewards
from .reward_pool import RewardProcessPool
from .schedule import GroupSchedule
from .stop_strings import check_stop
from .tool_calls import ToolCaller
from .vllm_requests import VLLMRequests

log = logging.getLogger(__name__)


#: Seconds between heartbeats while the loop idles (schedule done, or paced).
IDLE_POLL_S = 0.05

# Versions of the weights that sampled each turn of the rollout running in the current asyncio task.
_turn_versions: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("turn_versions", default=None)
# Whether each turn of that rollout stopped at its token limit (None: the generator did not say).
_turn_truncations: contextvars.ContextVar[list[bool | None] | None] = contextvars.ContextVar(
    "turn_truncations", default=None
)


class GRPORolloutLoop(VLLMRequests, _AsyncRolloutLoop):
    """TRL's rollout loop with GRPOTrainer's reward options and parallel scoring, a finite schedule and pacing.

    Scoring: a finished group is scored with every reward column (the reward functions; each environment class's
    `get_reward`; with `_provides_rollout_reward`, one more column named `_rollout_reward_name` from
    `_generate_one`'s reward), then `compute_group_advantages` with `reward_weights`, `multi_objective_aggregation`
    and `scale_rewards`. Synchronous reward functions run in a `RewardProcessPool` of `reward_num_workers` processes
    with a `reward_timeout` (so a hung or crashing reward scores NaN instead of freezing the loop); with
    `reward_num_workers=0` they run in threads, and async reward functions are awaited on this loop, both under the
    pool's rules (`InlineRewards`: the same timeout, NaN for a call that raises, hangs or returns a bad value, the
    same `reward_pool/*` counters), except that a hung thread cannot be killed and holds the GIL as it runs.

    With `trainer_scored`, the trainer adds reward columns that need its device: this loop scores its own columns,
    leaves the advantage NaN and attaches `extras[SCORE_PAYLOAD] = {"rows", "columns", "payload"}` (the group's row
    count, the reward columns scored here and `_trainer_score_payload(group)`).

    Schedule: group `g` is prompt `perm(seed, epoch)[g % N]` of epoch `g // N`, for `epochs * N` groups; ids in
    `consumed` are skipped (exactly-once resume). After the last id the loop schedules nothing and idles with its
    heartbeat alive.

    Pacing: with `groups_per_step` set, groups are admitted within `max_staleness` steps of the trainer (see
    `Pacing`), so with a steady trainer no group arrives staler than that and the trainer's stale drop stays a
    safety net.

    Tools and environments (TRL's `tools`, `environment_factory`, `max_tool_calling_iterations`): each rollout is a
    `Conversation`: every turn renders the conversation so far with the chat template, the policy's tool calls run
    (see `ToolCaller`: a tool that raises, hangs past `tool_timeout` or returns something unprintable answers with an
    error message and is counted), and the tool results are context for the next turn, never trained. An
    environment whose `reset` fails scores its rollout NaN in every column; one whose `get_reward` fails, NaN in its
    column. A sample's version is that of the oldest weights that sampled any of its turns.

    Args:
        reward_weights: one weight per reward column (reward functions, environment columns, rollout column).
            Default: all 1.
        multi_objective_aggregation: `"sum_then_normalize"` or `"normalize_then_sum"` (GDPO).
        scale_rewards: `"group"`, `"batch"` or `"none"` (see `compute_group_advantages`). `"batch"` is applied by the
            trainer over each optimizer step: here a sample's advantage is the group-centred signal and
            `extras[LEARNING_SIGNAL]` the signal itself (`learning_signal`), which the collator scales
            (`batch_advantages`).
        advantage_estimator: the baseline, `"grpo"`, `"rloo"` or `"reinforce_plus_plus"` (see
            `compute_group_advantages`).
        reward_num_workers: processes in the reward pool; 0 runs synchronous rewards in threads.
        trainer_scored: leave advantages pending for trainer scorers.
        reward_timeout: wall-clock seconds one reward call may take before it scores NaN.
        generator: `None` for TRL's vLLM HTTP path, or a `GeneratorSpec` (see `generator.py`; the worker makes one
            of "embedded").
        core_sharing: the trainer's `CoreSharing`, handed to the embedded generator (see `core_sharing.py`).
        stop: stop strings: a completion ends when its text contains one, as at an EOS id (sent to vLLM as `stop`;
            the embedded generator gets them from its spec).
        epochs: passes over the prompts in the group schedule.
        seed: seeds each epoch's prompt order.
        shuffle: False keeps dataset order in every epoch.
        consumed: group ids to skip (consumed by an earlier run).
        groups_per_step: prompt groups per optimizer step, the pacing unit; None disables pacing.
        max_staleness: policy versions a group may lag when it trains; pacing keeps groups within it.
        replace_early: the trainer drops and replaces groups whose advantages are all 0: the loop tags each such
            group (`extras[NO_SIGNAL]`) and starts its replacement as soon as it is scored (see `Pacing`).
        tool_timeout: seconds a tool call, an environment's `reset` or its `get_reward` may take (None: no limit).
        prompt_format: how string prompts are rendered: `"auto"`, `"chat"` or `"text"` (see `GRPODataModule`).
        **kwargs: TRL's `_AsyncRolloutLoop` arguments (model_name, dataset, reward_funcs, processing_class,
            eos_token_ids, num_generations, max_inflight_tasks, max_tokens, temperature, top_p, top_k, min_p,
            repetition_penalty, tools, environment_factory, max_tool_calling_iterations, chat_template_kwargs, ...).
    """

    #: Set by subclasses that score each rollout in `_generate_one` (one more reward column).
    _provides_rollout_reward: bool = False
    _rollout_reward_name: str = "rollout_reward"
    #: GRPORolloutWorker passes the trainer's consumed-groups counter to loops that set this.
    _accepts_groups_consumed = True

    def __init__(
        self,
        *,
        reward_weights: Iterable[float] | None = None,
        multi_objective_aggregation: Aggregation = "sum_then_normalize",
        scale_rewards: ScaleRewards = "group",
        advantage_estimator: AdvantageEstimator = "grpo",
        reward_num_workers: int = 1,
        trainer_scored: bool = False,
        reward_timeout: float = 60.0,
        generator: Any = None,
        core_sharing: Any = None,
        stop: Sequence[str] | None = None,
        epochs: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        consumed: Iterable[int] = (),
        groups_per_step: int | None = None,
        max_staleness: int = 4,
        replace_early: bool = False,
        groups_consumed_value: Any = None,
        tool_timeout: float | None = 60.0,
        prompt_format: PromptFormat = "auto",
        **kwargs: Any,
    ) -> None:
        tokenizer = kwargs["processing_class"]
        _ensure_response_parser(tokenizer, needs_tools=bool(kwargs.get("tools") or kwargs.get("environment_factory")))
        super().__init__(**kwargs)
        self.vllm_stop = check_stop(stop)
        self._environments = self._probed_environments(kwargs.get("environment_factory"))
        self._tool_timeout = tool_timeout
        self._tool_caller = ToolCaller(tool_timeout, self._counters, self._rates)
        self._conversation = ConversationOptions(
            tokenizer=self.tokenizer,
            prompt_format=prompt_format,
            chat_template=conversation_chat_template(self.tokenizer, self.tools),
            chat_template_kwargs=self.chat_template_kwargs,
            max_tool_calling_iterations=self.max_tool_calling_iterations,
        )
        self.reward_func_names: list[str] = [*self.reward_func_names]
        if self._provides_rollout_reward:
            self.reward_func_names.append(self._rollout_reward_name)
        self._weights = self._validated_weights(reward_weights)
        self._aggregation = multi_objective_aggregation
        self._batch_scaled = scale_rewards == "batch"
        self._scale_rewards: ScaleRewards = "none" if self._batch_scaled else scale_rewards
        self._estimator = advantage_estimator
        compute_group_advantages(
            np.zeros((len(self._weights), 2)),
            self._weights,
            multi_objective_aggregation,
            self._scale_rewards,
            estimator=advantage_estimator,
        )  # fail at start-up on a bad option, not on the first group
        self._trainer_scored = trainer_scored
        self._reward_timeout = reward_timeout
        self._inline_rewards = InlineRewards(self.reward_func_names[: len(self.reward_funcs)], reward_timeout)
        self._schedule = GroupSchedule(len(self.dataset), epochs=epochs, seed=seed, shuffle=shuffle)
        self._consumed = frozenset(consumed)
        self._pacing = None if groups_per_step is None else Pacing(groups_per_step, max_staleness)
        self._replace_early = replace_early
        self._groups_consumed_value = groups_consumed_value
        self._admitted = 0
        self._pool_stats_pushed: dict[str, float] = {}
        self._pool, self._generator = self._start_pool_and_generator(reward_num_workers, generator, core_sharing)

    # -- set-up ------------------------------------------------------------------------------------------------------

    def _probed_environments(self, environment_factory: Any) -> Environments | None:
        """The environments, from the instances TRL's `__init__` already made to probe them (none made twice)."""
        if environment_factory is None:
            return None
        return Environments(
            environment_factory, probes={name: pool[0] for name, pool in self._environment_pool.items()}
        )

    def _validated_weights(self, reward_weights: Iterable[float] | None) -> np.ndarray:
        names = self.reward_func_names
        if reward_weights is None:
            return np.ones(len(names))
        weights = np.asarray(list(reward_weights), dtype=np.float64)
        if weights.shape != (len(names),):
            raise ValueError(
                f"`reward_weights` has {weights.size} entries but there are {len(names)} reward columns {names}: "
                "pass one weight per reward function, environment reward and rollout reward, in that order."
            )
        return weights

    def _start_pool_and_generator(self, num_workers: int, generator: Any, core_sharing: Any) -> tuple[Any, Any]:
        """The reward pool and the embedded generator (None for vLLM), started at once: the pool's workers import
        the reward functions' modules while the policy loads. Whichever fails, the other is closed before it raises.
        """
        if num_workers < 0:
            raise ValueError(f"`reward_num_workers={num_workers}` must be 0 (threads) or more (processes).")
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-reward-pool-start") as starter:
            starting = starter.submit(self._start_reward_pool, num_workers)
            try:
                built = generator.build(core_sharing) if generator is not None else None
            except BaseException:
                with contextlib.suppress(Exception):
                    if (pool := starting.result()) is not None:
                        pool.close()
                raise
            try:
                return starting.result(), built
            except BaseException:
                if built is not None:
                    built.close()
                raise

    def _start_reward_pool(self, num_workers: int) -> RewardProcessPool | None:
        sync_funcs = [f for f in self.reward_funcs if not is_async_callable(f)]
        if num_workers == 0 or not sync_funcs:
            return None
        return RewardProcessPool(self.reward_funcs, num_workers, timeout=self._reward_timeout)

    # -- versions, pacing, schedule ----------------------------------------------------------------------------------

    @property
    def model_version(self) -> int:
        """The version samples are tagged with: with the embedded generator, that of the weights it runs."""
        if self._generator is not None:
            return self._generator.applied_version
        return int(self._model_version_value.value)

    def _admissible(self) -> bool:
        if self._pacing is None or self._groups_consumed_value is None:
            return True
        return self._pacing.admits(self._admitted - int(self._groups_consumed_value.value))

    def _scheduled_ids(self) -> Iterable[int]:
        return self._schedule.group_ids(skip=self._consumed)

    # -- the generate loop -------------------------------------------------------------------------------------------

    async def _generate_loop(self, stop_event: asyncio.Event) -> None:
        """Admit whole groups from the schedule while slots and pacing allow; hand finished groups to scoring.

        Replaces TRL's loop, which cycles the prompts forever and admits rollouts unconditionally.
        """
        ids = iter(self._scheduled_ids())
        next_id = next(ids, None)
        inflight: dict[asyncio.Task, int] = {}
        groups: dict[int, tuple[RolloutGroup, list[Rollout]]] = {}
        self._generation_start_time = time.monotonic()
        paced_since: float | None = None
        try:
            while not stop_event.is_set():
                self._heartbeat_value.value = time.time()
                while next_id is not None and len(inflight) + self.num_generations <= self.max_inflight_tasks:
                    if not self._admissible():
                        paced_since = paced_since or time.monotonic()
                        break
                    if paced_since is not None:
                        self._rates["rollout/pacing_wait_s"][0] += time.monotonic() - paced_since
                        self._rates["rollout/pacing_wait_s"][1] += 1
                        paced_since = None
                    groups[next_id] = self._start_group(next_id, inflight)
                    next_id = next(ids, None)
                self._inflight = len(inflight)
                if not inflight:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                done, _ = await asyncio.wait(inflight, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    group_id = inflight.pop(task)
                    group, rollouts = groups[group_id]
                    rollouts.append(task.result())  # a failed generation fails the child (reported to the trainer)
                    self._total_completion_tokens += len(rollouts[-1].completion_ids)  # rollout/generated_tok_s
                    if len(rollouts) == self.num_generations:
                        del groups[group_id]
                        if not await self._hand_to_scoring(assemble(group, rollouts), stop_event):
                            return
        finally:
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
            with contextlib.suppress(asyncio.QueueFull):
                self._groups_to_score.put_nowait(None)

    def _start_group(self, group_id: int, inflight: dict[asyncio.Task, int]) -> tuple[RolloutGroup, list[Rollout]]:
        row = self.dataset[self._schedule.prompt_index(group_id)]
        group = Group(
            prompts=[],
            reward_kwargs={
                key: [row[key]] * self.num_generations
                for key in row
                if key not in {"prompt", "completion", "completion_ids"}
            },
            completions=[],
            completions_ids=[],
            completions_sequences=[],
            tool_call_counts=[],
            tool_failure_counts=[],
            model_version=self.model_version,
            group_id=group_id,
            env_rewards=[],
            rollout_rewards=[],
        )
        for _ in range(self.num_generations):
            inflight[asyncio.create_task(self._rollout(row, group_id))] = group_id
        self._admitted += 1
        return group, []

    async def _hand_to_scoring(self, group: RolloutGroup, stop_event: asyncio.Event) -> bool:
        group.queued_at = time.monotonic()
        blocked_since = None
        while not stop_event.is_set():
            try:
                self._groups_to_score.put_nowait(group)
            except asyncio.QueueFull:
                blocked_since = blocked_since or time.monotonic()
                self._heartbeat_value.value = time.time()
                await asyncio.sleep(0.05)
                continue
            if blocked_since is not None:
                self._push_metrics({"rollout/score_block_s": time.monotonic() - blocked_since})
            return True
        return False

    async def _rollout(self, row: dict[str, Any], group_id: int) -> Rollout:
        """One conversation: take and reset an environment (if any), converse, score the environment's reward."""
        versions: list[int] = []
        _turn_versions.set(versions)  # this task's own context: concurrent rollouts do not see it
        truncations: list[bool | None] = []
        _turn_truncations.set(truncations)
        self._route_group(group_id)  # every vLLM request of a group goes to the group's server
        environments = self._environments
        name = environments.name_of(row) if environments is not None else None
        environment = environments.acquire(name) if environments is not None else None
        guards = dict(timeout=self._tool_timeout, counters=self._counters, rates=self._rates)
        observation, env_ok = None, True
        try:
            if environments is not None and environment is not None:
                observation, env_ok = await environments.reset(environment, row, **guards)
            prompt = with_observation(prompt_of(row, environment), observation)
            tools = [*self._standalone_tools, *environments.tools[name]] if environments is not None else self.tools
            tool_dict = {tool.__name__: tool for tool in self._standalone_tools + tool_methods(environment)}
            completion, completion_ids, sequences, calls, failures, rollout_reward = await self._generate_one(
                prompt, tool_dict=tool_dict, tools=tools, group_id=group_id
            )
            env_reward = None
            if environments is not None and environment is not None and env_ok:
                env_reward = await environments.reward(environment, **guards)
        finally:
            if environments is not None and environment is not None:
                environments.release(name, environment)
        version = min(versions) if versions else None
        return Rollout(
            prompt, completion, completion_ids, sequences, calls, failures, rollout_reward, env_reward, version,
            env_failed=not env_ok, truncated=truncations[-1] if truncations else None,
        )  # fmt: skip

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        """One conversation (see `Conversation`); TRL's return value: `(completion, completion_ids, training rows,
        tool calls, tool failures, rollout reward)`. Without tools it is one turn, decoded as plain text."""
        started = time.monotonic()
        conversation = Conversation(prompt, self._conversation, tools=tools or ())
        while not conversation.done:
            prompt_ids = conversation.prompt_ids()
            ids, logprobs = await self._generate_one_turn(prompt_ids)
            calls = conversation.add_turn(prompt_ids, ids, logprobs)
            if calls:
                conversation.add_tool_results(*await self._tool_caller.run(calls, tool_dict))
        sequences, tally = conversation.training_sequences(self._fork_threshold_tokens)
        self._push_rollout_metrics(
            turns=len(conversation.turns),
            sequences=len(sequences),
            completion_ids=conversation.completion_ids,
            tally=tally,
            loop_exhausted=conversation.loop_exhausted,
            duration_s=time.monotonic() - started,
        )
        calls, failures = conversation.tool_calls, conversation.tool_failures
        return conversation.completion, conversation.completion_ids, sequences, calls, failures, None

    def _push_rollout_metrics(self, *, completion_ids: list[int], **kwargs: Any) -> None:
        """TRL's, with `completions/clipped_ratio` counting completions the generator cut at `max_tokens`: TRL counts
        those not ending on an EOS id, which a completion a stop string ended is too."""
        truncations = _turn_truncations.get()
        truncated = truncations[-1] if truncations else None
        if completion_ids and truncated is not None:
            trl_counts = completion_ids[-1] not in (*self.eos_token_ids, self.tokenizer.pad_token_id)
            self._rates["completions/clipped_ratio"][0] += float(truncated) - float(trl_counts)  # TRL adds the latter
        super()._push_rollout_metrics(completion_ids=completion_ids, **kwargs)

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        """One turn, from the embedded generator or the vLLM server; records the version of the weights sampling it
        (vLLM: the live version when the request is sent, never newer than the weights that serve it)."""
        versions, truncations = _turn_versions.get(), _turn_truncations.get()
        if self._generator is None:
            version = self.model_version
            ids, logprobs, truncated = await self._vllm_turn(prompt_ids)
        else:
            output = await self._generator.generate(prompt_ids)
            version, truncated = output.model_version, output.truncated
            ids, logprobs = list(output.token_ids), list(output.logprobs)
        if versions is not None:
            versions.append(version)
        if truncations is not None:
            truncations.append(truncated)
        return ids, logprobs

    # -- scoring -----------------------------------------------------------------------------------------------------

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        columns = await self._reward_table(group)
        rewards, advantages = compute_group_advantages(
            columns, self._weights, self._aggregation, self._scale_rewards, estimator=self._estimator
        )
        if self._trainer_scored:
            advantages = np.full_like(advantages, np.nan)
        signal = learning_signal(columns, self._weights, self._aggregation) if self._batch_scaled else None
        self._push_pool_stats()
        samples = self._samples(group, columns, rewards, advantages, signal)
        if self._replace_early and samples and without_signal(samples):
            self._drop_early(samples)
        return samples

    def _drop_early(self, samples: list[RolloutSample]) -> None:
        """A group without signal, which the trainer will drop: tagged, so that the trainer leaves it out of the
        consumed count it reports, and counted by pacing as consumed now, so that its replacement starts now."""
        for sample in samples:
            sample.extras[NO_SIGNAL] = True
        if self._pacing is not None:
            self._pacing.dropped_early()

    async def _reward_table(self, group: RolloutGroup) -> np.ndarray:
        kwargs = dict(
            completions=group.completions,
            prompts=group.prompts,
            completion_ids=group.completions_ids,
            **group.reward_kwargs,
        )
        scored = await asyncio.gather(*(self._call_reward(i, kwargs) for i in range(len(self.reward_funcs))))
        columns: list[Sequence[float | None]] = list(scored)
        if self._environments is not None:
            columns.extend(self._environments.rewards_per_type(group.env_rewards))
        if self._provides_rollout_reward:
            columns.append(list(group.rollout_rewards))
        table = np.array([[np.nan if r is None else float(r) for r in column] for column in columns], dtype=np.float64)
        failed = getattr(group, "env_failed", None)  # a `Group`; a subclass may build TRL's own RolloutGroup
        if failed and any(failed):
            table[:, np.asarray(failed, dtype=bool)] = np.nan
        return table

    async def _call_reward(self, index: int, kwargs: dict[str, Any]) -> list[float]:
        func = self.reward_funcs[index]
        if is_async_callable(func):
            return await self._inline_rewards.score(index, func, kwargs, is_async=True)
        if self._pool is not None:
            return await self._pool.score(index, **kwargs)
        return await self._inline_rewards.score(index, func, kwargs, is_async=False)

    def _push_pool_stats(self) -> None:
        """Send the reward counters (the pool's and the in-process calls', summed under the same names) as increments
        since the last push (TRL sums `*_total` metrics over pushes)."""
        stats = self._inline_rewards.stats()
        if self._pool is not None:
            stats = {key: value + stats.get(key, 0.0) for key, value in self._pool.stats().items()}
        for key, value in stats.items():
            self._counters[key] += value - self._pool_stats_pushed.get(key, 0.0)
        self._pool_stats_pushed = stats

    def _trainer_score_payload(self, group: RolloutGroup) -> dict[str, Any]:
        """What trainer scorers need from this group beyond its samples (override; default empty)."""
        return {}

    def _samples(
        self,
        group: RolloutGroup,
        columns: np.ndarray,
        rewards: np.ndarray,
        advantages: np.ndarray,
        signal: np.ndarray | None = None,
    ) -> list[RolloutSample]:
        scored = rewards[~np.isnan(rewards)]
        reward_std = float(scored.std(ddof=1)) if scored.size > 1 else (0.0 if scored.size else float("nan"))
        rows = sum(len(sequences) for sequences in group.completions_sequences)
        extras = {}
        if self._trainer_scored:
            payload = {
                "rows": rows,
                "columns": list(self.reward_func_names),
                "payload": self._trainer_score_payload(group),
            }
            extras[SCORE_PAYLOAD] = payload
        if (replica_of := getattr(self._generator, "replica_of", None)) is not None:  # generator_replicas > 1
            extras[GENERATOR_REPLICA] = replica_of(group.group_id)
        eos = set(self.eos_token_ids)
        samples = []
        any_calls = sum(group.tool_call_counts) > 0
        for i, sequences in enumerate(group.completions_sequences):
            completion_ids = group.completions_ids[i]
            metrics = {
                "reward": float(rewards[i]),
                "reward_std": reward_std,
                **{f"rewards/{name}": float(columns[j, i]) for j, name in enumerate(self.reward_func_names)},
            }
            if any_calls:  # TRL's per-rollout tool metrics, in groups where a tool was called
                calls, failed = group.tool_call_counts[i], group.tool_failure_counts[i]
                metrics["tools/call_frequency"] = float(calls)
                metrics["tools/failure_frequency"] = failed / calls if calls else 0.0
            truncated = group.truncated[i] if isinstance(group, Group) else None
            if truncated is None:
                truncated = not completion_ids or completion_ids[-1] not in eos
            sample_extras = extras if signal is None else {**extras, LEARNING_SIGNAL: float(signal[i])}
            for sequence in sequences:
                samples.append(
                    RolloutSample(
                        prompt=group.prompts[i],
                        completion=group.completions[i],
                        input_ids=np.asarray(sequence.input_ids, dtype=np.int64),
                        completion_mask=np.asarray(sequence.completion_mask, dtype=np.int64),
                        old_log_probs=np.asarray(sequence.old_log_probs, dtype=np.float32),
                        advantage=float(advantages[i]),
                        model_version=group.model_version,
                        group_id=group.group_id,
                        metrics=dict(metrics),
                        truncated=truncated,
                        group_rows=rows,
                        extras=dict(sample_extras),
                    )
                )
        return samples

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            super().run()
        finally:
            if self._pool is not None:
                self._pool.close()
            if self._generator is not None:
                self._generator.close()


def _ensure_response_parser(tokenizer: Any, needs_tools: bool) -> None:
    """TRL's loop insists on a response parser; only tool calling needs one (plain turns are decoded as text)."""
    if needs_tools:
        note = ensure_tool_parser(tokenizer)
        if note:
            log.warning(note)
        return
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        return
    try:
        add_response_schema(tokenizer)
    except ValueError:
        # No tools: `_generate_one` never parses. A template TRL's __init__ accepts, never used.
        tokenizer.response_template = {"fields": {"content": {"content": "text"}}}
