"""Sharded training: FSDP2 under `ModelParallelStrategy` on 2 CPU processes (gloo) trains one policy, equal to a
1-process run on the same steps (with a reference model, sharded, mixed by TR-DPO and resumed from the checkpoint),
keeps the generator on the trained weights, ends by itself and resumes; strategies that would not synchronise
gradients, and FSDP1 and DeepSpeed (untested here: torch runs FSDP1 on GPUs only, DeepSpeed is not installed),
are refused at start-up.

The 2-process runs are `tests/scripts/fit_tiny.py` in their own process session (see `test_fit_processes.py`); the
1-process run replays their recorded micro-batches through a real `Trainer.fit` of `GRPOModule`, fed by
`ReplaySource` (tests/replay.py), a second implementation of `lightning_grpo.RolloutSource`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fit_script import all_groups, run_fit
from helpers.replay import ReplaySource, fit_replay, tiny_contract

from lightning_grpo import GRPOModule, RolloutSource
from lightning_grpo.pipeline.batch import StepBatch
from lightning_grpo.training.sharding import check_strategy
from lightning_grpo.weights.parameters import generator_parameters

# with a reference model mixed every step (TR-DPO): sharded like the policy, mixed shard by shard, checkpointed
REFERENCE = {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1}
FSDP2 = (
    *("--devices", "2", "--strategy", "fsdp2", "--max-staleness", "0", "--record", "--prompts", "8"),
    *("--beta", str(REFERENCE["beta"]), "--ref-sync-steps", str(REFERENCE["ref_model_sync_steps"])),
)


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
    module = GRPOModule("tiny-random", learning_rate=1e-3, **REFERENCE)
    source = fit_replay(module, steps, tiny_contract())
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
    # The two runs sum the same gradients in another order (a gloo reduce-scatter vs one process's accumulation);
    # Adam divides by the gradients' own scale, so fp32 rounding reaches the weights at ~1e-6. A rank that kept its
    # own gradients would differ by about the learning rate (1e-3) per step.
    assert moved > 1e-3 and difference <= 1e-5, (difference, moved)
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


@pytest.mark.timeout(200)
def test_fsdp1_is_refused_at_start_up_on_every_rank_naming_what_works(tmp_path):
    """FSDP1 (Lightning's `FSDPStrategy`, here a subclass that gets past Lightning's GPU-only check) is refused
    before the policy is wrapped or anything is generated: torch runs FSDP1 on GPUs only, where this module's manual
    optimization is untested."""
    code, results = run_fit(tmp_path, "--devices", "2", "--strategy", "fsdp1", "--prompts", "4")
    assert code != 0
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error.startswith("ValueError: `FSDPStrategy (FSDP1)` is not supported by GRPOModule"), error
        assert (
            "strategy='ddp'" in error and "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)" in error
        )
        assert results[rank]["global_step"] == 0


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["fsdp1", "deepspeed"])
def test_fsdp1_and_deepspeed_are_refused_in_one_line_naming_what_works(kind, world_size):
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    # DeepSpeed is not installed here, and its strategy refuses to be built without it: the check reads the type only
    strategy = FSDPStrategy() if kind == "fsdp1" else DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    with pytest.raises(ValueError, match="is not supported by GRPOModule") as refused:
        check_strategy(strategy, world_size=world_size)
    message = str(refused.value)
    assert "\n" not in message and ("FSDP1" in message if kind == "fsdp1" else "DeepSpeedStrategy" in message)
    assert (
        "strategy='ddp'" in message and "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)" in message
    )


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
