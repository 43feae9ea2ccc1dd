"""GroupIdSet, the ledger's compact set of group ids, and memory that stays flat over a long run.

A run consumes every group id once, so a `set` of them (an int object and a table slot an id) grows with every step;
the ledger and the planner keep theirs as a bitmap instead (one bit an id). The memory tests trace Python's allocations
over the second half of a long stretch of groups: with a `set` they grow by tens of kilobytes, with the bitmap by
bytes.
"""

from __future__ import annotations

import copy
import pickle
import tracemalloc
from collections.abc import Callable

import pytest
from helpers.rollouts import make_group
from hypothesis import given
from hypothesis import strategies as st

from lightning_grpo.pipeline.ledger import GroupIdSet, RolloutProgress, RolloutStop
from lightning_grpo.pipeline.planner import StepPlanner

OPERATIONS = st.lists(st.tuples(st.sampled_from(["add", "discard", "clear"]), st.integers(0, 70)), max_size=60)


@given(OPERATIONS)
def test_group_id_set_answers_as_a_set_does(operations):
    ids, reference = GroupIdSet(), set()
    for name, group_id in operations:
        if name == "clear":
            ids.clear(), reference.clear()
        else:
            getattr(ids, name)(group_id), getattr(reference, name)(group_id)
        assert len(ids) == len(reference) and list(ids) == sorted(reference)
    assert ids == reference and reference == ids and ids <= reference | {99}
    assert all((g in ids) == (g in reference) for g in range(-1, 80))
    assert ids.first_missing() == min(set(range(80)) - reference)
    assert (ids - {1, 2}) == reference - {1, 2} and isinstance(ids - {1, 2}, GroupIdSet)


def test_group_id_set_takes_numpy_ids_refuses_negative_ones_and_round_trips():
    np = pytest.importorskip("numpy")
    ids = GroupIdSet([3, np.int64(9), 0])
    assert np.int64(9) in ids and 9 in ids and "9" not in ids and -8 not in ids and 1.5 not in ids
    with pytest.raises(ValueError, match=r"GroupIdSet.add\(-1\).*never negative"):
        ids.add(-1)
    assert pickle.loads(pickle.dumps(ids)) == copy.deepcopy(ids) == {0, 3, 9}
    assert repr(ids) == "GroupIdSet([0, 3, 9])"


LEDGER_STEPS = st.lists(
    st.tuples(st.sampled_from(["train", "commit", "drop", "hold", "exclude"]), st.integers(0, 39)), max_size=80
)


@given(LEDGER_STEPS)
def test_ledger_checkpoints_the_same_with_its_bitmap_as_with_a_shared_set(steps):
    shared: set[int] = set()
    compact, plain = (RolloutProgress(c, total_groups=40, stall_groups=1000) for c in (GroupIdSet(), shared))
    for progress in (compact, plain):
        for verb, group_id in steps:
            try:
                if verb in ("train", "commit", "hold"):
                    getattr(progress, verb)([group_id])
                else:
                    getattr(progress, verb)(group_id, "no_signal")
            except (ValueError, RolloutStop):  # a commit refused (never collated, still held), or the run's end
                pass
    assert compact.state_dict() == plain.state_dict() and compact.consumed == plain.consumed == shared
    restored = RolloutProgress(total_groups=40, stall_groups=1000)
    restored.load_state_dict(compact.state_dict())
    assert restored.state_dict() == compact.state_dict()


def traced_growth_over_second_half(run: Callable[[Callable[[], None]], None]) -> int:
    """Bytes of Python memory that `run(on_half)` holds more at its end than when it called `on_half()`."""
    marks: list[int] = []
    tracemalloc.start()
    try:
        run(lambda: marks.append(tracemalloc.get_traced_memory()[0]))
        return tracemalloc.get_traced_memory()[0] - marks[0]
    finally:
        tracemalloc.stop()


def test_ledger_memory_stays_flat_while_a_long_run_consumes_its_groups():
    total = 20_000
    progress = RolloutProgress(total_groups=total, stall_groups=total)

    def run(on_half):
        for step in range(total // 2):
            if step == total // 4:
                on_half()
            ids = [2 * step, 2 * step + 1]
            progress.train(ids)
            progress.commit(ids)

    grew = traced_growth_over_second_half(run)
    assert len(progress.consumed) == total and progress.outstanding() == 0
    assert grew < 8 * 1024, f"the ledger grew by {grew} bytes over {total // 2} groups"  # a set: about 500 KB


def test_planner_memory_stays_flat_over_many_groups():
    total = 2_000
    groups = (make_group(group_id, size=2) for group_id in range(total))
    planner = StepPlanner(groups, num_processes=1, steps=1, token_budget=0, samples_per_row=4)

    def run(on_half):
        for plan in planner:
            if plan.group_ids[0] == total // 2:
                on_half()

    grew = traced_growth_over_second_half(run)
    assert planner.samples_planned == 2 * total
    assert grew < 8 * 1024, f"the planner grew by {grew} bytes over {total // 2} groups"  # a set: about 30 KB
