"""Training a Gemma 3: tree attention over a packed prefix trie keeps each sliding-window layer's window (the window
counts positions within a sample, not within the packed row), and a tiny random Gemma 3 saved as a local folder
trains a step through `Trainer.fit`, its weights pushed to the embedded generator that sampled the next groups."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import cpu_trainer, micro_batch, reference_logprobs, shared_prompt_group, tiny_datamodule
from peft import LoraConfig

from lightning_grpo.models import char_tokenizer, tiny_gemma3
from lightning_grpo.module import GRPOModule
from lightning_grpo.training.attention import tree_model_kwargs, use_tree_attention
from lightning_grpo.weights.parameters import generator_parameters

TOLERANCE = 1e-5


def gemma3_samples() -> list[dict]:
    """Two groups whose prompts (12 and 7 tokens) and completions are longer than the window of 4, forking inside."""
    return shared_prompt_group(12, [5, 9, 3, 9], seed=1) + shared_prompt_group(7, [6, 2], group_id=1, uid0=4, seed=2)


@pytest.mark.parametrize("layout", ["auto", "segments", "dense"])
def test_packed_gemma3_forward_matches_per_sample_forward_with_its_sliding_window(layout):
    samples = gemma3_samples()
    mb = micro_batch(samples)
    assert mb["input_ids"].numel() < sum(s["input_ids"].size for s in samples)  # prefixes really are shared
    expected, _ = reference_logprobs(tiny_gemma3(0), samples)
    model = use_tree_attention(tiny_gemma3(0))
    with torch.no_grad():
        logits = model(**tree_model_kwargs(mb, layout=layout)).logits[0]
    labels = mb["shift_labels"][mb["token_index"]]
    got = torch.log_softmax(logits[mb["token_index"]], -1).gather(1, labels[:, None]).squeeze(1)
    assert (got - expected).abs().max().item() < TOLERANCE
    # the window matters here: the same weights with a window wider than every sample give other logprobs
    wide, _ = reference_logprobs(tiny_gemma3(0, sliding_window=64), samples)
    assert (wide - expected).abs().max().item() > 1e-2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_tiny_gemma3_folder_trains_a_step_through_fit_with_the_embedded_generator(
    lora, tmp_path, no_leaked_processes
):
    """The user's path for a model of another family: a local folder passed as `model` to both modules; with LoRA
    the generator gets the adapted layers merged, under the base model's names."""
    folder = tmp_path / "tiny-gemma3"
    tiny_gemma3(0).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    before = {name: p.detach().clone() for name, p in tiny_gemma3(0).named_parameters()}
    datamodule = tiny_datamodule(4, model=str(folder), epochs=1)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) if lora else None
    module = GRPOModule(str(folder), learning_rate=1e-2, peft_config=peft_config)
    trainer = cpu_trainer(default_root_dir=tmp_path, max_steps=1)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1
    if lora:
        trained = [name for name, p in module.policy.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in name for name in trained), trained
        merged = dict(generator_parameters(module.policy))  # what the push sends
        assert set(merged) == set(before)
        assert not torch.equal(
            merged["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"]
        )
    else:
        assert type(module.policy).__name__ == "Gemma3ForCausalLM"
        changed = [name for name, p in module.policy.named_parameters() if not torch.equal(p.detach(), before[name])]
        assert any("layernorm" in name for name in changed) and any("q_proj" in name for name in changed), changed
    assert datamodule.state_dict()["weight_sync"]["version"] >= 1  # pushed to the generator after the step
