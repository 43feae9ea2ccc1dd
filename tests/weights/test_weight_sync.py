"""WeightSync, the one owner of weight pushes: the transfer is initialised once before the first send on every
backend, the full parameters go under the generator's names, the one version counter is published, listened to and
checkpointed, a failed send leaves no rank inside a collective.

`RecordingTransfer` stands in for TRL's NCCL `WeightTransferClient`, which needs a GPU: it implements TRL's
`WeightTransferProtocol` as strictly as the real client behaves (`send_weights(iterator)` takes no version; a send
before `init_weight_transfer()` is refused, where TRL's client silently sends nothing).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.transfers import RecordingTransfer

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.generator import EmbeddedGenerator
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.weights.factory import nccl_manifest, transfer_kind, uses_trainable_only
from lightning_grpo.weights.parameters import checkpoint_name, generator_parameters
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer
from lightning_grpo.weights.sync import WeightSync


def test_first_push_initialises_once_then_each_push_sends_the_full_weights_under_checkpoint_names():
    policy, transfer = tiny_llama(seed=0), RecordingTransfer()
    sync = WeightSync(transfer)
    assert sync.push(policy) == 0  # the initial weights are version 0
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    assert sync.push(policy) == 1 and sync.version == 1
    assert [c[0] for c in transfer.calls] == ["init", "pause", "send", "resume", "pause", "send", "resume"]
    expected = {name: param.detach() for name, param in policy.named_parameters()}
    assert transfer.sent[1].keys() == expected.keys()  # a tied output layer comes once, under the embedding's name
    assert all(torch.equal(transfer.sent[1][name], expected[name]) for name in expected)
    assert not torch.equal(transfer.sent[0]["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    sync.close()
    assert transfer.calls[-1] == ("destroy",)
    with pytest.raises(RuntimeError, match="after `close\\(\\)`"):
        sync.push(policy)


def test_a_factory_transfer_is_built_from_the_policy_at_the_first_push():
    built = []

    def factory(policy):
        built.append(policy)
        return RecordingTransfer()

    policy = tiny_llama(seed=0)
    sync = WeightSync(factory)
    assert sync.sends and sync.transfer is None
    sync.push(policy)
    sync.push(policy)
    assert built == [policy] and sync.transfer.calls[0] == ("init",)


def test_the_version_is_restored_from_the_checkpoint_and_the_first_push_republishes_it():
    policy = tiny_llama(seed=0)
    first = WeightSync(RecordingTransfer())
    for _ in range(4):
        first.push(policy)
    state = first.state_dict()
    assert state == {"version": 3}
    resumed = WeightSync(RecordingTransfer())
    resumed.load_state_dict(state)
    heard = []
    resumed.on_version(heard.append)  # nothing published yet in this run: not called now
    assert resumed.push(policy) == 3 and resumed.push(policy) == 4
    assert heard == [3, 4]
    late = []
    resumed.on_version(late.append)  # a listener added later hears the current version at once
    assert late == [4]


def test_versioned_backends_get_the_version_with_the_weights_and_the_generator_tags_its_samples_with_it():
    trainer_policy = tiny_llama(seed=1)
    sync = WeightSync(SharedMemoryWeightTransfer)
    sync.load_state_dict({"version": 7})
    sync.push(trainer_policy)
    generator = EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=6, weight_receiver=sync.receiver())
    try:
        prompt = [2, 40, 41, 42]
        output = asyncio.run(generator.generate(prompt))
        assert output.model_version == 7 == sync.transfer.version
        expected = teacher_forced_logprobs(trainer_policy, prompt, output.token_ids)
        assert (expected - torch.tensor(output.logprobs)).abs().max() <= 1e-4
    finally:
        generator.close()
        sync.close()


def test_a_failed_send_still_completes_the_stream_resumes_the_generator_and_raises(monkeypatch):
    import lightning_grpo.weights.sync as sync_module

    policy = tiny_llama(seed=0)
    transfer = RecordingTransfer(fail_after=3)
    sync = WeightSync(transfer)
    streamed = []

    def counting(*args, **kwargs):  # the real stream, recording how far it was gathered
        for item in generator_parameters(*args, **kwargs):
            streamed.append(item[0])
            yield item

    monkeypatch.setattr(sync_module, "generator_parameters", counting)
    with pytest.raises(OSError, match="mid-send"):
        sync.push(policy)
    # every parameter was still gathered (other ranks are not left in a collective), and the generator resumed
    assert streamed == [name for name, _ in policy.named_parameters()]
    assert transfer.calls[-1] == ("resume",) and sync.version == 0


def test_trainable_only_streams_trls_vllm_manifest_in_its_order():
    policy = tiny_llama(seed=0)
    policy.model.norm.weight.requires_grad_(False)  # frozen: a vLLM server fed over NCCL never receives it
    sync = WeightSync(RecordingTransfer(), trainable_only=True)
    sync.push(policy)
    manifest = nccl_manifest(policy)
    assert list(sync.transfer.sent[0]) == manifest["names"] and "model.norm.weight" not in manifest["names"]
    assert [list(t.shape) for t in sync.transfer.sent[0].values()] == manifest["shapes"]
    everything = WeightSync(RecordingTransfer())
    everything.push(policy)
    assert "model.norm.weight" in everything.transfer.sent[0]  # a generator built without weights needs it too


def test_which_backend_takes_which_parameters():
    assert transfer_kind("embedded") == "shared_memory" and not uses_trainable_only("shared_memory")
    assert transfer_kind("vllm", "http") == "http" and not uses_trainable_only("http")
    assert transfer_kind("vllm", "nccl") == "nccl" and uses_trainable_only("nccl")
    with pytest.raises(ValueError, match="generator='sglang'"):
        transfer_kind("sglang")


def test_wrapper_parts_are_not_part_of_a_checkpoint_name():
    assert checkpoint_name("module._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.weight") == (
        "model.layers.0.mlp.weight"
    )


def test_something_that_is_not_a_transfer_is_named():
    with pytest.raises(TypeError, match=r"is not a weight transfer.*\['init_weight_transfer', 'pause'"):
        WeightSync(object())


def test_other_ranks_gather_without_sending_or_publishing():
    policy = tiny_llama(seed=0)
    sync = WeightSync(None)
    heard = []
    sync.on_version(heard.append)
    assert not sync.sends and sync.push(policy) == 0 and sync.push(policy) == 1
    assert heard == []


class PartialRecordingTransfer(RecordingTransfer):
    """A transfer that takes partial sends (as the shared-memory and vLLM HTTP ones do), recording which were."""

    def __init__(self) -> None:
        super().__init__()
        self.partial: list[bool] = []

    def send_weights(self, iterator, partial: bool = False) -> None:
        super().send_weights(iterator)
        self.partial.append(partial)


def test_changed_only_sends_the_whole_model_first_then_what_training_changes_and_whole_again_after_a_resume():
    from helpers.lora import lora_policy

    from lightning_grpo.weights.parameters import changed_names

    policy, transfer = lora_policy(), PartialRecordingTransfer()
    sync = WeightSync(transfer, changed_only="tensors")
    for _ in range(2):
        sync.push(policy)
    sync.load_state_dict(sync.state_dict())  # a resumed run: the generator may hold anything
    sync.push(policy)
    everything = [name for name, _ in generator_parameters(policy)]
    assert transfer.partial == [False, True, False]
    assert [list(sent) for sent in transfer.sent] == [
        everything,
        sorted(changed_names(policy), key=everything.index),
        everything,
    ]
    assert sync.last_push_bytes == sum(t.numel() * t.element_size() for t in transfer.sent[-1].values())

    strict = WeightSync(RecordingTransfer(), changed_only="tensors")  # TRL's protocol: no partial sends
    strict.push(policy)
    with pytest.raises(TypeError, match=r"changed_only='tensors'.*RecordingTransfer\.send_weights takes no `partial`"):
        strict.push(policy)
    with pytest.raises(ValueError, match=r"changed_only='modules', adapter_only=True"):
        WeightSync(RecordingTransfer(), changed_only="modules", adapter_only=True)


def test_adapter_only_streams_the_lora_adapter_in_peft_saved_names():
    from helpers.lora import lora_policy

    policy, transfer = lora_policy(), RecordingTransfer()
    WeightSync(transfer, adapter_only=True).push(policy)
    [sent] = transfer.sent
    assert sent and all(".lora_A.weight" in name or ".lora_B.weight" in name for name in sent)
    expected = {n.replace(".default.", "."): p for n, p in policy.named_parameters() if p.requires_grad}
    assert sent.keys() == expected.keys() and all(torch.equal(sent[n], expected[n]) for n in sent)
