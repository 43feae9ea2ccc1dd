"""LoRA policies for tests: the tiny model with adapters, and what an optimizer step does to them."""

from __future__ import annotations

import torch
from peft import LoraConfig

from lightning_grpo.models import tiny_llama
from lightning_grpo.training.policy import apply_peft

LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


def lora_policy(seed: int = 0) -> torch.nn.Module:
    """The tiny model with LoRA on q/v; B starts non-zero (seeded), so the adapters change the outputs."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return apply_peft(tiny_llama(seed), LoraConfig(**LORA, init_lora_weights=False))


def nudge_adapters(policy: torch.nn.Module, by: float = 0.05) -> None:
    """What an optimizer step does to a LoRA policy: only the adapter tensors move."""
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.add_(by * torch.randn_like(param))
