"""Lending idle cores between the trainer and the embedded generator (`CoreSharing`, `borrow_idle_cores`).

Threads are read with `torch.get_num_threads()` in the thread that computes, where torch applies them.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest
import torch

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.core_sharing import CoreSharing
from lightning_grpo.rollout.generator import EmbeddedGenerator
from lightning_grpo.training.threads import borrow_idle_cores


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _generator_side(sharing: CoreSharing, go, threads) -> None:
    """A stand-in for the generator's worker thread in the rollout child: idle, then one step busy."""
    sharing.generator_idle()
    go.wait(30)
    sharing.generator_busy()
    threads.put(torch.get_num_threads())


@pytest.mark.timeout(60)
def test_each_side_runs_on_the_others_cores_while_the_other_is_idle_across_a_spawned_process(
    restore_threads, no_leaked_processes
):
    ctx = mp.get_context("spawn")
    sharing = CoreSharing(trainer_threads=1, generator_threads=1, ctx=ctx)
    go, threads = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_generator_side, args=(sharing, go, threads))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not sharing.generator_is_idle and time.monotonic() < deadline:
            time.sleep(0.01)
        sharing.trainer_compute()
        assert torch.get_num_threads() == 2  # the idle generator's core is the trainer's
        with sharing.trainer_waiting():
            go.set()
            assert threads.get(timeout=30) == 2  # the waiting trainer's core is the generator's
        assert not sharing.generator_is_idle and not sharing.trainer_is_waiting
        sharing.trainer_compute()
        assert torch.get_num_threads() == 1  # the generator is busy again: the trainer's own thread only
    finally:
        child.join(30)
    assert child.exitcode == 0


def test_the_trainer_switches_threads_before_every_decoder_layer_forward_and_backward(restore_threads):
    """The generator goes idle between the forward and the backward: every layer's forward ran on the trainer's own
    thread, every layer's backward on both cores."""
    model = tiny_llama(seed=0)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    sharing = CoreSharing(trainer_threads=1, generator_threads=1)
    handles = borrow_idle_cores(model, sharing)
    seen = {"forward": [], "backward": []}

    def record_forward(module, args):
        seen["forward"].append(torch.get_num_threads())

    def record_backward_hook(module, args, output):
        output = output[0] if isinstance(output, tuple) else output
        output.register_hook(lambda grad: seen["backward"].append(torch.get_num_threads()))

    for layer in layers:  # registered after borrow_idle_cores's hooks, so they run after them
        layer.register_forward_pre_hook(record_forward)
        layer.register_forward_hook(record_backward_hook)
    sharing.generator_busy()
    torch.set_num_threads(2)  # whatever ran last: the first layer sets the trainer's count
    loss = model(torch.tensor([[1, 2, 3, 4]])).logits.sum()
    sharing.generator_idle()
    loss.backward()
    assert seen == {"forward": [1] * len(layers), "backward": [2] * len(layers)}

    for handle in handles:
        handle.remove()
    seen["forward"].clear()
    sharing.generator_busy()  # (which sets this thread's count to the generator's)
    torch.set_num_threads(2)
    model(torch.tensor([[1, 2, 3, 4]]))
    assert seen["forward"] == [2] * len(layers)  # without the hooks the threads are left alone


class CausalOutput(torch.nn.Module):
    """No decoder layers; returns a transformers `ModelOutput`, as a whole causal LM does."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.linear(x))


@pytest.mark.parametrize("model", [torch.nn.Linear(4, 4), CausalOutput()], ids=["tensor", "model_output"])
def test_a_model_without_decoder_layers_switches_once_per_forward_and_once_per_backward(restore_threads, model):
    sharing = CoreSharing(trainer_threads=1, generator_threads=1)
    borrow_idle_cores(model, sharing)
    seen = []

    def record_backward(module, args, output):  # registered after borrow_idle_cores's, so it runs after it
        logits = output if isinstance(output, torch.Tensor) else output.logits
        logits.register_hook(lambda grad: seen.append(torch.get_num_threads()))

    model.register_forward_hook(record_backward)
    sharing.generator_busy()
    torch.set_num_threads(2)
    output = model(torch.ones(2, 4))
    assert torch.get_num_threads() == 1  # switched before the forward
    sharing.generator_idle()
    (output if isinstance(output, torch.Tensor) else output.logits).sum().backward()
    assert seen == [2]  # and before the backward


@pytest.mark.timeout(60)
def test_the_generator_is_idle_between_requests_and_borrows_the_waiting_trainers_core(restore_threads):
    sharing = CoreSharing(trainer_threads=1, generator_threads=1)
    model = tiny_llama(seed=0)
    seen = []
    # The generator runs the model's modules itself (not `model.forward`): the embedding starts every step.
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))

    async def generate(generator):
        return await generator.generate([1, 2, 3], max_tokens=4, seed=0)

    with EmbeddedGenerator(model, eos_token_ids=(), temperature=1.0, core_sharing=sharing) as generator:
        asyncio.run(generate(generator))
        assert set(seen) == {1}  # the trainer computes meanwhile: the generator keeps to its own thread
        deadline = time.monotonic() + 10
        while not sharing.generator_is_idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sharing.generator_is_idle  # no request left: its core is lent
        seen.clear()
        with sharing.trainer_waiting():
            asyncio.run(generate(generator))
        assert set(seen) == {2}
        assert not sharing.trainer_is_waiting


@pytest.mark.parametrize(("trainer", "generator"), [(0, 1), (1, 0)])
def test_each_side_needs_a_thread(trainer, generator):
    with pytest.raises(ValueError, match=f"trainer_threads={trainer}, generator_threads={generator}"):
        CoreSharing(trainer_threads=trainer, generator_threads=generator)
