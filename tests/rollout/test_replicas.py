"""`generator_replicas=N`: N real embedded-generator processes on the tiny model, each pinned to one core of this
2-core machine: each group sampled on one replica by the weights its version names (on both replicas), a fit that
trains on both, a replica killed mid-fit failing the run with its name, and no process left behind.

Nothing is faked: the replicas are real processes fed by the real rollout child, weights go through the real
shared-memory block, and the fits are real `Trainer.fit`s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import lightning.pytorch as pl
import psutil
import pytest
from helpers.fit_rewards import char_count_reward
from helpers.rollouts import check_sampled_by, groups_per_version
from helpers.tiny import cpu_trainer
from helpers.tiny import tiny_prompts as prompts

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.balancing import current_group
from lightning_grpo.rollout.generator import GeneratorSpec, PolicySpec
from lightning_grpo.rollout.records import GENERATOR_REPLICA
from lightning_grpo.rollout.replicas import WATCH_S, GeneratorReplicasSpec, replica_cores
from lightning_grpo.rollout.worker import GRPORolloutWorker
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer
from lightning_grpo.weights.sync import WeightSync

MODEL = "tiny-random"
HEARTBEAT_S = 120.0  # the fits' heartbeat_timeout: a silent replica is lost after half of it


def replica_processes(worker: GRPORolloutWorker) -> dict[int, psutil.Process]:
    """The rollout child's replica processes by index (their command line ends `<fd> <parent pid> <index> <path>`)."""
    replicas = {}
    for process in psutil.Process(worker.pid).children(recursive=True):
        args = process.cmdline()
        if any("replica_main" in arg for arg in args):
            replicas[int(args[5])] = process
    return replicas


# -- no process needed ------------------------------------------------------------------------------------------------


def test_each_replica_gets_its_own_run_of_cores_or_none_when_they_do_not_go_round():
    assert replica_cores(2, 1, [0, 1]) == (1, [[0], [1]])
    assert replica_cores(2, None, list(range(8))) == (4, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert replica_cores(3, 1, [0, 1]) == (1, [[], [], []])  # three replicas on two cores share them, unpinned


def test_bad_replica_options_are_named_with_the_fix():
    from lightning_grpo import GRPODataModule

    with pytest.raises(ValueError, match=r"generator_replicas=0 \(an int >= 1"):
        GRPODataModule(model=MODEL, generator_replicas=0)
    with pytest.raises(
        ValueError, match=r"generator_replicas=2 with generator='vllm'.*list their URLs in vllm_server_url"
    ):
        GRPODataModule(model=MODEL, generator="vllm", generator_replicas=2)
    with pytest.raises(ValueError, match=r"replicas=1\)` must be an int >= 2"):
        GeneratorReplicasSpec(GeneratorSpec(MODEL), 1)


# -- real replicas ----------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_replica_that_goes_silent_fails_every_later_request_naming_it(no_leaked_processes):
    """Two replicas of the named tiny model, built here: a request the replica refuses raises its ValueError; then
    replica 1 is stopped (SIGSTOP) and, once it has sent no heartbeat for `stale_after_s`, requests fail naming it."""
    replicas = GeneratorReplicasSpec(GeneratorSpec(MODEL, max_tokens=4, num_threads=1), 2, stale_after_s=2).build()
    silenced = replicas.replicas[1].process

    async def on_group(group_id: int, prompt: list[int]):
        current_group.set(group_id)
        return await replicas.generate(prompt)

    async def two_groups():
        return await asyncio.wait_for(asyncio.gather(on_group(0, [2, 40]), on_group(1, [2, 41])), 120)

    try:
        outputs = asyncio.run(two_groups())
        for output in outputs:  # 4 tokens, or fewer ending at the tiny model's EOS (id 3; sampling is unseeded)
            assert len(output.token_ids) == 4 or (0 < len(output.token_ids) < 4 and output.token_ids[-1] == 3)
        assert {replicas.replica_of(0), replicas.replica_of(1)} == {0, 1}
        with pytest.raises(ValueError, match="Generator replica 0: .*outside the model's vocabulary"):
            asyncio.run(on_group(0, [10**6]))
        os.kill(silenced.pid, signal.SIGSTOP)
        time.sleep(2 + 3 * WATCH_S)
        with pytest.raises(RuntimeError, match=rf"Generator replica 1 of 2 \(pid {silenced.pid}, cores 1\) sent no "):
            asyncio.run(on_group(2, [2, 42]))
    finally:
        os.kill(silenced.pid, signal.SIGCONT)
        replicas.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_group_is_sampled_on_one_replica_by_the_weights_its_version_names(tokenizer, no_leaked_processes):
    """Pacing admits two groups per version (`max_staleness=0`); the test publishes a new version before it lets
    the next two in. Each group has one version and one replica, every sample matches a teacher-forced forward of
    the weights its version names (so neither replica sampled a group of version v before it held v's weights), both
    replicas served groups, and each ran pinned to a core of its own."""
    models = [tiny_llama(seed=seed) for seed in (0, 1, 2)]
    sync = WeightSync(SharedMemoryWeightTransfer(models[0]))
    sync.push(models[0])
    spec = GeneratorSpec(
        PolicySpec.from_model(models[0]), temperature=0.7, max_tokens=24, eos_token_ids=[tokenizer.eos_token_id],
        weight_receiver=sync.receiver(), num_threads=1,
    )  # fmt: skip
    worker = GRPORolloutWorker(
        model_name=MODEL, dataset=prompts(6), reward_funcs=[char_count_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], num_generations=4, max_inflight_tasks=8, max_tokens=24,
        temperature=0.7, reward_num_workers=0, epochs=1, shuffle=False, groups_per_step=2, max_staleness=0,
        generator=GeneratorReplicasSpec(spec, 2), child_ready_timeout=300,
    )  # fmt: skip
    try:
        worker.start()
        sync.on_version(worker.update_model_version)
        pinned = {index: p.cpu_affinity() for index, p in replica_processes(worker).items()}
        groups = groups_per_version(worker, sync, models)
    finally:
        worker.stop()
        kept = os.path.exists(f"/dev/shm/{sync.transfer.block_name}")  # no replica's exit unlinked the trainer's block
        sync.close()
    assert pinned == {0: [0], 1: [1]} and kept
    assert sorted(groups) == list(range(6))
    replicas = {}
    for group_id, samples in groups.items():
        [version] = {sample.model_version for sample in samples}
        [replicas[group_id]] = {sample.extras[GENERATOR_REPLICA] for sample in samples}
        assert version == group_id // 2
        check_sampled_by(samples, models[version], temperature=0.7)
    assert set(replicas.values()) == {0, 1}, replicas
    # each version's two groups were admitted together onto idle replicas: one on each
    assert all({replicas[2 * v], replicas[2 * v + 1]} == {0, 1} for v in range(3)), replicas


class _StepSamples(pl.Callback):
    """Each trained group's replicas and versions, and the trainer's version when it trained."""

    def __init__(self) -> None:
        self.groups: dict[int, tuple[set[int], set[int], int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trained_at = trainer.datamodule.weight_sync.version
        for sample in batch.samples:
            replicas, versions, _ = self.groups.setdefault(sample.group_id, (set(), set(), trained_at))
            replicas.add(sample.extras[GENERATOR_REPLICA])
            versions.add(sample.model_version)


class _KillReplica(pl.Callback):
    """SIGKILLs replica `index` of the rollout child after optimizer step `at_step`."""

    def __init__(self, index: int, at_step: int = 1) -> None:
        self.index, self.at_step = index, at_step
        self.killed_at: float | None = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step and self.killed_at is None:
            replica_processes(trainer.datamodule.rollout_worker)[self.index].kill()
            self.killed_at = time.monotonic()


def fit_parts(tmp_path, callbacks, **options):
    from lightning_grpo import GRPODataModule, GRPOModule

    datamodule = GRPODataModule(
        model=MODEL, dataset=prompts(8), reward_funcs=[char_count_reward], num_generations=4,
        max_completion_length=8, samples_per_row=4, heartbeat_timeout=HEARTBEAT_S, generator_replicas=2,
        reward_num_workers=0, **options,
    )  # fmt: skip
    trainer = cpu_trainer(callbacks=list(callbacks), default_root_dir=tmp_path)
    return trainer, GRPOModule(MODEL, learning_rate=1e-3), datamodule


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="each replica is pinned to a core of its own")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fit_with_two_replicas_trains_every_group_once_each_from_one_replica(tmp_path, no_leaked_processes):
    """A real fit on two replicas: every group trained once, each sampled on one replica by one version no newer
    than the trainer's, both replicas used, and some groups sampled by weights the fit pushed."""
    recorder = _StepSamples()
    # Groups without signal train here: dropped, they would not reach the recorder, and whether the groups a
    # replica sampled all score alike is chance (the tiny model's completions are often all 8 tokens long).
    trainer, module, datamodule = fit_parts(tmp_path, [recorder], drop_no_signal_groups=False)
    trainer.fit(module, datamodule=datamodule)
    progress = datamodule.progress
    assert progress.trained_total + sum(progress.dropped.values()) == 8
    assert set(progress.dropped) <= {"stale"}, progress.dropped
    assert recorder.groups and all(
        len(replicas) == 1 and len(versions) == 1 for replicas, versions, _ in recorder.groups.values()
    )
    by_replica = {}
    for (replica,), (version,), trained_at in recorder.groups.values():
        assert version <= trained_at
        by_replica.setdefault(replica, set()).add(version)
    # The router gives the second group to replica 1 whatever the timing (the fewest in flight, then the fewest
    # groups given), so only a stale drop of every group it sampled could leave it out.
    assert sorted(by_replica) == [0, 1], (by_replica, progress.dropped)
    # Pushed weights were sampled with. Which replica sampled which version depends on timing; that each replica
    # samples by the weights its tag names is the deterministic test above.
    assert max(max(versions) for versions in by_replica.values()) > 0, by_replica


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="each replica is pinned to a core of its own")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replica_killed_mid_fit_fails_it_naming_the_replica(tmp_path, no_leaked_processes):
    killed = _KillReplica(1)
    trainer, module, datamodule = fit_parts(tmp_path, [killed], epochs=3)
    # "died" when its watcher sees the exit first, "could not be reached" when a request to it fails first
    lost = r"(died|could not be reached) \(killed by SIGKILL\)"
    with pytest.raises(RuntimeError, match=rf"Generator replica 1 of 2 \(pid \d+, cores 1\) {lost}"):
        trainer.fit(module, datamodule=datamodule)
    assert killed.killed_at is not None and time.monotonic() - killed.killed_at < HEARTBEAT_S
