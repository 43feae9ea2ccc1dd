"""Multi-node fits on one machine: the same `lightning-grpo fit` started as two "nodes" on localhost, by hand
(`NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `--trainer.num_nodes 2`: Lightning's `LightningEnvironment`) and through
`torchrun --nnodes 2` (its `TorchElasticEnvironment`), each node one CPU process on gloo. Every node is a real process
in its own session; the tests check that the job trains one policy (the same weights on every rank), that only global
rank 0 starts a rollout child, that every prompt group trains exactly once across the job, that every rank ends at the
same step, and that a job killed mid-fit and started again from its checkpoint trains the remaining groups once.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import yaml
from helpers.fit_script import rank_results as results
from helpers.processes import Session, finish_sessions, free_port, kill_sessions, start_session, tails

pytestmark = pytest.mark.slow  # four 2-node jobs of real processes: about three minutes
PROMPTS = 8  # 2 groups per step (one row of one group on each of the 2 ranks): 4 steps


def write_config(out: Path, kill_at: int | None = None) -> Path:
    """The smoke settings on 2 nodes of 1 CPU process, with a checkpoint every step and the step recorder; no group
    can be dropped, so exactly once means every group trains once."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "num_nodes": 2,
            "strategy": "ddp",
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "callbacks": [
                {"class_path": "helpers.fit_probe.StepRecorder", "init_args": {"out": str(out), "kill_at": kill_at}},
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(out / "ckpt"), "every_n_train_steps": 1, "save_top_k": -1},
                },
            ],
        },
        "model": {"model": "tiny-random", "learning_rate": 1.0e-3},
        "data": {
            "dataset": "arithmetic",
            "dataset_size": PROMPTS,
            "val_size": 4,
            "reward_funcs": ["helpers.fit_rewards.char_sum_reward"],  # a signal in every group: none is dropped
            "max_staleness": PROMPTS,  # nor is one too stale: every group trains
            "num_generations": 4,
            "max_completion_length": 8,
            "samples_per_row": 4,
            "heartbeat_timeout": 60,
        },
    }
    path = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def start_nodes(commands: list[list[str]], envs: list[dict], logs: list[Path]) -> list[Session]:
    """Each node's command in its own session (from its log's folder: the CLI writes config.yaml there)."""
    return [
        start_session(command, log=log, cwd=log.parent, env=dict(os.environ, **env))
        for command, env, log in zip(commands, envs, logs, strict=True)
    ]


def by_hand(config: Path, port: int, *extra: str) -> tuple[list[list[str]], list[dict]]:
    """Two `lightning-grpo fit` processes, one per node, as a user starts them on two machines."""
    command = [sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", str(config), *extra]
    envs = [{"NODE_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in (0, 1)]
    return [command, command], envs


def with_torchrun(config: Path, port: int) -> tuple[list[list[str]], list[dict]]:
    """Two `torchrun --nnodes 2 --nproc-per-node 1` agents with a static rendezvous on localhost."""

    def agent(node_rank: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "lightning_grpo.cli", "fit", "--config", str(config),
        ]  # fmt: skip

    return [agent(0), agent(1)], [{}, {}]


def check_one_job(ranks: dict[int, dict]) -> list[int]:
    """The job's ranks trained one policy on the same steps, ended together, and only rank 0 had a rollout child;
    returns the groups trained, in step order."""
    assert set(ranks) == {0, 1}
    assert [ranks[r]["node_rank"] for r in (0, 1)] == [0, 1] and ranks[0]["world_size"] == 2
    assert ranks[0]["ended"] and ranks[1]["ended"]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] > 0
    assert ranks[0]["steps"] == ranks[1]["steps"]  # every rank holds its rows of the same step's groups
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one policy
    assert ranks[0]["rollout_child"] and not ranks[1]["rollout_child"]
    return [g for step in ranks[0]["steps"] for g in step]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("launch", [by_hand, with_torchrun], ids=["node_rank_by_hand", "torchrun"])
def test_two_localhost_nodes_train_one_policy_and_every_group_once(tmp_path, launch):
    config = write_config(tmp_path / "run")
    commands, envs = launch(config, free_port())
    nodes = start_nodes(commands, envs, [tmp_path / "node0.log", tmp_path / "node1.log"])
    assert finish_sessions(nodes, timeout=360) == [0, 0], tails(nodes)
    ranks = results(tmp_path / "run")
    trained = check_one_job(ranks)
    assert sorted(trained) == list(range(PROMPTS)), ranks[0]["steps"]  # every group trained, none twice
    assert ranks[0]["consumed"] == list(range(PROMPTS)) and not ranks[0]["dropped"], ranks[0]


@pytest.mark.timeout(600)
def test_a_two_node_job_killed_mid_fit_and_started_again_trains_the_remaining_groups_once(tmp_path):
    kill_at = 2
    commands, envs = by_hand(write_config(tmp_path / "run1", kill_at=kill_at), free_port())
    first = start_nodes(commands, envs, [tmp_path / "node0.log", tmp_path / "node1.log"])
    try:
        assert first[0].process.wait(timeout=300) == -signal.SIGKILL, tails(first)  # node 0 died at step 3's start
    finally:
        kill_sessions(first)  # the scheduler ends the rest of the job
    killed = results(tmp_path / "run1")
    before = [g for step in killed[0]["steps"][:kill_at] for g in step]
    checkpoint = next((tmp_path / "run1" / "ckpt").glob(f"*step={kill_at}.ckpt"))

    commands, envs = by_hand(write_config(tmp_path / "run2"), free_port(), "--ckpt_path", str(checkpoint))
    resumed = start_nodes(commands, envs, [tmp_path / "resume0.log", tmp_path / "resume1.log"])
    assert finish_sessions(resumed, timeout=360) == [0, 0], tails(resumed)
    after = check_one_job(results(tmp_path / "run2"))
    assert before and after
    assert sorted(before + after) == list(range(PROMPTS)), (before, after)  # every group once across the restart
