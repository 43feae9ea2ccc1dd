"""`Trainer.fit` as real processes: 2-rank DDP on CPU (gloo), a dead or hung rollout child, a stall, a SIGKILLed run
resumed from its checkpoint, and Ctrl-C. Each run is `tests/scripts/fit_tiny.py` in its own process session, bounded by a
timeout; the test then checks that no process of that session is left (the rollout child and its reward pool too).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
from helpers.fit_script import all_groups, rank_results, run_fit

#: How much later than its `heartbeat_timeout` a hung rollout child may fail the fit on a loaded 2-core machine: the
#: trainer notices at its next poll (twice a second), and every rank then ends at its next fetch.
HEARTBEAT_SLACK_S = 30.0


def check_each_group_consumed_once(results: dict[int, dict], prompts: int) -> None:
    """Rank 0's ledger holds every group; each trained on one step at most, and those not trained were dropped."""
    trained = all_groups(results)
    assert len(trained) == len(set(trained)), results[0]["steps"]
    assert results[0]["consumed"] == list(range(prompts)), results[0]["consumed"]
    assert len(trained) + sum(results[0]["dropped"].values()) == prompts, (trained, results[0]["dropped"])


@pytest.mark.timeout(300)
def test_ddp_two_ranks_end_together_when_groups_are_consumed(tmp_path):
    code, results = run_fit(tmp_path, "--devices", "2", "--prompts", "8")
    assert code == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert set(results) == {0, 1}
    assert results[0]["error"] is None and results[1]["error"] is None
    assert results[0]["global_step"] == results[1]["global_step"] > 0
    assert results[0]["steps"] == results[1]["steps"]  # same micro-batches, same groups, on both ranks
    check_each_group_consumed_once(results, 8)
    assert results[0]["ended"] and results[0]["weights"] == results[1]["weights"] != ""  # one policy after the fit


@pytest.mark.timeout(300)
def test_ddp_full_pass_without_signal_raises_stall_on_both_ranks(tmp_path):
    code, results = run_fit(tmp_path, "--devices", "2", "--scenario", "stall", "--prompts", "4")
    assert code != 0
    for rank in (0, 1):
        assert results[rank]["error"].startswith("RolloutStallError"), results[rank]
        assert "no_signal" in results[rank]["error"] and "4" in results[rank]["error"]
        assert results[rank]["global_step"] == 0


@pytest.mark.timeout(300)
def test_ddp_steps_with_empty_places_train_on_both_ranks(tmp_path):
    """`replace_dropped_groups=False` on 2 ranks (2 groups a step): the even prompts' groups are dropped, so a step may
    train one group, whose samples are spread over both ranks' rows; both ranks train the same steps to the end. A
    group may also arrive stale on a loaded machine: then it is dropped as stale, whatever its signal."""
    code, results = run_fit(tmp_path, "--devices", "2", "--scenario", "empty_places", "--prompts", "8")
    assert code == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert results[0]["error"] is None and results[1]["error"] is None
    dropped = results[0]["dropped"]
    assert results[0]["steps"] == results[1]["steps"]
    assert set(dropped) <= {"no_signal", "stale"}, dropped
    assert 4 - dropped.get("stale", 0) <= dropped.get("no_signal", 0) <= 4, dropped  # the even prompts' 4 drop
    check_each_group_consumed_once(results, 8)
    assert results[0]["ended"] and results[0]["weights"] == results[1]["weights"] != ""


@pytest.mark.timeout(300)
def test_ddp_rollout_child_killed_mid_run_stops_both_ranks(tmp_path):
    code, results = run_fit(tmp_path, "--devices", "2", "--scenario", "kill_child", "--prompts", "16")
    assert code != 0
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error.startswith("RolloutStreamError") and "killed by signal 9" in error, results[rank]
    assert results[0]["global_step"] == results[1]["global_step"]


@pytest.mark.timeout(400)
def test_ddp_rollout_child_stopped_mid_run_fails_both_ranks_naming_it_within_the_heartbeat_timeout(tmp_path):
    """A rollout child that is alive but makes no progress (SIGSTOP after the first step) fails every rank once its
    heartbeat is `heartbeat_timeout` s old, with an error naming its pid; the stopped child is killed with the run."""
    heartbeat = 10
    try:
        code, results = run_fit(
            tmp_path, "--devices", "2", "--scenario", "stop_child", "--prompts", "16",
            "--heartbeat-timeout", str(heartbeat), timeout=300,
        )  # fmt: skip
    finally:
        stopped = rank_results(tmp_path).get(0, {}).get("stopped_child")
        if stopped:  # run_fit killed its session; a child left behind by a failure must not stay stopped either
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped["pid"], signal.SIGCONT)
                os.kill(stopped["pid"], signal.SIGKILL)
    assert code != 0 and stopped, (tmp_path / "log.txt").read_text()[-3000:]
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error.startswith("RolloutStreamError"), results[rank]
        assert f"(pid {stopped['pid']}) is hung: no heartbeat for" in error and f"(limit {heartbeat} s)" in error
    assert results[0]["global_step"] == results[1]["global_step"] >= 1
    failed_after = results[0]["failed_at"] - stopped["at"]
    assert heartbeat - 1 <= failed_after <= heartbeat + HEARTBEAT_SLACK_S, failed_after


@pytest.mark.timeout(300)
def test_a_fit_sigkilled_while_its_rollout_child_is_stopped_leaves_no_process_behind(tmp_path):
    """The trainer SIGKILLed (no handler runs) while its rollout child is SIGSTOPped (it can run nothing, not even its
    parent-watch thread): the kernel must end the child and its forkserver, as `run_fit` fails on any process of the
    run left `LEFTOVER_GRACE_S` after the trainer."""
    try:
        code, results = run_fit(tmp_path, "--scenario", "stop_child_kill_self", "--prompts", "16", timeout=200)
    finally:
        stopped = rank_results(tmp_path).get(0, {}).get("stopped_child")
        if stopped:  # a child left behind by a failure must not stay stopped after the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped["pid"], signal.SIGCONT)
                os.kill(stopped["pid"], signal.SIGKILL)
    assert code == -signal.SIGKILL and stopped, (tmp_path / "log.txt").read_text()[-3000:]


@pytest.mark.timeout(400)
def test_sigkilled_fit_resumed_from_checkpoint_trains_every_group_exactly_once(tmp_path):
    kill_at, prompts = 2, 8
    code, first = run_fit(
        tmp_path / "run1", "--scenario", "kill_self", "--kill-at", str(kill_at), "--prompts", str(prompts)
    )
    assert code == -signal.SIGKILL
    trained_before = [g for step in first[0]["steps"][:kill_at] for g in step]
    ckpt = next((tmp_path / "run1" / "ckpt").glob(f"*step={kill_at}.ckpt"))
    restored_weights = json.loads((tmp_path / "run1" / f"weights_step{kill_at}.json").read_text())

    code, second = run_fit(tmp_path / "run2", "--scenario", "resume", "--ckpt", str(ckpt), "--prompts", str(prompts))
    assert code == 0, (tmp_path / "run2" / "log.txt").read_text()[-3000:]
    trained_after = all_groups(second)
    # Every group consumed once: trained in one run or the other, none twice, or dropped (a group that finished after
    # a later one can come too late for `max_staleness`: consumed, counted, not trained).
    trained = trained_before + trained_after
    assert len(set(trained)) == len(trained) and second[0]["consumed"] == list(range(prompts))
    assert prompts - len(trained) == sum(second[0]["dropped"].values()), second[0]["dropped"]
    # The resumed run generated with its restored weights: pushed before generation, under the restored version.
    assert second[0]["weights_at_fit_start"] == pytest.approx(restored_weights, rel=1e-12)
    assert min(second[0]["first_versions"]) >= kill_at


@pytest.mark.timeout(300)
def test_ctrl_c_in_a_terminal_ends_the_fit_and_every_process_of_the_run(tmp_path):
    """SIGINT to the whole process group: Lightning shuts down gracefully and exits 1; the rollout child and its
    reward workers, which got the signal too, are gone (run_in_session fails on any process left in the session)."""
    code, results = run_fit(tmp_path, "--scenario", "ctrl_c", "--kill-at", "1", "--prompts", "8", timeout=120)
    log = (tmp_path / "log.txt").read_text()
    assert code == 1, log[-3000:]
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in log
    assert len(results[0]["steps"]) == 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2], ids=["one_rank", "two_ddp_ranks"])
def test_multi_turn_fit_with_an_environment_ends_by_itself_and_validates_its_conversations(
    tmp_path, devices, tool_policy_path
):
    """The policy taught to call `lookup` trains on conversations with `LookupEnv` (reward column `LookupEnv`),
    the run ends when its groups are consumed, and validation holds the same conversations on every rank: the
    ranks' `val/reward` is that of one process validating the same held-out prompts with the fit's final weights
    (greedy, so the same conversations however the prompts are split over ranks)."""
    code, results = run_fit(
        tmp_path / "fit", "--scenario", "tools", "--policy", str(tool_policy_path), "--devices", str(devices),
        "--prompts", "6", "--validate", "--save-final",
    )  # fmt: skip
    assert code == 0, (tmp_path / "fit" / "log.txt").read_text()[-3000:]
    assert set(results) == set(range(devices)) and all(r["error"] is None for r in results.values())
    assert len({r["global_step"] for r in results.values()}) == 1 and results[0]["global_step"] > 0
    assert results[0]["tool_samples"] > 0  # the trained samples are conversations that called the tool
    check_each_group_consumed_once(results, 6)
    assert len({r["weights"] for r in results.values()}) == 1

    final = tmp_path / "fit" / "policy_rank0.pt"
    code, alone = run_fit(
        tmp_path / "alone", "--scenario", "tools", "--policy", str(final), "--prompts", "6", "--validate",
        "--only-validate",
    )  # fmt: skip
    assert code == 0, (tmp_path / "alone" / "log.txt").read_text()[-3000:]
    assert alone[0]["val_reward"] is not None
    for rank in results.values():
        assert rank["val_reward"] == pytest.approx(alone[0]["val_reward"], abs=1e-6), (rank, alone[0])
