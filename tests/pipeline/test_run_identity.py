"""The recorded run identity: which changes a resume refuses (each one named) and which it allows."""

from __future__ import annotations

import pytest

from lightning_grpo.pipeline.run_identity import checked_restore, identity_differences
from lightning_grpo.rollout.schedule import GroupSchedule

RECORDED = {
    "dataset_fingerprint": "abc",
    "dataset_size": 8,
    "epochs": 2,
    "seed": 0,
    "num_generations": 4,
    "groups_per_step": 2,
}


@pytest.mark.parametrize(
    ("field", "now", "named"),
    [
        ("dataset_fingerprint", "def", "dataset (a hash of its prompts in order): abc in the checkpoint, def now"),
        ("dataset_size", 6, "dataset_size: 8 in the checkpoint, 6 now"),
        ("epochs", 1, "epochs: 2 in the checkpoint, 1 now"),
        ("seed", 1, "seed: 0 in the checkpoint, 1 now"),
        ("num_generations", 8, "num_generations: 4 in the checkpoint, 8 now"),
        ("groups_per_step", 1, "groups_per_step: 2 in the checkpoint, 1 now"),
    ],
)
def test_each_recorded_field_changed_is_refused_naming_it_and_the_way_out(field, now, named):
    with pytest.raises(ValueError) as raised:
        checked_restore({"run": RECORDED, "progress": {"frontier": 3}}, RECORDED | {field: now}, allow_changed=False)
    message = str(raised.value)
    assert named in message and "--data.allow_changed_data true" in message and "\n" not in message


def test_raising_epochs_is_allowed_and_the_recorded_group_ids_keep_their_prompts():
    state = {"run": RECORDED, "progress": {"frontier": 3}}
    assert identity_differences(RECORDED, RECORDED | {"epochs": 5}) == []
    assert checked_restore(state, RECORDED | {"epochs": 5}, allow_changed=False) is state  # the ledger is kept
    shorter, longer = GroupSchedule(8, epochs=2, seed=0), GroupSchedule(8, epochs=5, seed=0)
    assert [shorter.prompt_index(g) for g in range(16)] == [longer.prompt_index(g) for g in range(16)]
