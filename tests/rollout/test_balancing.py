"""`GroupRouter`: a group stays on its backend while it is live; a new group goes to the least loaded one."""

from __future__ import annotations

from lightning_grpo.rollout.balancing import GroupRouter


def test_a_group_stays_on_its_backend_and_a_new_one_goes_where_load_is_least():
    router = GroupRouter(2)
    router.inflight[:] = [3, 1]
    assert router.route(7, live=[0, 1]) == 1
    router.inflight[:] = [0, 9]
    assert router.route(7, live=[0, 1]) == 1 and router.route(8, live=[0, 1]) == 0
    assert router.target_of(7) == 1 and router.target_of(9) is None


def test_ties_spread_groups_and_a_group_whose_backend_is_gone_moves_to_a_live_one():
    router = GroupRouter(3)
    assert [router.route(g, live=[0, 1, 2]) for g in range(3)] == [0, 1, 2]  # nothing in flight: one group each
    assert router.route(None, live=[0, 1, 2]) == 0  # a request of no group is routed, not remembered
    assert router.route(1, live=[0, 2]) == 2 and router.target_of(1) == 2  # 0 was given two groups, 2 one
