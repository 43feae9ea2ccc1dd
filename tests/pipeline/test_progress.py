"""Progress accounting and termination: the run always ends, on every rank at once, and resumes exactly once.

The rank-0 pipeline is real (GroupedQueue -> SampleFilterQueue -> StepPlanner -> StopAwareDataset -> DataLoader with
ProgressCollator); the rollout child is replaced by a `queue.Queue` filled with the groups it would generate
(`GroupSchedule.group_ids(skip=consumed)`), and the Lightning loop by `train_like_lightning`, which keeps a fit's
order: step k trains and commits, then step k+1 is fetched (so collated) by the look-ahead, then step k is
checkpointed. The 2-rank Lightning run is tested with the module.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import queue
import time
from dataclasses import dataclass, field

import pytest
import torch
from helpers.rollouts import make_group, queue_of
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from lightning_grpo.pipeline.batch import StepBatch
from lightning_grpo.pipeline.collating import ProgressCollator
from lightning_grpo.pipeline.filtering import SampleFilterQueue
from lightning_grpo.pipeline.grouping import GroupedQueue
from lightning_grpo.pipeline.ledger import RolloutProgress, RolloutStop
from lightning_grpo.pipeline.planner import StepPlanner
from lightning_grpo.pipeline.stopping import StopAwareDataset
from lightning_grpo.pipeline.stream import RolloutPipeline
from lightning_grpo.rollout.records import NO_SIGNAL
from lightning_grpo.rollout.schedule import GroupSchedule

POLL_S = 0.005


def pipeline(
    q: queue.Queue,
    progress: RolloutProgress | None,
    *,
    num_processes: int = 2,
    steps: int = 1,
    token_budget: int = 200,
    max_staleness: int = 100,
    version: int = 0,
    metrics: dict | None = None,
    health_check=None,
    drop_no_signal_groups: bool = True,
    replace_dropped_groups: bool = True,
    max_groups_per_step: int | None = None,
) -> DataLoader:
    """Rank 0's data path, as the data module builds it."""
    groups = GroupedQueue(q, health_check=health_check, poll_interval_s=POLL_S)
    filtered = SampleFilterQueue(
        groups,
        progress,
        model_version=lambda: version,
        max_staleness=max_staleness,
        mask_truncated_completions=True,
        token_budget=token_budget,
        drop_no_signal_groups=drop_no_signal_groups,
        replace_dropped_groups=replace_dropped_groups,
        metrics=metrics,
    )
    planner = StepPlanner(
        filtered,
        num_processes=num_processes,
        steps=steps,
        token_budget=token_budget,
        samples_per_row=0,
        progress=progress,
        metrics=metrics,
        poll_interval_s=POLL_S,
        max_groups_per_step=max_groups_per_step,
    )
    collator = ProgressCollator(progress, num_processes=num_processes, reward_names=["acc"])
    return DataLoader(StopAwareDataset(planner), batch_size=None, num_workers=0, collate_fn=collator)


@dataclass
class Run:
    steps: list[list[int]] = field(default_factory=list)  # group ids of each optimizer step, in order
    checkpoint: dict | None = None  # the last saved progress state
    checkpoint_steps: int = 0  # optimizer steps the checkpoint includes
    stop: RolloutStop | None = None  # how rank 0's stream ended, None when killed


def train_like_lightning(loader, progress, *, score=None, kill_after=None, checkpoint_every=1) -> Run:
    """Step through the stream in a fit's order: Lightning fetches step 0; then for each step k: score and train k,
    commit k and look ahead to k+1 (RolloutStopCallback), then checkpoint k (ModelCheckpoint runs last)."""
    run = Run()
    batches = iter(loader)
    current = next(batches)
    while True:
        assert len(current) == loader.collate_fn.num_processes
        if current[0].stop is not None:
            assert all(b.stop is not None and b.stop.error == current[0].stop.error for b in current)
            assert next(batches, None) is None, "the stream must end right after its stop item"
            run.stop = current[0].stop
            return run
        if score is not None:
            score(current, progress)  # score_step, in on_train_batch_start
        run.steps.append(list(current[0].group_ids))
        progress.commit(current[0].group_ids)  # after the optimizer step ...
        following = next(batches, None)  # ... the look-ahead ...
        assert following is not None, "the stream ended without a stop item"
        if len(run.steps) % checkpoint_every == 0:  # ... and only then the checkpoint
            run.checkpoint, run.checkpoint_steps = copy.deepcopy(progress.state_dict()), len(run.steps)
        if kill_after is not None and len(run.steps) >= kill_after:
            return run
        current = following


def trained_ids(steps: list[list[int]], excluded: set[int] = frozenset()) -> list[int]:
    return [g for step in steps for g in step if g not in excluded]


# ---------------------------------------------------------------- the stream ends


@pytest.mark.timeout(60)
def test_all_trainable_groups_stop_right_after_the_last_group():
    progress = RolloutProgress(total_groups=6, stall_groups=6)
    q = queue_of([make_group(g, size=3) for g in range(6)])  # exactly the run's groups: nothing more is generated
    start = time.monotonic()
    run = train_like_lightning(pipeline(q, progress, token_budget=40), progress)
    assert sorted(trained_ids(run.steps)) == list(range(6)) and len(run.steps) > 1
    assert run.stop.error is None and time.monotonic() - start < 10
    assert progress.trained_total == 6 and progress.outstanding() == 0 and q.empty()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replace", [True, False])
def test_full_pass_without_training_raises_stall_after_exactly_stall_groups(replace):
    progress = RolloutProgress(total_groups=20, stall_groups=5)
    q = queue_of([make_group(g, size=2, advantages=[0.0, 0.0]) for g in range(20)])
    loader = pipeline(q, progress, max_groups_per_step=2, replace_dropped_groups=replace)
    run = train_like_lightning(loader, progress)
    assert run.steps == []
    assert q.qsize() == (20 - 5) * 2  # it read exactly stall_groups groups, not the whole stream
    assert progress.dropped == {"no_signal": 5}
    error = run.stop.error
    assert "RolloutStop" not in error and "5 prompt groups in a row were consumed without one training" in error
    assert "(no_signal: 5)" in error and "num_generations" in error and "Raise stall_groups" in error


@pytest.mark.timeout(60)
def test_mixed_stream_counts_each_drop_reason_once_and_consumes_every_group_once():
    groups = [
        make_group(0, version=5),
        make_group(1, version=0),  # stale: 5 - 0 > max_staleness=2
        make_group(2, version=5, truncated=[True] * 4),
        make_group(3, version=5, completion_lens=[3, 3, 60, 3]),  # 64 tokens > token_budget=40
        make_group(4, version=5, advantages=[0.0] * 4),
        make_group(5, version=5, truncated=[True, False, False, False]),  # partly truncated: trains 3
        make_group(6, version=5, advantages=[1.0, 0.0, 0.0, 0.0], truncated=[True, False, False, False]),
        make_group(7, version=4),  # staleness 1: trains
    ]
    metrics: dict[str, list] = {}
    progress = RolloutProgress(total_groups=8, stall_groups=8)
    loader = pipeline(queue_of(groups), progress, token_budget=40, max_staleness=2, version=5, metrics=metrics)
    run = train_like_lightning(loader, progress)
    assert run.stop.error is None
    assert sorted(trained_ids(run.steps)) == [0, 5, 7]
    expected = {"stale": 1, "truncated": 1, "oversize": 1, "no_signal": 2}  # group 6's only signal is masked
    assert progress.dropped == expected
    assert {k: sum(v) for k, v in metrics.items() if k.startswith("progress/")} == {
        f"progress/dropped_{reason}_total": float(n) for reason, n in expected.items()
    }
    assert metrics["sample/staleness_max"] == [0.0, 0.0, 1.0] and len(metrics["sample/time_in_queue_s"]) == 12
    assert progress.consumed == set(range(8)) and progress.trained_total == 3


@pytest.mark.timeout(60)
def test_groups_without_signal_train_when_not_dropped_and_other_drops_stay():
    """`drop_no_signal_groups=False`: the all-zero group and the group whose only signal was masked train; the stale,
    truncated and oversize drops are unchanged."""
    groups = [
        make_group(0, version=5),
        make_group(1, version=0),  # stale
        make_group(2, version=5, truncated=[True] * 4),
        make_group(3, version=5, completion_lens=[3, 3, 60, 3]),  # oversize
        make_group(4, version=5, advantages=[0.0] * 4),
        make_group(5, version=5, advantages=[1.0, 0.0, 0.0, 0.0], truncated=[True, False, False, False]),
    ]
    metrics: dict[str, list] = {}
    progress = RolloutProgress(total_groups=6, stall_groups=6)
    loader = pipeline(
        queue_of(groups), progress, token_budget=40, max_staleness=2, version=5, metrics=metrics,
        drop_no_signal_groups=False,
    )  # fmt: skip
    run = train_like_lightning(loader, progress)
    assert run.stop.error is None
    assert sorted(trained_ids(run.steps)) == [0, 4, 5]
    assert progress.dropped == {"stale": 1, "truncated": 1, "oversize": 1}
    assert "progress/dropped_no_signal_total" not in metrics and progress.trained_total == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replace", [True, False])
def test_dropped_groups_are_replaced_or_leave_their_places_empty(replace):
    """Two groups per step. Replaced (the default), each step waits for two groups that train; not replaced, a
    dropped group (any reason) takes its place and the step trains the rest; either way every group is consumed once
    and the places alone never make a step."""
    signal, none = {}, {"advantages": [0.0] * 4}
    kinds = [signal, none, signal, signal, none, {"version": 0}, none, signal, none]  # group 5 is stale
    progress = RolloutProgress(total_groups=len(kinds), stall_groups=len(kinds))
    groups = [make_group(g, **({"version": 5} | kind)) for g, kind in enumerate(kinds)]
    loader = pipeline(
        queue_of(groups), progress, num_processes=1, max_staleness=2, version=5, max_groups_per_step=2,
        replace_dropped_groups=replace,
    )  # fmt: skip
    run = train_like_lightning(loader, progress)
    assert run.stop.error is None
    assert run.steps == ([[0, 2], [3, 7]] if replace else [[0], [2, 3], [7]])
    assert progress.dropped == {"no_signal": 4, "stale": 1} and progress.consumed == set(range(len(kinds)))
    assert progress.trained_total == 4


class QueueWorker:
    """What `RolloutPipeline` reads of the rollout worker: its queue, its health check, the consumed count it sets."""

    def __init__(self, groups: list) -> None:
        self.rollout_buffer = queue_of(groups)
        self.groups_consumed = 0

    def check_health(self, stale_after_s: float) -> None:
        pass


def tagged(group: list) -> list:
    """The group as the rollout loop sends one it found without signal (and counted as consumed for pacing)."""
    for sample in group:
        sample.extras[NO_SIGNAL] = True
    return group


@pytest.mark.timeout(60)
def test_groups_the_loop_dropped_early_are_left_out_of_the_consumed_count_pacing_reads():
    """The loop counts a group it tagged as without signal when it scores it; the trainer reports every other group
    whose fate is final, so each group counts once. A tagged group dropped for another reason (stale) is the loop's
    too; an untagged group without signal (a loop that does not tag) is the trainer's."""
    none = {"advantages": [0.0] * 4}
    groups = [make_group(g, **({"version": 5} | kind)) for g, kind in enumerate([{}, none, {}, none, {}, {}, none, {}])]
    groups[4] = make_group(4, version=0, **none)  # stale as well
    for g in (1, 3, 4):
        tagged(groups[g])
    progress = RolloutProgress(total_groups=len(groups), stall_groups=len(groups))
    worker = QueueWorker(groups)
    stream = RolloutPipeline(
        worker,
        progress,
        planner_kwargs=dict(num_processes=1, steps=1, token_budget=200, samples_per_row=0, max_groups_per_step=2),
        collator=ProgressCollator(progress, num_processes=1, reward_names=["acc"]),
        model_version=lambda: 5,
        max_staleness=2,
        mask_truncated_completions=True,
        heartbeat_timeout=60.0,
        metrics={},
    )
    steps = []
    for batches in stream:
        if batches[0].stop is not None:
            break
        steps.append(list(batches[0].group_ids))
        progress.commit(batches[0].group_ids)
    stream.report_consumed()
    assert steps == [[0, 2], [5, 7]]
    assert progress.dropped == {"no_signal": 3, "stale": 1} and progress.consumed == set(range(len(groups)))
    assert worker.groups_consumed == len(groups) - 3


@pytest.mark.timeout(60)
def test_a_tagged_group_that_would_train_stops_the_run_naming_the_mismatch():
    """The loop tags only groups the trainer drops; a tagged group that would train means the two disagree on
    `drop_no_signal_groups` (pacing's count would be off by it), so the stream stops with that error."""
    progress = RolloutProgress(total_groups=2, stall_groups=2)
    groups = [make_group(0, version=5), tagged(make_group(1, version=5, advantages=[0.0] * 4))]
    loader = pipeline(queue_of(groups), progress, num_processes=1, version=5, drop_no_signal_groups=False)
    run = train_like_lightning(loader, progress)
    assert "Group 1 came tagged as without learning signal" in str(run.stop.error)
    assert "drop_no_signal_groups" in str(run.stop.error)


def test_filter_skips_a_group_consumed_before_a_resume():
    metrics: dict[str, list] = {}
    progress = RolloutProgress([0], total_groups=2, stall_groups=2)
    groups = GroupedQueue(queue_of([make_group(0), make_group(1)]), poll_interval_s=POLL_S)
    filtered = SampleFilterQueue(
        groups,
        progress,
        model_version=lambda: 0,
        max_staleness=0,
        mask_truncated_completions=False,
        token_budget=0,
        metrics=metrics,
    )
    assert filtered.get(timeout=1)[0].group_id == 1
    assert metrics["progress/duplicate_total"] == [1.0] and progress.stall_run == 0
    with pytest.raises(queue.Empty):
        filtered.get(timeout=0.02)


def test_partly_truncated_group_masks_its_truncated_samples_for_the_collator():
    progress = RolloutProgress(total_groups=1, stall_groups=1)
    q = queue_of([make_group(0, size=2, completion_lens=[3, 4], truncated=[False, True])])
    batches = next(iter(pipeline(q, progress, num_processes=1)))
    (micro_batch,) = batches[0].micro_batches
    assert micro_batch["sample_truncated"].tolist() == [False, True]
    assert micro_batch["sample_trained_tokens"].tolist() == [3, 0]
    assert micro_batch["step_trained_tokens"].item() == 3 == micro_batch["token_index"].numel()


# ---------------------------------------------------------------- pending groups and stalls


def test_pending_groups_are_held_until_scoring_trains_or_excludes_them():
    progress = RolloutProgress(total_groups=3, stall_groups=2)
    pending = [make_group(g, size=2, advantages=[math.nan, math.nan]) for g in range(3)]
    batches = next(iter(pipeline(queue_of(pending), progress, num_processes=1)))
    assert batches[0].group_ids == [0, 1, 2]
    assert progress.outstanding() == 0 and progress.stall_run == 0  # held: consumed, stall untouched
    with pytest.raises(ValueError, match=r"groups \[0, 1, 2\] are held for trainer scoring"):
        progress.commit([0, 1, 2])
    progress.train([0])
    progress.exclude(1, "masked")
    progress.exclude(2, "masked")  # completes a stall, but exclude never raises
    progress.commit([0, 1, 2])
    assert progress.trained_total == 1 and progress.excluded == {"masked": 2}
    with pytest.raises(RolloutStop, match=r"2 prompt groups in a row.*\(masked: 2\).*trainer scorers") as stop:
        progress.check()
    assert stop.value.error is not None
    assert progress.state_dict()["frontier"] == 3


def test_held_groups_neither_reset_nor_extend_a_stall():
    progress = RolloutProgress(total_groups=10, stall_groups=3)
    progress.drop(0, "no_signal")
    progress.hold([1])
    progress.drop(2, "stale")
    assert progress.stall_run == 2
    progress.hold([3])
    with pytest.raises(RolloutStop, match=r"3 prompt groups in a row.*\(no_signal: 2, stale: 1\)"):
        progress.drop(4, "no_signal")


@pytest.mark.timeout(60)
def test_stall_completed_by_the_last_steps_exclusions_ends_the_stream_with_the_stall_error():
    """Held groups count as consumed, so the run's end is decided at the look-ahead after the last step, once
    score_step excluded that step's groups: the stop item carries the stall, not a clean end."""
    progress = RolloutProgress(total_groups=2, stall_groups=2)
    pending = [make_group(g, size=2, advantages=[math.nan, math.nan]) for g in range(2)]
    batches = iter(pipeline(queue_of(pending), progress, num_processes=1))
    step = next(batches)
    for group_id in step[0].group_ids:  # score_step masks every sample
        progress.exclude(group_id, "masked")
    stop = next(batches)
    assert (
        stop[0].stop.stalled
        and "2 prompt groups in a row were consumed without one training (masked: 2)" in stop[0].stop.error
    )


@pytest.mark.timeout(60)
def test_stall_raised_while_a_trainable_group_waits_in_the_planner_is_cleared_when_it_trains():
    """Groups 1 and 2 are dropped while group 0 waits in the open step; emitting that step trains it."""
    progress = RolloutProgress(total_groups=4, stall_groups=2)
    groups = [make_group(0), make_group(1, advantages=[0.0] * 4), make_group(2, advantages=[0.0] * 4), make_group(3)]
    run = train_like_lightning(pipeline(queue_of(groups), progress, token_budget=10_000), progress)
    assert run.steps == [[0], [3]] and run.stop.error is None
    assert progress.dropped == {"no_signal": 2}


# ---------------------------------------------------------------- stop items on every rank


@pytest.mark.timeout(60)
def test_stop_reaches_every_rank_as_one_item_and_the_stream_ends_after_it():
    progress = RolloutProgress(total_groups=2, stall_groups=2)
    loader = pipeline(queue_of([make_group(0), make_group(1)]), progress, num_processes=3)
    items = list(loader)  # would hang if the stream read on after the stop
    assert [[b.stop is not None for b in item] for item in items] == [[False] * 3, [True] * 3]
    assert all(b.stop.error is None and not b.stop.stalled for b in items[-1])
    again = list(loader)  # a new epoch re-iterates: the same stop, once
    assert len(again) == 1 and all(b.stop is not None for b in again[0])


@pytest.mark.timeout(60)
def test_rollout_child_death_becomes_a_stop_item_with_the_error_on_every_rank():
    def check_health():
        raise RuntimeError("Rollout worker died (exit code -9)")

    progress = RolloutProgress(total_groups=2, stall_groups=2)
    items = list(pipeline(queue.Queue(), progress, num_processes=2, health_check=check_health))
    assert len(items) == 1 and all(b.stop is not None and not b.stop.stalled for b in items[0])
    for batch in items[0]:
        error = batch.stop.error
        assert "RuntimeError: Rollout worker died (exit code -9)" in error and "Traceback on rank 0" in error


def test_collator_gives_rank_r_row_r_of_every_micro_batch_and_rank_0_the_samples():
    progress = RolloutProgress(total_groups=6, stall_groups=6)
    planner = StepPlanner(
        [make_group(g, size=3) for g in range(6)],
        num_processes=2,
        steps=2,
        token_budget=40,
        samples_per_row=0,
        progress=progress,
    )
    plan = next(iter(planner))
    batches = ProgressCollator(progress, num_processes=2, reward_names=["acc", "missing"])(plan)
    for rank, batch in enumerate(batches):
        assert len(batch.micro_batches) == 2 and batch.group_ids == plan.group_ids
        for m, micro_batch in enumerate(batch.micro_batches):
            row = plan.micro_batches[m][rank]
            assert micro_batch["sample_uid"].tolist() == row.uids
            assert micro_batch["sample_group_id"].tolist() == [d["group_id"] for d in row.samples]
            rewards = micro_batch["rollout_rewards"]
            assert rewards.shape == (len(row.samples), 2) and rewards[:, 1].isnan().all()
            assert rewards[:, 0].tolist() == [d["sample"].metrics["rewards/acc"] for d in row.samples]
    assert batches[0].samples == plan.samples and batches[1].samples == []
    assert "batch/packing_ratio" in batches[0].metrics and "reward" in batches[0].metrics and not batches[1].metrics
    assert progress.consumed == set(plan.group_ids)


def test_a_batcher_that_runs_out_ends_with_a_clean_stop_and_a_collation_error_stops_every_rank():
    items = list(StopAwareDataset(["plan a", "plan b"]))
    assert items[:2] == ["plan a", "plan b"] and isinstance(items[2], RolloutStop) and items[2].error is None
    planner = StepPlanner([make_group(0, size=2)], num_processes=2, steps=1, token_budget=200, samples_per_row=0)
    plan = next(iter(planner))
    plan.micro_batches[0].pop()  # a malformed plan: one row short
    batches = ProgressCollator(num_processes=2)(plan)
    assert len(batches) == 2 and all(b.stop is not None and not b.micro_batches for b in batches)
    assert "1 rows but `ProgressCollator(num_processes=2)`" in batches[1].stop.error


def test_rollout_stop_pickles_with_its_error_and_flags_alone_and_inside_a_stop_item():
    stop = pickle.loads(pickle.dumps(RolloutStop(error="stalled")))
    assert isinstance(stop, RolloutStop) and stop.error == "stalled" and repr(stop) == "RolloutStop(error='stalled')"
    assert pickle.loads(pickle.dumps(RolloutStop())).error is None
    item = pickle.loads(pickle.dumps(StepBatch(stop=RolloutStop("no progress", stalled=True))))
    assert repr(item.stop) == "RolloutStop(error='no progress', stalled=True)" and item.micro_batches == []
    preempted = pickle.loads(pickle.dumps(RolloutStop(preempted=True)))
    assert preempted.preempted and not preempted.stalled and preempted.error is None


# ---------------------------------------------------------------- checkpoint state and resume


def test_state_dict_is_compact_plain_and_loads_with_weights_only():
    progress = RolloutProgress([0, 1], total_groups=10, stall_groups=10)
    progress.drop(2, "stale")
    progress.train([5, 3])
    progress.commit([5])
    progress.drop(7, "no_signal")
    state = progress.state_dict()
    assert state["frontier"] == 3 and state["consumed_above"] == [5, 7]  # 3 trained but not committed
    buffer = io.BytesIO()
    torch.save({"progress": state}, buffer)
    buffer.seek(0)
    restored = RolloutProgress(total_groups=10, stall_groups=10)
    restored.load_state_dict(torch.load(buffer, weights_only=True)["progress"])
    assert restored.consumed == {0, 1, 2, 5, 7} and restored.dropped == {"stale": 1, "no_signal": 1}
    assert restored.trained_total == 1 and restored.stall_run == 1
    older = RolloutProgress(total_groups=10, stall_groups=10)
    older.load_state_dict({"frontier": 4})  # keys added later fall back to defaults
    assert older.consumed == {0, 1, 2, 3} and older.trained_total == 0


def test_progress_rejects_bad_arguments_and_ids_outside_the_run():
    with pytest.raises(ValueError, match=r"RolloutProgress\(total_groups=0, stall_groups=3\)"):
        RolloutProgress(total_groups=0, stall_groups=3)
    progress = RolloutProgress(total_groups=4, stall_groups=4)
    with pytest.raises(ValueError, match=r"group ids \[4\] are outside the run's range\(total_groups=4\)"):
        progress.train([1, 4])
    assert progress.consumed == set()  # checked before anything changed
    with pytest.raises(ValueError, match="never collated"):
        progress.commit([2])


@pytest.mark.timeout(60)
def test_checkpoint_leaves_out_the_looked_ahead_step_and_resume_regenerates_it():
    schedule = GroupSchedule(num_prompts=4)
    progress = RolloutProgress(total_groups=len(schedule), stall_groups=4)
    # a token budget of 12 holds one 2-sample group: one group per step
    loader = pipeline(
        queue_of([make_group(g, size=2) for g in schedule.group_ids()]), progress, num_processes=1, token_budget=12
    )
    first = train_like_lightning(loader, progress, kill_after=1)
    assert first.steps == [[0]]
    assert 1 in progress.consumed  # step 1 was collated (trained) by the look-ahead ...
    assert first.checkpoint["frontier"] == 1 and first.checkpoint["consumed_above"] == []  # ... but not committed

    resumed = RolloutProgress(total_groups=len(schedule), stall_groups=4)
    resumed.load_state_dict(first.checkpoint)
    regenerate = list(schedule.group_ids(skip=resumed.consumed))
    assert regenerate == [1, 2, 3]
    loader = pipeline(queue_of([make_group(g, size=2) for g in regenerate]), resumed, num_processes=1, token_budget=12)
    second = train_like_lightning(loader, resumed)
    assert second.steps == [[1], [2], [3]] and second.stop.error is None


@pytest.mark.timeout(60)
def test_resume_after_every_group_was_consumed_stops_before_any_step():
    progress = RolloutProgress(total_groups=3, stall_groups=3)
    progress.load_state_dict({"frontier": 3, "trained_total": 3})
    run = train_like_lightning(pipeline(queue.Queue(), progress), progress)
    assert run.steps == [] and run.stop.error is None


@st.composite
def runs(draw):
    num_prompts = draw(st.integers(1, 8))
    epochs = draw(st.integers(1, 2))
    n = num_prompts * epochs
    kinds = draw(
        st.lists(st.sampled_from(["train", "train", "constant", "pending", "pending_excluded"]), min_size=n, max_size=n)
    )
    return {
        "schedule": GroupSchedule(num_prompts, epochs=epochs, seed=draw(st.integers(0, 3))),
        "kinds": kinds,
        "size": draw(st.integers(1, 3)),
        "num_processes": draw(st.integers(1, 2)),
        "steps": draw(st.integers(1, 2)),
        "token_budget": draw(st.sampled_from([24, 24, 40, 200])),  # every group fits one row
        "kill_after": draw(st.sampled_from([0, 1, 1, 2, 2, 3])),  # 0: run to the end, resume from its last checkpoint
        "checkpoint_every": draw(st.integers(1, 2)),
        "max_groups_per_step": draw(st.sampled_from([None, 1, 2, 3])),
        "replace_dropped_groups": draw(st.booleans()),  # False: a dropped group's place stays empty
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_resume_after_a_kill_at_any_step_trains_every_group_exactly_once(case):
    schedule, kinds, size = case["schedule"], case["kinds"], case["size"]
    excluded_by_scoring = {g for g, kind in enumerate(kinds) if kind == "pending_excluded"}

    def generate(group_id):
        kind = kinds[group_id]
        advantages = {"constant": [0.0] * size, "pending": [math.nan] * size, "pending_excluded": [math.nan] * size}
        return make_group(group_id, size=size, advantages=advantages.get(kind))

    def score(batches, progress):  # score_step on rank 0: pending groups train or are excluded
        for group_id in batches[0].group_ids:
            if group_id in excluded_by_scoring:
                progress.exclude(group_id, "masked")
            elif kinds[group_id] == "pending":
                progress.train([group_id])

    def run(progress, kill_after=None):
        ids = list(schedule.group_ids(skip=set(progress.consumed)))
        q = queue_of([generate(g) for g in ids])
        names = ("num_processes", "steps", "token_budget", "max_groups_per_step", "replace_dropped_groups")
        options = {k: case[k] for k in names}
        return train_like_lightning(
            pipeline(q, progress, **options),
            progress,
            score=score,
            kill_after=kill_after,
            checkpoint_every=case["checkpoint_every"],
        )

    def new_progress():
        return RolloutProgress(total_groups=len(schedule), stall_groups=len(schedule))

    first = run(new_progress(), kill_after=case["kill_after"] or None)
    resumed = new_progress()
    if first.checkpoint is not None:
        resumed.load_state_dict(first.checkpoint)
    event(f"killed before the end: {first.stop is None}; resumed from a checkpoint: {first.checkpoint is not None}")
    second = run(resumed)

    trainable = [g for g, kind in enumerate(kinds) if kind in ("train", "pending")]
    kept = first.steps[: first.checkpoint_steps]  # what the restored weights trained on
    assert sorted(trained_ids(kept + second.steps, excluded_by_scoring)) == trainable
    assert resumed.consumed == set(range(len(schedule))) and resumed.trained_total == len(trainable)
    assert resumed.dropped.get("no_signal", 0) == kinds.count("constant")
    assert resumed.excluded.get("masked", 0) == len(excluded_by_scoring)
    assert (second.stop.error is not None) == (not trainable)
