"""`Pacing`: groups admitted within `max_staleness` steps of the trainer, a whole step's groups at a time once held."""

from __future__ import annotations

import pytest

from lightning_grpo.rollout.pacing import Pacing


def admitted_until_held(pacing: Pacing, ahead: int) -> int:
    """Admit groups one by one from `ahead` until pacing holds; returns how many it let in."""
    started = ahead
    while pacing.admits(ahead):
        ahead += 1
    return ahead - started


def test_a_full_window_resumes_only_when_a_whole_step_fits():
    pacing = Pacing(groups_per_step=4, max_staleness=2)
    assert admitted_until_held(pacing, 0) == 12  # the window: 3 steps of 4 groups
    for ahead in (11, 10, 9):  # the trainer drops groups one at a time: none starts alone
        assert not pacing.admits(ahead)
    assert admitted_until_held(pacing, 8) == 4  # a whole step's room: its 4 groups start together


def test_a_window_never_filled_admits_one_group_at_a_time():
    pacing = Pacing(groups_per_step=4, max_staleness=2)
    assert pacing.admits(5) and pacing.admits(11)


@pytest.mark.parametrize("held_with", [1, 2, 3])
def test_with_max_staleness_0_one_free_group_resumes_so_an_unfinished_step_gets_its_replacement(held_with):
    """The trainer holds `held_with` groups of its step (not yet committed) and dropped the rest: the window has
    room for a replacement only, which must start, or the step would wait for ever."""
    pacing = Pacing(groups_per_step=4, max_staleness=0)
    assert admitted_until_held(pacing, 0) == 4
    assert pacing.admits(held_with)


def test_one_group_per_step_admits_as_each_is_consumed():
    pacing = Pacing(groups_per_step=1, max_staleness=2)
    assert admitted_until_held(pacing, 0) == 3
    assert pacing.admits(2)


def test_a_group_dropped_early_is_replaced_at_once_though_the_window_waits_for_a_whole_step():
    """The loop found a finished group without signal while the window was full and held: its replacement starts
    now (once per drop), not when the trainer next makes room for a whole step."""
    pacing = Pacing(groups_per_step=4, max_staleness=1)
    assert admitted_until_held(pacing, 0) == 8
    assert not pacing.admits(8)
    pacing.dropped_early()
    assert pacing.admits(8)  # its replacement: 9 admitted, one of them consumed
    assert not pacing.admits(9)  # one drop, one replacement
    for ahead in (8, 7, 6):  # the trainer consumes the step's groups one by one (the dropped one not among them)
        assert not pacing.admits(ahead + 1)
    assert admitted_until_held(pacing, 5) == 4  # a whole step's room, as without the drop


def test_early_drops_count_as_consumed_within_the_window_never_beyond_it():
    pacing = Pacing(groups_per_step=2, max_staleness=1)
    for _ in range(3):
        pacing.dropped_early()
    # 3 dropped of 5 admitted: 2 still count against the window of 4, so 2 more may start (replacements first)
    assert admitted_until_held(pacing, 5) == 2
