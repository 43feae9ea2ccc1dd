"""The trainer's torch threads beside the embedded generator: `trainer_threads` and its `"auto"` rule."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_grpo import GRPODataModule, GRPOModule
from lightning_grpo.training import threads
from lightning_grpo.training.threads import trainer_threads_for

SHARED_CPU = dict(on_cpu=True, embedded_generator=True, generator_threads=1, world_size=1)


@pytest.mark.parametrize(
    ("cores", "current", "generator_threads", "expected"),
    [(2, 2, 1, 1), (8, 8, 1, 7), (8, 8, 3, 5), (8, 4, 1, None), (1, 1, 1, None), (4, 4, 4, 1)],
)
def test_auto_gives_the_trainer_the_cores_the_generator_leaves(
    monkeypatch, cores, current, generator_threads, expected
):
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    options = SHARED_CPU | {"generator_threads": generator_threads}
    assert trainer_threads_for("auto", current=current, **options) == expected


@pytest.mark.parametrize(
    "not_shared",
    [{"on_cpu": False}, {"embedded_generator": False}, {"generator_threads": None}, {"world_size": 2}],
    ids=["gpu", "vllm", "generator_on_all_cores", "ddp"],
)
def test_auto_leaves_torch_alone_unless_trainer_and_generator_share_one_cpu(monkeypatch, not_shared):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    assert trainer_threads_for("auto", current=8, **(SHARED_CPU | not_shared)) is None


def test_a_number_is_used_as_given_and_none_leaves_torch_alone():
    assert trainer_threads_for(3, current=8, **SHARED_CPU) == 3
    assert trainer_threads_for(None, current=8, **SHARED_CPU) is None


@pytest.mark.parametrize(("replicas", "trainer", "shares"), [(1, 7, True), (2, 6, False), (4, 4, False)])
def test_auto_leaves_every_replica_its_cores_and_only_one_generator_shares_them(monkeypatch, replicas, trainer, shares):
    """On 8 cores with one thread per replica. torch's thread setters are recorded, not applied: this process keeps
    its own threads."""
    set_to = []
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    fit = threads.FitThreads()
    fit.apply(
        GRPODataModule(model="tiny-random", generator_replicas=replicas).options.generation, on_cpu=True, world_size=1
    )
    assert (set_to, fit.core_sharing is not None) == ([trainer], shares)


@pytest.mark.parametrize("bad", [0, -1, "all", 1.5])
def test_a_bad_value_is_named_at_construction(bad):
    with pytest.raises(ValueError, match=f"trainer_threads={bad!r}"):
        GRPODataModule(model="tiny-random", trainer_threads=bad)


@pytest.mark.timeout(240)
def test_fit_trains_with_the_threads_asked_for_and_restores_torchs_setting(no_leaked_processes):
    from helpers.tiny import cpu_trainer, tiny_datamodule

    class RecordThreads(pl.Callback):
        seen: list[int] = []
        sharing: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(torch.get_num_threads())
            if not self.sharing:
                self.sharing.append(trainer.datamodule.core_sharing)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        recorder = RecordThreads()
        trainer = cpu_trainer(callbacks=[recorder])
        trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=tiny_datamodule(4, trainer_threads=1))
        assert recorder.seen and set(recorder.seen) == {1}
        assert recorder.sharing == [None]  # a number asked for is never lent or borrowed
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(240)
def test_auto_fit_lends_cores_through_hooks_on_the_policys_layers_and_takes_them_off_after(
    monkeypatch, no_leaked_processes
):
    from helpers.tiny import cpu_trainer, tiny_datamodule

    monkeypatch.setattr(threads, "available_cores", lambda: 2)

    class RecordSharing(pl.Callback):
        def __init__(self):
            self.sharing, self.in_layers = None, set()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sharing = trainer.datamodule.core_sharing
            layer = next(m for m in pl_module.policy.modules() if type(m).__name__.endswith("DecoderLayer"))
            layer.register_forward_pre_hook(lambda module, args: self.in_layers.add(torch.get_num_threads()))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        recorder = RecordSharing()
        datamodule = tiny_datamodule(4, trainer_threads="auto")
        module = GRPOModule("tiny-random", learning_rate=1e-3)
        cpu_trainer(callbacks=[recorder]).fit(module, datamodule=datamodule)
        sharing = recorder.sharing
        assert (sharing.trainer_threads, sharing.generator_threads) == (1, 1)
        assert recorder.in_layers and recorder.in_layers <= {1, 2}  # its own core, or both while the generator idles
        assert datamodule.core_sharing is None and torch.get_num_threads() == 2
        hooked = [m for m in module.policy.modules() if type(m).__name__.endswith("DecoderLayer")]
        assert all(len(m._forward_hooks) == 0 for m in hooked)  # ours are off (the recorder's were pre-hooks)
    finally:
        torch.set_num_threads(before)
