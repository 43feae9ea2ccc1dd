"""StepPlanner, GroupedQueue, ScoredRow and check_step_capacity on scripted rollout streams.

Real components throughout: TRL's `TreeRow` packing, `queue.Queue` standing in for the rollout child's mp queue (the
child itself is tested in test_rollout), and `ProgressCollator` for the packed tensors.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.rollouts import make_group, queue_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_grpo.pipeline.collating import ProgressCollator
from lightning_grpo.pipeline.filtering import DroppedGroup
from lightning_grpo.pipeline.grouping import GroupedQueue
from lightning_grpo.pipeline.ledger import RolloutProgress, RolloutStop
from lightning_grpo.pipeline.planner import GroupExtra, ScoredRow, StepPlan, StepPlanner, check_step_capacity
from lightning_grpo.rollout.records import RolloutSample


def real_dicts(plan: StepPlan) -> list[dict]:
    return [d for row in plan.rows for d in row.samples if d["uid"] != -1]


# ---------------------------------------------------------------- GroupedQueue


def test_grouped_queue_releases_interleaved_groups_whole_in_completion_order():
    a, b = make_group(0, size=3), make_group(1, size=2)
    q: queue.Queue = queue.Queue()
    for sample in (a[0], b[0], a[1], b[1], a[2]):
        q.put(sample)
    groups = GroupedQueue(q, poll_interval_s=0.01)
    first, second = groups.get(timeout=1), groups.get(timeout=1)
    assert [s.group_id for s in first] == [1, 1] and first == b
    assert [s.group_id for s in second] == [0, 0, 0] and second == a
    with pytest.raises(queue.Empty):
        groups.get(timeout=0.05)


def test_grouped_queue_calls_health_check_while_waiting_and_raises_its_error():
    calls = []

    def child_died():
        calls.append(time.monotonic())
        if len(calls) >= 3:
            raise RuntimeError("rollout child exited with code -9")

    groups = GroupedQueue(queue.Queue(), health_check=child_died, poll_interval_s=0.01)
    with pytest.raises(RuntimeError, match="exited with code -9"):
        groups.get()  # no timeout: only the health check can end the wait
    assert len(calls) == 3


def test_grouped_queue_holds_a_partial_group_back():
    group = make_group(7, size=3)
    groups = GroupedQueue(queue_of([group[:2]]), poll_interval_s=0.01)
    with pytest.raises(queue.Empty):
        groups.get(timeout=0.05)
    assert groups.partial_groups == 1


def test_grouped_queue_rejects_a_sample_without_group_rows():
    sample = make_group(0, size=1)[0]
    sample.group_rows = 0
    with pytest.raises(ValueError, match="group_rows=0"):
        GroupedQueue(queue_of([[sample]]), poll_interval_s=0.01).get(timeout=0.1)


# ---------------------------------------------------------------- check_step_capacity


def test_check_step_capacity_names_the_knob_for_fixed_count_rows():
    with pytest.raises(ValueError, match=r"needs 3 rows.*steps=1 x num_processes=2.*Raise samples_per_row or steps"):
        check_step_capacity(16, steps=1, num_processes=2, token_budget=0, samples_per_row=6)
    check_step_capacity(16, steps=2, num_processes=2, token_budget=0, samples_per_row=4)


def test_check_step_capacity_rejects_samples_longer_than_the_budget_and_groups_that_cannot_fit():
    with pytest.raises(ValueError, match="does not fit in token_budget=100. Raise token_budget"):
        check_step_capacity(8, 1, 1, 100, 0, max_sample_tokens=101)
    with pytest.raises(ValueError, match=r"needs 4 rows of token_budget=100.*Raise token_budget or steps"):
        check_step_capacity(8, 1, 2, 100, 0, max_sample_tokens=50)
    check_step_capacity(8, 2, 2, 100, 0, max_sample_tokens=50)
    check_step_capacity(64, 1, 1, 100, 0)  # without the sample length nothing can be ruled out


def test_check_step_capacity_lists_every_problem_at_once():
    with pytest.raises(ValueError, match=r"`steps=0`.*`num_processes=0`"):
        check_step_capacity(4, 0, 0, 100, 0)
    with pytest.raises(ValueError, match="samples_per_row=0"):
        check_step_capacity(4, 1, 1, 0, 0)


def test_step_planner_rejects_bad_arguments_with_the_call():
    with pytest.raises(ValueError, match=r"StepPlanner\(num_processes=0, steps=0"):
        StepPlanner([], num_processes=0, steps=0, token_budget=10, samples_per_row=0)


# ---------------------------------------------------------------- ScoredRow


def test_scored_row_without_prefix_sharing_packs_samples_end_to_end():
    group = make_group(0, size=2, completion_lens=[3, 3], seed=1)
    group[1].input_ids = group[0].input_ids.copy()  # identical samples: a trie would share all of them
    shared, plain = ScoredRow(), ScoredRow(share_prefixes=False)
    for i, sample in enumerate(group):
        d = {
            "input_ids": sample.input_ids,
            "completion_mask": sample.completion_mask,
            "old_log_probs": sample.old_log_probs,
            "advantage": sample.advantage,
            "group_id": 0,
            "uid": i,
        }
        assert plain.fits(d, 14) and not (len(plain.tokens) and plain.fits(d, 13))
        shared.add(d)
        plain.add(d)
    assert len(shared.tokens) == 7  # a trie shares identical samples entirely
    assert len(plain.tokens) == 14 and plain.uids == [0, 1]
    packed = plain.pack()
    assert packed["input_ids"].tolist() == group[0].input_ids.tolist() * 2
    assert packed["position_ids"].tolist() == list(range(7)) * 2
    assert packed["token_index"].numel() == 2 * 3 and packed["tree_cu_seqlens_q"].tolist() == [0, 7, 14]


def _as_dict(sample: RolloutSample, uid: int) -> dict:
    return {
        "input_ids": sample.input_ids,
        "completion_mask": sample.completion_mask,
        "old_log_probs": sample.old_log_probs,
        "advantage": sample.advantage,
        "group_id": sample.group_id,
        "uid": uid,
    }


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=8)), min_size=1, max_size=8),
    st.integers(0, 8),
    st.booleans(),
)
def test_scored_row_pop_undoes_add_exactly(specs, pops, share_prefixes):
    dicts = [
        _as_dict(make_group(group_id, size=1, prompt=[1, 2], completion_lens=[len(tokens)])[0], uid)
        for uid, (group_id, tokens) in enumerate(specs)
    ]
    for d, (_, tokens) in zip(dicts, specs, strict=True):
        d["input_ids"] = np.array([1, 2, *tokens])  # tiny vocab: lots of shared prefixes and forks
    row = ScoredRow(share_prefixes)
    for d in dicts:
        row.add(d)
    kept = len(dicts) - min(pops, len(dicts) - 1)
    while len(row.samples) > kept:
        row.pop()
    fresh = ScoredRow(share_prefixes)
    for d in dicts[:kept]:
        fresh.add(d)
    assert (row.tokens, row.load, row.trained, row.groups) == (fresh.tokens, fresh.load, fresh.trained, fresh.groups)
    packed, expected = row.pack(), fresh.pack()
    assert all(torch.equal(packed[key], expected[key]) for key in expected)
    row.add(dicts[-1])  # the popped row keeps working
    fresh.add(dicts[-1])
    assert row.tokens == fresh.tokens and all(torch.equal(row.pack()[k], fresh.pack()[k]) for k in expected)


# ---------------------------------------------------------------- StepPlanner behaviour


def plan_all(groups, **kwargs) -> tuple[StepPlanner, list[StepPlan]]:
    kwargs.setdefault("samples_per_row", 0)
    planner = StepPlanner(groups, **kwargs)
    return planner, list(planner)


def test_group_that_does_not_fit_closes_the_step_and_opens_the_next():
    groups = [make_group(g, size=2) for g in range(5)]  # 2 x 7 tokens each; 4 + 2x3 + 1 unique = 11 per group
    planner, plans = plan_all(groups, num_processes=1, steps=1, token_budget=24)
    assert [plan.group_ids for plan in plans] == [[0, 1], [2, 3], [4]]
    assert all(len(plan.rows[0].tokens) <= 24 for plan in plans)
    assert planner.samples_planned == planner.samples_in == 10


def test_a_duplicate_group_is_planned_once():
    metrics: dict[str, list] = {}
    groups = [make_group(0), make_group(1), make_group(0)]
    planner, plans = plan_all(groups, num_processes=1, steps=1, token_budget=200, metrics=metrics)
    assert [plan.group_ids for plan in plans] == [[0, 1]] and metrics["progress/duplicate_total"] == [1.0]


def test_dropped_groups_keep_their_places_and_a_step_never_goes_out_without_a_group():
    """A `DroppedGroup` counts towards `max_groups_per_step`: the step closes with the groups that remain; places
    alone never emit a step, and the first group after them closes it."""
    dropped = {g: DroppedGroup(g, "no_signal") for g in (1, 3, 4, 5, 8)}
    items = [make_group(0), dropped[1], make_group(2), dropped[3], dropped[4], dropped[5], make_group(6), make_group(7)]
    _, plans = plan_all(items + [dropped[8]], num_processes=1, steps=1, token_budget=200, max_groups_per_step=3)
    assert [plan.group_ids for plan in plans] == [[0, 2], [6], [7]]
    assert [plan.metrics["batch/empty_places_per_step"] for plan in plans] == [1.0, 3.0, 1.0]
    assert [plan.metrics["batch/groups_per_step"] for plan in plans] == [2.0, 1.0, 1.0]
    _, plans = plan_all(items, num_processes=1, steps=1, token_budget=200)  # no cap: places change nothing
    assert [plan.group_ids for plan in plans] == [[0, 2, 6, 7]]
    assert plan_all(list(dropped.values()), num_processes=1, steps=1, token_budget=200, max_groups_per_step=1)[1] == []


def test_group_too_big_for_an_empty_step_is_dropped_as_oversize_and_accounted_for():
    metrics: dict[str, list] = {}
    progress = RolloutProgress(total_groups=3, stall_groups=3)
    groups = [make_group(0, size=2), make_group(1, size=6), make_group(2, size=2)]
    planner = StepPlanner(
        groups, num_processes=1, steps=1, token_budget=0, samples_per_row=4, progress=progress, metrics=metrics
    )
    plans = list(planner)
    assert [plan.group_ids for plan in plans] == [[0, 2]]
    assert progress.dropped == {"oversize": 1} and 1 in progress.consumed
    assert metrics["progress/dropped_oversize_total"] == [1.0]
    assert (planner.samples_in, planner.samples_planned, planner.samples_dropped) == (10, 4, 6)


def test_fewer_samples_than_rows_adds_fillers_that_train_nothing():
    plan = next(
        iter(StepPlanner([make_group(3, size=1)], num_processes=2, steps=2, token_budget=64, samples_per_row=0))
    )
    rows = plan.rows
    assert len(plan.micro_batches) == 2 and all(len(mb) == 2 for mb in plan.micro_batches)
    fillers = [d for row in rows for d in row.samples if d["uid"] == -1]
    assert len(fillers) == 3 and all(len(row.samples) == 1 for row in rows)
    assert all(d["completion_mask"].sum() == 0 and d["sample"] is None and d["advantage"] == 0.0 for d in fillers)
    assert plan.metrics["batch/filler_rows_total"] == 3.0
    batches = ProgressCollator(num_processes=2)(plan)
    filler_rows = [mb for b in batches for mb in b.micro_batches if mb["sample_uid"].tolist() == [-1]]
    assert len(filler_rows) == 3
    assert all(mb["token_index"].numel() == 0 and mb["sample_trained_tokens"].tolist() == [0] for mb in filler_rows)
    assert all(math.isnan(v) for mb in filler_rows for v in mb["rollout_rewards"].flatten().tolist())


def test_empty_rows_are_filled_by_spreading_the_samples_first():
    (plan,) = plan_all([make_group(0, size=4)], num_processes=2, steps=2, token_budget=200)[1]
    assert sorted(len(row.samples) for row in plan.rows) == [1, 1, 1, 1]
    assert all(d["uid"] >= 0 for row in plan.rows for d in row.samples)
    assert plan.metrics["batch/spread_samples_total"] == 3.0 and plan.metrics["batch/filler_rows_total"] == 0.0


def test_group_extras_go_on_a_row_holding_their_group():
    class Reference:
        def group_extras(self, samples):
            return [] if samples[0].group_id == 1 else [f"ref{samples[0].group_id}"]

    groups = [make_group(g, size=3) for g in range(3)]
    (plan,) = plan_all(groups, num_processes=2, steps=1, token_budget=200, scorers=[Reference()])[1]
    placed = {(e.group_id, e.value): row for row in plan.rows for e in row.extras}
    assert set(placed) == {(0, "ref0"), (2, "ref2")}
    for (group_id, _), row in placed.items():
        assert group_id in {d["group_id"] for d in row.samples}
    assert all(isinstance(e, GroupExtra) and e.scorer == 0 and e.index == 0 for row in plan.rows for e in row.extras)


def test_pending_groups_are_listed_and_keep_nan_advantages():
    groups = [make_group(0, size=2, advantages=[math.nan, math.nan]), make_group(1, size=2)]
    (plan,) = plan_all(groups, num_processes=1, steps=1, token_budget=200)[1]
    assert plan.pending_group_ids == [0] and plan.group_ids == [0, 1]
    (batch,) = ProgressCollator(num_processes=1)(plan)
    advantages = batch.micro_batches[0]["advantages"]
    assert advantages.isnan().sum().item() == 2 * 3 and (advantages[~advantages.isnan()].abs() == 1).all()


def test_rows_are_balanced_across_ranks_by_attention_cost():
    # eight single-sample groups of very different lengths, 2 ranks x 2 micro-batches
    groups = [make_group(g, size=1, completion_lens=[n]) for g, n in enumerate([40, 2, 30, 3, 20, 4, 10, 5])]
    (plan,) = plan_all(groups, num_processes=2, steps=2, token_budget=64)[1]
    rank_loads = [sum(mb[r].load for mb in plan.micro_batches) for r in range(2)]
    assert max(rank_loads) / min(rank_loads) < 1.5
    assert plan.metrics["batch/row_imbalance"] >= 1.0


def test_stop_from_the_source_emits_the_partial_step_then_reraises():
    class Source:
        def __init__(self):
            self.items = [make_group(0), make_group(1)]

        def get(self, timeout=None):
            if self.items:
                return self.items.pop(0)
            raise RolloutStop(error="rollout child died")

    planner = StepPlanner(Source(), num_processes=1, steps=1, token_budget=10_000, samples_per_row=0)
    it = iter(planner)
    plan = next(it)
    assert plan.group_ids == [0, 1]
    with pytest.raises(RolloutStop, match="child died"):
        next(it)


@pytest.mark.timeout(30)
def test_last_groups_are_emitted_without_waiting_for_groups_that_never_come():
    """The step is far from full, but the run has no other group left: waiting would deadlock the last step."""
    progress = RolloutProgress(total_groups=3, stall_groups=3)
    q = queue_of([make_group(g) for g in range(3)])
    planner = StepPlanner(
        GroupedQueue(q, poll_interval_s=0.01),
        num_processes=2,
        steps=2,
        token_budget=10_000,
        samples_per_row=0,
        progress=progress,
        poll_interval_s=0.01,
    )
    collate = ProgressCollator(progress, num_processes=2)
    it = iter(planner)
    start = time.monotonic()
    plan = next(it)
    assert plan.group_ids == [0, 1, 2] and time.monotonic() - start < 5
    collate(plan)
    with pytest.raises(RolloutStop) as stop:
        next(it)
    assert stop.value.error is None


@pytest.mark.timeout(30)
def test_planner_waits_for_more_groups_while_the_run_expects_them():
    progress = RolloutProgress(total_groups=4, stall_groups=4)
    q: queue.Queue = queue.Queue()
    planner = StepPlanner(
        GroupedQueue(q, poll_interval_s=0.01),
        num_processes=1,
        steps=1,
        token_budget=10_000,
        samples_per_row=0,
        progress=progress,
        poll_interval_s=0.01,
    )
    for sample in make_group(0) + make_group(1):
        q.put(sample)
    late = threading.Timer(0.3, lambda: [q.put(s) for s in make_group(2) + make_group(3)])
    late.start()
    plan = next(iter(planner))
    late.join()
    assert plan.group_ids == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_max_groups_per_step_keeps_a_paced_rollout_loop_flowing():
    """A producer paced like `GRPORolloutLoop` (admit while admitted - consumed < (max_staleness + 1) * groups_per_step)
    never admits the group a planner without the cap would wait for; with the cap the run completes."""
    groups_per_step, max_staleness, total = 2, 0, 7
    progress = RolloutProgress(total_groups=total, stall_groups=total)
    q: queue.Queue = queue.Queue()
    done = threading.Event()

    def paced_rollout_loop():
        for group_id in range(total):
            while len(progress.consumed) + (max_staleness + 1) * groups_per_step <= group_id:
                if done.wait(0.005):
                    return
            for sample in make_group(group_id):
                q.put(sample)

    producer = threading.Thread(target=paced_rollout_loop, daemon=True)
    producer.start()
    planner = StepPlanner(
        GroupedQueue(q, poll_interval_s=0.01),
        num_processes=1,
        steps=1,
        token_budget=10_000,  # room for every group: only the cap closes a step
        samples_per_row=0,
        progress=progress,
        poll_interval_s=0.01,
        max_groups_per_step=groups_per_step,
    )
    collate = ProgressCollator(progress, num_processes=1)
    steps = []
    try:
        for plan in planner:
            collate(plan)
            steps.append(plan.group_ids)
    except RolloutStop as stop:
        assert stop.error is None
    finally:
        done.set()
        producer.join(5)
    assert steps == [[0, 1], [2, 3], [4, 5], [6]]


# ---------------------------------------------------------------- invariants under generated streams


@st.composite
def streams(draw):
    num_processes = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 3))
    budget_mode = draw(st.booleans())
    token_budget = draw(st.integers(8, 48)) if budget_mode else 0
    samples_per_row = 0 if budget_mode else draw(st.integers(1, 4))
    shared_system = draw(st.booleans())
    groups = []
    for g in range(draw(st.integers(1, 12))):
        size = draw(st.integers(1, 5))
        prompt = ([7, 7, 7] if shared_system else []) + draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))
        lens = draw(st.lists(st.integers(1, 10), min_size=size, max_size=size))
        pending = draw(st.integers(0, 5)) == 0
        advantages = [math.nan] * size if pending else [1.0 - 2 * (i % 2) for i in range(size)]
        groups.append(make_group(g, size=size, prompt=prompt, completion_lens=lens, advantages=advantages, vocab=4))
    return num_processes, steps, token_budget, samples_per_row, groups


class _EveryThirdGroupHasAReference:
    def group_extras(self, samples):
        return ["ref", "alt"] if samples[0].group_id % 3 == 0 else []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_planner_invariants_hold_on_generated_streams(stream):
    num_processes, steps, token_budget, samples_per_row, groups = stream
    planner = StepPlanner(
        groups,
        num_processes=num_processes,
        steps=steps,
        token_budget=token_budget,
        samples_per_row=samples_per_row,
        scorers=[_EveryThirdGroupHasAReference()],
    )
    plans = list(planner)
    seen: Counter[int] = Counter()  # id(sample) -> times planned
    step_of_group: dict[int, int] = {}
    collate = ProgressCollator(num_processes=num_processes, reward_names=["acc"])
    for index, plan in enumerate(plans):
        # exactly `steps` micro-batches of `num_processes` rows, none empty, every budget kept
        assert len(plan.micro_batches) == steps and all(len(mb) == num_processes for mb in plan.micro_batches)
        for row in plan.rows:
            assert row.samples, "empty row"
            if token_budget > 0:
                assert len(row.tokens) <= token_budget and row.trained <= token_budget
            else:
                assert len(row.samples) <= samples_per_row
            for d in row.samples:
                if d["uid"] == -1:  # fillers train nothing, are not scored, and only exist when samples ran out
                    assert d["completion_mask"].sum() == 0 and d["sample"] is None
                    assert len(plan.samples) < steps * num_processes
            for extra in row.extras:
                assert extra.group_id in row.groups
        # uids index the step's sample list; a group never straddles two steps
        dicts = real_dicts(plan)
        assert sorted(d["uid"] for d in dicts) == list(range(len(plan.samples)))
        assert all(plan.samples[d["uid"]] is d["sample"] for d in dicts)
        for d in dicts:
            seen[id(d["sample"])] += 1
            assert step_of_group.setdefault(d["group_id"], index) == index
        assert set(plan.group_ids) == {d["group_id"] for d in dicts}
        assert set(plan.pending_group_ids) == {g for g in plan.group_ids if math.isnan(groups[g][0].advantage)}
        extras = Counter(e.group_id for row in plan.rows for e in row.extras)
        assert extras == {g: 2 for g in plan.group_ids if g % 3 == 0}
        # the collated step counts its loss terms once over all ranks and micro-batches
        batches = collate(plan)
        terms = sum(mb["token_index"].numel() for b in batches for mb in b.micro_batches)
        assert terms == sum(mb["sample_trained_tokens"].sum().item() for b in batches for mb in b.micro_batches)
        assert all(mb["step_trained_tokens"].item() == terms for b in batches for mb in b.micro_batches)
    # every sample it was given is trained exactly once or accounted for (a group too big for a step)
    all_samples = [s for group in groups for s in group]
    assert all(seen[id(s)] in (0, 1) for s in all_samples)
    assert planner.samples_planned == sum(seen.values())
    assert planner.samples_planned + planner.samples_dropped == planner.samples_in == len(all_samples)
    dropped = [g for g, group in enumerate(groups) if seen[id(group[0])] == 0]
    assert sum(len(groups[g]) for g in dropped) == planner.samples_dropped
    for g in dropped:  # only groups that cannot fit a whole step are dropped
        fit, _ = plan_all(
            [groups[g]],
            num_processes=num_processes,
            steps=steps,
            token_budget=token_budget,
            samples_per_row=samples_per_row,
        )
        assert not fit.samples_planned
