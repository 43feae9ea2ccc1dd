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
