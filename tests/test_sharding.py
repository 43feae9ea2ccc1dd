"""Sharded training: FSDP2 under `ModelParallelStrategy` on 2 CPU processes (gloo) trains one policy, equal to a
1-process run on the same steps, keeps the generator on the trained weights, ends by itself and resumes; strategies
that would not synchronise gradients are refused at start-up.

The 2-process runs are `tests/scripts/fit_tiny.py` in their own process session (see `test_fit_processes.py`); the
1-process run replays their recorded micro-batches through a real `Trainer.fit` of `GRPOModule`, fed by
`ReplaySource`, a second implementation of `lightning_grpo.RolloutSource`.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_fit_processes import all_groups, run_fit
from test_weight_sync import RecordingTransfer
from tiny_fits import cpu_trainer
from torch.utils.data import DataLoader

from lightning_grpo import GRPOModule, RolloutContract, RolloutSource
from lightning_grpo.models import char_tokenizer
from lightning_grpo.pipeline.batch import StepBatch
from lightning_grpo.sharding import check_strategy
from lightning_grpo.weights.parameters import generator_parameters
from lightning_grpo.weights.sync import WeightSync

FSDP2 = ("--devices", "2", "--strategy", "fsdp2", "--max-staleness", "0", "--record", "--prompts", "8")


class ReplaySource(pl.LightningDataModule):
    """Replays recorded steps to `GRPOModule` on one process: the whole `RolloutSource` protocol, nothing spawned."""

    def __init__(self, steps: list[StepBatch], contract: RolloutContract) -> None:
        super().__init__()
        self.steps = steps
        self.contract = contract
        self.transfer = RecordingTransfer()
        self.weight_sync = WeightSync(self.transfer)
        self.progress = None
        self.process_group = None
        self.finished: list[list[int]] = []
        self._stop: StepBatch | None = None

    def rollout_contract(self) -> RolloutContract:
        return self.contract

    def train_dataloader(self) -> DataLoader:
        self.weight_sync.push(self.trainer.lightning_module.policy)
        return DataLoader(self.steps, batch_size=None, collate_fn=lambda step: step)

    def finish_step(self, batch: StepBatch, *, look_ahead: bool) -> StepBatch | None:
        self.finished.append(batch.group_ids)
        if look_ahead and len(self.finished) == len(self.steps):
            self._stop = StepBatch.stop_item()
        return self._stop

    def stream_stop(self) -> StepBatch | None:
        return self._stop

    def rollout_metrics(self) -> dict[str, float]:
        return {}

    def progress_summary(self) -> None:
        return None

    def score_completions(self, completions, rows):
        raise AssertionError("the replay has no validation")


def one_process_steps(run_dirs: list[Path]) -> list[StepBatch]:
    """Each recorded 2-rank step as one rank's step: rank 0's and rank 1's micro-batches, interleaved."""
    steps = []
    for run in run_dirs:
        per_rank = [torch.load(run / f"steps_rank{r}.pt") for r in (0, 1)]
        for rank0, rank1 in zip(*per_rank, strict=True):
            micro_batches = [mb for pair in zip(rank0, rank1, strict=True) for mb in pair]
            steps.append(StepBatch(micro_batches=micro_batches, group_ids=[len(steps)]))
    return steps


def replay(steps: list[StepBatch]) -> tuple[dict[str, torch.Tensor], ReplaySource]:
    """The weights after training fit_tiny.py's module on `steps` in one process (same options, same initial weights)."""
    contract = RolloutContract(
        tokenizer=char_tokenizer(),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=8,
        reward_names=("char_sum_reward",),
        reward_weights=(1.0,),
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards="group",
        mask_truncated_completions=False,
    )
    source = ReplaySource(steps, contract)
    module = GRPOModule("tiny-random", learning_rate=1e-3)
    cpu_trainer().fit(module, datamodule=source)
    return dict(generator_parameters(module.policy)), source


@pytest.mark.timeout(400)
def test_fsdp2_on_two_cpu_ranks_trains_one_policy_equal_to_one_process_and_resumes(tmp_path):
    code, first = run_fit(tmp_path / "a", *FSDP2, "--scenario", "checkpoint", "--max-steps", "2")
    assert code == 0, (tmp_path / "a" / "log.txt").read_text()[-3000:]
    assert first[0]["global_step"] == first[1]["global_step"] == 2
    checkpoint = next((tmp_path / "a" / "ckpt").glob("*step=2.ckpt"))  # a distributed checkpoint (a folder)

    code, second = run_fit(tmp_path / "b", *FSDP2, "--scenario", "resume", "--ckpt", str(checkpoint), "--validate")
    assert code == 0, (tmp_path / "b" / "log.txt").read_text()[-3000:]
    assert second[0]["error"] is None and second[1]["error"] is None  # it ended by itself ...
    assert second[0]["val_reward"] is not None  # ... and validated (a sharded greedy generate on both ranks)
    assert sorted(all_groups(first) + all_groups(second)) == list(range(8))  # every group once across the resume

    # One policy: both ranks hold the same full weights.
    final = [torch.load(tmp_path / "b" / f"final_rank{r}.pt") for r in (0, 1)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])
    # The generator sampled with the weights the trainer had at each step (max_staleness=0, after every push).
    errors = first[0]["logprob_errors"] + second[0]["logprob_errors"]
    assert len(errors) == second[0]["global_step"] and max(errors) <= 1e-4, errors

    # The same steps on one process (through the checkpoint's optimizer state) give the same weights.
    replayed, source = replay(one_process_steps([tmp_path / "a", tmp_path / "b"]))
    assert replayed.keys() == final[0].keys()
    initial = dict(generator_parameters(_tiny_policy()))
    moved = max((final[0][name] - initial[name]).abs().max().item() for name in final[0])
    difference = max((final[0][name] - replayed[name]).abs().max().item() for name in final[0])
    assert moved > 1e-3 and difference <= 1e-6, (difference, moved)
    assert source.transfer.sent_versions == [None] * (len(source.steps) + 1)  # TRL's protocol carries no version


def _tiny_policy() -> torch.nn.Module:
    from lightning_grpo.models import tiny_llama

    return tiny_llama(seed=0)


@pytest.mark.timeout(200)
def test_model_parallel_with_a_tensor_parallel_mesh_is_refused_at_start_up_on_every_rank(tmp_path):
    """`ModelParallelStrategy()`'s default mesh on 2 devices is tensor-parallel: every rank would train its own
    rows without the other's gradients. It must fail before anything is generated, naming the fix."""
    code, results = run_fit(tmp_path, "--devices", "2", "--strategy", "fsdp2_tp", "--prompts", "4")
    assert code != 0
    for rank in (0, 1):
        error = results[rank]["error"]
        assert "tensor_parallel_size=2" in error and "data_parallel_size=2, tensor_parallel_size=1" in error, error
        assert results[rank]["global_step"] == 0


def test_a_multi_process_strategy_that_does_not_reduce_gradients_is_refused():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    with pytest.raises(ValueError, match=r"SingleDeviceStrategy` on 2 processes does not reduce.*strategy='ddp'"):
        check_strategy(SingleDeviceStrategy(device="cpu"), world_size=2)
    check_strategy(SingleDeviceStrategy(device="cpu"), world_size=1)  # one process needs nothing


def test_grpo_module_and_data_module_implement_the_contract():
    from lightning_grpo import GRPODataModule
    from lightning_grpo.contract import PolicySource

    assert isinstance(GRPODataModule(model="tiny-random"), RolloutSource)
    assert isinstance(ReplaySource([], None), RolloutSource)
    assert isinstance(GRPOModule(_tiny_policy()), PolicySource)
