"""GRPOModule + GRPODataModule under a real `Trainer.fit` on CPU, with the tiny model and a real rollout child."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers.learning_rates import learning_rates
from helpers.tiny import cpu_trainer, tiny_datamodule, tiny_prompts

from lightning_grpo.module import GRPOModule
from lightning_grpo.rollout.loop import GRPORolloutLoop
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer


class StrictSharedMemory(SharedMemoryWeightTransfer):
    """The embedded generator's transfer, refusing a send before `init_weight_transfer()` (as TRL's NCCL client
    effectively does) and recording each push's version."""

    calls: list[str] = []
    versions: list[int] = []

    def init_weight_transfer(self) -> None:
        self.calls.append("init")
        self.initialised = True
        super().init_weight_transfer()

    def send_weights(self, iterator, version=None) -> None:
        assert getattr(self, "initialised", False), "send_weights before init_weight_transfer"
        self.calls.append("send")
        self.versions.append(version)
        super().send_weights(iterator, version=version)


@pytest.mark.timeout(240)
def test_fit_ends_by_itself_when_groups_are_consumed(tmp_path, no_leaked_processes):
    """Also: the weight transfer passed as `weight_transfer` (built from the policy at the first push) is initialised
    once, before the first send, and every push publishes the next version; the progress bar (drawn as in a
    terminal) counts prompt groups: its total is the run's, its count the consumed ones."""
    from lightning_grpo.callbacks import GRPOProgressBar

    datamodule = tiny_datamodule(6, epochs=1, gradient_accumulation_steps=2, weight_transfer=StrictSharedMemory)
    bar = GRPOProgressBar(lines=False)
    trainer = cpu_trainer(default_root_dir=tmp_path, enable_progress_bar=True, callbacks=[bar])
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    assert trainer.global_step == 3
    assert datamodule.progress.trained_total + sum(datamodule.progress.dropped.values()) == 6
    assert bar.train_progress_bar.total == 6 and bar.train_progress_bar.n == len(datamodule.progress.consumed) == 6
    assert StrictSharedMemory.calls == ["init"] + ["send"] * 4 and StrictSharedMemory.versions == [0, 1, 2, 3]
    assert datamodule.state_dict()["weight_sync"] == {"version": 3}


@pytest.mark.timeout(240)
def test_tiny_run_logs_trl_metric_names_with_sane_values(tmp_path, no_leaked_processes):
    import math

    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    datamodule = tiny_datamodule(8, gradient_accumulation_steps=2, val_dataset=tiny_prompts(4), val_size=4)
    trainer = cpu_trainer(logger=CSVLogger(tmp_path), log_every_n_steps=1, limit_val_batches=None)
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    metrics = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    last = {k: v for k, v in metrics.ffill().iloc[-1].items() if not (isinstance(v, float) and math.isnan(v))}
    for name in (
        "reward",
        "reward_std",
        "rewards/char_sum_reward",
        "ratio",
        "sampling/sampling_logp_difference/mean",
        "entropy",
        "clip_ratio/region_mean",
        "sample/staleness_mean",
        "batch/packing_ratio",
        "perf/step_s",
        "rollout/generated_tok_s",
        "loss",
        "lr",
        "val/reward",  # the end-of-fit validation runs when the stream stops the run
    ):
        assert name in last, f"{name} not logged; logged: {sorted(last)}"
    assert 0 <= last["reward"] <= 1 and last["reward_std"] >= 0
    assert 0.5 < last["ratio"] < 2 and last["sampling/sampling_logp_difference/mean"] >= 0 and last["entropy"] > 0
    assert "kl" not in last  # the KL to a reference model, logged with beta > 0
    assert 0 <= last["clip_ratio/region_mean"] <= 1 and last["sample/staleness_mean"] >= 0
    assert last["batch/packing_ratio"] >= 1 and metrics["rollout/generated_tok_s"].max() > 0
    # One training row per optimizer step: the stop batch, which trains nothing, adds no copy of the last one.
    training_rows = metrics.dropna(subset=["loss"])
    assert list(training_rows["step"]) == list(range(trainer.global_step)), training_rows[["step", "loss"]]


@pytest.mark.timeout(240)
def test_fit_with_a_trainer_scorer_scores_every_pending_group(tmp_path, no_leaked_processes):
    """The rollout child leaves advantages pending; a reward model on the trainer scores each step before it trains."""
    from helpers.tiny import tiny_reward_model

    from lightning_grpo.scoring.builtin_scorers import RewardModelScorer

    datamodule = tiny_datamodule(6)
    module = GRPOModule("tiny-random", scorers=[RewardModelScorer(tiny_reward_model(), name="rm")], learning_rate=1e-3)
    trainer = cpu_trainer()
    trainer.fit(module, datamodule=datamodule)
    progress = datamodule.progress
    assert progress.trained_total > 0
    assert progress.trained_total + sum(progress.dropped.values()) + sum(progress.excluded.values()) == 6
    assert trainer.global_step == progress.trained_total  # one group per step here


class TaggedLoop(GRPORolloutLoop):
    """A user's loop subclass with an argument of its own: it sends trainer scorers a payload with every group."""

    def __init__(self, *, tag: str, **kwargs):
        super().__init__(**kwargs)
        self.tag = tag

    def _trainer_score_payload(self, group):
        return {"tag": self.tag, "completions": len(group.completions_sequences)}


@pytest.mark.timeout(240)
def test_a_loop_subclass_from_loop_cls_runs_in_the_child_and_its_payload_reaches_the_scorer(no_leaked_processes):
    from helpers.tiny import tiny_reward_model

    from lightning_grpo.rollout.records import SCORE_PAYLOAD
    from lightning_grpo.scoring.builtin_scorers import RewardModelScorer

    class PayloadRecordingScorer(RewardModelScorer):
        payloads: list = []

        def group_extras(self, samples):
            self.payloads.append(samples[0].extras[SCORE_PAYLOAD]["payload"])
            return super().group_extras(samples)

    scorer = PayloadRecordingScorer(tiny_reward_model(), name="rm")
    datamodule = tiny_datamodule(4, loop_cls=TaggedLoop, loop_kwargs={"tag": "from-my-loop"})
    trainer = cpu_trainer()
    trainer.fit(GRPOModule("tiny-random", scorers=[scorer], learning_rate=1e-3), datamodule=datamodule)
    assert len(scorer.payloads) == 4
    assert all(payload == {"tag": "from-my-loop", "completions": 4} for payload in scorer.payloads)


@pytest.mark.timeout(240)
def test_interrupting_fit_stops_the_rollout_child_while_the_process_lives_on(no_leaked_processes):
    """Jupyter's "interrupt kernel" (and Ctrl-C where only the trainer gets the signal) raises KeyboardInterrupt in
    the trainer's process alone, which lives on: Lightning's graceful shutdown must stop the rollout child and its
    reward pool, since the child's die-with-parent guard never fires."""
    import os
    import signal

    from helpers.processes import live_children, wait_no_children

    class InterruptAtSecondStep(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    before = {p.pid for p in live_children()}
    datamodule = tiny_datamodule(8)
    trainer = cpu_trainer(callbacks=[InterruptAtSecondStep()])
    handler = signal.getsignal(signal.SIGINT)
    # Python's own handler, as in a notebook or a terminal: a suite started in the background by a non-interactive
    # shell inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit):  # Lightning exits after its graceful shutdown
            trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
        assert trainer.interrupted and trainer.global_step == 1
        assert wait_no_children(timeout=10, ignore=before) == []
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from its shutdown on


def scheduled_rates(module: GRPOModule, steps: int) -> list[float]:
    """The learning rate of each of `steps` optimizer steps under the module's optimizer and schedule."""
    configured = module.configure_optimizers()
    return learning_rates(configured["optimizer"], configured["lr_scheduler"]["scheduler"], steps)


def test_default_optimizer_is_adamw_over_trainable_parameters_with_a_linear_warm_up(tiny_model):
    tiny_model.model.embed_tokens.weight.requires_grad_(False)  # e.g. frozen embeddings, or a LoRA base
    module = GRPOModule(tiny_model, learning_rate=0.3, warmup_steps=2, weight_decay=0.1)
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["weight_decay"] == 0.1
    assert optimizer.defaults["fused"]  # TRL's default kernel (`optim="adamw_torch_fused"`), which CPUs have
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(trained) == len(list(tiny_model.parameters())) - 1 and all(p.requires_grad for p in trained)
    assert scheduled_rates(module, 5) == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])


def test_an_optimizer_and_scheduler_callable_replace_the_default_and_the_warm_up_runs_first(tiny_model):
    """What LightningCLI builds from `model.optimizer` / `model.lr_scheduler` YAML: callables of the parameters and
    of the optimizer."""
    import functools

    cosine = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=4)
    module = GRPOModule(tiny_model, optimizer=functools.partial(torch.optim.SGD, lr=0.5), lr_scheduler=cosine)
    assert isinstance(module.configure_optimizers()["optimizer"], torch.optim.SGD)
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    expected = learning_rates(reference, torch.optim.lr_scheduler.CosineAnnealingLR(reference, T_max=4), 4)
    rates = scheduled_rates(module, 4)
    assert rates == pytest.approx(expected)
    warmed = GRPOModule(
        tiny_model, optimizer=functools.partial(torch.optim.SGD, lr=0.5), lr_scheduler=cosine, warmup_steps=1
    )
    assert scheduled_rates(warmed, 3) == pytest.approx([0.25, *expected[:2]])  # warm-up, then the cosine from its start


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"optimizer": "sgd_negative"},
            r"GRPOModule\(optimizer=...\)` cannot be built: ValueError: Invalid learning rate",
        ),
        ({"lr_scheduler": "plateau"}, r"ReduceLROnPlateau\)` needs a monitored metric"),
    ],
)
def test_an_optimizer_or_scheduler_that_cannot_work_fails_at_construction(tiny_model, options, message):
    import functools

    factories = {
        "sgd_negative": functools.partial(torch.optim.SGD, lr=-1.0),
        "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau,
    }
    with pytest.raises(ValueError, match=message):
        GRPOModule(tiny_model, **{key: factories[value] for key, value in options.items()})


@pytest.mark.timeout(240)
def test_checkpoints_every_step_print_no_note_about_manual_optimization(tmp_path, no_leaked_processes):
    """Lightning warns at every save that a manually optimized module's checkpoint holds the weights after the step;
    that is what a resume needs, so the warning is left out (the main job's output stays on one screen)."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = cpu_trainer(default_root_dir=tmp_path, enable_checkpointing=True, callbacks=[saves])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=tiny_datamodule(4, epochs=1))
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == trainer.global_step > 0
    assert not [w for w in caught if "manual optimization" in str(w.message)]
