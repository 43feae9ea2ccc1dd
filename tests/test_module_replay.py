"""`GRPOModule` under a real `Trainer.fit` on replayed steps (`tests/replay.py`: no rollout child): the trainer's
log-probabilities under the sampler's truncation, the reference model, several updates per step, every loss type."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.replay import fit_replay, planned_steps, replay_steps, tiny_contract
from helpers.tiny import rollout_group

from lightning_grpo.models import tiny_llama
from lightning_grpo.module import GRPOModule
from lightning_grpo.rollout.sampling import process_logits, sample_from_logprobs, teacher_forced_logprobs


class MetricsRecorder:
    """The metrics logged at each optimizer step (a Lightning callback)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class _Recorder(pl.Callback):
            def __init__(self) -> None:
                self.steps: list[dict[str, float]] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})

        return _Recorder()


def sampled_groups(count: int, *, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list:
    """Groups of 4 completions the tiny policy samples under `top_k`/`top_p`, with its log-probabilities under the
    truncated distribution (what the embedded generator reports for weights version 0)."""
    policy = tiny_llama(0)
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(count):
        group = rollout_group(g, 5, [4, 6, 3, 5], seed=seed + g)
        for k, sample in enumerate(group):
            ids = sample.input_ids.tolist()
            for t in range(5, len(ids)):
                with torch.no_grad():
                    logits = policy(input_ids=torch.tensor([ids[:t]])).logits[:, -1]
                ids[t] = int(
                    sample_from_logprobs(process_logits(logits, 1.0, top_k, top_p), torch.rand(1, generator=generator))
                )
            sample.input_ids = np.asarray(ids, dtype=np.int64)
            old = teacher_forced_logprobs(policy, ids[:5], ids[5:], 1.0, top_k, top_p).numpy()
            sample.old_log_probs = np.concatenate([np.zeros(5, np.float32), old]).astype(np.float32)
            sample.advantage = float((-1) ** k) * (0.5 + g)
        groups.append(group)
    return groups


def test_a_truncated_sampling_distribution_is_the_one_the_trainer_scores_so_the_first_ratio_is_one():
    """With `top_k`/`top_p`, the generator's log-probabilities are of the truncated, renormalised distribution. The
    trainer computes its own under the same truncation (from the contract), so an unchanged policy has a ratio of
    exactly 1 instead of the kept probability mass."""
    groups = sampled_groups(2, top_k=20, top_p=0.8)
    steps = [rank[0] for rank in planned_steps([groups])]
    recorder = MetricsRecorder()
    fit_replay(GRPOModule("tiny-random"), steps, tiny_contract(top_k=20, top_p=0.8), callbacks=[recorder])
    assert recorder.steps[0]["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert recorder.steps[0]["sampling/sampling_logp_difference/max"] < 1e-4


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_kl_to_the_reference_is_zero_on_the_first_step_and_grows_after():
    recorder = MetricsRecorder()
    module = GRPOModule("tiny-random", learning_rate=1e-2, beta=0.04)
    fit_replay(module, replay_steps(3), callbacks=[recorder])
    kls = [step["kl"] for step in recorder.steps]
    assert kls[0] == 0.0 and kls[1] > 0 and kls[2] > kls[1], kls


def test_the_reference_mixes_as_tr_dpo_every_ref_model_sync_steps_and_never_otherwise():
    """`sync_ref_model=True`: after every `ref_model_sync_steps`-th optimizer step the reference becomes
    `alpha * policy + (1 - alpha) * reference`, as TRL's `SyncRefModelCallback` does (called here on copies)."""
    import lightning.pytorch as pl
    from trl.trainer.callbacks import SyncRefModelCallback

    class Snapshots(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[tuple[dict, dict]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            reference = {name: value.clone() for name, value in pl_module.reference.named_parameters()}
            self.steps.append((parameters(pl_module.policy), reference))

    snapshots = Snapshots()
    module = GRPOModule("tiny-random", learning_rate=1e-2, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2)
    fit_replay(module, replay_steps(4), callbacks=[snapshots])
    expected = tiny_llama(0)
    for step, (policy, reference) in enumerate(snapshots.steps, start=1):
        if step % 2 == 0:
            current = tiny_llama(0)
            current.load_state_dict(policy, strict=False)  # the tied output layer is the embedding
            SyncRefModelCallback._sync_target_model(current, expected, 0.6)
        for name, value in expected.named_parameters():
            torch.testing.assert_close(reference[name], value.detach(), rtol=0, atol=0, msg=f"step {step}: {name}")
    assert module.reference.mixed


def test_a_mixed_reference_is_checkpointed_and_restored_and_the_initial_one_is_not(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_grpo.training.checkpoint import REFERENCE_KEY

    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    module = GRPOModule("tiny-random", learning_rate=1e-2, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2)
    fit_replay(module, replay_steps(3), callbacks=[checkpoints], enable_checkpointing=True)
    saved = {int(path.stem.split("step=")[1]): torch.load(path, weights_only=False) for path in tmp_path.glob("*.ckpt")}
    assert sorted(saved) == [1, 2, 3]
    assert REFERENCE_KEY not in saved[1]  # still the initial policy: rebuilt from it on resume
    assert saved[2][REFERENCE_KEY]["mixed"] and REFERENCE_KEY in saved[3]

    import lightning.pytorch as pl

    class AtStart(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.reference = {name: value.clone() for name, value in pl_module.reference.named_parameters()}

    at_start = AtStart()
    resumed = GRPOModule("tiny-random", learning_rate=1e-2, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2)
    fit_replay(resumed, replay_steps(1), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"), callbacks=[at_start])
    for name, value in saved[2][REFERENCE_KEY]["parameters"].items():
        torch.testing.assert_close(at_start.reference[name], value, rtol=0, atol=0)
    assert resumed.reference.mixed


def test_num_iterations_steps_the_optimizer_and_schedule_that_often_and_pushes_after_each_batch():
    """Two updates per planned step: the learning-rate warm-up advances per optimizer step, each step's groups are
    committed once, and a `WeightSyncCallback(every_n_steps=3)` pushes after every batch that reached a multiple of
    3 (batches end at steps 2, 4, 6: pushes after the second and the third)."""
    from lightning_grpo.callbacks import WeightSyncCallback

    recorder = MetricsRecorder()
    module = GRPOModule("tiny-random", learning_rate=1e-2, num_iterations=2, warmup_steps=4)
    source = fit_replay(module, replay_steps(3), callbacks=[recorder, WeightSyncCallback(every_n_steps=3)])
    assert module.trainer.global_step == 6 and len(source.finished) == 3
    # the rate of each planned step's first update (after 0, 2, 4 optimizer steps): the warm-up starts at 1/5 of the
    # rate and adds 1/5 per optimizer step
    assert [step["lr"] for step in recorder.steps] == pytest.approx([1e-2 / 5, 1e-2 * 3 / 5, 1e-2])
    assert len(source.transfer.sent) == 1 + 2  # the push at the start, then after batches 2 and 3


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_fused_adamw_steps_on_gradients_clipped_to_max_grad_norm(precision):
    """The default AdamW is fused; Lightning's mixed-precision plugin refuses to clip for a fused optimizer, so the
    module clips itself where there is no gradient scaler: the optimizer steps on gradients of norm `max_grad_norm`."""
    import lightning.pytorch as pl

    class GradientNorms(pl.Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    norms = GradientNorms()
    module = GRPOModule("tiny-random", learning_rate=1e-3, max_grad_norm=1e-3)
    fit_replay(module, replay_steps(2), precision=precision, callbacks=[norms])
    assert module.optimizers().optimizer.defaults["fused"]
    assert norms.norms == pytest.approx([1e-3, 1e-3], rel=1e-3)


def test_under_bf16_autocast_each_of_num_iterations_updates_forwards_the_weights_it_updated():
    """Lightning runs the whole `training_step` (every update of `num_iterations`) in one autocast region: were the
    weights' bf16 copies cached for the region (torch's default; Lightning's plugin turns it off), the later updates
    would forward the first one's weights."""
    seen: list[bool] = []

    def check_fresh(head: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if head.training and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                fresh = torch.nn.functional.linear(inputs[0].to(torch.bfloat16), head.weight.to(torch.bfloat16))
            seen.append(torch.equal(output, fresh))

    class HookHead(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            pl_module.policy.lm_head.register_forward_hook(check_fresh)

    module = GRPOModule("tiny-random", learning_rate=1e-2, num_iterations=2)
    fit_replay(module, replay_steps(2), precision="bf16-mixed", callbacks=[HookHead()])
    assert module.trainer.global_step == 4
    assert len(seen) == 4 and all(seen), seen  # two updates of two planned steps, each on the current weights


def test_num_iterations_stops_at_max_steps():
    module = GRPOModule("tiny-random", learning_rate=1e-2, num_iterations=2)
    source = fit_replay(module, replay_steps(3), max_steps=3)
    assert module.trainer.global_step == 3 and len(source.finished) == 2


@pytest.mark.parametrize(
    "options",
    [{"loss_type": loss_type} for loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]]
    + [
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "dapo", "vllm_importance_sampling_correction": True, "num_iterations": 2},
        {"loss_type": "dapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01, "off_policy_mask_threshold": 1.0},
    ],
    ids=lambda options: "-".join(f"{k}={v}" for k, v in options.items()),
)
def test_a_fit_ends_by_itself_for_every_loss_type(options):
    recorder = MetricsRecorder()
    module = GRPOModule("tiny-random", learning_rate=1e-3, **options)
    source = fit_replay(module, replay_steps(2, micro_batches=2), callbacks=[recorder])
    assert len(source.finished) == 2 and source.stream_stop() is not None
    assert module.trainer.global_step == 2 * options.get("num_iterations", 1)
    assert all(np.isfinite(step["loss"]) for step in recorder.steps)
